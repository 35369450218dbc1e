"""Reads Hugging Face checkpoints (safetensors or PyTorch .bin, single file or sharded) into a model.

Tensors are streamed one at a time into the model's preallocated parameters (cast to the model dtype on copy),
so peak memory is the model plus one tensor. A tensor-parallel rank reads only its ``Shard`` of each split
tensor (a safetensors slice read, or a narrow of a memory-mapped .bin), never the whole model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from ksana.models.base import CausalLM
from ksana.models.parallel import Shard

logger = logging.getLogger(__name__)

_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The weight files of ``model_dir``, preferring safetensors over .bin and a single file over shards."""
    model_dir = Path(model_dir)
    for single, index in zip(_SINGLE_FILES, _INDEX_FILES, strict=True):
        if (model_dir / single).is_file():
            return [model_dir / single]
        if (model_dir / index).is_file():
            weight_map = json.loads((model_dir / index).read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
            for path in files:
                if not path.is_file():
                    raise FileNotFoundError(f"shard {path.name} listed in {model_dir / index} does not exist")
            return files
    shards = sorted(model_dir.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected one of {', '.join(_SINGLE_FILES + _INDEX_FILES)}"
    )


def iter_checkpoint_tensors(
    files: list[Path], shards: dict[str, Shard] | None = None
) -> Iterator[tuple[str, torch.Tensor, Path, tuple[int, ...]]]:
    """Yield ``(name, tensor, file, full_shape)`` for every tensor, on CPU, lazily where the format allows.

    A tensor named in ``shards`` comes as that part only; ``full_shape`` is the checkpoint tensor's shape.
    """
    shards = shards or {}
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shard = shards.get(name)
                    if shard is None:
                        tensor = f.get_tensor(name)
                        yield name, tensor, path, tuple(tensor.shape)
                        continue
                    part = f.get_slice(name)
                    full_shape = tuple(part.get_shape())
                    index = [slice(None)] * len(full_shape)
                    index[shard.dim] = slice(shard.start, shard.start + shard.size)
                    yield name, part[tuple(index)], path, full_shape
        else:
            try:
                state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
            except RuntimeError:  # legacy (pre-zipfile) .bin files cannot be memory-mapped
                state = torch.load(path, weights_only=True, map_location="cpu")
            for name, tensor in state.items():
                shard = shards.get(name)
                part = tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.size)
                yield name, part, path, tuple(tensor.shape)
            del state


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``model_dir``.

    Raises ValueError naming the tensor and file on a shape mismatch, and naming the missing tensors when the
    checkpoint lacks some. A missing ``lm_head.weight`` means tied embeddings; the model itself may stand in for
    other missing tensors (``CausalLM.fill_missing_weights``: optional modules, shared copies).
    """
    slots = model.weight_slots()
    shards = model.weight_shards() if hasattr(model, "weight_shards") else {}
    ignored = model.ignored_weight_names()
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor, path, full_shape in iter_checkpoint_tensors(checkpoint_files(model_dir), shards):
            slot = slots.get(name)
            if slot is None:
                if name not in ignored:
                    unexpected.append(name)
                continue
            target = slot.target()
            if tuple(tensor.shape) != tuple(target.shape):
                what = "its tensor-parallel part has" if name in shards else "has"
                raise ValueError(
                    f"tensor {name!r} in {path} {what} shape {tuple(tensor.shape)} (checkpoint shape "
                    f"{full_shape}), but config.json implies {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
    if unexpected:
        logger.warning(
            "ignoring %d unexpected checkpoint tensors in %s: %s",
            len(unexpected),
            model_dir,
            ", ".join(unexpected[:5]),
        )
    missing = sorted(model.fill_missing_weights(set(slots) - loaded))
    if missing == ["lm_head.weight"]:
        logger.info("no lm_head.weight in %s: tying it to the input embedding", model_dir)
        model.tie_lm_head()
        missing = []
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {model_dir} lacks tensors {', '.join(missing[:5])}{more}")
