import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.sampling_params import SamplingParams
from tandem.executor.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
    argmax,
    make_generator,
    make_logit_bias,
)

# Every test runs on the CPU, and on CUDA too where there is one.
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
sampler = Sampler()


@pytest.fixture(params=DEVICES, ids=str)
def device(request) -> torch.device:
    return request.param


def row(device, prompt=(), output=(), seed=None, eos=None, generator=None, **params) -> SamplingRow:
    gen = generator if generator is not None else make_generator(seed, device)
    p = SamplingParams(max_tokens=100, **params)
    return SamplingRow(p, list(prompt), list(output), gen, eos, make_logit_bias(p, device))


def randn(*shape, seed: int, device) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    return sampler(logits, SamplingMetadata.build(rows, logits.shape[-1], logits.device))


def test_greedy_is_argmax_and_takes_the_fast_path(device):
    logits = randn(5, 100, seed=0, device=device)
    md = SamplingMetadata.build([row(device, temperature=0.0) for _ in range(5)], 100, device)
    assert md.all_greedy and md.no_penalties and md.temperature is None
    out = sampler(logits, md)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_bf16_logits_are_accepted(device):
    logits = randn(3, 50, seed=0, device=device).to(torch.bfloat16)
    rows = [
        row(device, temperature=0.0),
        row(device, temperature=0.8, seed=1),
        row(device, temperature=0.0, logprobs=2),
    ]
    out = sample(logits, rows)
    assert out.sampled_token_ids[0] == logits[0].float().argmax().item()
    assert len(out.logprobs[2]) == 3


def test_top_k_1_equals_greedy(device):
    logits = randn(8, 64, seed=1, device=device)
    out = sample(logits, [row(device, temperature=1.0, top_k=1, seed=i) for i in range(8)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-3, 1e-9])  # 1 - 1e-9 rounds to 1.0 in fp32
def test_tiny_top_p_keeps_only_the_max(device, top_p):
    logits = randn(8, 64, seed=2, device=device)
    out = sample(logits, [row(device, temperature=2.0, top_p=top_p, seed=i) for i in range(8)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_min_p_filters_unlikely_tokens(device):
    # probs ~ [0.5, 0.3, 0.15, 0.05]: min_p=0.4 keeps tokens with prob >= 0.2, i.e. {0, 1}.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]], device=device).log().repeat(400, 1)
    out = sample(logits, [row(device, min_p=0.4, seed=i) for i in range(400)])
    assert set(out.sampled_token_ids) == {0, 1}


def test_mixed_greedy_and_random_rows(device):
    logits = randn(4, 32, seed=3, device=device)
    rows = [
        row(device, temperature=0.0),
        row(device, temperature=1.0, top_k=1, seed=0),
        row(device, temperature=0.0, top_k=3),
        row(device),
    ]
    md = SamplingMetadata.build(rows, 32, device)
    assert md.greedy_mask.tolist() == [True, False, True, False]
    assert list(md.generators) == [1]  # greedy rows never consume their RNG
    out = sampler(logits, md)
    assert out.sampled_token_ids[:3] == logits[:3].argmax(-1).tolist()


def test_temperature_shapes_the_distribution(device):
    base = torch.tensor([1.0, 0.5, 0.0, -1.0], device=device)
    n = 4000
    generator = make_generator(
        1234, device
    )  # one seeded stream shared by all rows: independent draws
    out = sample(
        base.repeat(n, 1), [row(device, temperature=0.5, generator=generator) for _ in range(n)]
    )
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).float() / n
    expected = (base / 0.5).softmax(-1).cpu()
    assert (freq - expected).abs().max() < 0.03
    # The check can fail: temperature 1 would be far off.
    assert (base.softmax(-1).cpu() - expected).abs().max() > 0.1


def test_seeded_rows_do_not_depend_on_the_batch(device):
    vocab = 50
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randn(vocab, generator=gen) for _ in range(5)]
    params = dict(temperature=1.3, top_p=0.9, top_k=20, seed=42)

    def run(batch_size: int, index: int) -> list[int]:
        target = row(device, **params)
        neighbours = [
            row(device, temperature=0.7, seed=100 + j if j % 2 else None) for j in range(batch_size)
        ]
        tokens = []
        for step_logits in steps:
            logits = torch.randn(batch_size, vocab)
            logits[index] = step_logits
            logits = logits.to(device)
            rows = neighbours[:index] + [target] + neighbours[index + 1 :]
            tokens.append(sample(logits, rows).sampled_token_ids[index])
        return tokens

    alone = run(1, 0)
    assert run(4, 2) == alone
    assert run(9, 8) == alone
    assert len(set(alone)) > 1  # actually random, not degenerate


def test_penalties_match_hand_computation(device):
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]], device=device)
    rows = [
        row(
            device,
            prompt=[0, 4],
            output=[2, 2, 3],
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
        )
    ]
    md = SamplingMetadata.build(rows, 6, device)
    got = apply_penalties(logits.clone(), md)
    # token 0: prompt, positive -> 2/2; token 4: prompt, negative -> -2*2; token 1, 5: untouched;
    # token 2: output x2 -> 3/2 - 0.5*2 - 0.25; token 3: output x1 -> 0.5/2 - 0.5 - 0.25.
    expected = torch.tensor(
        [[1.0, -1.0, 1.5 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, -4.0, 1.0]], device=device
    )
    torch.testing.assert_close(got, expected)


