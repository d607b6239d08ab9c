"""Hugging Face checkpoint folders in and out: config.json + safetensors (one file, or shards
with `model.safetensors.index.json`) + tokenizer files. Names and config fields: hf_convert.py.

    model = load_hf("path/to/Qwen3-0.6B")
    save_hf(model, "out/checkpoint", tokenizer_dir="path/to/tokenizer")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from whetstone.config import expand_path
from whetstone.errors import CheckpointError, ConfigError
from whetstone.model.config import ModelConfig
from whetstone.model.hf_convert import (
    DOWN,
    GATE_UP,
    IGNORED_SUFFIXES,
    TOP_NAMES,
    expert_names,
    hf_config,
    hf_name,
    model_config_from_hf,
)
from whetstone.model.transformer import Transformer
from whetstone.utils.atomic import atomic_directory

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def check_vocab_fits(tokenizer_ids: int, tokenizer: str, vocab_size: int, model: str, advice: str = "") -> None:
    """Refuse a tokenizer with more ids (`tokenizer_ids`, `Tokenizer.vocab_size`) than the model
    has embedding rows (`vocab_size`): the first id past them would fail an embedding lookup
    mid-run, as an IndexError or a device assert. `tokenizer` and `model` say where each comes
    from (paths, settings); `advice` what to do (a default suits a model folder)."""
    if tokenizer_ids <= vocab_size:
        return
    advice = advice or (
        f"Use the tokenizer the model was trained with, or a model whose vocab_size is at least {tokenizer_ids}"
    )
    raise ConfigError(
        f"the tokenizer {tokenizer} has {tokenizer_ids} token ids, but the model's vocab_size ({model}) is only "
        f"{vocab_size}: ids from {vocab_size} up have no embedding row, and a run fails at the first it meets. {advice}"
    )


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint folder (its config.json); `~` and `$NAME` in `path` are
    expanded (`expand_path`)."""
    folder = expand_path(path)
    config_path = folder / "config.json"
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a Hugging Face checkpoint folder (config.json + safetensors)")
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{config_path} does not exist (not a Hugging Face checkpoint folder?)") from None
    except IsADirectoryError:
        raise CheckpointError(f"{config_path} is a directory, not a JSON file") from None
    except OSError as err:
        raise CheckpointError(f"{config_path} cannot be read: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    return model_config_from_hf(config, str(config_path))


class _TensorFiles:
    """Lazy access to the tensors of one checkpoint folder, by HF name, tracking which were used."""

    def __init__(self, folder: Path, stack: ExitStack):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except OSError as err:
                raise CheckpointError(f"{index} cannot be read: {err.strerror or err}") from None
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{index} is not a valid safetensors index: {err!r}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
            files = sorted(set(weight_map.values()))
            if (folder / "model.safetensors").exists() and files != ["model.safetensors"]:
                # transformers reads model.safetensors, vLLM the files the index names
                raise CheckpointError(
                    f"{folder} holds both model.safetensors and model.safetensors.index.json, whose "
                    f"weight_map names other files ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''}): "
                    "transformers would load the first and vLLM the second, so which checkpoint the folder "
                    "holds is unclear. Delete the stale one (saving into a folder that held a checkpoint "
                    "of the other form leaves it behind)"
                )
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
        self.folder = folder
        self.location: dict[str, tuple[str, object]] = {}
        for name in files:
            file = folder / name
            if not file.exists():
                raise CheckpointError(f"{file} is listed in the index but does not exist")
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
                keys = list(handle.keys())
            except Exception as err:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"{file} is not a readable safetensors file: {err}") from None
            for key in keys:
                self.location[key] = (str(file), handle)
        self.unused = {k for k in self.location if not k.endswith(IGNORED_SUFFIXES)}

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.location:
            raise CheckpointError(f"the checkpoint in {self.folder} is missing tensor {name}")
        file, handle = self.location[name]
        try:
            tensor = handle.get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {err}") from None
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}, the config expects {shape}")
        self.unused.discard(name)
        return tensor.to(dtype)


def _load_experts(files: _TensorFiles, layer: int, cfg: ModelConfig, dtype: torch.dtype):
    """Stacked (gate_up [E, 2I, H], down [E, H, I]) from per-expert or fused HF tensors."""
    experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fused = f"model.layers.{layer}.{GATE_UP}"
    if fused in files:
        gate_up = files.get(fused, (experts, 2 * inner, hidden), dtype)
        return gate_up, files.get(f"model.layers.{layer}.{DOWN}", (experts, hidden, inner), dtype)
    gate_up, down = [], []
    for expert in range(experts):
        names = expert_names(layer, expert)
        gate = files.get(names["gate_proj"], (inner, hidden), dtype)
        up = files.get(names["up_proj"], (inner, hidden), dtype)
        gate_up.append(torch.cat([gate, up]))
        down.append(files.get(names["down_proj"], (hidden, inner), dtype))
    return torch.stack(gate_up), torch.stack(down)


