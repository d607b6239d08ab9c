"""The engine on a device: the static-shape decode path CUDA graphs replay (run here on the CPU
against the normal decode), what a step does on the host, device names; and, where CUDA is
present, the engine on it with and without graphs against the CPU engine."""

import copy

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from tests.gpus import TWO_GPUS
from tests.host_work import watch_host_work
from tests.inference.inference_fixtures import make_engine, tiny_model
from whetstone.errors import ConfigError
from whetstone.inference.cli import app
from whetstone.inference.config import EngineConfig
from whetstone.inference.decode import StaticDecode, batch_buckets
from whetstone.inference.engine import Engine
from whetstone.inference.metrics import render_prometheus
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.swap import full_update


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def mixed_params():
    """Greedy, plain, top-k/top-p and top-logprobs rows, seeded, finishing at different steps."""
    return [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=25, seed=1),
        SamplingParams(max_tokens=33, seed=2, top_k=20, top_p=0.9, temperature=0.8),
        SamplingParams(max_tokens=12, seed=3, top_logprobs=3),
        SamplingParams(max_tokens=40, temperature=0.0, top_logprobs=2),
    ]


def same_generations(ours, theirs, atol=1e-5):
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=atol)
        assert torch.equal(a.routes, b.routes)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]


def test_static_shapes_decode_the_tokens_and_logprobs_of_the_normal_decode():
    # 5 rows: bucket 8 (3 dummy rows), then 4, 2, 1 as they finish; the longest reach 70
    # positions, so the attended length goes through 32, 64 and 128.
    model = tiny_model()
    lengths = (30, 7, 19, 2, 11)
    normal = make_engine(copy.deepcopy(model), max_batch=8).generate(prompts(*lengths), mixed_params())
    engine = make_engine(model, max_batch=8, static_shapes=True)
    assert isinstance(engine.decoder, StaticDecode) and not engine.decoder.graphs  # graphs are CUDA's
    static = engine.generate(prompts(*lengths), mixed_params())
    same_generations(static, normal)
    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(6) == [1, 2, 4, 6]
    assert engine.decoder.shape(5, 70) == (8, 128) and engine.decoder.shape(1, 1) == (1, 32)


def test_static_shapes_keep_prefix_sharing_priorities_and_preemption():
    model = tiny_model()
    base = prompts(40)[0]
    group = [base] * 3 + [base[:20] + prompts(9, seed=1)[0]]
    params = [SamplingParams(max_tokens=10, seed=i) for i in range(4)]
    shared = make_engine(copy.deepcopy(model), max_batch=8, static_shapes=True)
    alone = make_engine(copy.deepcopy(model), max_batch=8, share_prefixes=False)
    same_generations(shared.generate(group, params), alone.generate(group, params))
    assert shared.stats.prompt_tokens_shared_total == 2 * 39 + 20

    reference_params = SamplingParams(max_tokens=20, seed=5)
    [reference] = make_engine(copy.deepcopy(model)).generate(prompts(10), reference_params)
    engine = make_engine(model, max_batch=1, static_shapes=True)
    rollout = Sequence("rollout", prompts(10)[0], reference_params, priority="batch")
    user = Sequence("user", prompts(6, seed=2)[0], SamplingParams(max_tokens=4, seed=0), priority="interactive")
    engine.add(rollout)
    with torch.inference_mode():
        for _ in range(7):
            engine.step()
        engine.add(user)
        engine.step()  # the user takes the only slot
        assert rollout.slot is None and user.output_ids
        while not rollout.finished:
            engine.step()
    assert engine.stats.preemptions_total == 1
    same_generations([rollout], [reference])


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_step_builds_nothing_on_the_host_and_reads_back_once(static_shapes):
    """One step that prefills three sequences (one copying another's prefix) and decodes them:
    no tensor built on the host by the engine's code, one read-back (the sampled tokens with
    their logprobs; routes come back by copies that do not wait). The model's own internals
    (its expert dispatch counts tokens per expert on the CPU) are not the engine's."""
    engine = make_engine(tiny_model(), max_batch=4, static_shapes=static_shapes)
    base = prompts(20)[0]
    for i, prompt in enumerate([base, base + [3, 4], prompts(9, seed=1)[0]]):
        engine.add(Sequence(f"s{i}", prompt, SamplingParams(max_tokens=3, seed=i, top_k=5, top_logprobs=2)))
    with torch.inference_mode(), watch_host_work() as work:
        engine.step()
    assert len(engine.scheduler.running) == 3 and engine.stats.prompt_tokens_shared_total == 19
    engine_work = [where for where in work.host_tensors + work.syncs if not where.startswith("model/")]
    assert engine_work == [next(w for w in work.syncs if w.startswith("inference/sampling.py"))]
    assert engine_work[0].endswith(" result")  # Readback.result


