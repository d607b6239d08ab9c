"""The hand-written expert dispatch against the obvious per-token loop."""

import torch

from whetstone.model.experts import expert_mlp


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
