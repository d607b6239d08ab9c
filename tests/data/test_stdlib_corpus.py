"""The embedded default: the interpreter's own standard library as the code corpus (slow: ~15 s)."""

import pytest

from whetstone.data import CorpusConfig, build_corpus


@pytest.mark.slow
def test_default_corpus_from_the_stdlib(tmp_path):
    corpus = build_corpus(CorpusConfig(cache_dir=str(tmp_path)))
    m = corpus.manifest
    assert m["sources"]["files"] > 500 and m["sources"]["over_cap"] == 0
    assert m["dedup"]["near_duplicates"] > 0  # the encodings/ code-page tables
    assert all("encodings/" in example for example in m["dedup"]["examples"] if "~" in example)
    assert corpus.vocab_size == 4096 and m["tokens"]["train"] > 1_000_000
    assert 3.0 < m["bytes_per_token"] < 4.5
    assert 5.0 < corpus.unigram_entropy < m["val_unigram_cross_entropy"] < 8.3  # ln 4096 = 8.32
    batch = corpus.train_loader(batch_size=16, seq_len=256).batch_at(0)
    assert batch.input_ids.shape == (16, 256) and int(batch.input_ids.max()) < corpus.vocab_size
