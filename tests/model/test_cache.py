"""KV cache: incremental forwards must match the full causal forward."""

import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.model import KVCache, Transformer


@pytest.fixture
def model_and_config(make_config):
    torch.manual_seed(0)
    cfg = make_config()
    return cfg, Transformer(cfg).eval()


@torch.no_grad()
def test_prefill_then_one_token_at_a_time_matches_full_forward(model_and_config):
    cfg, model = model_and_config
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    full = model(ids, return_routes=True)
    cache = KVCache(cfg, batch_size=2, max_len=16)
    steps = [model(ids[:, :5], cache=cache, return_routes=True)]
    for t in range(5, 12):
        steps.append(model(ids[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache, return_routes=True))
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), full.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([s.routes for s in steps], 1), full.routes)


@torch.no_grad()
def test_rows_at_different_positions_decode_together(model_and_config):
    cfg, model = model_and_config
    long_ids = torch.randint(0, cfg.vocab_size, (1, 9))
    short_ids = torch.randint(0, cfg.vocab_size, (1, 4))
    cache = KVCache(cfg, batch_size=2, max_len=16)
    # Prompts of different lengths: prefill each row on its own (as an engine does per slot),
    # then decode one token for both rows together, at positions 8 and 3.
    model(long_ids[:, :8], positions=torch.arange(8)[None], cache=_RowView(cache, 0))
    model(short_ids[:, :3], positions=torch.arange(3)[None], cache=_RowView(cache, 1))
    step = torch.cat([long_ids[:, 8:9], short_ids[:, 3:4]])
    logits = model(step, positions=torch.tensor([[8], [3]]), cache=cache).logits
    torch.testing.assert_close(logits[0, 0], model(long_ids).logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, 0], model(short_ids).logits[0, -1], atol=1e-5, rtol=1e-5)


class _RowView:
    """Drives one row of a batched KVCache (as an engine's slot cache would)."""

    def __init__(self, cache: KVCache, row: int):
        self.cache, self.row = cache, row

    def begin(self, positions):
        self.positions = positions
        self.cache.written[self.row, positions[0]] = True

    def update(self, layer, k, v):
        pos = self.positions[0]
        self.cache.keys[layer, self.row, :, pos] = k[0]
        self.cache.values[layer, self.row, :, pos] = v[0]
        return k, v, (pos[None, :] <= pos[:, None])[None, None]


def test_positions_beyond_the_cache_are_rejected(model_and_config):
    cfg, model = model_and_config
    cache = KVCache(cfg, batch_size=1, max_len=4)
    with pytest.raises(WhetstoneError, match="cache holds 0..3"):
        model(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([[3, 4]]), cache=cache)


@torch.no_grad()
def test_reset_row_starts_a_fresh_sequence(model_and_config):
    cfg, model = model_and_config
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    cache = KVCache(cfg, batch_size=1, max_len=8)
    model(torch.randint(0, cfg.vocab_size, (1, 8)), cache=cache)
    cache.reset()
    out = model(ids, cache=cache)
    torch.testing.assert_close(out.logits, model(ids).logits, atol=1e-5, rtol=1e-5)
