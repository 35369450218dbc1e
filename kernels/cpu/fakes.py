"""Fake implementations of the CPU operators (``registration.cpp``): output shapes and dtypes without running a
kernel, so ``torch.compile`` and meta-device tracing see through them. Ops that only write their arguments have
no output to describe; the build queries take no tensor."""

from __future__ import annotations

import torch
from torch import Tensor


def register_fakes(namespace: str) -> None:
    """Register every operator's fake implementation under ``namespace`` (once per namespace)."""
    if namespace in _registered:
        return
    _registered.add(namespace)

    def fake(name: str):
        return torch.library.register_fake(f"{namespace}::{name}")

    @fake("rms_norm")
    def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return x.new_empty(x.shape)

    @fake("fused_add_rms_norm")
    def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @fake("rotary_neox")
    def _(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x.new_empty(x.shape)

    @fake("silu_and_mul")
    def _(x: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @fake("paged_decode")
    def _(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
          sliding_window: int) -> Tensor:
        return query.new_empty(query.shape)

    @fake("prefill_attention")
    def _(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_len: int, scale: float,
          sliding_window: int) -> Tensor:
        return query.new_empty(query.shape)

    @fake("packed_rows")
    def _(packed: Tensor, out_features: int, ids: Tensor) -> Tensor:
        return packed.new_empty((ids.shape[0], packed.shape[1]))

    @fake("packed_linear")
    def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
        return x.new_empty((x.shape[0], out_features))

    @fake("packed_linear_greedy")
    def _(x: Tensor, packed: Tensor, out_features: int, vocab_size: int) -> tuple[Tensor, Tensor]:
        return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], dtype=torch.float32)

    @fake("greedy_logprobs")
    def _(logits: Tensor) -> tuple[Tensor, Tensor]:
        return logits.new_empty(logits.shape[0], dtype=torch.int64), logits.new_empty(logits.shape[0])

    for name in ("store_kv", "pack_weight", "unpack_weight", "decode_layers", "decode_phase_clock"):
        torch.library.register_fake(f"{namespace}::{name}")(lambda *args: None)


_registered: set[str] = set()
