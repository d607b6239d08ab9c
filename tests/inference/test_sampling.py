import math
import random
import re

import numpy as np
import pytest
import torch

from whetstone.inference import sampling
from whetstone.inference.sampling import InvalidRequest, SamplingParams, sample, uniforms
from whetstone.utils.transfer import tensor_to_device, to_device


def draw(logits, params, seeds, counter=0):
    seeds = list(seeds)
    return sample(logits, params, seeds, [counter] * len(seeds)).read_later(params).result()


def test_greedy_takes_the_argmax_and_reports_the_model_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    out = draw(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert out.tokens == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 0].item()])


def test_logprob_is_that_of_the_distribution_sampled_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    # by hand: scale, keep the 3 best, then the smallest prefix holding 0.9 of their mass
    probs = torch.softmax(logits[0, :3] / 0.7, -1)
    kept = 3 if probs[:2].sum() < 0.9 else 2
    renormalised = probs[:kept] / probs[:kept].sum()
    for seed in range(20):
        out = draw(logits, [params], [seed])
        assert out.tokens[0] < kept
        assert out.logprobs[0] == pytest.approx(math.log(renormalised[out.tokens[0]].item()), abs=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    assert draw(logits, [SamplingParams(top_k=1)] * 4, range(4)).tokens == best
    out = draw(logits, [SamplingParams(top_p=1e-6)] * 4, range(4))
    assert out.tokens == best and out.logprobs == [0.0] * 4


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    out = draw(logits, [SamplingParams()] * 4000, range(4000))
    counts = torch.bincount(torch.tensor(out.tokens), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_same_seed_same_token_whatever_else_is_in_the_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(temperature=2.0),
        SamplingParams(),
    ]
    together = draw(logits, params, range(6))
    for row in range(6):
        alone = draw(logits[row : row + 1], [params[row]], [row])
        assert (alone.tokens[0], alone.logprobs[0]) == (together.tokens[row], together.logprobs[row])


def test_each_token_of_a_sequence_draws_its_own_uniform():
    logits = torch.zeros(1, 1000)
    first = draw(logits, [SamplingParams()], [7], counter=0).tokens
    second = draw(logits, [SamplingParams()], [7], counter=1).tokens
    assert first != second  # the stream advanced
    assert draw(logits, [SamplingParams()], [7], counter=0).tokens == first


def test_uniforms_are_uniform_and_depend_on_seed_and_counter_alone():
    device = torch.device("cpu")
    by_counter = uniforms([3] * 20000, list(range(20000)), device)
    by_seed = uniforms(list(range(20000)), [5] * 20000, device)
    for u in (by_counter, by_seed):
        assert 0.0 <= u.min() and u.max() < 1.0
        assert u.mean().item() == pytest.approx(0.5, abs=0.01)
        histogram = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
        assert torch.allclose(histogram, torch.full((10,), 0.1), atol=0.01)
    assert len(set(by_counter.tolist())) > 19900
    # any int is a seed (mod 2^64); a row's uniform ignores the rest of the batch
    assert uniforms([-1, 2**64 - 1], [4, 4], device).unique().numel() == 1
    assert uniforms([9], [2], device).item() == uniforms([1, 9, 4], [0, 2, 1], device)[1].item()


def _reference_uniform(seed: int, counter: int) -> float:
    """The hash spelled out on Python ints, one row at a time."""

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    seed %= 2**64
    mixed = mix(mix(mix((seed & 0xFFFFFFFF) ^ 0x9E3779B9) ^ (seed >> 32)) ^ (counter & 0xFFFFFFFF))
    return (mixed >> 8) * 2.0**-24


def test_uniforms_hashed_as_a_batch_are_the_hash_of_each_row():
    # the same stream as the hash row by row, so a seeded request draws the same tokens
    generator = random.Random(0)
    seeds = [generator.getrandbits(64) for _ in range(200)] + [0, -1, 2**64 - 1, 2**70 + 5, 12345]
    counters = [generator.randrange(10**6) for _ in range(200)] + [0, 3, 2**32 + 7, 5, 2**40]
    got = uniforms(seeds, counters, torch.device("cpu")).tolist()
    assert got == [_reference_uniform(s, c) for s, c in zip(seeds, counters)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inputs_reach_the_device_from_lists_and_numpy_arrays(device):
    # on CUDA through pinned memory, which torch will not build from a numpy array directly
    device = torch.device(device)
    from_list = to_device([[1, 2], [3, 4]], torch.int64, device)
    from_array = to_device(np.array([[1, 2], [3, 4]], dtype=np.int32), torch.int64, device)
    assert from_list.device.type == from_array.device.type == device.type
    assert from_array.dtype == torch.int64 and torch.equal(from_list, from_array)
    seeds, counters = [0, 7, 2**64 - 1], [0, 1, 2**40]
    assert uniforms(seeds, counters, device).tolist() == uniforms(seeds, counters, torch.device("cpu")).tolist()
    # host tensors (a training batch's), a strided view among them
    host = torch.arange(12).view(3, 4)
    moved = tensor_to_device(host.t(), device)
    assert moved.device.type == device.type and torch.equal(moved.cpu(), host.t())
    assert tensor_to_device(moved, moved.device) is moved  # already there


def test_a_filtered_draw_stays_in_the_kept_tokens_when_the_cdf_runs_past_them(monkeypatch):
    # CUDA's parallel cumsum can leave the cut tail's CDF an ulp above the last kept token's: a
    # uniform that lands there must still give a kept token (a cut one has logprob -inf)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(3, 1)

    def last(row_logprobs, uniforms):  # the worst case: the last position
        return torch.full_like(uniforms, row_logprobs.shape[-1] - 1, dtype=torch.int64)

    monkeypatch.setattr(sampling, "_inverse_cdf", last)
    out = draw(logits, [SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(top_p=0.5)], [0, 1, 2])
    assert out.tokens == [1, 2, 0] and all(math.isfinite(lp) for lp in out.logprobs)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_k=2), SamplingParams(top_p=0.9)])
