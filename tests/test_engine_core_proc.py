"""The engine core behind ZeroMQ: AsyncLLM against a real engine-core process (the handshake,
greedy outputs equal to the offline engine, abort, utility messages with a Future, errors by
type, unknown and malformed messages refused) and in the in-process mode (on_add before any
step, stop strings aborting in the core)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from cluster_fixture import wait_for
from structured_fixture import with_tokenizer

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.core.sampling_params import StructuredOutputsParams
from tandem.engine.async_llm import AsyncLLM, EngineDeadError
from tandem.engine.core_messages import (
    CheckKVPeer,
    CompileGrammar,
    GetSchedulerStats,
    KVSent,
    SendKV,
    UtilityCall,
    decode_utility,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]


def _opts(model_dir: str) -> dict:
    return dict(model=model_dir, dtype="float32", kv_cache_memory=1 << 22, num_threads=1)


async def _final(llm: AsyncLLM, prompt, params, **kw):
    final = None
    async for out in llm.generate(prompt, params, **kw):
        final = out
    return final


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("tok") / "m")


@pytest.fixture(scope="module")
def proc_llm(model_dir):
    llm = AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)))
    yield llm
    llm.shutdown()


def test_the_front_end_imports_no_torch(tiny_model_dirs, tmp_path):
    """A server's API process (command line, app, tokenizer, core client) never imports torch:
    seconds of start-up and ~250 MB of memory that only the engine core needs. Neither for a
    GGUF nor for a Hugging Face folder (whose safetensors headers it checks), nor for that
    folder's tokenizer once AutoTokenizer has picked its class (recorded in the cache)."""
    folder = with_tokenizer(
        tiny_model_dirs["llama"], tmp_path / "m"
    )  # loads it once, with AutoTokenizer
    code = (
        "import sys; from tandem.cli import build_parser; build_parser(['serve'])\n"
        "import tandem.server.api_server, tandem.engine.core_client, tandem.cluster.router.app\n"
        "from tandem.engine.tokenizer import get_tokenizer; "
        "assert get_tokenizer('smollm2-135m') is not None\n"
        f"assert get_tokenizer({tiny_model_dirs['llama']!r}) is None\n"
        f"assert get_tokenizer({folder!r}) is not None\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_handshake_facts_and_greedy_outputs_equal_offline(proc_llm, model_dir):
    offline = LLM(**_opts(model_dir))
    assert proc_llm.engine_pid != os.getpid() and proc_llm.engine_core is None
    assert (proc_llm.max_model_len, proc_llm.vocab_size, proc_llm.eos_token_id) == (
        offline.engine.max_model_len,
        offline.engine.vocab_size,
        offline.engine.eos_token_id,
    )
    assert proc_llm.precisions.served == offline.engine.precisions.served
    want = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]

    async def run():
        return await asyncio.gather(*[_final(proc_llm, p, GREEDY) for p in PROMPTS])

    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outs] == want
    m = outs[0].metrics  # the core's timings crossed too
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_leaving_early_aborts_in_the_core(proc_llm):
    async def run():
        gen = proc_llm.generate(
            [5, 6, 7], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        )
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()

    asyncio.run(run())
    assert wait_for(
        lambda: proc_llm.stats.num_running == 0 and proc_llm.stats.num_waiting == 0, 2.0
    )
    assert proc_llm.num_in_flight == 0


def test_bad_input_is_a_value_error_and_nothing_is_queued(proc_llm):
    async def run(
        prompt, params=GREEDY
    ):  # the front end's refusals come at the call, the core's later
        return await _final(proc_llm, prompt, params)

    with pytest.raises(ValueError, match="the prompt is empty"):
        asyncio.run(run([]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(run([10_000]))
    bad = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="("))
    with pytest.raises(ValueError, match="invalid regex"):  # the core's refusal, as a ValueError
        asyncio.run(run([5, 6], bad))
    assert proc_llm.num_in_flight == 0


def test_utility_messages_futures_and_errors_cross_the_process(proc_llm):
    async def run():
        so = StructuredOutputsParams(choice=["yes", "no"])
        assert await proc_llm.call_utility(CompileGrammar(so)) is None  # a Future, resolved
        with pytest.raises(ValueError, match="invalid regex"):
            await proc_llm.call_utility(CompileGrammar(StructuredOutputsParams(regex="(")))
        stats = await proc_llm.call_utility(GetSchedulerStats())
        assert stats["kv_total_blocks"] > 0
        assert (
            await proc_llm.call_utility(CheckKVPeer(None)) is None
        )  # P/D's, registered by the process
        with pytest.raises(ValueError, match="no KV send 'never-sent' here"):
            await proc_llm.call_utility(KVSent("never-sent"))

    asyncio.run(run())