def test_penalties_apply_to_greedy_rows_only_where_asked(device):
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]], device=device)
    rows = [
        row(device, output=[0], temperature=0.0, presence_penalty=2.0),
        row(device, output=[0], temperature=0.0),
    ]
    assert sample(logits, rows).sampled_token_ids == [1, 0]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_tokens(device, ignore_eos):
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0]], device=device).repeat(2, 1)
    kwargs = dict(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=ignore_eos)
    out = sample(
        logits,
        [row(device, output=[1], eos=2, **kwargs), row(device, output=[1, 1], eos=2, **kwargs)],
    )
    # Row 0 still owes a token: stop token 3 is blocked, EOS too unless EOS does not stop it anyway.
    assert out.sampled_token_ids == [2 if ignore_eos else 4, 2]


def test_logit_bias_steers_greedy_and_random_rows_but_not_logprobs(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]], device=device).repeat(3, 1)
    out = sample(
        logits,
        [
            row(device, temperature=0.0, logit_bias={3: 4.0}, logprobs=0),
            row(device, temperature=0.9, seed=0, logit_bias={0: 100.0, 1: -100.0}),
            row(device, temperature=0.0),
        ],
    )
    assert out.sampled_token_ids == [3, 0, 1]  # biases add to the logits; the third row has none
    # logprobs are of the raw logits (vLLM's default), before the bias
    assert out.logprobs[0][0][1] == pytest.approx(logits[0].log_softmax(-1)[3].item(), abs=1e-5)


def test_logprobs_are_raw_log_softmax(device):
    logits = randn(3, 40, seed=5, device=device)
    rows = [
        row(device, temperature=0.0, logprobs=3),
        row(device, temperature=0.0),
        row(device, temperature=0.7, seed=3, logprobs=0, presence_penalty=1.0, output=[1]),
    ]
    out = sample(logits, rows)
    ref = logits.log_softmax(-1)
    assert [len(lp) for lp in out.logprobs] == [4, 0, 1]
    for i in (0, 2):
        token, lp = out.logprobs[i][0]
        assert token == out.sampled_token_ids[i]
        assert lp == pytest.approx(ref[i, token].item(), abs=1e-5)
    top = ref[0].topk(3)
    assert [t for t, _ in out.logprobs[0][1:]] == top.indices.tolist()
    assert [lp for _, lp in out.logprobs[0][1:]] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_logprobs_none_when_no_row_asked(device):
    rows = [row(device, seed=1), row(device, temperature=0.0, repetition_penalty=1.2)]
    assert sample(torch.randn(2, 10, device=device), rows).logprobs is None


def _allowed(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Reference filter, slightly lenient at float boundaries (ties and rounding)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kth = scaled[order[min(top_k, len(order)) - 1]] if top_k else -math.inf
    keep = [i for i in order if scaled[i] >= kth]
    top = max(scaled)
    weights = {i: math.exp(scaled[i] - top) for i in keep}
    total = sum(weights.values())
    mass, nucleus = 0.0, []
    for i in keep:
        nucleus.append(i)
        mass += weights[i] / total
        if mass >= top_p - 1e-4:
            break
    floor = weights[nucleus[-1]] * (1 - 1e-4)
    nucleus = [i for i in keep if weights[i] >= floor]  # ties with the last kept token
    return {i for i in nucleus if weights[i] >= min_p * (1 - 1e-4)}


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=24),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(0, 30),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**31),
    device=st.sampled_from(DEVICES),
)
def test_sampled_tokens_lie_in_the_allowed_set(
    device, logits, temperature, top_k, top_p, min_p, seed
):
    logits = torch.tensor(logits).tolist()  # the reference sees the fp32 values the sampler sees
    n = 16
    rows = [
        row(device, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed + i)
        for i in range(n)
    ]
    out = sample(torch.tensor([logits] * n, device=device), rows)
    assert set(out.sampled_token_ids) <= _allowed(logits, temperature, top_k, top_p, min_p)


@given(
    st.integers(1, 5),
    st.integers(1, 300),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(["tie", "next", "nan", "-inf", "inf"])),
        max_size=6,
    ),
    st.booleans(),
    st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_argmax_is_torchs_first_maximum_with_ties_nans_and_strides(
    rows, vocab, dtype, edits, transposed, seed
):
    """The sampler's argmax (numpy's on CPU) picks torch's index: the first of tied maxima, the
    first NaN, a maximum just above another (the next float64: no rounding to a tie), in every
    float dtype logits come in, strided or not."""
    x = randn(rows, vocab, seed=seed, device="cpu").to(dtype)
    for at, kind in edits:
        r, c = at % rows, (at // rows) % vocab
        top = x[r].max().double()
        x[r, c] = {
            "tie": top,
            "next": torch.nextafter(top, torch.tensor(math.inf, dtype=torch.float64)),
            "nan": math.nan,
            "-inf": -math.inf,
            "inf": math.inf,
        }[kind]
    if transposed:
        x = x.t().contiguous().t()
    for device in DEVICES:
        assert torch.equal(argmax(x.to(device)).cpu(), x.argmax(dim=-1))