def test_a_temperature_too_small_to_divide_by_is_greedy(params):
    # logits / 1e-40 overflow float32: NaN logprobs on the plain path, an index of -1 on the
    # filtered one (a device-side assert on CUDA, which ends every later call of the server)
    logits = torch.tensor([[2.0, 9.0, 0.5, -1.0], [3.0, 1.0, 8.0, -3.0]])
    for temperature in (1e-40, sampling.GREEDY_BELOW / 2):
        tiny = SamplingParams(temperature=temperature, top_k=params.top_k, top_p=params.top_p)
        out = draw(logits, [tiny, tiny], [0, 1])
        assert out.tokens == [1, 2] and out == draw(logits, [SamplingParams(temperature=0.0)] * 2, [0, 1])


def test_a_row_whose_logits_are_not_finite_still_draws_a_token_of_the_vocabulary():
    # a broken model's NaNs must fail the request, not the device: no index outside the row
    logits = torch.tensor([[float("nan")] * 4, [1.0, 2.0, 3.0, 4.0]])
    out = draw(logits, [SamplingParams(top_k=2), SamplingParams(top_k=2)], [0, 1])
    assert 0 <= out.tokens[0] < 4 and out.tokens[1] in (2, 3)


def test_top_logprobs_are_the_most_likely_of_the_used_distribution():
    logits = torch.tensor([[0.0, 4.0, 3.0, 2.0, 1.0]])
    out = draw(logits, [SamplingParams(top_k=2, top_logprobs=3)], [0])
    ids = [token for token, _ in out.top[0]]
    assert ids == [1, 2]  # only two tokens survive top-k: no -inf alternatives
    assert sum(math.exp(lp) for _, lp in out.top[0]) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("top_logprobs", 21), ("stop", ("",))],
)
def test_bad_parameters_are_named(field, value):
    with pytest.raises(InvalidRequest, match=rf"^{re.escape(field)}\b"):  # the message starts with the field
        SamplingParams(**{field: value})
