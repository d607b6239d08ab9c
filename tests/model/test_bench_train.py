"""The training benchmark compares like with like (its timings are not tested here)."""

import pytest

from whetstone.errors import WhetstoneError

pytest.importorskip("transformers")


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_both_start_from_the_same_weights_and_batches(make_config, dtype, tolerance):
    from whetstone.bench.train import run

    result = run(steps=2, rounds=2, warmup=1, batch_size=2, seq_len=8, threads=1, dtype=dtype, config=make_config())
    # Same initial weights and batches: the same loss, step after step (to the dtype's rounding).
    assert result["dtype"] == dtype
    assert result["first_loss"]["whetstone"] == pytest.approx(result["first_loss"]["hf"], abs=tolerance)
    assert result["last_loss"]["whetstone"] == pytest.approx(result["last_loss"]["hf"], abs=10 * tolerance)
    assert result["hf_experts_implementation"] == "grouped_mm"
    for key in ("whetstone_tokens_per_s", "hf_tokens_per_s", "speedup_vs_hf", "speedup_cpu_time", "speedup_ceiling"):
        assert result[key] > 0
    assert 0 < result["dense_kernel_share"] < 1


def test_dense_kernel_time_counts_matmuls_and_attention_only():
    import torch

    from whetstone.bench.kernels import dense_kernel_seconds

    a = torch.randn(256, 256)
    assert dense_kernel_seconds(lambda: (a * 2).exp().sum(), calls=3) == 0.0  # elementwise only
    assert dense_kernel_seconds(lambda: a @ a) > 0
    q = torch.randn(1, 2, 64, 32, requires_grad=True)
    attention = dense_kernel_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward())
    assert attention > 0


def test_bad_arguments_are_named():
    from whetstone.bench.train import run

    with pytest.raises(WhetstoneError, match="dtype 'float16'"):
        run(dtype="float16")
    with pytest.raises(WhetstoneError, match="rounds"):
        run(steps=2, rounds=3)


def test_bf16_steps_train_on_fresh_weight_copies(make_config):
    # autocast keeps its bf16 copies of the weights until its block exits: each step must run in
    # its own block, or later steps compute with the first step's weights.
    import torch

    from whetstone.bench.train import _whetstone_step, run
    from whetstone.model import Transformer

    config = make_config()
    result = run(steps=2, rounds=1, warmup=1, batch_size=2, seq_len=8, threads=1, dtype="bfloat16", config=config)
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, config.vocab_size, (2, 9), generator=generator) for _ in range(3)]
    losses = []
    for batch in tokens:  # warm-up step, then the two measured ones
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(_whetstone_step(model, optimizer, batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
    assert result["first_loss"]["whetstone"] == pytest.approx(losses[0], abs=1e-5)
    assert result["last_loss"]["whetstone"] == pytest.approx(losses[-1], abs=1e-5)