def test_an_unknown_or_malformed_utility_message_is_refused_in_words(proc_llm):
    async def run():
        with pytest.raises(TypeError, match="not an engine-core utility message: str"):
            await proc_llm.call_utility(
                "scheduler_stats"
            )  # a method name is not a message: nothing sent
        # a struct is not checked when built: the core refuses its mistyped field, by its path
        with pytest.raises(
            ValueError,
            match=r"malformed engine-core utility message: Expected `array`, "
            r"got `str` - at `\$\.token_ids`",
        ):
            await proc_llm.call_utility(SendKV("not tokens", "t", None))
        return await _final(proc_llm, PROMPTS[0], GREEDY)

    assert len(asyncio.run(run()).outputs[0].token_ids) == GREEDY.max_tokens  # and it keeps serving
    unknown = UtilityCall(7, msgspec.Raw(msgspec.msgpack.encode({"type": "double", "x": 21})))
    with pytest.raises(
        ValueError, match="malformed engine-core utility message: Invalid value 'double'"
    ):
        decode_utility(unknown)


class _Recorder:
    """An on_add hook: sees each add with kv_transfer before any step."""

    def __init__(self, core) -> None:
        self.core, self.seen = core, []

    def on_add(self, request_id, kv_transfer, accepted) -> None:
        req = self.core.scheduler.requests.get(request_id)
        self.seen.append(
            (request_id, kv_transfer, accepted, req is None or req.num_computed_tokens == 0)
        )


def test_on_add_in_process(model_dir):
    llm = AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)), in_process=True)
    try:
        rec = _Recorder(llm.engine_core)
        llm.engine_core.register_utilities({}, rec.on_add)

        async def run():
            await _final(llm, [5, 6, 7], GREEDY, request_id="a", kv_transfer={"transfer_id": "t1"})
            await _final(llm, [5, 6, 7], GREEDY, request_id="b")  # no kv_transfer: no hook

        asyncio.run(run())
        assert rec.seen == [("a", {"transfer_id": "t1"}, True, True)]
        # an add the core refuses (a constraint that does not compile) still runs the hook
        bad = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="("))
        with pytest.raises(ValueError, match="invalid regex"):
            asyncio.run(_final(llm, [5, 6], bad, request_id="c", kv_transfer={"x": 1}))
        assert rec.seen[-1] == ("c", {"x": 1}, False, True)
        with pytest.raises(
            ValueError, match=r"already handled: \['KVSent'\]"
        ):  # one handler per message type
            llm.engine_core.register_utilities({KVSent: rec.on_add})
    finally:
        llm.shutdown()


def test_engine_core_death_fails_every_stream(model_dir):
    llm = AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)))
    died = []
    llm.on_dead = died.append
    try:

        async def run():
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            gens = [llm.generate([5, 6, 7 + i], long) for i in range(4)]
            firsts = [await gen.__anext__() for gen in gens]
            assert all(f.outputs[0].token_ids for f in firsts)
            os.kill(llm.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            for gen in gens:
                with pytest.raises(EngineDeadError):
                    async for _ in gen:
                        pass
            return time.monotonic() - start

        assert asyncio.run(run()) < 1.0
        assert wait_for(lambda: died) and not llm.alive
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2], GREEDY)
    finally:
        llm.shutdown()


def test_the_core_process_freezes_its_startup_heap(model_dir, capfd):
    """Once built, the engine-core process puts what it holds (torch's modules, the model's
    Python objects) out of the garbage collector's full collections, which walked all of it
    mid-serving; it then serves as before."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)  # the level the core process logs at
    try:
        llm = AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)))
    finally:
        root.setLevel(level)
    try:
        out = asyncio.run(_final(llm, PROMPTS[0], GREEDY))
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()
    frozen = re.search(r"engine core: (\d+) startup objects frozen", capfd.readouterr().err)
    assert frozen is not None and int(frozen.group(1)) > 10_000


def test_engine_niceness_lowers_only_the_core_process(model_dir):
    """`tandem serve --engine-niceness N`: the engine-core process (and so every torch thread it
    starts) runs at niceness N above this one, which keeps its own; out of [0, 19], or asked of
    an in-process core, it is refused in words."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    llm = AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)), engine_niceness=5)
    try:
        pid = llm._client.process.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(own + 5, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == own
        out = asyncio.run(_final(llm, PROMPTS[0], GREEDY))
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()
    for bad in (-1, 20, 2.5):
        with pytest.raises(ValueError, match="engine niceness must be an integer in \\[0, 19\\]"):
            AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)), engine_niceness=bad)
    with pytest.raises(ValueError, match="not in-process"):
        AsyncLLM(EngineConfig.from_kwargs(**_opts(model_dir)), in_process=True, engine_niceness=3)
