"""The code corpus: sources, deduplication, split, tokenization, packing, and training batches.

corpus = build_corpus(CorpusConfig(), demos=None)        # cached by config
loader = corpus.train_loader(batch_size=16, seq_len=256, seed=0, demo_weight=0.1)
batch = loader.batch_at(step)                            # input_ids, targets: [B, T] int64
"""

from whetstone.data.build import build_corpus
from whetstone.data.config import CorpusConfig, DedupConfig, DirectorySource, JsonlSource
from whetstone.data.loader import IGNORE_INDEX, Batch, Corpus, TrainLoader
from whetstone.data.mix import DemoSource

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "Corpus",
    "CorpusConfig",
    "DedupConfig",
    "DemoSource",
    "DirectorySource",
    "JsonlSource",
    "TrainLoader",
    "build_corpus",
]
