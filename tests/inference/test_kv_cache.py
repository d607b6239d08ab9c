import torch

from whetstone.inference.kv_cache import ATTENTION_BLOCK, SlotKVCache


def test_ragged_rows_decode_like_a_full_forward(model):
    """Three sequences of different lengths, prefilled into slots, then decoded together."""
    cache = SlotKVCache.for_model(model.cfg, slots=4, max_len=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 8)]
    with torch.no_grad():
        for slot, seq in enumerate(seqs):
            model(torch.tensor([seq[:-1]]), cache=cache.rows(slot, 1, len(seq) - 1))
        step = model(
            torch.tensor([[s[-1]] for s in seqs]),
            positions=torch.tensor([[len(s) - 1] for s in seqs]),
            cache=cache.rows(0, 3, max(len(s) for s in seqs)),
        )
        for row, seq in enumerate(seqs):
            full = model(torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(step.logits[row, 0], full, atol=1e-5)


def test_move_keeps_a_sequence_decodable_from_its_new_slot(model):
    cache = SlotKVCache.for_model(model.cfg, slots=3, max_len=32, dtype=torch.float32)
    seq = list(range(1, 10))
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]), cache=cache.rows(2, 1, len(seq) - 1))
        cache.move(2, 0, len(seq) - 1)
        step = model(
            torch.tensor([[seq[-1]]]), positions=torch.tensor([[len(seq) - 1]]), cache=cache.rows(0, 1, len(seq))
        )
        assert torch.allclose(step.logits[0, 0], model(torch.tensor([seq])).logits[0, -1], atol=1e-5)


def test_attended_length_is_whole_blocks_and_mask_is_causal():
    cache = SlotKVCache(num_layers=1, num_kv_heads=1, head_dim=2, slots=2, max_len=40)
    assert cache.max_len % ATTENTION_BLOCK == 0
    rows = cache.rows(0, 2, 6)
    rows.begin(torch.tensor([[3], [5]]))
    keys, values, mask = rows.update(0, torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2))
    assert keys.shape[2] == ATTENTION_BLOCK and mask.shape == (2, 1, 1, ATTENTION_BLOCK)
    assert mask[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert mask[1, 0, 0].sum() == 6
    assert keys[0, 0, 3].tolist() == [1.0, 1.0]  # written before being returned


def test_under_bf16_the_cache_is_bf16_and_changes_no_bit(monkeypatch):
    """Attention computes in bf16 under bf16 autocast, so a bf16 cache holds what it reads: the
    same tokens and logprobs as an fp32 cache, in half the memory. Invariant numerics on the CPU
    attend in fp32 and keep an fp32 cache."""
    from tests.inference.inference_fixtures import make_engine, tiny_model
    from whetstone.inference import engine as engine_module
    from whetstone.inference.sampling import SamplingParams

    model = tiny_model(seed=2)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=i) for i in range(3)]

    def generate():
        engine = make_engine(model, dtype="bfloat16", prefill_chunk=16)
        seqs = engine.generate(prompts, params)
        return engine.cache, [(s.output_ids, s.logprobs) for s in seqs]

    cache, half = generate()
    assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
    weights_dtype = engine_module.kv_cache_dtype
    monkeypatch.setattr(engine_module, "kv_cache_dtype", lambda config, weights, device: weights)
    cache32, full = generate()
    assert cache32.keys.dtype == torch.float32 and cache32.keys.nbytes == 2 * cache.keys.nbytes
    assert half == full
    invariant_cpu = make_engine(model, dtype="bfloat16", numerics="invariant").config
    assert weights_dtype(invariant_cpu, torch.float32, torch.device("cpu")) == torch.float32
    assert weights_dtype(invariant_cpu, torch.float32, torch.device("cuda")) == torch.bfloat16
