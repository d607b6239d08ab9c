"""The model on any device: nothing in a forward, a backward or a decode step is built on the
host, read-backs are where the code says they must be, and the experts' grouped path (CUDA's)
computes what the per-expert path (the CPU's) does. CPU tests check the device-agnostic code
with `watch_host_work`; the `gpu` tests run the same on CUDA."""

from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from tests.host_work import no_gpu_waits, watch_host_work
from whetstone.model import KVCache, Transformer, ops
from whetstone.model.experts import expert_mlp, grouped_mm_on_cpu, uses_grouped_mm
from whetstone.model.moe import load_balancing_loss

NUMERICS = ["fast", "invariant"]
DTYPES = ["float32", "bfloat16"]


def _autocast(dtype: str, device: str = "cpu"):
    return torch.autocast(device, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()


def _model(make_config, device="cpu"):
    torch.manual_seed(0)
    cfg = make_config(num_experts=6)  # one MoE layer's worth of tokens leaves some expert idle
    return Transformer(cfg).to(device)


def _batch(cfg, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=generator)
    targets = ids.roll(-1, dims=1)
    targets[:, :4] = -100  # a prompt: the head trains only the other rows
    return ids.to(device), targets.to(device)


def _functions(syncs: list[str]) -> Counter:
    """Read-backs per function ('model/head.py:132 target_logprobs' -> target_logprobs)."""
    return Counter(where.split()[-1] for where in syncs)


def _train_step(model, ids, targets, routes=None):
    """Logprobs, routes and every parameter's gradient of one forward and backward."""
    model.zero_grad()
    out = model(ids, targets=targets, routes=routes, return_routes=True)
    (-out.logprobs.sum() + out.aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.logprobs.detach(), out.routes, grads


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_forward_and_backward_build_nothing_on_the_host(numerics, dtype, make_config):
    model = _model(make_config)
    ids, targets = _batch(model.cfg)
    with ops.numerics(numerics), _autocast(dtype), watch_host_work() as work:
        _, routes, _ = _train_step(model, ids, targets)
        _train_step(model, ids, targets, routes=routes)  # the RL trainer's replayed routes
    assert work.host_tensors == []
    # Per forward: the CPU's per-expert dispatch reads its slice sizes back once per MoE layer,
    # the head the number of trained rows once, route checking the ids' range once (routes on the
    # host, as here; on a device the check is queued, not read back: tests/model/test_routes.py).
    layers = model.cfg.num_moe_layers
    assert _functions(work.syncs) == {"expert_mlp": 2 * layers, "target_logprobs": 2, "check_route_ids": 1}


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoding_through_the_kv_cache_builds_nothing_on_the_host(numerics, dtype, make_config):
    model = _model(make_config).eval()
    ids, _ = _batch(model.cfg)
    cache = KVCache(model.cfg, batch_size=2, max_len=16, device=ids.device)
    with torch.no_grad(), ops.numerics(numerics), _autocast(dtype), watch_host_work() as work:
        model(ids[:, :8], cache=cache, logits_to_keep=1)
        for t in range(8, 12):
            model(ids[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache)
    assert work.host_tensors == []
    # The cache reads the positions' range back once per forward (its check and the attended span).
    assert _functions(work.syncs) == {"expert_mlp": 5 * model.cfg.num_moe_layers, "begin": 5}


def _expert_case():
    """x [24, 32], ids [24, 2] over 6 experts of which 4 and 5 get no token (their gradients
    must be exact zeros), gate_up, down, and a probe to weight the output by."""
    generator = torch.Generator().manual_seed(0)
    x, gate_up, down = (torch.randn(shape, generator=generator) for shape in ((24, 32), (6, 32, 32), (6, 32, 16)))
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(24)])
    return x, ids, gate_up, down, torch.randn(24, 2, 32, generator=generator)


def _run_experts(dtype, device="cpu", watch=nullcontext):
    """The experts' output and the gradients of x, gate_up and down, all fp32; `watch` is entered
    around the dispatch only (the inputs are on the device by then)."""
    x, ids, gate_up, down, probe = (t.to(device) for t in _expert_case())
    x, gate_up, down = (t.requires_grad_() for t in (x, gate_up, down))
    with watch(), _autocast(dtype, device):
        out = expert_mlp(x, ids, gate_up, down)
        grads = torch.autograd.grad((out.float() * probe).sum(), (x, gate_up, down))
    return [out.float(), *grads]


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_experts_match_the_per_expert_path_without_a_sync(dtype):
    per_expert = _run_experts(dtype)
    with grouped_mm_on_cpu(), watch_host_work() as work:
        grouped = _run_experts(dtype)
    assert work.syncs == [] and work.host_tensors == []
    for got, expected in zip(grouped, per_expert):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert grouped[2][4:].abs().sum() == 0 and grouped[3][4:].abs().sum() == 0


def test_grouped_experts_skip_the_autograd_function_without_grad_and_agree_with_it():
    x, gate_up, down = torch.randn(10, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    ids = torch.randint(0, 4, (10, 2))
    with grouped_mm_on_cpu():
        with torch.no_grad():
            decoding = expert_mlp(x, ids, gate_up, down)
        differentiable = expert_mlp(x, ids, gate_up.requires_grad_(), down)
    assert differentiable.requires_grad and torch.equal(decoding, differentiable.detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_model_trains_and_replays_routes_as_the_per_expert_one(dtype, make_config):
    model = _model(make_config)
    ids, targets = _batch(model.cfg)
    with _autocast(dtype):
        logprobs, routes, grads = _train_step(model, ids, targets)
        with grouped_mm_on_cpu(), watch_host_work() as work:
            grouped_logprobs, grouped_routes, grouped_grads = _train_step(model, ids, targets)
            replayed_logprobs, _, replayed_grads = _train_step(model, ids, targets, routes=grouped_routes)
    # No read-back in the expert dispatch: the head's and the host routes' check remain.
    assert _functions(work.syncs) == {"target_logprobs": 2, "check_route_ids": 1}
    assert torch.equal(grouped_routes, routes)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    for got_logprobs, got_grads in ((grouped_logprobs, grouped_grads), (replayed_logprobs, replayed_grads)):
        torch.testing.assert_close(got_logprobs, logprobs, **tolerance)
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, **tolerance, msg=name)


def test_grouped_expert_counts_give_the_same_load_balancing_loss(make_config):
    ids = [torch.randint(0, 6, (40, 2)) for _ in range(2)]
    probs = [torch.rand(40, 6).softmax(-1) for _ in range(2)]
    with grouped_mm_on_cpu():
        grouped = load_balancing_loss(ids, probs, 6)
    assert torch.equal(grouped, load_balancing_loss(ids, probs, 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_numerics_keep_their_own_expert_tiles(dtype, make_config):
    model = _model(make_config).eval()
    ids, _ = _batch(model.cfg)
    x = torch.randn(4, model.cfg.hidden_size)
    experts = model.layers[1].mlp.experts
    with torch.no_grad(), ops.numerics("invariant"), _autocast(dtype):
        with grouped_mm_on_cpu():
            assert not uses_grouped_mm(x, experts.gate_up_proj, experts.down_proj)
            forced = model(ids).logits
        assert torch.equal(forced, model(ids).logits)


def test_the_grouped_path_wants_rows_the_grouped_kernels_accept():
    gate_up, down = torch.randn(2, 12, 6), torch.randn(2, 6, 6)
    with grouped_mm_on_cpu():
        assert not uses_grouped_mm(torch.randn(3, 6), gate_up, down)  # 24-byte rows
        assert uses_grouped_mm(torch.randn(3, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 4))
        with torch.no_grad():
            assert expert_mlp(torch.randn(3, 6), torch.tensor([[0, 1]] * 3), gate_up, down).shape == (3, 2, 6)
    assert not uses_grouped_mm(torch.randn(3, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 4))  # a CPU tensor


def test_masked_attention_with_query_heads_folded_into_rows_equals_grouped_query_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 2, 16), torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    positions = torch.tensor([[4, 5], [17, 18], [0, 1]])  # ragged rows, as a cache's decode step
    mask = (torch.arange(20) <= positions.unsqueeze(-1)).unsqueeze(1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ops.grouped_rows_attention(q, k, v, mask), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_fp32_grouped_query_attention_on_cuda_keeps_no_score_matrix():
    # SDPA's math fallback (the only CUDA kernel for fp32 with grouped heads) would keep
    # [B, Hq, T, T] fp32 scores, 512 MB here, for the backward; repeated kv heads take the
    # memory-efficient kernel, with the same result
    torch.manual_seed(0)
    q = torch.randn(1, 8, 4096, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, 4096, 64, device="cuda", requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = ops.torch_attention(q, k, v, None)
    out.sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 128 * 2**20
    short = [t.detach()[:, :, :256] for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*(t.cpu() for t in short), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ops.torch_attention(*short, None).cpu(), expected, rtol=1e-4, atol=1e-4)


# On CUDA: the same model against its CPU twin. Both replay the CPU's routes: in bf16 a router
# choice between two nearly equal experts may go either way on the two devices.


def _cuda_twin(make_config):
    cpu = _model(make_config)
    gpu = _model(make_config, "cuda")
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def _assert_near(got: torch.Tensor, expected: torch.Tensor, relative: float, what: str = ""):
    """|got - expected| within `relative` of |expected| (norms over the whole tensor)."""
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    error = (got - expected).norm() / expected.norm().clamp_min(1e-12)
    assert error <= relative or got.equal(expected), f"{what}: relative error {error:.2e} > {relative:.0e}"


TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_training_step_matches_the_cpu(numerics, dtype, make_config):
    cpu, gpu = _cuda_twin(make_config)
    ids, targets = _batch(cpu.cfg)
    with ops.numerics(numerics):
        with _autocast(dtype):
            logprobs, routes, grads = _train_step(cpu, ids, targets)
            logprobs, _, grads = _train_step(cpu, ids, targets, routes=routes)
        with _autocast(dtype, "cuda"):
            _train_step(gpu, ids.cuda(), targets.cuda())  # its own routes: runs
            got_logprobs, _, got_grads = _train_step(gpu, ids.cuda(), targets.cuda(), routes=routes.cuda())
    _assert_near(got_logprobs, logprobs, TOLERANCE[dtype], "logprobs")
    for name, grad in grads.items():
        _assert_near(got_grads[name], grad, TOLERANCE[dtype], name)


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_decoding_through_the_kv_cache_matches_the_cpu(numerics, dtype, make_config):
    cpu, gpu = _cuda_twin(make_config)
    ids, _ = _batch(cpu.cfg)
    with torch.no_grad(), ops.numerics(numerics):
        with _autocast(dtype):
            expected = cpu(ids, return_routes=True)
        ids, routes = ids.cuda(), expected.routes.cuda()
        cache = KVCache(gpu.cfg, batch_size=2, max_len=16, device="cuda")
        with _autocast(dtype, "cuda"):
            full = gpu(ids, routes=routes).logits
            steps = [gpu(ids[:, :8], cache=cache, routes=routes[:, :8]).logits]
            for t in range(8, 12):
                positions = torch.full((2, 1), t, device="cuda")
                steps.append(
                    gpu(ids[:, t : t + 1], positions=positions, cache=cache, routes=routes[:, t : t + 1]).logits
                )
    _assert_near(full, expected.logits, TOLERANCE[dtype], "full forward")
    _assert_near(torch.cat(steps, dim=1), expected.logits, TOLERANCE[dtype], "decoding")


@pytest.mark.gpu
def test_cuda_takes_the_grouped_path_and_it_never_waits_for_the_gpu():
    x, _, gate_up, down, _ = (t.cuda() for t in _expert_case())
    assert uses_grouped_mm(x.bfloat16(), gate_up, down)
    expected = _run_experts("bfloat16")
    got = _run_experts("bfloat16", "cuda", watch=no_gpu_waits)
    for name, tensor, want in zip(("output", "x", "gate_up", "down"), got, expected):
        _assert_near(tensor, want, TOLERANCE["bfloat16"], name)
    assert got[2][4:].abs().sum() == 0 and got[3][4:].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_attention_runs_on_the_fused_kernels(make_config, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(make_config, "cuda")
    assert model.cfg.num_attention_heads != model.cfg.num_key_value_heads  # grouped heads, the hard case
    ids, targets = _batch(model.cfg, "cuda")
    cache = KVCache(model.cfg, batch_size=2, max_len=16, device="cuda")
    # SDPA raises where only its math fallback takes the call: a training step (causal) and a
    # cached prefill and decode step (masked), in bf16 and in fp32 (grouped heads repeated there)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with _autocast(dtype, "cuda"):
            _train_step(model, ids, targets)
            with torch.no_grad():
                model(ids[:, :8], cache=cache)
                model(ids[:, 8:9], positions=torch.full((2, 1), 8, device="cuda"), cache=cache)
