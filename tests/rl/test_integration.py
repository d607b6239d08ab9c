"""The real pieces together at tiny scale: a MoE model samples a two-call segment, which becomes a
sample, a batch on disk, and a replayed training forward whose loss moves the policy."""

from __future__ import annotations

import torch

from tests.model.conftest import tiny_config
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.inference.protocol import encode_routes
from whetstone.model import Transformer
from whetstone.rl.advantages import AdvantageConfig
from whetstone.rl.advantages.groups import score_groups
from whetstone.rl.batch import collate, load_batch, save_batch
from whetstone.rl.loss import LossConfig, LossInputs, policy_loss
from whetstone.rl.samples import trajectory_samples

CONFIG = tiny_config(vocab_size=61, num_hidden_layers=2, mlp_only_layers=[])


@torch.no_grad()
def sample_call(model: Transformer, prompt: list[int], steps: int, generator: torch.Generator) -> ModelCall:
    """What a server returns: sampled tokens, their logprobs, and the routes of every fed token."""
    tokens, logprobs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        tokens.append(token)
    routes = model(torch.tensor([tokens[:-1]]), return_routes=True).routes[0]
    return ModelCall(
        prompt_ids=prompt,
        completion_ids=tokens[len(prompt) :],
        logprobs=logprobs,
        versions=[0] * steps,
        loss_mask=[1] * steps,
        routes=encode_routes(routes),
    )


def rollout(model, generator, reward) -> Trajectory:
    first = sample_call(model, [1, 2, 3, 4], 4, generator)
    tool_output = [5, 6]
    second = sample_call(model, first.prompt_ids + first.completion_ids + tool_output, 3, generator)
    return Trajectory(task_id="t", group_id="g", reward=reward, segments=[Segment(calls=[first, second])])


def trained_logprobs(model, batch):
    return model(batch.input_ids, routes=batch.routes, targets=batch.target_ids).logprobs


def test_sample_batch_replay_and_loss_end_to_end(tmp_path):
    torch.manual_seed(0)
    model, generator = Transformer(CONFIG), torch.Generator().manual_seed(1)
    rollouts = [rollout(model, generator, reward) for reward in (1.0, 0.0, 0.0)]
    kept, _ = score_groups(rollouts, AdvantageConfig())
    samples = [s for trajectory, advantage in kept for s in trajectory_samples(trajectory, advantage)]
    save_batch(tmp_path / "batch.safetensors", collate(samples))
    batch = load_batch(tmp_path / "batch.safetensors")
    assert batch.routes.shape == (3, 12, CONFIG.num_moe_layers, 2) and batch.num_loss_tokens == 3 * 7

    # Replaying the rollout's routes, the trainer reproduces the sampler's logprobs.
    logprobs = trained_logprobs(model, batch)
    inputs = LossInputs(logprobs, batch.behavior_logprobs, batch.advantages, batch.loss_mask)
    loss, stats = policy_loss(inputs, LossConfig())
    metrics = stats.metrics()
    assert metrics["logprob_diff_max"] < 1e-4 and metrics["mismatch_kl_k3"] < 1e-8
    assert metrics["clip_fraction"] == 0.0

    # One gradient step makes the rewarded rollout's tokens more likely, the others' less.
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.5 * param.grad
        after = trained_logprobs(model, batch)
    change = ((after - logprobs.detach()) * batch.loss_mask).sum(dim=1)
    assert change[0] > 0 and change[1] < 0 and change[2] < 0
