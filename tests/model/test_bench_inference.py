"""`whetstone bench inference`'s throughput side compares like with like (timings are not tested)."""

import pytest

pytest.importorskip("transformers")


def test_throughput_generates_the_same_tokens_as_transformers_and_reports_its_ceiling(make_config, tmp_path):
    from whetstone.bench.inference import throughput
    from whetstone.model import Transformer
    from whetstone.model.hf import save_hf

    model = Transformer(make_config()).eval()
    model_dir = save_hf(model, tmp_path / "model")
    result = throughput(model, model_dir, batch=2, prompt_tokens=8, new_tokens=4, repeats=1)
    assert result["agree"] == 1.0  # greedy, fp32, same weights: the same tokens
    assert result["whetstone"] > 0 and result["hf"] > 0
    assert 0 < result["dense_share"] < 1 and result["ceiling"] > 0
