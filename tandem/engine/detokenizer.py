"""Incremental detokenisation with stop strings, for streaming text out as tokens arrive."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context so the first output tokens get their leading space / bytes right
# (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 byte sequence ends with


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; never emits a broken UTF-8 character;
    checks stop strings.

    The concatenation of the returned deltas always equals output_text. Text is held back while it
    ends in an incomplete character or could be the start of a stop string; pass finished=True on
    the request's last update to release it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend, called directly: what transformers' decode does without
        # clean-up, less its Python around the call (~0.15 ms of a decode step at batch 1).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.params = params
        self.stop_reason: str | int | None = None
        # Prefix/read offsets (vLLM, HF TextStreamer): token_ids[prefix:read] is context whose text
        # was already produced, token_ids[read:] tokens whose text is not yet stable.
        self._token_ids = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""  # stable output text, cut at a matched stop string
        self._num_emitted = 0  # chars of _text already returned as deltas
        self._max_stop_len = max(map(len, params.stop), default=0)
        # Of the last update's tokens, how many up to the one that completed a stop string
        # (None: no stop string, or one completed only by the final flush).
        self.stop_token_count: int | None = None

    @property
    def output_text(self) -> str:
        return self._text[: self._num_emitted]

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Add sampled tokens; return the new text delta ("" while nothing new is safe to show).

        After a stop string matched (stop_reason set) the request is over and further calls return
        "". The caller drops a terminating EOS / stop token id itself if its text must not appear.
        """
        self.stop_token_count = None
        if self.tokenizer is None or self.stop_reason is not None:
            return ""
        old_len = len(self._text)
        for n, token_id in enumerate(new_token_ids, 1):
            self._token_ids.append(token_id)
            self._text += self._decode_next(flush=False)
            # Token by token, as if each came in its own step: several at once (an accepted
            # speculative run) stop at the token that completes the stop string.
            if self._max_stop_len and len(self._text) > old_len:
                self._check_stop(old_len)
                if self.stop_reason is not None:
                    self.stop_token_count = n
                    break
        if finished and self.stop_reason is None:
            self._text += self._decode_next(flush=True)
        if self._max_stop_len and len(self._text) > old_len and self.stop_reason is None:
            self._check_stop(old_len)
        end = len(self._text)
        if not finished and self.stop_reason is None:
            end -= self._partial_stop_len()
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return delta

    def _decode_next(self, flush: bool) -> str:
        """Decode the window with and without the unread tokens; the difference is the new text.

        Returns "" (and keeps the offsets) while the text ends in U+FFFD, i.e. a multi-byte
        character is still incomplete, unless flushing.
        """
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and not flush
        ):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenisation spaces: it rewrites text near the window's edges, so is not
        # incremental.
        if self._backend is not None:
            return self._backend.decode(
                token_ids, skip_special_tokens=self.params.skip_special_tokens
            )
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _check_stop(self, old_len: int) -> None:
        """Cut the text at the earliest stop string that ends in the new text (at old_len or
        later)."""
        matches = []
        for stop in self.params.stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1:
                matches.append((index, stop))
        if not matches:
            return
        index, stop = min(matches, key=lambda m: m[0])
        self._text = self._text[
            : index + len(stop) if self.params.include_stop_str_in_output else index
        ]
        self.stop_reason = stop

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that a later token could complete into a stop
        string."""
        for k in range(min(len(self._text), self._max_stop_len - 1), 0, -1):
            tail = self._text[-k:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return k
        return 0
