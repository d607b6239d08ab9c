"""Batched sampling with a private random stream per request.

Each row of the batch has its own `SamplingParams` and its own `torch.Generator`, and every
operation below works row by row, so a request's tokens depend only on its own seed, prompt and
the weights, never on what else is in the batch.

The logprob returned for a sampled token is the log-probability under the distribution it was
actually drawn from: logits / temperature, then top-k, then top-p, renormalised. That is the
behaviour policy the trainer's importance ratios need. One exception: temperature 0 is argmax,
whose distribution is a point mass (logprob 0 for every token), so there we report the plain
log-softmax of the raw logits, which is what a user asking for greedy logprobs wants.

Sampling is by inverse CDF with a single uniform per row (one call to the row's generator), over
the vocabulary order for unfiltered rows and over the sorted order for top-k/top-p rows. Which
path a row takes depends only on its own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whetstone.errors import WhetstoneError

MAX_TOP_LOGPROBS = 20


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
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept in the token ids, left out of the text)."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's end-of-turn token (benchmarks, fixed-length rollouts)."""
    seed: int | None = None
    top_logprobs: int = 0
    """How many most likely alternatives (with logprobs) to return per generated token."""

    def __post_init__(self) -> None:
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


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # fresh entropy from the OS
    else:
        generator.manual_seed(seed)
    return generator


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    """Per row: the `top_logprobs` most likely (token, logprob) of the distribution used."""


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> SampleOutput:
    """Draw one token per row of `logits` [B, vocab]."""
    logits = logits.float()
    rows = len(params)
    tokens = torch.zeros(rows, dtype=torch.long)
    logprobs = torch.zeros(rows)
    top: list[list[tuple[int, float]]] = [[] for _ in range(rows)]

    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    plain = [i for i, p in enumerate(params) if p.temperature > 0.0 and not p.filtered]
    filtered = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.filtered]

    if greedy:
        idx = torch.tensor(greedy)
        row_logprobs = torch.log_softmax(_rows(logits, greedy), dim=-1)
        chosen = row_logprobs.argmax(dim=-1)
        _scatter(idx, chosen, row_logprobs, None, tokens, logprobs, top, params)
    if plain:
        idx = torch.tensor(plain)
        temps = [params[i].temperature for i in plain]
        scaled = _rows(logits, plain)
        if any(t != 1.0 for t in temps):  # dividing by 1 changes no bit: skip the pass over [B, vocab]
            scaled = scaled / torch.tensor(temps).unsqueeze(1)
        row_logprobs = torch.log_softmax(scaled, dim=-1)
        chosen = _inverse_cdf(row_logprobs, [generators[i] for i in plain])
        _scatter(idx, chosen, row_logprobs, None, tokens, logprobs, top, params)
    if filtered:
        idx = torch.tensor(filtered)
        row_logprobs, order = _filter_sorted(_rows(logits, filtered), [params[i] for i in filtered])
        position = _inverse_cdf(row_logprobs, [generators[i] for i in filtered])
        _scatter(idx, position, row_logprobs, order, tokens, logprobs, top, params)
    return SampleOutput(tokens.tolist(), logprobs.tolist(), top)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without the copy when `rows` is every row in order (the usual decode step)."""
    return logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows)]


def _filter_sorted(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs in descending order after temperature, top-k and top-p (-inf where cut)."""
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    scaled, order = torch.sort(logits / temps, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    scaled = scaled.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    scaled = scaled.masked_fill((mass_before >= top_p) & (rank > 0), float("-inf"))
    return torch.log_softmax(scaled, dim=-1), order


def _inverse_cdf(row_logprobs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators]).unsqueeze(1)
    cdf = torch.cumsum(row_logprobs.exp(), dim=-1)
    # first index whose cdf exceeds u * total: always a token with positive probability
    chosen = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)
    return chosen.clamp_(max=cdf.shape[-1] - 1).squeeze(1)


def _scatter(
    idx: torch.Tensor,
    chosen: torch.Tensor,
    row_logprobs: torch.Tensor,
    order: torch.Tensor | None,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    top: list,
    params: list[SamplingParams],
) -> None:
    """Write a group's results back to its batch rows (`order` maps sorted positions to ids)."""
    token_ids = chosen if order is None else order.gather(1, chosen.unsqueeze(1)).squeeze(1)
    tokens[idx] = token_ids
    logprobs[idx] = row_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    rows = idx.tolist()
    want = max(params[i].top_logprobs for i in rows)
    if want == 0:
        return
    values, positions = row_logprobs.topk(want, dim=-1)
    ids = positions if order is None else order.gather(1, positions)
    for i, vals, toks in zip(rows, values.tolist(), ids.tolist()):
        n = params[i].top_logprobs
        top[i] = [(t, v) for t, v in zip(toks[:n], vals[:n]) if v != float("-inf")]
