"""Batched sampling on the logits' device, with a private random stream per request.

Each row of the batch has its own `SamplingParams` and its own seed, and every operation below
works row by row, so a request's tokens depend only on its own seed, prompt and the weights,
never on what else is in the batch.

The logprob returned for a sampled token is the log-probability under the distribution it was
actually drawn from: logits / temperature, then top-k, then top-p, renormalised. That is the
behaviour policy the trainer's importance ratios need. One exception: temperature 0 is argmax,
whose distribution is a point mass (logprob 0 for every token), so there we report the plain
log-softmax of the raw logits, which is what a user asking for greedy logprobs wants. A
temperature below `GREEDY_BELOW` is sampled as 0.

Sampling is by inverse CDF with a single uniform per row, over the vocabulary order for
unfiltered rows and over the sorted order for top-k/top-p rows. Which path a row takes depends
only on its own parameters. The uniform is a hash of (seed, index of the token in the
completion): counter-based, so there is no generator object per row to keep on the device, the
batch's uniforms reach it in one copy, and a sequence that is preempted and resumed draws
exactly the uniforms it would have drawn.

Everything stays on the device until `Drawn.read_later`, the step's one read-back.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

from whetstone.errors import WhetstoneError
from whetstone.model import ops
from whetstone.utils.transfer import to_device

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5
"""Temperatures below this are sampled greedily, as 0 (vLLM's rule too): logits divided by a
smaller one can overflow float32 to inf, whose softmax is NaN, and no draw from it differs from
the argmax anyway."""


class InvalidRequest(WhetstoneError):
    """A request the engine refuses (bad parameter, prompt too long): the server answers 400."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filter."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; it is cut from the text."""
    stop_token_ids: frozenset[int] = frozenset()
    """Token ids that end generation (kept in the token ids, left out of the text). Any collection
    of ids may be given; it is held as a frozenset, as the engine thread looks every sampled token
    up in it."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's end-of-turn token (benchmarks, fixed-length rollouts)."""
    seed: int | None = None
    top_logprobs: int = 0
    """How many most likely alternatives (with logprobs) to return per generated token."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def random_seed() -> int:
    """A seed for a request that gave none (fresh entropy from the OS)."""
    return secrets.randbits(64)


_LOW32 = 0xFFFFFFFF


_MIX_FACTORS = np.uint32(0x21F0AAAD), np.uint32(0x735A2D97)
_GOLDEN = np.uint32(0x9E3779B9)
_UNIT = np.float32(2.0**-24)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (Wellons' lowbias32) of each uint32 (products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x *= _MIX_FACTORS[0]
    x ^= x >> 15
    x *= _MIX_FACTORS[1]
    return x ^ (x >> 15)


def uniforms(seeds: list[int], counters: list[int], device: torch.device) -> torch.Tensor:
    """Each row's uniform in [0, 1) with 24 random bits (as `torch.rand`'s float32), a function of
    its seed (any int, taken mod 2^64) and its counter (the token's index) alone, as a float32
    tensor on `device`. Hashed on the host, the batch at once with numpy's uint32 arithmetic: a
    dozen vector operations, where hashing row by row in Python costs ~2 µs a row (0.13 ms of a
    batch-64 decode step) and a dozen tensor operations on the device cost more to launch."""
    seed = np.array([s % 2**64 for s in seeds], dtype=np.uint64)
    low, high = seed.astype(np.uint32), (seed >> np.uint64(32)).astype(np.uint32)  # astype wraps
    counter = np.array([c & _LOW32 for c in counters], dtype=np.uint32)
    mixed = _mix(_mix(_mix(low ^ _GOLDEN) ^ high) ^ counter)
    return to_device((mixed >> 8).astype(np.float32) * _UNIT, torch.float32, device)


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    """Per row: the `top_logprobs` most likely (token, logprob) of the distribution used."""


@dataclass
class Drawn:
    """One step's draws, still on the device."""

    tokens: torch.Tensor
    """[B] int64."""
    logprobs: torch.Tensor
    """[B] float32: each token's logprob under the distribution it was drawn from."""
    top_logprobs: torch.Tensor | None
    """[B, n] float32, most likely first (-inf where cut), n = the batch's largest `top_logprobs`;
    None when no row asked."""
    top_ids: torch.Tensor | None
    """[B, n] int64 token ids of `top_logprobs`."""

    def read_later(self, params: list[SamplingParams]) -> Readback:
        """Start the read-back: one float64 tensor (exact for token ids and float32 logprobs),
        copied to the host behind the work queued so far, without waiting for it."""
        parts = [self.tokens.unsqueeze(1), self.logprobs.unsqueeze(1)]
        if self.top_ids is not None:
            parts += [self.top_logprobs, self.top_ids]
        packed = torch.cat([part.double() for part in parts], dim=1)
        want = 0 if self.top_ids is None else self.top_ids.shape[1]
        if packed.device.type != "cuda":
            return Readback(packed, None, params, want)
        host = packed.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(packed.device))  # the copy's device, current or not
        return Readback(host, done, params, want)


