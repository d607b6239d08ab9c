"""whetstone's own decoder-only transformer (Qwen3 / Qwen3-MoE architecture), its KV cache and
its Hugging Face checkpoint converter. See docs/model.md."""

from whetstone.model.cache import KVCache
from whetstone.model.config import ModelConfig
from whetstone.model.ops import Numerics, numerics
from whetstone.model.transformer import ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "Numerics", "Transformer", "numerics"]
