"""Log-probabilities of given target tokens straight from the final hidden states.

What training needs (next-token loss, RL importance ratios) is log p(target), not the full
logits. Computing it here, with its own backward, saves the separate log_softmax and nll passes
over the [N, vocab] logits: the softmax is formed chunk by chunk while a chunk is still in cache,
and the backward is one fused `probs * -grad` plus the two matmuls. On request it also gives
each row's entropy, with its gradient (RL's entropy term), from the same probabilities.

Under invariant numerics (`ops.numerics`) the logits come from the engine's own `lm_head`
matmul and the log-probabilities from the sampler's `log_softmax`, row by row, so the trainer
gets the engine's logprobs bit for bit (docs/consistency.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from whetstone.model import invariant, ops
from whetstone.model.causal_attention import REDUCED
from whetstone.utils.device import autocast_dtype

CHUNK_BYTES = 1 << 20  # rows per chunk so that one chunk of fp32 logits stays in L2
REDUCED_CHUNK_BYTES = 4 << 20  # bf16 compute: rows per chunk's matmul (fewer, larger matmuls)
DEVICE_CHUNK_BYTES = 256 << 20
"""On a GPU, chunks of fp32 logits this large: a chunk sized for a CPU's cache (8 rows at a
32k vocabulary) would make each chunk's few kernels a launch of their own, thousands a step.
Row-wise results do not depend on the chunk, so invariant numerics keep their bits."""


def _chunk_rows(vocab: int, device: torch.device, cpu_bytes: int) -> int:
    """Rows per chunk of [rows, vocab] fp32 logits: `cpu_bytes` of them on the CPU."""
    return max(1, (cpu_bytes if device.type == "cpu" else DEVICE_CHUNK_BYTES) // (4 * vocab))


def _probabilities(hidden, weight, targets, batch_invariant):
    """(softmax probabilities [N, V] in fp32 or better, log p(target) [N])."""
    if batch_invariant:  # the engine's lm_head and sampler: the same matmul, log_softmax per row
        logits = invariant.linear(hidden, weight)
    else:
        logits = torch.mm(hidden, weight.t())  # [N, V], softmax in fp32 (or better)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    rows = _chunk_rows(logits.shape[1], logits.device, CHUNK_BYTES)
    if batch_invariant:
        logprobs = logits.new_empty(logits.shape[0])
        for chunk, lp, target in zip(logits.split(rows), logprobs.split(rows), targets.split(rows)):
            chunk.copy_(invariant.log_softmax(chunk))
            lp.copy_(chunk.gather(1, target.unsqueeze(1)).squeeze(1))
            chunk.exp_()  # now softmax probabilities, in place
    else:
        logprobs = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
        for chunk, lp in zip(logits.split(rows), logprobs.split(rows)):
            lse = torch.logsumexp(chunk, dim=1)
            lp.sub_(lse)
            chunk.sub_(lse.unsqueeze(1)).exp_()  # now softmax probabilities, in place
    return logits, logprobs


def _reduced_probabilities(hidden, weight, targets):
    """The same under bf16 compute, probabilities in bf16: each chunk's logits are made and
    normalised in fp32 while in cache, with no fp32 [N, V] matrix written, read back and cast."""
    probs = hidden.new_empty(hidden.shape[0], weight.shape[0])
    logprobs = hidden.new_empty(targets.shape[0], dtype=torch.float32)
    rows = _chunk_rows(probs.shape[1], probs.device, REDUCED_CHUNK_BYTES)
    chunks = zip(hidden.split(rows), probs.split(rows), logprobs.split(rows), targets.split(rows))
    for part, chunk_probs, lp, target in chunks:
        chunk = torch.log_softmax(torch.mm(part, weight.t()).float(), dim=1)
        lp.copy_(chunk.gather(1, target.unsqueeze(1)).squeeze(1))
        chunk_probs.copy_(chunk.exp_())
    return probs, logprobs


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, batch_invariant, with_entropy):
        ignored = targets < 0
        targets = targets.masked_fill(ignored, 0)
        if hidden.dtype in REDUCED and not (batch_invariant or with_entropy):
            probs, logprobs = _reduced_probabilities(hidden, weight, targets)
        else:  # (the entropy wants fp32 probabilities)
            probs, logprobs = _probabilities(hidden, weight, targets, batch_invariant)
        entropy = logprobs.new_zeros(probs.shape[0])
        if with_entropy:
            rows = _chunk_rows(probs.shape[1], probs.device, CHUNK_BYTES)
            for chunk, h in zip(probs.split(rows), entropy.split(rows)):
                torch.sum(torch.special.entr(chunk), dim=1, out=h)
            entropy.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, targets, ignored, probs, entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no wasted pass
        return logprobs.masked_fill_(ignored, 0.0), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, ignored, probs, entropy = ctx.saved_tensors
        entropy_term = None
        if grad_entropy is not None:
            # dH / d logits_j = -p_j (log p_j + H) = entr(p_j) - p_j H
            grad_entropy = grad_entropy.masked_fill(ignored, 0.0).unsqueeze(1)
            entropy_term = (torch.special.entr(probs) - probs * entropy.unsqueeze(1)) * grad_entropy
        # The probabilities are needed no more: their [N, V] buffer becomes the logits' gradient.
        if grad_logprobs is not None:
            # In the probabilities' dtype: bf16 times an fp32 column takes a slow mixed-dtype path.
            grad_logprobs = grad_logprobs.masked_fill(ignored, 0.0).to(probs.dtype)
            # d logp(target) / d logits = onehot(target) - probs
            grad_logits = probs.mul_(-grad_logprobs.unsqueeze(1))
            # + the row's gradient at its target, as index_add_ on the flat view: the same additions
            # as scatter_add_, which is ~1000x slower on bf16 CPU tensors.
            at_target = torch.arange(targets.shape[0], device=targets.device) * grad_logits.shape[1] + targets
            grad_logits.view(-1).index_add_(0, at_target, grad_logprobs)
        else:
            grad_logits = probs.zero_()
        if entropy_term is not None:
            grad_logits += entropy_term
        grad_logits = grad_logits.to(hidden.dtype)
        grad_hidden = torch.mm(grad_logits, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.mm(grad_logits.t(), hidden) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def target_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_softmax(hidden @ weight.T)[targets], entropy of each row's softmax or None), fp32,
    without keeping log-softmax tensors.

    hidden [..., H], weight [V, H], targets [...] int64 -> two [...]. Negative targets (-100,
    the usual ignore index) give 0 and no gradient. Under autocast the matmuls run in the
    autocast dtype; the softmax is always fp32.
    """
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if dtype := autocast_dtype(hidden):
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    batch_invariant = ops.is_invariant()
    # Only the trained rows go through the head (prompts and tool results in chat data are most
    # of the tokens, and the head is most of a small model's compute). Their number sets the
    # head's shapes, so it is read back: one sync per forward, after the whole forward is queued.
    rows = (targets >= 0).nonzero().squeeze(1)
    with torch.autocast(hidden.device.type, enabled=False):
        if rows.numel() == targets.numel():
            logprobs, entropy = _TargetLogprobs.apply(hidden, weight, targets, batch_invariant, with_entropy)
            return logprobs.view(shape), entropy.view(shape) if with_entropy else None
        trained, picked = rows.numel(), targets[rows]
        if ops.pads_shapes(hidden):  # dummy rows (row 0 with an ignored target) up to a size with a built kernel
            extra = -trained % ops.shape_tile(trained)
            rows, picked = F.pad(rows, (0, extra)), F.pad(picked, (0, extra), value=-1)
        logprobs, entropy = _TargetLogprobs.apply(hidden[rows], weight, picked, batch_invariant, with_entropy)
        rows = rows[:trained]
        logprobs = logprobs.new_zeros(targets.shape).index_put((rows,), logprobs[:trained]).view(shape)
        if not with_entropy:
            return logprobs, None
        return logprobs, entropy.new_zeros(targets.shape).index_put((rows,), entropy[:trained]).view(shape)
