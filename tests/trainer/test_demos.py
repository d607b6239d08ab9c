"""The behaviour-cloning anchor: demonstration files, the rows each step draws, the loss term's
gradient and scale, and a trainer run with it that resumes onto the same rows."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.trainer_fixtures import TINY_MOE, TRANSCRIPTS, put_batches, trainer_config
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.rl.batch import collate
from whetstone.rl.demos import demo_rows, load_demos, write_demos
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.samples import NOT_GENERATED, Sample
from whetstone.tokenizer import Tokenizer, render_chat
from whetstone.trainer.loop import run_trainer
from whetstone.trainer.step import DemoAnchor, Learner, StepSettings, forward_logprobs, train_step
from whetstone.training.checkpoint import latest_checkpoint
from whetstone.utils.metrics import read_metrics


@pytest.fixture(scope="module")
def tokenizer(chat_moe) -> Tokenizer:
    return Tokenizer.load(chat_moe)


def test_demonstrations_round_trip_and_train_only_the_assistants_tokens(tmp_path, tokenizer):
    path = tmp_path / "demos.jsonl"
    assert write_demos(path, TRANSCRIPTS) == 3
    demos = load_demos(path, tokenizer)
    assert [d.task_id for d in demos] == ["demo:1", "demo:2", "demo:3"]
    second = demos[1]
    assert tokenizer.decode(second.input_ids) == render_chat(TRANSCRIPTS[1])
    trained = [second.input_ids[t + 1] for t, on in enumerate(second.loss_mask) if on]
    assert "return x * 2" in tokenizer.decode(trained) and "done" in tokenizer.decode(trained)
    assert "double it" not in tokenizer.decode(trained) and "thanks" not in tokenizer.decode(trained)
    assert len(load_demos(path, tokenizer, max_positions=len(demos[0].input_ids) - 1)) == 2  # the long one skipped


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"messages": [{"role": "assistant", "content": "hi"}]}\nnot json\n', r"line 2: not a demonstration"),
        ('{"turns": []}\n', r"line 1: not a demonstration .*'messages'"),
        ('{"messages": "hi"}\n', r"line 1: not a demonstration .*not a list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"line 1: the transcript has no assistant tokens"),
        ("\n", r"has no transcript to train on"),
    ],
)
def test_a_bad_demonstrations_file_is_refused_naming_the_line(tmp_path, tokenizer, content, error):
    path = tmp_path / "demos.jsonl"
    path.write_text(content)
    with pytest.raises(WhetstoneError, match=error):
        load_demos(path, tokenizer)


def test_a_missing_demonstrations_file_is_named(tmp_path, tokenizer):
    with pytest.raises(WhetstoneError, match=r"demonstrations file .*nowhere.jsonl"):
        load_demos(tmp_path / "nowhere.jsonl", tokenizer)


def test_each_step_draws_its_rows_by_its_seed():
    demos = [
        Sample([i, i + 1, i + 2], [1, 1], [0.0] * 2, [NOT_GENERATED] * 2, None, 0.0, task_id=f"demo:{i}")
        for i in range(10)
    ]
    ids = [[row["task_id"] for row in demo_rows(demos, 4, seed).rows] for seed in (0, 0, 1)]
    assert ids[0] == ids[1] and ids[0] != ids[2] and len(set(ids[0])) == 4
    assert len(demo_rows(demos, 50, seed=0)) == 10  # never more rows than demonstrations


def token_demos(count: int = 4) -> list[Sample]:
    """Demonstrations of the vocabulary-64 tiny MoE: 9 tokens, the last 4 the assistant's."""
    generator = torch.Generator().manual_seed(7)
    demos = []
    for i in range(count):
        ids = torch.randint(0, TINY_MOE.vocab_size, (9 + i,), generator=generator).tolist()
        mask = [0] * 4 + [1] * (4 + i)
        demos.append(Sample(ids, mask, [0.0] * len(mask), [NOT_GENERATED] * len(mask), None, 0.0))
    return demos