@dataclass
class Readback:
    """A step's draws on their way to the host (`Drawn.read_later`). `done` is recorded after the
    copies queued before it (the step's routes, say), so once `result()` returns they are there
    too; work queued after it (the next step) is not waited for."""

    host: torch.Tensor
    done: torch.cuda.Event | None
    params: list[SamplingParams]
    want: int

    def result(self) -> SampleOutput:
        if self.done is not None:
            self.done.synchronize()
        rows, want = self.host.tolist(), self.want
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if want:  # no row asked for top logprobs: no per-row work
            for i, (row, p) in enumerate(zip(rows, self.params)):
                n = min(p.top_logprobs, want)
                values, ids = row[2 : 2 + n], row[2 + want : 2 + want + n]
                top[i] = [(int(t), v) for t, v in zip(ids, values) if v != float("-inf")]
        return SampleOutput([int(row[0]) for row in rows], [row[1] for row in rows], top)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int]) -> Drawn:
    """Draw one token per row of `logits` [B, vocab]; row i's randomness is (seeds[i], counters[i])."""
    logits = logits.float()
    rows, vocab = logits.shape
    distinct = {id(p): p for p in params}  # requests share their params: classify each once
    want = min(max(p.top_logprobs for p in distinct.values()), vocab)
    kinds = {key: _kind(p) for key, p in distinct.items()}
    groups: dict[str, list[int]] = {"greedy": [], "plain": [], "filtered": []}
    if len(kinds) == 1:  # the usual step: every row alike
        groups[next(iter(kinds.values()))] = list(range(rows))
    else:
        for i, p in enumerate(params):
            groups[kinds[id(p)]].append(i)
    results = []
    for kind, members in groups.items():
        if not members:
            continue
        every = len(members) == rows  # the usual decode step: no gather, no scatter
        idx = None if every else to_device(members, torch.int64, logits.device)
        group_logits = logits if every else logits.index_select(0, idx)
        group_params = [params[i] for i in members]
        draw = [seeds[i] for i in members], [counters[i] for i in members]
        results.append((idx, _draw(kind, group_logits, group_params, *draw, want)))
    if len(results) == 1:
        return Drawn(*results[0][1])
    tokens = logits.new_zeros(rows, dtype=torch.int64)
    logprobs = logits.new_zeros(rows)
    top_logprobs = logits.new_zeros(rows, want) if want else None
    top_ids = logits.new_zeros(rows, want, dtype=torch.int64) if want else None
    for idx, group in results:
        for into, values in zip((tokens, logprobs, top_logprobs, top_ids), group):
            if into is not None:
                into.index_copy_(0, idx, values)
    return Drawn(tokens, logprobs, top_logprobs, top_ids)


def _kind(p: SamplingParams) -> str:
    """How a row with these params is drawn: greedy (temperature 0, or below `GREEDY_BELOW`), plain, or
    filtered (top-k/p)."""
    if p.temperature < GREEDY_BELOW:
        return "greedy"
    return "filtered" if p.filtered else "plain"


def _draw(kind: str, logits: torch.Tensor, params: list[SamplingParams], seeds, counters, want: int):
    """(tokens, logprobs, top logprobs, top ids) of one group of rows sampled the same way."""
    order = None
    if kind == "greedy":
        row_logprobs = ops.log_softmax(logits)
        chosen = row_logprobs.argmax(dim=-1)
    elif kind == "plain":
        scaled = logits
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):  # dividing by 1 changes no bit: skip the pass over [B, vocab]
            scaled = scaled / _per_row(temps, logits)
        row_logprobs = ops.log_softmax(scaled)
        chosen = _inverse_cdf(row_logprobs, uniforms(seeds, counters, logits.device))
    else:
        row_logprobs, order = _filter_sorted(logits, params)
        chosen = _inverse_cdf(row_logprobs, uniforms(seeds, counters, logits.device))
        # within the kept prefix: CUDA's parallel cumsum may end the cut tail's CDF (all zeros
        # added) an ulp above the last kept token's, which a uniform within 2^-24 of 1 would pick
        # (at least the first: a row whose logits are not finite keeps none, and an index of -1
        # would be a device-side assert on CUDA, which no later call of the process survives)
        kept = torch.isfinite(row_logprobs).sum(dim=-1)
        chosen = torch.minimum(chosen, (kept - 1).clamp_(min=0))
    tokens = chosen if order is None else order.gather(1, chosen.unsqueeze(1)).squeeze(1)
    logprobs = row_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if not want:
        return tokens, logprobs, None, None
    values, positions = row_logprobs.topk(want, dim=-1)
    return tokens, logprobs, values, positions if order is None else order.gather(1, positions)


def _per_row(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-row parameter as a column [rows, 1] on `like`'s device, in `dtype` (default: like's);
    filled on the device, without a copy, when every row has the same."""
    dtype = dtype or like.dtype
    if all(v == values[0] for v in values):
        return like.new_full((len(values), 1), values[0], dtype=dtype)
    return to_device(values, dtype, like.device).unsqueeze(1)


def _filter_sorted(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs in descending order after temperature, top-k and top-p (-inf where cut)."""
    temps = _per_row([p.temperature for p in params], logits)
    scaled, order = torch.sort(logits / temps, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    top_k = _per_row([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], logits, torch.int64)
    scaled = scaled.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p = _per_row([p.top_p for p in params], logits)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    scaled = scaled.masked_fill((mass_before >= top_p) & (rank > 0), float("-inf"))
    return torch.log_softmax(scaled, dim=-1), order


def _inverse_cdf(row_logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = torch.cumsum(row_logprobs.exp(), dim=-1)
    # first index whose cdf exceeds u * total: always a token with positive probability
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True)
    return chosen.clamp_(max=cdf.shape[-1] - 1).squeeze(1)
