"""DeepSeek-V3's multi-head latent attention (MLA) over a paged latent cache.

Per token the layer caches only the normed KV latent (``kv_lora_rank``) and the rotated decoupled key
(``qk_rope_head_dim``): see ``kernels/mla.py`` for the layout and the two attention forms. Decode rows run absorbed
(``W_UK`` folded into the query, ``W_UV`` applied to the attended latent); prefill rows expand their sequence's
cached latent into per-head keys and values through ``kv_b_proj``, as ``transformers`` computes them.

With a ``q_lora_rank``, ``q_a_proj`` and ``kv_a_proj_with_mqa`` share one matmul (both read the layer input). The
``q_a``/``kv_a`` norms use eps 1e-6, as transformers builds them; ``rope_interleave`` rotates the checkpoint's
interleaved rotary pairs as transformers does, by taking the even then the odd dimensions and rotating halves.

Under tensor parallelism (``tp``) a rank holds ``num_attention_heads / N`` query heads: ``q_b_proj`` (or ``q_proj``)
and ``kv_b_proj`` are column-parallel by head (their rows are head-major), ``o_proj`` row-parallel and followed by
an all-reduce (its bias added on rank 0 only). ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms stay whole:
the latent and the rope key are every head's, so each rank computes them and caches the whole latent (the same
cache on every rank), and both the absorbed decode and the expanded prefill run over the rank's heads alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ksana.kernels import mla
from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.kernels.dispatch import KernelOps
from ksana.models.base import WeightSlot
from ksana.models.moe import empty_param
from ksana.models.parallel import Shard, TPGroup, rank_and_size

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep


def mla_softmax_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN with ``mscale_all_dim`` (DeepSeek's correction of
    the whole score, which transformers' ``yarn_apply_mscale`` applies)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if rope_type != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, ops: KernelOps, device: torch.device,
                 tp: TPGroup | None = None):
        super().__init__()
        self.ops = ops
        self.rank, num_ranks = rank_and_size(tp)
        self.sharded = tp is not None
        self.all_reduce = None if tp is None else tp.all_reduce
        self.num_heads = heads = config.num_attention_heads // num_ranks
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        self.scale = mla_softmax_scale(config)
        hidden, qk_dim = config.hidden_size, self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        kv_a_rows = self.kv_lora_rank + self.rope_dim
        # The rows that read the layer input: [q_a | kv_a] with a q_lora_rank, else kv_a alone (q_proj apart).
        self.q_a_rows = self.q_lora_rank or 0
        self.in_weight = empty_param((self.q_a_rows + kv_a_rows, hidden), dtype, device)
        self.in_bias = empty_param((self.q_a_rows + kv_a_rows,), dtype, device) if bias else None
        if self.q_lora_rank:
            self.q_a_norm_weight = empty_param((self.q_lora_rank,), dtype, device)
            self.q_weight = empty_param((heads * qk_dim, self.q_lora_rank), dtype, device)  # q_b_proj
        else:
            self.q_a_norm_weight = None
            self.q_weight = empty_param((heads * qk_dim, hidden), dtype, device)  # q_proj
        self.kv_a_norm_weight = empty_param((self.kv_lora_rank,), dtype, device)
        self.kv_b_weight = empty_param((heads * (self.nope_dim + self.v_dim), self.kv_lora_rank), dtype, device)
        self.o_weight = empty_param((hidden, heads * self.v_dim), dtype, device)
        # Row-parallel: the bias is added once, by rank 0, before the all-reduce.
        self.o_bias = empty_param((hidden,), dtype, device) if bias and self.rank == 0 else None
        # The cache store and attention kernels, swapped for timed ones in perf mode.
        self.store: Callable[..., None] = mla.store_latent
        self.decode_attention: Callable[..., torch.Tensor] = mla.mla_decode_attention
        self.prefill_attention: Callable[..., torch.Tensor] = mla.mla_prefill_attention

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        kv_a_rows = self.kv_lora_rank + self.rope_dim
        slots = {f"{prefix}.kv_a_proj_with_mqa.weight": WeightSlot(self.in_weight, self.q_a_rows, kv_a_rows),
                 f"{prefix}.kv_a_layernorm.weight": WeightSlot(self.kv_a_norm_weight),
                 f"{prefix}.kv_b_proj.weight": WeightSlot(self.kv_b_weight),
                 f"{prefix}.o_proj.weight": WeightSlot(self.o_weight)}
        if self.q_lora_rank:
            slots[f"{prefix}.q_a_proj.weight"] = WeightSlot(self.in_weight, 0, self.q_a_rows)
            slots[f"{prefix}.q_a_layernorm.weight"] = WeightSlot(self.q_a_norm_weight)
            slots[f"{prefix}.q_b_proj.weight"] = WeightSlot(self.q_weight)
        else:
            slots[f"{prefix}.q_proj.weight"] = WeightSlot(self.q_weight)
        if self.in_bias is not None:
            slots[f"{prefix}.kv_a_proj_with_mqa.bias"] = WeightSlot(self.in_bias, self.q_a_rows, kv_a_rows)
            if self.q_lora_rank:
                slots[f"{prefix}.q_a_proj.bias"] = WeightSlot(self.in_bias, 0, self.q_a_rows)
        if self.o_bias is not None:
            slots[f"{prefix}.o_proj.bias"] = WeightSlot(self.o_bias)
        return slots

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        """The part of each checkpoint tensor this rank reads: its heads' rows of ``q_b_proj``/``q_proj`` and
        ``kv_b_proj``, their columns of ``o_proj`` (empty without tensor parallelism)."""
        if not self.sharded:
            return {}
        h, r = self.num_heads, self.rank
        q_rows = h * (self.nope_dim + self.rope_dim)
        kv_rows = h * (self.nope_dim + self.v_dim)
        q_name = "q_b_proj" if self.q_lora_rank else "q_proj"
        return {f"{prefix}.{q_name}.weight": Shard(0, r * q_rows, q_rows),
                f"{prefix}.kv_b_proj.weight": Shard(0, r * kv_rows, kv_rows),
                f"{prefix}.o_proj.weight": Shard(1, r * h * self.v_dim, h * self.v_dim)}

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        first_key: int = 0,
    ) -> torch.Tensor:
        """``first_key``: see ``kernels/mla.py`` (1 for an MTP module's layer, whose position 0 is no key)."""
        num_tokens = hidden.shape[0]
        projected = self.ops.qkv_proj(hidden, self.in_weight, self.in_bias)
        if self.q_lora_rank:
            q_a = self.ops.rms_norm(projected[:, : self.q_a_rows].contiguous(), self.q_a_norm_weight, LATENT_NORM_EPS)
            query = self.ops.qkv_proj(q_a, self.q_weight)
        else:
            query = self.ops.qkv_proj(hidden, self.q_weight)
        query = query.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        kv_a = projected[:, self.q_a_rows :]
        latent = self.ops.rms_norm(kv_a[:, : self.kv_lora_rank].contiguous(), self.kv_a_norm_weight, LATENT_NORM_EPS)
        # Rotate the query's rope part and the one shared rope key together.
        rope = torch.cat((query[:, :, self.nope_dim :], kv_a[:, None, self.kv_lora_rank :]), dim=1)
        if self.rope_interleave:
            rope = torch.cat((rope[..., 0::2], rope[..., 1::2]), dim=-1)
        rope = self.ops.apply_rotary(rope.contiguous(), cos, sin)
        q_nope, q_rope, k_rope = query[:, :, : self.nope_dim], rope[:, : self.num_heads], rope[:, self.num_heads]
        latent_cache, rope_cache = kv_cache
        self.store(latent, k_rope, latent_cache, rope_cache, meta.slot_mapping)

        kv_b = self.kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = kv_b[:, : self.nope_dim], kv_b[:, self.nope_dim :]
        seq_lens = meta.seq_lens_list or meta.seq_lens.tolist()
        query_lens = meta.query_lens_list or meta.query_start_loc.diff().tolist()
        num_decodes = meta.num_decodes
        outs = []
        if num_decodes:
            # Absorbed: [H, B, nope] @ [H, nope, r] -> the query in latent space; the attended latent @ W_UV^T.
            q_latent = torch.bmm(q_nope[:num_decodes].transpose(0, 1), w_uk).transpose(0, 1)
            attended = self.decode_attention(q_latent, q_rope[:num_decodes], latent_cache, rope_cache,
                                             meta.block_tables[:num_decodes], meta.seq_lens[:num_decodes],
                                             self.scale, max(seq_lens[:num_decodes]), first_key)
            outs.append(torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))
        start = num_decodes
        for i in range(num_decodes, len(seq_lens)):
            end = start + query_lens[i]
            context, context_rope = mla.gather_latent(latent_cache, rope_cache, meta.block_tables[i], seq_lens[i])
            expanded = torch.nn.functional.linear(context, self.kv_b_weight)
            expanded = expanded.view(-1, self.num_heads, self.nope_dim + self.v_dim)
            key = torch.cat((expanded[..., : self.nope_dim],
                             context_rope[:, None].expand(-1, self.num_heads, -1)), dim=-1)
            q = torch.cat((q_nope[start:end], q_rope[start:end]), dim=-1)
            outs.append(self.prefill_attention(q, key, expanded[..., self.nope_dim :], self.scale, first_key))
            start = end
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = self.ops.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim), self.o_weight, self.o_bias)
        return out if self.all_reduce is None else self.all_reduce(out)
