"""Remote KV stores for remote cache loading: blocks keyed by their prefix hash chain.

The cache manager only asks ``contains`` (which hashes could be loaded); the worker, the only actor that touches
tensors, calls ``load``/``save``. The filesystem store is the embedded default: one safetensors file per block under
``<root>/<namespace>/``, written atomically (temporary file, then rename), so two engines may share a directory.
``namespace`` ties the files to a model and block size: another model's blocks are never a hit.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
from pathlib import Path

import torch


class RemoteKVStore(abc.ABC):
    """Block KV by hash: ``{"k.<layer>": tensor, "v.<layer>": tensor, ...}`` per block."""

    @abc.abstractmethod
    def contains(self, block_hash: int) -> bool: ...

    @abc.abstractmethod
    def load(self, block_hash: int) -> dict[str, torch.Tensor] | None:
        """The block's tensors, or None when missing or unreadable (the caller then computes the tokens)."""

    @abc.abstractmethod
    def save(self, block_hash: int, tensors: dict[str, torch.Tensor]) -> None: ...


def store_namespace(model_dir: str | os.PathLike, block_size: int, dtype: torch.dtype) -> str:
    """A directory-safe key for one model's blocks: its name, a digest of its path, block size and dtype."""
    path = str(Path(model_dir).resolve())
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).name) or "model"
    digest = hashlib.blake2b(path.encode(), digest_size=4).hexdigest()
    return f"{name}-{digest}-b{block_size}-{str(dtype).removeprefix('torch.')}"


class FilesystemKVStore(RemoteKVStore):
    def __init__(self, root: str | os.PathLike, namespace: str = "default") -> None:
        self.directory = Path(root) / namespace
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:032x}.safetensors"

    def contains(self, block_hash: int) -> bool:
        return self._path(block_hash).exists()

    def load(self, block_hash: int) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        try:
            return load_file(str(self._path(block_hash)))
        except Exception:  # noqa: BLE001 - a missing or torn file is a miss, never a crash
            return None

    def save(self, block_hash: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self._path(block_hash)
        if path.exists():
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
