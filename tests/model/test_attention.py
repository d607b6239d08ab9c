"""Attention's fused q/k/v weight under inference mode."""

import torch

from whetstone.model import Transformer


def test_a_model_made_under_inference_mode_runs_and_sees_weights_written_in_place(make_config):
    # Tensors made under inference mode (a model loaded inside `torch.inference_mode()`) have no
    # version counter, so the fused matrix cannot tell when they are written to.
    torch.manual_seed(0)
    reference = Transformer(make_config()).eval()
    ids = torch.randint(0, reference.cfg.vocab_size, (2, 5))
    with torch.inference_mode():
        model = Transformer(make_config()).eval()
        model.load_state_dict(reference.state_dict())
        assert model.layers[0].self_attn.q_proj.weight.is_inference()
        first = model(ids).logits
        assert torch.equal(first, reference(ids).logits)
        model.layers[0].self_attn.k_proj.weight.mul_(2)  # a swap writes in place
        swapped = model(ids).logits
    assert not torch.equal(swapped, first)
    with torch.no_grad():
        reference.layers[0].self_attn.k_proj.weight.mul_(2)
        assert torch.equal(swapped, reference(ids).logits)
