"""The numerics contract between the inference engine and the trainer (docs/consistency.md).

With `numerics = "invariant"` on both sides and the same dtype, the logprob the engine returns
for each token it generated (continuously batched with other requests, prompts prefilled in
chunks, a user preempting rollouts, decoding from its KV cache) is bit for bit the logprob the
trainer computes for the same sequences in one full forward inside a different batch (another
order, other padding, other micro-batches). The trainer's own router picks the engine's experts
in the engine's order without replay, and at staleness 0 every importance ratio is exactly 1.
In `fast` mode the same comparison differs, so these tests can fail.
"""

import copy

import pytest
import torch

from tests.inference.inference_fixtures import tiny_model
from tests.triton_kernels import kernels
from whetstone.bench.consistency import rollout_batch
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.model import numerics
from whetstone.rl.batch import Batch
from whetstone.trainer.step import Learner, StepSettings, forward_logprobs, train_step
from whetstone.utils.device import autocast

MODELS = {"dense": dict(num_experts=0), "moe": dict()}
PROMPT_LENGTHS = (3, 141, 9, 17, 120, 5, 12)  # two cross the attention's 128-key chunks
COMPLETIONS = (14, 6, 21, 9, 16, 17, 8)


def model_for(kind: str):
    return tiny_model(seed=4, vocab_size=128, num_hidden_layers=3, max_position_embeddings=192, **MODELS[kind])


def rollouts(
    model, mode: str, dtype: str, threads: int = 1, device: str = "cpu", static_shapes: bool | None = None
) -> list[Sequence]:
    """Batch requests sharing 3 slots, prefilled 32 tokens at a time; two users arrive midway
    and preempt rollouts (which later resume by replaying their routes)."""
    torch.set_num_threads(threads)
    engine = Engine(
        model,
        EngineConfig(
            max_batch=3,
            context_limit=192,
            prefill_chunk=32,
            batch_beside_interactive=1,
            interactive_grace_s=0,
            numerics=mode,
            dtype=dtype,
            device=device,  # the CPU's invariance by default, against a trainer on the CPU
        ),
        static_shapes=static_shapes,
    )
    g = torch.Generator().manual_seed(7)
    seqs = [
        Sequence(
            f"r{i}",
            torch.randint(0, 128, (n,), generator=g).tolist(),
            SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True, seed=i),
            priority="interactive" if i in (3, 5) else "batch",
        )
        for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, COMPLETIONS))
    ]
    with torch.inference_mode():
        for seq in seqs:
            if seq.priority == "batch":
                engine.add(seq)
        for step in range(400):
            if step in (4, 9):  # users arrive while rollouts are decoding
                engine.add(seqs[3 if step == 4 else 5])
            engine.step()
            if all(seq.finished for seq in seqs):
                break
    torch.set_num_threads(1)
    assert all(seq.finish_reason == "length" for seq in seqs)
    assert engine.stats.preemptions_total > 0
    if engine.device.type == "cuda":  # the decode steps replayed CUDA graphs (a failed capture runs eagerly)
        assert engine.stats.graph_captures_total > 0 and engine.decoder.graphs
    return seqs


def trainer_logprobs(model, batch: Batch, mode: str, dtype: str, micro_batch_size: int = 3) -> torch.Tensor:
    """What the trainer computes, micro-batch by micro-batch, with gradients on and no replay
    (micro-batches of consecutive rows, so the result lines up with the batch's rows; the
    trainer's own `micro_batches` groups rows by length, other neighbours again)."""
    model.train()
    chunks = [
        batch.select(range(i, min(i + micro_batch_size, len(batch)))) for i in range(0, len(batch), micro_batch_size)
    ]
    parts = [
        forward_logprobs(model, micro, replay=False, dtype=dtype, numerics=mode).logprobs.detach() for micro in chunks
    ]
    length = batch.input_ids.shape[1]
    return torch.cat([torch.nn.functional.pad(p, (0, length - p.shape[1])) for p in parts])


