"""Compiles structured-output constraints with xgrammar, off the engine's step path (worker
threads), cached by their text.

xgrammar rather than llguidance (docs/benchmarks.md section 11): llguidance lets through only the
canonical tokenization where the grammar forces text (a JSON key, a literal), so a constrained
greedy run could leave a path the unconstrained one took; xgrammar's mask holds every token that
keeps the output valid, and fills it in a few microseconds. Its cost is a slower compile for a
large schema, which is why compiling is asynchronous and bounded by a timeout.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from tandem.core.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# JSON laid out as json.dumps writes it. Free whitespace lets a small model pad with newlines
# until max_tokens (xgrammar's default allows it).
_JSON_LAYOUT = dict(any_whitespace=False, separators=(", ", ": "))


class GrammarCompiler:
    """Builds xgrammar's tokenizer info once, then one compiled grammar per distinct constraint;
    each request gets a matcher over it (executor/structured_output.py)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        timeout_s: float = 10.0,
        on_compile: Callable[[str, float], None] | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: masks cover every row of the LM head
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.on_compile = on_compile  # (kind, seconds) per grammar compiled: the metrics hook
        self._xgr_compiler = None
        # Two threads: a schema still compiling past its timeout does not block the next one.
        self._worker = ThreadPoolExecutor(2, thread_name_prefix="tandem-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._init_lock = (
            threading.Lock()
        )  # building the tokenizer info (once, ~0.4 s), on a worker

    def compile(self, so: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; the same one for the same constraint text."""
        if self._hf_tokenizer is None:
            raise ValueError(
                "structured outputs need the model's tokenizer, and this model has none"
            )
        with self._lock:
            future = self._cache.get(so.key)
            if future is None:
                future = self._cache[so.key] = self._worker.submit(self._compile, so)
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(so.key)
        return future

    def get(self, so: StructuredOutputsParams):
        """The compiled grammar, waiting at most timeout_s; ValueError names what is wrong."""
        future = self.compile(so)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            with self._lock:
                if self._cache.get(so.key) is future:
                    del self._cache[so.key]
            raise ValueError(
                f"the {so.kind} constraint did not compile within {self.timeout_s:g} s "
                "(too large or too complex)"
            ) from None

    def _compile(self, so: StructuredOutputsParams):
        import xgrammar as xgr

        with self._init_lock:
            if self._xgr_compiler is None:
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                )
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler = self._xgr_compiler
        kind, text = so.key
        start = time.perf_counter()
        try:
            if kind in ("json", "json_object"):
                grammar = compiler.compile_json_schema(text or '{"type": "object"}', **_JSON_LAYOUT)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "structural_tag":
                grammar = compiler.compile_structural_tag(text)
            elif kind == "choice":
                grammar = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in so.choice)
                )
            else:
                grammar = compiler.compile_grammar(text)  # EBNF / GBNF, rule `root` first
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {kind} constraint: {_first_line(e)}") from None
        if self.on_compile is not None:
            self.on_compile(kind, time.perf_counter() - start)
        return grammar


def _first_line(e: Exception) -> str:
    """xgrammar's message without its C++ file:line prefix."""
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return message.split(": ", 1)[1] if message.startswith("[") and ": " in message else message