def mean_nll(model, demos_batch) -> torch.Tensor:
    logprobs = forward_logprobs(model, demos_batch, replay=False, dtype="float32").logprobs
    return -(logprobs * demos_batch.loss_mask).sum() / demos_batch.num_loss_tokens


def sgd_step(model, batch, lr=1.0, anchor=None, logit_scale=None):
    learner = Learner(model, torch.optim.SGD(model.parameters()), logit_scale=logit_scale)
    return train_step(learner, batch, StepSettings(grad_clip=1e9, micro_batch_size=3), lr, anchor=anchor)


def test_the_anchor_adds_its_coefficient_times_the_demonstrations_mean_loss(tiny_moe, batches):
    demos = collate(token_demos())
    plain, anchored, probe = load_hf(tiny_moe), load_hf(tiny_moe), load_hf(tiny_moe)
    expected = mean_nll(probe, demos)
    expected.backward()
    sgd_step(plain, batches[2])
    metrics = sgd_step(anchored, batches[2], anchor=DemoAnchor(demos, coef=0.5))
    assert metrics["demo_nll"] == pytest.approx(expected.item(), rel=1e-6)
    # Plain SGD at lr 1: the two steps differ by exactly the anchor's gradient.
    for (name, a), p, q in zip(anchored.named_parameters(), plain.parameters(), probe.parameters()):
        gradient = torch.zeros_like(q) if q.grad is None else q.grad
        torch.testing.assert_close(p - a, 0.5 * gradient, rtol=1e-4, atol=1e-6, msg=name)
    assert "demo_nll" not in sgd_step(load_hf(tiny_moe), batches[2], anchor=DemoAnchor(demos, coef=0.0))


def test_the_anchor_is_taken_before_the_learned_logit_scale(tiny_moe, batches):
    # A policy that only sharpened (the learned scale, folded into the final norm) fits the
    # demonstrations exactly as before: the anchor must not pull the sharpening back.
    demos = collate(token_demos())
    base = mean_nll(load_hf(tiny_moe), demos).item()
    sharpened = load_hf(tiny_moe)
    with torch.no_grad():
        sharpened.norm.weight.mul_(math.exp(1.5))
    assert abs(mean_nll(sharpened, demos).item() - base) > 0.01  # near-uniform logits: a small change
    metrics = sgd_step(
        sharpened, batches[2], lr=0.0, anchor=DemoAnchor(demos, coef=1.0), logit_scale=LogitScale(lr=0.0, log_scale=1.5)
    )
    assert metrics["demo_nll"] == pytest.approx(base, rel=1e-5)


def test_the_trainer_anchors_every_step_and_resumes_onto_the_same_rows(tmp_path, chat_moe, batches):
    demos = tmp_path / "demos.jsonl"
    write_demos(demos, TRANSCRIPTS * 4)
    anchor = dict(demo_coef=0.3, demos_path=str(demos), demo_rows=2, optimizer_steps_per_batch=2, checkpoint_interval=2)
    put_batches(tmp_path / "straight" / "batches", batches[:4])
    run_trainer(trainer_config(tmp_path / "straight", chat_moe, max_steps=4, **anchor))
    put_batches(tmp_path / "resumed" / "batches", batches[:4])
    run_trainer(trainer_config(tmp_path / "resumed", chat_moe, max_steps=2, **anchor))
    run_trainer(trainer_config(tmp_path / "resumed", chat_moe, max_steps=4, **anchor))
    straight = read_metrics(tmp_path / "straight" / "trainer" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "trainer" / "metrics.jsonl")
    assert all(r["demo_nll"] > 0 for r in straight) and len(resumed) == 4
    assert [r["demo_nll"] for r in straight] == [r["demo_nll"] for r in resumed]
    straight, resumed = (
        load_file(str(latest_checkpoint(tmp_path / run / "trainer" / "checkpoints") / "model.safetensors"))
        for run in ("straight", "resumed")
    )
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_an_anchor_without_demonstrations_is_refused_before_loading_the_model(tmp_path):
    with pytest.raises(ConfigError, match="demo_coef > 0 needs demos_path"):
        run_trainer(trainer_config(tmp_path, tmp_path / "no-model", demo_coef=0.1))
