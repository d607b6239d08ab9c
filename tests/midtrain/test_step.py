"""One optimizer step: accumulation equals one big batch, ignored targets do not count, and a
diverged loss stops the run before it touches the weights."""

import numpy as np
import pytest
import torch

from tests.training.conftest import TINY
from whetstone.data import IGNORE_INDEX, Batch
from whetstone.data.loader import make_batch
from whetstone.errors import WhetstoneError
from whetstone.midtrain import step as step_module
from whetstone.midtrain.step import rank_share, train_step, validation_loss
from whetstone.model import Transformer
from whetstone.training.optim import build_optimizer


def batch(rows: torch.Tensor, ignore_from: int | None = None, demo_rows: int = 0) -> Batch:
    """The loader's batch of `rows` (seq_len + 1 tokens each); targets from `ignore_from` on are ignored."""
    trained = np.ones(tuple(rows.shape), dtype=bool)
    if ignore_from is not None:
        trained[:, ignore_from + 1 :] = False
    return make_batch(rows.numpy(), trained, eos_id=0, demo_rows=demo_rows)


def rows_of(full: Batch, rows: slice) -> Batch:
    return Batch(**{name: tensor[rows] for name, tensor in vars(full).items()})


def model_and_optimizer(aux: float = 0.001):
    torch.manual_seed(0)
    model = Transformer(TINY.model_copy(update={"router_aux_loss_coef": aux}))
    return model, build_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def step(model, optimizer, micro_batches, **kw):
    settings = dict(lr=1e-2, dtype="float32", grad_clip=0.0, step=0) | kw
    return train_step(model, optimizer, micro_batches, **settings)


def test_accumulated_micro_batches_make_the_same_step_as_one_batch():
    torch.manual_seed(1)
    rows = torch.randint(0, 50, (4, 9))
    # The second half of the first two rows is ignored: token weighting must still match.
    full = batch(rows)
    full.targets[:2, 4:] = IGNORE_INDEX
    halves = [rows_of(full, slice(0, 2)), rows_of(full, slice(2, 4))]

    big_model, big_opt = model_and_optimizer(aux=0.0)  # the aux loss is per micro-batch by design
    acc_model, acc_opt = model_and_optimizer(aux=0.0)

    big = step(big_model, big_opt, [full])
    acc = step(acc_model, acc_opt, halves)

    assert acc.loss == pytest.approx(big.loss, rel=1e-5)
    assert acc.grad_norm == pytest.approx(big.grad_norm, rel=1e-4)
    assert acc.tokens == big.tokens == 32
    for (name, a), b in zip(big_model.named_parameters(), acc_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_clipping_bounds_the_update_and_reports_the_unclipped_norm():
    rows = torch.randint(0, 50, (2, 9))
    model, optimizer = model_and_optimizer()
    stats = step(model, optimizer, [batch(rows)], grad_clip=1e-3)
    assert stats.grad_norm > 1e-3  # the norm before clipping


def test_a_step_moves_the_weights_and_lowers_the_loss_on_repeat():
    rows = torch.randint(0, 50, (2, 9))
    model, optimizer = model_and_optimizer()
    losses = [step(model, optimizer, [batch(rows)]).loss for _ in range(5)]
    assert losses[-1] < losses[0]


def test_bf16_compute_keeps_fp32_master_weights():
    model, optimizer = model_and_optimizer()
    stats = step(model, optimizer, [batch(torch.randint(0, 50, (2, 9)))], dtype="bfloat16")
    assert stats.loss > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in optimizer.state.values() for k, v in s.items() if k != "step")


def test_a_batch_with_nothing_to_learn_is_an_error():
    model, optimizer = model_and_optimizer()
    with pytest.raises(WhetstoneError, match="step 0: the batch has no trained tokens"):
        step(model, optimizer, [batch(torch.randint(0, 50, (2, 9)), ignore_from=0)])


def test_a_diverged_loss_stops_before_the_weights_change():
    model, optimizer = model_and_optimizer()
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WhetstoneError, match="step 3: the loss is nan"):
        step(model, optimizer, [batch(torch.randint(0, 50, (2, 9)))], step=3)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or before[k].isnan().all() for k in before)


def test_a_gradient_that_is_not_finite_stops_before_the_weights_change():
    # a finite loss whose gradient overflowed: clipping by a NaN norm would make every weight NaN
    model, optimizer = model_and_optimizer()
    model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WhetstoneError, match=r"step 2: the loss is [0-9.]+ and the gradient norm nan"):
        step(model, optimizer, [batch(torch.randint(0, 50, (2, 9)))], step=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_demonstration_rows_get_their_own_loss():
    model, optimizer = model_and_optimizer()
    rows = torch.randint(0, 50, (4, 9))
    code_only = step(model, optimizer, [batch(rows)])
    assert code_only.demo_loss is None
    mixed = step(model, optimizer, [batch(rows, demo_rows=1)])
    assert mixed.demo_loss is not None and mixed.demo_loss != mixed.loss


def test_validation_loss_is_the_token_mean_cross_entropy():
    model, _ = model_and_optimizer()
    rows = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert validation_loss(model, [batch(rows[:2]), batch(rows[2:])], "float32") == pytest.approx(expected, rel=1e-5)


def test_ranks_validate_a_batch_with_fewer_rows_than_ranks_and_add_up_to_one_rank(monkeypatch):
    # three ranks simulated in turn on one process: each runs every forward (FSDP2's collectives
    # pair up), and the shares' sums, reduced, are the one-rank loss
    model, _ = model_and_optimizer()
    torch.manual_seed(2)
    batches = [batch(torch.randint(0, 50, (4, 9))), batch(torch.randint(0, 50, (1, 9)))]
    expected = validation_loss(model, batches, "float32")
    reduced = []
    monkeypatch.setattr(step_module, "sum_on_device", lambda tensor: reduced.append(tensor.clone()) or tensor)
    for rank in range(3):
        monkeypatch.setattr(step_module, "world", lambda rank=rank: (rank, 3))
        shares = [rank_share(b) for b in batches]
        assert [len(share.input_ids) for share in shares] == [2, 1]  # the short last batch: 1 row for 3 ranks
        if rank > 0:  # padded with a row that trains nothing
            padding = [shares[0].targets[1], shares[1].targets[0]]
            assert all((targets == IGNORE_INDEX).all() for targets in padding)
        validation_loss(model, batches, "float32")
    total, count = torch.stack(reduced).sum(0).tolist()
    assert count == 5 * 8 and total / count == pytest.approx(expected, rel=1e-5)
