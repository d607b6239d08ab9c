"""The hand-written expert dispatch against the obvious per-token loop."""

import torch

from whetstone.model import experts, ops
from whetstone.model.experts import expert_mlp
from whetstone.model.ops import shape_tile


def naive_expert_mlp(x, ids, gate_up, down):
    inner = down.shape[-1]
    rows = []
    for token in range(x.shape[0]):
        outs = []
        for expert in ids[token].tolist():
            hidden = gate_up[expert] @ x[token]
            outs.append(down[expert] @ (torch.nn.functional.silu(hidden[:inner]) * hidden[inner:]))
        rows.append(torch.stack(outs))
    return torch.stack(rows)


def _inputs(dtype=torch.float64, experts=4):
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    gate_up = torch.randn(experts, 6, 4, dtype=dtype, requires_grad=True)
    down = torch.randn(experts, 4, 3, dtype=dtype, requires_grad=True)
    # The last expert gets no tokens: its gradient must be exactly zero, not garbage.
    ids = torch.stack([torch.randperm(experts - 1)[:2] for _ in range(6)])
    return x, ids, gate_up, down


def test_forward_and_gradients_match_the_naive_loop():
    x, ids, gate_up, down = _inputs()
    probe = torch.randn(6, 2, 4, dtype=torch.float64)
    grads = torch.autograd.grad((expert_mlp(x, ids, gate_up, down) * probe).sum(), (x, gate_up, down))
    reference = torch.autograd.grad((naive_expert_mlp(x, ids, gate_up, down) * probe).sum(), (x, gate_up, down))
    torch.testing.assert_close(expert_mlp(x, ids, gate_up, down), naive_expert_mlp(x, ids, gate_up, down))
    for got, expected in zip(grads, reference):
        torch.testing.assert_close(got, expected)
    assert grads[1][-1].abs().sum() == 0 and grads[2][-1].abs().sum() == 0


def test_gradcheck():
    x, ids, gate_up, down = _inputs()
    assert torch.autograd.gradcheck(lambda a, b, c: expert_mlp(a, ids, b, c), (x, gate_up, down))


def test_autocast_runs_the_matmuls_in_bf16_and_grads_reach_fp32_weights():
    x, ids, gate_up, down = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = expert_mlp(x, ids, gate_up, down)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 2, 4)
    out.float().sum().backward()
    assert gate_up.grad.dtype == torch.float32 and gate_up.grad.abs().sum() > 0


def test_inference_path_gives_the_same_bits_as_the_differentiable_one():
    x, ids, gate_up, down = _inputs(torch.float32)
    differentiable = expert_mlp(x, ids, gate_up, down)
    assert differentiable.requires_grad
    with torch.no_grad():
        assert torch.equal(expert_mlp(x, ids, gate_up, down), differentiable.detach())


def test_shape_tile_rounds_up_by_at_most_an_eighth_to_few_sizes():
    padded = [count + (-count % shape_tile(count)) for count in range(1, 4097)]
    assert all(count <= size <= count * 9 / 8 for count, size in zip(range(1, 4097), padded))
    assert len(set(padded)) <= 16 + 8 * 8  # 1..16 exact, then eight sizes per power of two
    assert shape_tile(0) == 1


def test_bf16_training_pads_expert_groups_and_keeps_the_results(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(40, 8, requires_grad=True)
    gate_up = torch.randn(4, 12, 8, requires_grad=True)
    down = torch.randn(4, 8, 6, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
    probe = torch.randn(40, 2, 8)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = expert_mlp(x, ids, gate_up, down)
        return [out.float(), *torch.autograd.grad((out.float() * probe).sum(), (x, gate_up, down))]

    plain = run()
    sizes = []
    original = experts._padded_groups
    monkeypatch.setattr(experts, "_padded_groups", lambda *args: sizes.append(original(*args)[2]) or original(*args))
    with ops.training_kernels():
        padded = run()
    assert sizes and all(size % shape_tile(size) == 0 for size in sizes[0])
    assert sum(sizes[0]) > ids.numel()  # 80 slots over 4 experts: some group needed padding
    for got, expected in zip(padded, plain):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_grouped_offsets_end_each_expert_group_idle_experts_included():
    # the grouped matmuls' offsets, found by binary search over the sorted slots: an idle expert
    # (first, middle or last) ends where the one before it does
    slot_expert = torch.tensor([3, 1, 3, 5, 1, 1, 3, 6])
    ends = experts._group_ends(slot_expert.sort(stable=True).values, 8)
    assert ends.dtype == torch.int32
    assert ends.tolist() == experts.expert_counts(slot_expert, 8).cumsum(0).tolist() == [0, 3, 3, 6, 6, 7, 8, 8]