def _check_tied_copy(files: _TensorFiles, embedding: torch.Tensor, dtype: torch.dtype) -> None:
    """Accept the `lm_head.weight` some tied checkpoints store beside the embedding when it is a
    copy of it; refuse one that differs: transformers then loads it as a separate output head
    (untied), vLLM ignores it, so the folder holds no one model."""
    head = TOP_NAMES["lm_head.weight"]
    if head in files and not torch.equal(files.get(head, tuple(embedding.shape), dtype), embedding):
        raise CheckpointError(
            f"{files.folder}: config.json sets tie_word_embeddings to true, but the checkpoint's {head} differs "
            f"from {TOP_NAMES['embed_tokens.weight']}: transformers would load it as a separate output head "
            "and vLLM would ignore it. Set tie_word_embeddings to false to use it as the head, or "
            f"remove {head} from the checkpoint to tie the head to the embedding"
        )


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer with the config and weights of an HF Qwen3 / Qwen3-MoE checkpoint folder
    (`~` and `$NAME` in `path` expanded)."""
    folder = expand_path(path)
    cfg = read_hf_config(folder)
    with torch.device("meta"):
        model = Transformer(cfg)  # no memory, no init: every tensor is replaced below
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        files = _TensorFiles(folder, stack)
        for layer in cfg.moe_layers:
            gate_up, down = _load_experts(files, layer, cfg, dtype)
            state[f"layers.{layer}.{GATE_UP}"], state[f"layers.{layer}.{DOWN}"] = gate_up, down
        for name, meta in expected.items():
            if name in state or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            state[name] = files.get(hf_name(name), tuple(meta.shape), dtype)
        if cfg.tie_word_embeddings:
            _check_tied_copy(files, state["embed_tokens.weight"], dtype)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        if files.unused:
            extra = sorted(files.unused)
            raise CheckpointError(
                f"{folder}: {len(extra)} tensors do not belong to the model described by config.json: "
                + ", ".join(extra[:5])
                + (" ..." if len(extra) > 5 else "")
            )
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def hf_tensors(model: Transformer, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the model, in a stable order, experts split out."""
    for name, tensor in model.state_dict().items():
        yield from hf_pieces(name, tensor.detach().to(dtype or tensor.dtype), model.cfg)


def hf_pieces(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of one whetstone tensor: itself renamed, or its experts split out (views,
    no copy); nothing for a tied head, which HF folders do not store."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return
    if not (name.endswith(GATE_UP) or name.endswith(DOWN)):
        yield hf_name(name), tensor
        return
    layer, inner = int(name.split(".")[1]), cfg.moe_intermediate_size
    for expert in range(cfg.num_experts):
        names = expert_names(layer, expert)
        if name.endswith(GATE_UP):
            yield names["gate_proj"], tensor[expert, :inner]
            yield names["up_proj"], tensor[expert, inner:]
        else:
            yield names["down_proj"], tensor[expert]


def _shards(tensors: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy packing in order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


@contextmanager
def _write_errors(folder: Path) -> Iterator[None]:
    """A write into `folder` that fails (a full disk, a read-only one) as a CheckpointError naming it."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"cannot write the model folder {folder}: {err}. It is left as it was") from None


def save_hf(
    model: Transformer,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF checkpoint folder at `path`, atomically (all of it or nothing).

    One `model.safetensors` when the weights fit in `max_shard_bytes`, otherwise
    `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json` (as
    transformers writes them). `dtype` casts the weights (default: as they are in the model).
    Tokenizer files found in `tokenizer_dir` are copied alongside.
    """
    tokenizer_files = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).exists()]
        if not tokenizer_files:
            raise CheckpointError(f"{tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    tensors = list(hf_tensors(model, dtype))
    dtype_name = str(tensors[0][1].dtype).removeprefix("torch.")
    shards = _shards(tensors, max_shard_bytes)
    with _write_errors(Path(path)), atomic_directory(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config(model.cfg, dtype_name), indent=2) + "\n")
        weight_map, total = {}, 0
        for number, shard in enumerate(shards, start=1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            # clone: safetensors refuses views that share storage (split experts, tied weights)
            save_file({n: t.contiguous().clone() for n, t in shard}, str(tmp / file), metadata={"format": "pt"})
            for name, tensor in shard:
                weight_map[name] = file
                total += tensor.numel() * tensor.element_size()
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for file in tokenizer_files:
            shutil.copy2(file, tmp / file.name)
    return Path(path)
