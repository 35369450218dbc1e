"""The paged KV cache tensors: one (key, value) pair of block pools per layer.

Only the worker touches these tensors; which block belongs to which sequence is the cache manager's business
and reaches the model through ``AttentionMetadata.block_tables`` / ``slot_mapping``.

With the prefix cache on a sliding-window model, sliding layers get their own pool of ``num_swa_blocks`` blocks
(indexed by SWA block ids, through ``AttentionMetadata.swa``); full-attention layers keep ``num_blocks``.

A multi-head latent attention model (``ModelShape.is_mla``) caches per token and layer its normed KV latent in the
K tensor and its rotated decoupled key in the V tensor, one head each: ``[num_blocks, block_size, 1,
kv_lora_rank]`` and ``[num_blocks, block_size, 1, qk_rope_head_dim]``. ``extra_layers`` appends layers of the same
layout after the model's own, indexed ``num_layers + i``: the KV of its multi-token-prediction modules.
"""

from __future__ import annotations

import attrs
import torch

from ksana.kernels.dispatch import kv_cache_zeros
from ksana.models.shape import ModelShape


@attrs.define
class KVCache:
    """``layers[i]`` is layer i's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Head-major caches (``allocate(head_major=True)``) are views of ``[num_blocks, num_kv_heads, block_size,
    head_dim]`` tensors with the same shape and indexing: each KV head's positions of a block lie together, so a
    decode kernel reads one head's keys as one run of memory instead of a slice of every slot's row, which the
    hardware prefetchers follow. The native CPU kernels ask for it (``KernelOps.kv_head_major``): their decode
    attention reads the KV faster so (``tools/kv_layout_ab.py`` sets the two layouts against each other in the
    fused decode step)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int
    num_swa_blocks: int = 0  # > 0: the sliding layers (``swa_layers``) index a separate SWA pool
    swa_layers: tuple[int, ...] = ()
    extra_layers: int = 0  # layers past the model's own (its MTP modules'), at the end of ``layers``

    @classmethod
    def allocate(
        cls,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        num_swa_blocks: int = 0,
        head_major: bool = False,
        extra_layers: int = 0,
    ) -> KVCache:
        """Zero-filled, so slots never written (padding in block tables) hold finite values under the mask; laid
        out as the device's kernels read it fastest (``kernels.dispatch.kv_cache_zeros``: on the CPU, huge pages
        where the system gives them).

        ``num_swa_blocks`` > 0 gives the sliding-window layers their own pool of that many blocks; ``head_major``
        lays each block out head by head (see the class); ``extra_layers`` full-attention layers follow the model's
        own (an MTP module's, ``shape.num_mtp_layers`` of them for all)."""
        swa_layers = tuple(i for i, w in enumerate(shape.sliding_windows) if w is not None) if num_swa_blocks else ()
        heads, *dims_kv = _per_token_dims(shape)
        layers = []
        for i in range(shape.num_layers + extra_layers):
            blocks = num_swa_blocks if i in swa_layers else num_blocks
            if head_major:
                pair = tuple(kv_cache_zeros((blocks, heads, block_size, d), dtype, device).transpose(1, 2)
                             for d in dims_kv)
            else:
                pair = tuple(kv_cache_zeros((blocks, block_size, heads, d), dtype, device) for d in dims_kv)
            layers.append(pair)
        return cls(layers=layers, num_blocks=num_blocks, block_size=block_size, num_swa_blocks=num_swa_blocks,
                   swa_layers=swa_layers, extra_layers=extra_layers)

    def block_tensors(self, fa_block_id: int, swa_block_id: int) -> dict[str, torch.Tensor]:
        """One block's K/V in every layer (sliding layers from ``swa_block_id`` when there is an SWA pool)."""
        out = {}
        for i, (k, v) in enumerate(self.layers):
            block = swa_block_id if i in self.swa_layers else fa_block_id
            if block < 0:
                continue
            out[f"k.{i}"], out[f"v.{i}"] = k[block], v[block]
        return out

    def write_block(self, fa_block_id: int, swa_block_id: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Copy a block's K/V in; False (nothing half-written matters: the caller discards the block) when the
        tensors do not fit this cache's layout."""
        targets = []
        for i, (k, v) in enumerate(self.layers):
            block = swa_block_id if i in self.swa_layers else fa_block_id
            if block < 0:
                continue
            src_k, src_v = tensors.get(f"k.{i}"), tensors.get(f"v.{i}")
            if src_k is None or src_v is None or src_k.shape != k.shape[1:] or src_v.shape != v.shape[1:]:
                return False
            targets.append((k[block], src_k, v[block], src_v))
        for dst_k, src_k, dst_v, src_v in targets:
            dst_k.copy_(src_k)
            dst_v.copy_(src_v)
        return True

    def gather_blocks(self, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
        """The K/V of a sequence's first ``num_tokens`` positions (whole blocks, the last one partial) as one byte
        tensor: every layer's keys then values, each ``[blocks, block_size, heads, dim]``. A copy, so
        the blocks may be reused as soon as it returns."""
        ids = self._block_index(block_ids, num_tokens)
        parts = [t.index_select(0, ids).reshape(-1) for pair in self.layers for t in pair]
        return torch.cat(parts).view(torch.uint8)

    def scatter_blocks(self, block_ids: tuple[int, ...], num_tokens: int, payload: torch.Tensor,
                       skip_blocks: int = 0) -> None:
        """Write ``gather_blocks``' bytes (from a cache of the same shape and dtype) into ``block_ids``, but for the
        first ``skip_blocks``."""
        ids = self._block_index(block_ids, num_tokens)
        tensors = [t for pair in self.layers for t in pair]
        values = payload.view(tensors[0].dtype)
        sizes = [len(ids) * t[0].numel() for t in tensors]
        if values.numel() != sum(sizes):
            raise ValueError(f"KV payload of {payload.numel()} bytes does not fit {len(ids)} blocks of this cache")
        for tensor, chunk in zip(tensors, values.split(sizes), strict=True):
            blocks = chunk.view(len(ids), *tensor.shape[1:])
            tensor.index_copy_(0, ids[skip_blocks:], blocks[skip_blocks:])

    def payload_bytes(self, num_tokens: int) -> int:
        """The size of ``gather_blocks``' bytes for ``num_tokens`` positions of this cache."""
        per_block = sum(t[0].numel() * t.element_size() for pair in self.layers for t in pair)
        return -(-num_tokens // self.block_size) * per_block

    def _block_index(self, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
        if self.swa_layers:
            raise ValueError("moving a sequence's KV between nodes needs one block pool (no separate SWA pool)")
        num_blocks = -(-num_tokens // self.block_size)
        return torch.tensor(block_ids[:num_blocks], dtype=torch.int64, device=self.layers[0][0].device)

    @staticmethod
    def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
        """Bytes one block takes across all layers (and ``extra_layers`` more, as ``allocate``), keys and values:
        an MLA model's latent and rotary key, ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer."""
        heads, k_dim, v_dim = _per_token_dims(shape)
        element_size = torch.empty((), dtype=dtype).element_size()
        return (shape.num_layers + extra_layers) * block_size * heads * (k_dim + v_dim) * element_size


def _per_token_dims(shape: ModelShape) -> tuple[int, int, int]:
    """``(heads, K width, V width)`` of one token in one layer: ``ModelShape``'s cache dims (an MLA model's latent
    and rotary key), or ``num_kv_heads``/``head_dim`` of a shape-like object without them."""
    if getattr(shape, "is_mla", False):
        return shape.kv_cache_heads, shape.k_cache_dim, shape.v_cache_dim
    return shape.num_kv_heads, shape.head_dim, shape.head_dim
