"""The paged KV cache tensors: one (key, value) pair of block pools per layer.

Only the worker touches these tensors; which block belongs to which sequence is the cache manager's business
and reaches the model through ``AttentionMetadata.block_tables`` / ``slot_mapping``.
"""

from __future__ import annotations

import attrs
import torch

from ksana.models.shape import ModelShape


@attrs.define
class KVCache:
    """``layers[i]`` is layer i's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> KVCache:
        """Zero-filled, so slots never written (padding in block tables) hold finite values under the mask."""
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        layers = [
            (torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device))
            for _ in range(shape.num_layers)
        ]
        return cls(layers=layers, num_blocks=num_blocks, block_size=block_size)

    @staticmethod
    def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element_size
