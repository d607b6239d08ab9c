"""A bf16 engine serves its matmul weights in bf16 (`layout.serving_copy`), in fast and in
invariant numerics: the tokens, logprobs and routes of one that keeps fp32 weights and lets
autocast cast them every step, in about half the weight memory, across weight swaps; the
caller's model keeps its fp32 weights."""

import pytest
import torch

from tests.inference.inference_fixtures import make_engine, tiny_model
from whetstone.inference import engine as engine_module
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.swap import full_update

PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 17, 9)]
PARAMS = [
    SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True, seed=0),
    SamplingParams(max_tokens=10, temperature=0.0, top_logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=2),
    SamplingParams(max_tokens=8, temperature=1.0, seed=3),
]


def served(engine, prompts=PROMPTS):
    return [(s.output_ids, s.logprobs, s.top_logprobs, s.routes.tolist()) for s in engine.generate(prompts, PARAMS)]


def trained_looking(seed: int):
    """A tiny model whose norms are not all ones (bf16 holds 1.0 exactly: a norm cast by mistake
    would go unseen)."""
    model = tiny_model(seed=seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("numerics", ["fast", "invariant"])
@pytest.mark.parametrize("static_shapes", [False, True])  # True: the decode CUDA graphs replay
def test_bf16_weights_serve_the_bits_autocast_gave_in_less_memory(monkeypatch, static_shapes, numerics):
    model = trained_looking(seed=4)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    config = dict(dtype="bfloat16", prefill_chunk=16, max_batch=3, static_shapes=static_shapes, numerics=numerics)
    engine = make_engine(model, **config)
    half = served(engine)
    assert engine.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert all(torch.equal(t, before[name]) and t.dtype == torch.float32 for name, t in model.state_dict().items())
    with monkeypatch.context() as patch:  # the engine as it was: fp32 weights, autocast casts them each step
        patch.setattr(engine_module, "serving_copy", lambda model, device, dtype: model)
        autocast_engine = make_engine(model, **config)
        assert served(autocast_engine) == half
    halved = sum(p.numel() * 2 for p in engine.model.parameters() if p.dtype == torch.bfloat16)
    assert weight_bytes(engine.model) == weight_bytes(autocast_engine.model) - halved
    assert weight_bytes(engine.model) < 0.65 * weight_bytes(autocast_engine.model)  # the embedding stays fp32

    # a swap writes the new weights as bf16, where autocast would have cast them
    new = trained_looking(seed=5)
    for each in (engine, autocast_engine):
        each.update_weights(full_update(new.state_dict(), version=1))
    swapped = served(engine, PROMPTS[::-1])
    assert swapped == served(autocast_engine, PROMPTS[::-1])
    assert swapped == served(make_engine(new, **config), PROMPTS[::-1])


def test_fp32_engines_keep_the_weights_as_given():
    model = tiny_model()
    for numerics in ("fast", "invariant"):
        engine = make_engine(model, dtype="float32", numerics=numerics)
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