def test_bad_device_names_are_refused_with_the_field_named():
    with pytest.raises(
        ValidationError, match=r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' \(N from 0 to 127\), got 'gpu'"
    ):
        EngineConfig(device="gpu")
    result = CliRunner().invoke(app, ["serve", "--set", "model_path=x", "--set", "engine.device=tpu"])
    assert isinstance(result.exception, ConfigError) and "engine.device" in str(result.exception)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error_at_engine_and_server_start(tmp_path):
    with pytest.raises(ConfigError, match="device = 'cuda', but torch sees no CUDA device"):
        Engine(tiny_model(), EngineConfig(device="cuda"))
    # refused before the model folder is read (it does not exist) or the port is bound
    result = CliRunner().invoke(
        app, ["serve", "--set", f"model_path={tmp_path / 'none'}", "--set", "engine.device=cuda"]
    )
    assert isinstance(result.exception, ConfigError) and "torch sees no CUDA device" in str(result.exception)


# ---- on CUDA -----------------------------------------------------------------------------------


def cuda_engine(model, cuda_graphs: bool, **config):
    return make_engine(model, device="cuda", cuda_graphs=cuda_graphs, **config)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_engine_decodes_what_the_cpu_engine_decodes(cuda_graphs):
    model = tiny_model()
    lengths = (30, 7, 19, 2, 11)
    greedy = [SamplingParams(max_tokens=24 + i, temperature=0.0, top_logprobs=2) for i in range(5)]
    on_cpu = make_engine(copy.deepcopy(model), max_batch=8).generate(prompts(*lengths), greedy)
    engine = cuda_engine(model, cuda_graphs, max_batch=8)
    assert engine.cache.keys.is_cuda and next(engine.model.parameters()).is_cuda
    assert isinstance(engine.decoder, StaticDecode) == cuda_graphs
    on_cuda = engine.generate(prompts(*lengths), greedy)
    same_generations(on_cuda, on_cpu, atol=1e-4)
    assert all(not s.routes.is_cuda for s in on_cuda)  # finished sequences' routes are on the host
    if cuda_graphs:
        assert engine.stats.graph_captures_total >= 4 and engine.stats.graph_capture_seconds_sum > 0
        assert "whetstone_graph_captures_total" in render_prometheus(engine.stats, "m")
        captured = engine.stats.graph_captures_total
        engine.generate(prompts(*lengths), greedy)
        assert engine.stats.graph_captures_total == captured  # replayed, not captured again
    # seeded sampling draws the CPU's tokens wherever the distributions agree to float noise
    seeded = [SamplingParams(max_tokens=16, seed=i, top_k=50) for i in range(5)]
    cpu_seeded = make_engine(copy.deepcopy(model), max_batch=8).generate(prompts(*lengths), seeded)
    cuda_seeded = engine.generate(prompts(*lengths), seeded)
    assert sum(a.output_ids == b.output_ids for a, b in zip(cpu_seeded, cuda_seeded)) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("weights_on", ["cpu", "cuda"])