def shuffled(seqs: list[Sequence]) -> Batch:
    """The sequences in another order than the engine's (so other neighbours and padding)."""
    return rollout_batch(seqs, order=[4, 0, 6, 2, 5, 1, 3])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", MODELS)
def test_engine_logprobs_are_the_trainers_bit_for_bit(kind, dtype):
    model = model_for(kind)
    batch = shuffled(rollouts(model, "invariant", dtype))
    trained = batch.loss_mask
    assert int(trained.sum()) == sum(COMPLETIONS)
    logprobs = trainer_logprobs(model, batch, "invariant", dtype)
    assert torch.equal(logprobs[trained], batch.behavior_logprobs[trained])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_routes_are_the_engines_without_replay(dtype):
    model = model_for("moe")
    batch = shuffled(rollouts(model, "invariant", dtype))
    with torch.no_grad(), autocast(dtype), numerics("invariant"):
        own = model(batch.input_ids, return_routes=True).routes
    real = batch.target_ids >= 0  # every token fed, prompt and completion; padding excluded
    assert torch.equal(own[real], batch.routes[real])  # same experts, same top-k order


def test_importance_ratio_is_exactly_one_at_staleness_zero():
    model = model_for("moe")
    batch = shuffled(rollouts(model, "invariant", "float32"))
    logprobs = trainer_logprobs(model, batch, "invariant", "float32")
    trained = batch.loss_mask
    assert (torch.exp(logprobs - batch.behavior_logprobs)[trained] == 1.0).all()
    # The RL step itself sees it: no mismatch, nothing clipped, its router agrees with the replay.
    policy = copy.deepcopy(model)
    metrics = train_step(
        Learner(policy, torch.optim.AdamW(policy.parameters())),
        batch,
        StepSettings(grad_clip=1.0, micro_batch_size=2, numerics="invariant"),
        lr=1e-3,
    )
    assert metrics["logprob_diff_max"] == 0.0 and metrics["mismatch_kl_k3"] == 0.0
    assert metrics["clip_fraction"] == 0.0 and metrics["routing_disagreement"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(  # the interpreter takes ~2 minutes a run
    "where", [pytest.param("interpreter", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_the_triton_kernels_keep_the_contract(where, dtype, monkeypatch):
    """The GPU's invariant kernels (on a GPU, or under Triton's interpreter): the engine's
    logprobs and routes are the trainer's, bit for bit. The engine decodes as on CUDA, in static
    shapes (batches padded to buckets with dummy rows, keys to a power of two of blocks)."""
    device, context = kernels(where, monkeypatch)
    model = model_for("moe")
    with context():
        seqs = rollouts(model, "invariant", dtype, device=str(device), static_shapes=True)
        batch = shuffled(seqs).to(device)
        model.to(device)
        logprobs = trainer_logprobs(model, batch, "invariant", dtype)
        with torch.no_grad(), autocast(dtype, device), numerics("invariant"):
            own = model(batch.input_ids, return_routes=True).routes
    trained, real = batch.loss_mask, batch.target_ids >= 0
    assert torch.equal(logprobs[trained], batch.behavior_logprobs[trained])
    assert torch.equal(own[real], batch.routes[real])


@pytest.mark.slow  # two threads on shared cores: slow when other work runs
def test_engine_on_two_threads_trainer_on_one():
    model = model_for("moe")
    batch = shuffled(rollouts(model, "invariant", "float32", threads=2))
    logprobs = trainer_logprobs(model, batch, "invariant", "float32", micro_batch_size=7)
    assert torch.equal(logprobs[batch.loss_mask], batch.behavior_logprobs[batch.loss_mask])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_numerics_do_differ(dtype):
    model = model_for("moe")
    batch = shuffled(rollouts(model, "fast", dtype))
    logprobs = trainer_logprobs(model, batch, "fast", dtype)
    trained = batch.loss_mask
    assert not torch.equal(logprobs[trained], batch.behavior_logprobs[trained])
    close = 1e-4 if dtype == "float32" else 1e-2  # but only by rounding
    torch.testing.assert_close(logprobs[trained], batch.behavior_logprobs[trained], atol=close, rtol=0)
