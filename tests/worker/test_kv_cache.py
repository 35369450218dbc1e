"""The KV cache pools: both layouts hold the same values under the same indexing, and blocks move between them."""

from __future__ import annotations

import torch

from ksana.models.shape import ModelShape
from ksana.worker.kv_cache import KVCache

SHAPE = ModelShape(model_type="llama", num_layers=2, hidden_size=12, num_heads=3, num_kv_heads=3, head_dim=4,
                   intermediate_size=16, vocab_size=100, max_position_embeddings=64, sliding_windows=[None, None],
                   eos_token_ids=[], dtype=torch.float32)


def _filled(head_major: bool) -> KVCache:
    cache = KVCache.allocate(SHAPE, num_blocks=5, block_size=8, dtype=torch.float32, device="cpu",
                             head_major=head_major)
    for i, (k, v) in enumerate(cache.layers):
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view(k.shape) + 1000 * i)
        v.copy_(-k)
    return cache


def test_a_head_major_cache_keeps_each_blocks_heads_together_in_memory() -> None:
    cache = _filled(head_major=True)
    k, v = cache.layers[0]
    assert k.shape == v.shape == (5, 8, 3, 4)
    assert k.stride() == v.stride() == (8 * 3 * 4, 4, 8 * 4, 1)
    # slot 2's KV head 1 of block 3: one head's slots are one run of memory
    flat = k.transpose(1, 2).contiguous().view(-1)
    assert torch.equal(k[3, 2, 1], flat[3 * 96 + 1 * 32 + 2 * 4:][:4])
    assert KVCache.allocate(SHAPE, 5, 8, torch.float32, "cpu").layers[0][0].is_contiguous()


def test_both_layouts_hold_the_same_values_and_blocks_move_between_them() -> None:
    slot_major, head_major = _filled(head_major=False), _filled(head_major=True)
    for (a, b), (c, d) in zip(slot_major.layers, head_major.layers, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    block = slot_major.block_tensors(fa_block_id=1, swa_block_id=-1)
    assert head_major.write_block(fa_block_id=4, swa_block_id=-1, tensors=block)
    for (k, v), (src_k, src_v) in zip(head_major.layers, slot_major.layers, strict=True):
        assert torch.equal(k[4], src_k[1]) and torch.equal(v[4], src_v[1])
        assert torch.equal(k[:4], src_k[:4]), "only the written block changed"