def test_cuda_graphs_serve_swapped_weights(weights_on):
    """A swap writes the parameters in place: the graphs replay the new weights (or are captured
    again if a weight the model derives was made anew), never the old ones. Weights already on
    the device (the online gate's) are cast on the caller's stream, which the upload follows."""
    new = tiny_model(seed=9)
    engine = cuda_engine(tiny_model(), cuda_graphs=True, max_batch=4)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine.generate(prompts(5, 9), params)  # captures
    assert engine.stats.graph_captures_total > 0 and engine.decoder.graphs
    state = {name: t.to(weights_on, torch.float64) for name, t in new.state_dict().items()}  # cast when prepared
    engine.update_weights(full_update(state, version=1))
    swapped = engine.generate(prompts(5, 9), params)
    expected = make_engine(new, max_batch=4).generate(prompts(5, 9), params)
    same_generations(swapped, expected, atol=1e-4)
    assert all(s.versions == [1] * 12 for s in swapped) and engine.stats.swaps_total == 1


@pytest.mark.gpu
def test_cuda_graphs_keep_prefix_sharing_and_preemption():
    model = tiny_model()
    base = prompts(40)[0]
    group = [base] * 3 + [base[:20] + prompts(9, seed=1)[0]]
    params = [SamplingParams(max_tokens=10, temperature=0.0) for _ in range(4)]
    shared = cuda_engine(copy.deepcopy(model), cuda_graphs=True, max_batch=8)
    same_generations(
        shared.generate(group, params),
        make_engine(copy.deepcopy(model), max_batch=8).generate(group, params),
        atol=1e-4,
    )
    assert shared.stats.prompt_tokens_shared_total == 2 * 39 + 20

    reference_params = SamplingParams(max_tokens=20, temperature=0.0)
    [reference] = make_engine(copy.deepcopy(model)).generate(prompts(10), reference_params)
    engine = cuda_engine(model, cuda_graphs=True, max_batch=1)
    rollout = Sequence("rollout", prompts(10)[0], reference_params, priority="batch")
    engine.add(rollout)
    with torch.inference_mode():
        for _ in range(7):
            engine.step()
        engine.add(Sequence("user", prompts(6, seed=2)[0], SamplingParams(max_tokens=4), priority="interactive"))
        while not rollout.finished:
            engine.step()
    assert engine.stats.preemptions_total == 1
    same_generations([rollout], [reference], atol=1e-4)


@pytest.mark.gpu
def test_bf16_on_cuda_with_graphs_decodes_like_without():
    model = tiny_model()
    params = SamplingParams(max_tokens=20, temperature=0.0)
    eager = cuda_engine(copy.deepcopy(model), cuda_graphs=False, dtype="bfloat16").generate(prompts(9, 4, 13), params)
    engine = cuda_engine(model, cuda_graphs=True, dtype="bfloat16")
    static = engine.generate(prompts(9, 4, 13), params)
    assert engine.stats.graph_captures_total > 0 and engine.decoder.graphs  # replayed, not fallen back
    assert all(len(s.output_ids) == 20 for s in static)
    assert sum(a.output_ids == b.output_ids for a, b in zip(static, eager)) >= 2


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_an_engine_on_the_second_gpu_decodes_what_one_on_the_first_does(numerics):
    # cuda:1 is not the current device: the engine's Triton kernels, graph captures and read-back
    # events must still go to its own GPU (`utils.device.on_device`), else tokens are read early
    model = tiny_model()
    lengths = (30, 7, 19, 2, 11)
    seeded = [SamplingParams(max_tokens=24, seed=i) for i in range(5)]
    config = dict(max_batch=8, numerics=numerics, overlap_steps=True)  # reading back one step behind
    first = make_engine(copy.deepcopy(model), device="cuda:0", **config)
    second = make_engine(model, device="cuda:1", **config)
    assert second.overlap and isinstance(second.decoder, StaticDecode)
    assert torch.cuda.current_device() == 0 and second.cache.keys.device == torch.device("cuda", 1)
    same_generations(second.generate(prompts(*lengths), seeded), first.generate(prompts(*lengths), seeded), atol=0)
    assert second.stats.graph_captures_total > 0 and torch.cuda.current_device() == 0  # restored
