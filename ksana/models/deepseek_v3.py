"""DeepSeek-V3: multi-head latent attention, a mixture of experts, and the multi-token-prediction (MTP) modules.

Layers ``0 .. first_k_dense_replace - 1`` have a dense MLP, the rest a ``DeepseekMoE``; attention is ``MLAttention``
(``mla_attention.py``), whose paged cache holds one latent "head" per token (``ModelShape`` and ``KVCache`` size it:
``(kv_lora_rank + qk_rope_head_dim) * element_size`` bytes per token and layer). The ops come from ``KernelOps``
one by one; the native CPU backend's fused all-layer decode step is the Llama decoder's and is never used here.

Tensor parallelism (``tp``, N ranks): each rank holds ``num_attention_heads / N`` query heads of every MLA layer and
the whole latent cache (``mla_attention.py``), ``1/N`` of every expert's, the shared experts' and the dense MLPs'
intermediate size (``moe.py``; the router whole), and ``ceil(vocab / N)`` rows of the embedding and lm_head
(vocabulary-parallel as in ``decoder.py``: masked lookups all-reduced, logit slices all-gathered). Each layer
all-reduces twice (after ``o_proj``, after the MLP or the sum of experts). ``rank_shape`` is the rank's sizes, its
KV cache the full one-head latent. ``weight_shards`` names the part of each checkpoint tensor a rank reads.

MTP modules. A checkpoint with ``num_nextn_predict_layers = n`` holds module ``i`` under ``model.layers.{L + i}``
(``L = num_hidden_layers``): ``enorm``, ``hnorm``, ``eh_proj``, a decoder block (``self_attn``, ``mlp`` (a MoE),
the two layer norms), ``shared_head.norm``, ``shared_head.head`` and often ``embed_tokens`` (a copy of the main
table). They load into ``model.mtp_layers``; a missing ``embed_tokens``/``shared_head.head`` shares the main
model's embedding/lm_head, and a module none of whose tensors are in the checkpoint is dropped (transformers'
config claims one module by default), so ``model.num_mtp_layers`` (and ``model.shape.num_mtp_layers``) counts the
modules the checkpoint really has. The interface:

- ``mtp_forward(i, input_ids, positions, previous_hidden, kv_cache, meta) -> hidden [T, hidden]``: row ``t`` is
  token ``input_ids[t]`` at ``positions[t]``, and ``previous_hidden[t]`` is the hidden state at the position before
  it: the main model's final-normed output (what ``forward`` returns) for the first module, the previous MTP
  step's returned hidden when a module is chained. Computes ``eh_proj([enorm(embed(ids)) ; hnorm(previous)])``
  (that order, as DeepSeek's checkpoints and vLLM/transformers take it), then the block over the module's own
  paged cache layer, and returns the block's output before ``shared_head.norm``.
- ``mtp_compute_logits(i, hidden) -> [N, vocab]`` float32: ``shared_head.head(shared_head.norm(hidden))``.
- The KV cache: module ``i`` reads and writes layer ``num_layers + i`` of a ``KVCache`` allocated with
  ``KVCache.allocate(shape, ..., extra_layers=model.num_mtp_layers)`` (and sized with
  ``KVCache.bytes_per_block(shape, block_size, dtype, extra_layers=...)``): same layout and block tables as the
  main layers, so a sequence's blocks hold its MTP KV at the same slots.
- Position 0 has no previous hidden state, and DeepSeek's MTP sequence starts at position 1 (its first entry
  pairs ``h_0`` with token 1). So the module's layer hides key position 0 from every later query: a caller may
  include a row at position 0 (with any finite ``previous_hidden``, zeros say) without changing any other row,
  or skip it. (vLLM feeds the same pairs one position earlier and zeroes the embedding at its position 0; rotary
  attention depends on relative positions only, so the rows here equal DeepSeek's.)
- Under tensor parallelism the modules split as the main layers do (``eh_proj`` and the norms whole, the block's
  heads and experts split, ``embed_tokens`` and ``shared_head.head`` vocabulary-parallel with gathered logits);
  every rank must call ``mtp_forward``/``mtp_compute_logits`` together, for their collectives. (The engine's MTP
  drafting runs on rank 0 alone and refuses tensor parallelism.)
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ksana.kernels import mla
from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.kernels.dispatch import KernelOps, get_ops
from ksana.models.base import CausalLM, WeightSlot
from ksana.models.decoder import OpProfiler, rope_from_hf_config
from ksana.models.mla_attention import MLAttention
from ksana.models.moe import DeepseekMoE, GatedMLP, empty_param
from ksana.models.parallel import (
    Shard,
    TPGroup,
    gathered_logits,
    rank_and_size,
    rank_shape,
    vocab_parallel_embedding,
    vocab_range,
)
from ksana.models.shape import ModelShape

KVLayer = tuple[torch.Tensor, torch.Tensor]


def _vocab_table(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, tp: TPGroup | None) -> nn.Parameter:
    """An embedding or head table of ``rows`` rows; under tensor parallelism zero-filled, so the padding rows past
    the vocabulary (never loaded, never looked up, their logits cut) hold zeros."""
    table = empty_param((rows, hidden), dtype, device)
    return table if tp is None else table.zero_()


class DeepseekV3Layer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, ops: KernelOps, device: torch.device,
                 tp: TPGroup | None = None):
        super().__init__()
        self.ops = ops
        self.eps = float(config.rms_norm_eps)
        self.self_attn = MLAttention(config, dtype, ops, device, tp)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp: nn.Module = DeepseekMoE(config, dtype, ops, device, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, ops, device, tp)
        self.input_norm_weight = empty_param((config.hidden_size,), dtype, device)
        self.post_attention_norm_weight = empty_param((config.hidden_size,), dtype, device)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        return {
            **self.self_attn.weight_slots(f"{prefix}.self_attn"),
            **self.mlp.weight_slots(f"{prefix}.mlp"),
            f"{prefix}.input_layernorm.weight": WeightSlot(self.input_norm_weight),
            f"{prefix}.post_attention_layernorm.weight": WeightSlot(self.post_attention_norm_weight),
        }

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        return {**self.self_attn.weight_shards(f"{prefix}.self_attn"), **self.mlp.weight_shards(f"{prefix}.mlp")}

    def set_all_reduce(self, all_reduce: Any) -> None:
        """The all-reduce after ``o_proj`` and after the MLP (the shared experts' partial output has none)."""
        self.self_attn.all_reduce = self.mlp.all_reduce = all_reduce

    def set_ops(self, ops: KernelOps) -> None:
        self.ops = self.self_attn.ops = self.mlp.ops = ops
        if isinstance(self.mlp, DeepseekMoE) and self.mlp.shared is not None:
            self.mlp.shared.ops = ops

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVLayer, meta: AttentionMetadata, first_key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this layer's output, the residual stream before it)``: their sum is the layer's full output."""
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_norm_weight, self.eps)
        else:
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, self.input_norm_weight, self.eps)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta, first_key)
        hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, self.post_attention_norm_weight, self.eps)
        return self.mlp(hidden), residual


class MTPLayer(nn.Module):
    """One next-n module: its norms and projection, a decoder block, its shared head (and embedding)."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, ops: KernelOps, device: torch.device,
                 tp: TPGroup | None = None):
        super().__init__()
        hidden = config.hidden_size
        rank, num_ranks = rank_and_size(tp)
        _, self.num_vocab_rows, rows_per_rank = vocab_range(config.vocab_size, rank, num_ranks)
        self.sharded = tp is not None
        self.enorm_weight = empty_param((hidden,), dtype, device)
        self.hnorm_weight = empty_param((hidden,), dtype, device)
        self.eh_proj_weight = empty_param((hidden, 2 * hidden), dtype, device)
        self.block = DeepseekV3Layer(config, layer_idx, dtype, ops, device, tp)
        self.head_norm_weight = empty_param((hidden,), dtype, device)
        self.embed_weight = _vocab_table(rows_per_rank, hidden, dtype, device, tp)
        self.head_weight = _vocab_table(rows_per_rank, hidden, dtype, device, tp)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        rows = self.num_vocab_rows if self.sharded else None
        return {
            **self.block.weight_slots(prefix),
            f"{prefix}.enorm.weight": WeightSlot(self.enorm_weight),
            f"{prefix}.hnorm.weight": WeightSlot(self.hnorm_weight),
            f"{prefix}.eh_proj.weight": WeightSlot(self.eh_proj_weight),
            f"{prefix}.shared_head.norm.weight": WeightSlot(self.head_norm_weight),
            f"{prefix}.shared_head.head.weight": WeightSlot(self.head_weight, 0, rows),
            f"{prefix}.embed_tokens.weight": WeightSlot(self.embed_weight, 0, rows),
        }

    def weight_shards(self, prefix: str, vocab: Shard | None) -> dict[str, Shard]:
        """The block's shards and ``vocab`` (this rank's vocabulary rows) for the embedding and the head."""
        if vocab is None:
            return {}
        return {**self.block.weight_shards(prefix), f"{prefix}.shared_head.head.weight": vocab,
                f"{prefix}.embed_tokens.weight": vocab}


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        eos_token_ids: list[int] | None = None,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        # ``shape`` is the whole model's; ``rank_shape`` this tensor-parallel rank's (its KV cache is that size).
        self.shape = ModelShape.from_hf_config(config, dtype, eos_token_ids)
        self.tp = tp
        rank, self.num_ranks = rank_and_size(tp)
        self.rank_shape = rank_shape(self.shape, self.num_ranks)
        self.ops = self.plain_ops = get_ops(device)
        self.eps = float(config.rms_norm_eps)
        hidden = config.hidden_size
        self.vocab_start, self.num_vocab_rows, rows_per_rank = vocab_range(config.vocab_size, rank, self.num_ranks)
        self.embed_weight = _vocab_table(rows_per_rank, hidden, dtype, device, tp)
        self.layers = nn.ModuleList(
            DeepseekV3Layer(config, i, dtype, self.ops, device, tp) for i in range(config.num_hidden_layers))
        self.norm_weight = empty_param((hidden,), dtype, device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head_weight = (self.embed_weight if self.tied
                               else _vocab_table(rows_per_rank, hidden, dtype, device, tp))
        self.mtp_layers = nn.ModuleList(
            MTPLayer(config, config.num_hidden_layers + i, dtype, self.ops, device, tp)
            for i in range(self.shape.num_mtp_layers))
        self.all_reduce = None if tp is None else tp.all_reduce
        self.all_gather = None if tp is None else tp.all_gather_last_dim
        inv_freq, self.attention_scaling = rope_from_hf_config(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.profiler: OpProfiler | None = None
        self.layer_forward_round = 1

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp_layers)

    # ---- weights --------------------------------------------------------------------------------------------
    def _mtp_prefix(self, index: int) -> str:
        return f"model.layers.{self.shape.num_layers + index}"

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = self.stack_weight_slots()
        for i, layer in enumerate(self.mtp_layers):
            slots |= layer.weight_slots(self._mtp_prefix(i))
        return slots

    def weight_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor name -> the part this tensor-parallel rank reads; tensors not named are whole."""
        shards = self.stack_weight_shards()
        if self.tp is None:
            return shards
        for i, layer in enumerate(self.mtp_layers):
            shards |= layer.weight_shards(self._mtp_prefix(i), shards["lm_head.weight"])
        return shards

    def ignored_weight_names(self) -> frozenset[str]:
        num_layers = self.shape.num_layers + self.shape.num_mtp_layers
        names = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(num_layers)}
        if self.tied:
            names.add("lm_head.weight")
        if self.tp is not None and self.tp.rank != 0:  # the row-parallel o_proj bias lives on rank 0
            names |= {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(num_layers)}
        return frozenset(names)

    def fill_missing_weights(self, missing: set[str]) -> set[str]:
        """Drop the trailing MTP modules the checkpoint has none of, share the main embedding/lm_head where a
        module lacks its copy; the names still missing come back."""
        missing = set(missing)
        keep = self.num_mtp_layers
        while keep and set(self.mtp_layers[keep - 1].weight_slots(self._mtp_prefix(keep - 1))) <= missing:
            keep -= 1
            missing -= set(self.mtp_layers[keep].weight_slots(self._mtp_prefix(keep)))
        if keep < self.num_mtp_layers:
            self.mtp_layers = self.mtp_layers[:keep]
            self.shape = attrs.evolve(self.shape, num_mtp_layers=keep)
            self.rank_shape = rank_shape(self.shape, self.num_ranks)
        for i, layer in enumerate(self.mtp_layers):
            prefix = self._mtp_prefix(i)
            if f"{prefix}.embed_tokens.weight" in missing:
                layer.embed_weight = self.embed_weight
                missing.discard(f"{prefix}.embed_tokens.weight")
            if f"{prefix}.shared_head.head.weight" in missing:
                layer.head_weight = self.lm_head_weight
                missing.discard(f"{prefix}.shared_head.head.weight")
        return missing

    def tie_lm_head(self) -> None:
        self.tied = True
        self.lm_head_weight = self.embed_weight

    def pack_weights(self) -> None:
        """The projections stay plain tensors (BLAS through ``KernelOps``' projections): nothing to pack."""

    # ---- perf-mode hooks ------------------------------------------------------------------------------------
    def set_profiler(self, profiler: OpProfiler | None) -> None:
        """Time every op through ``profiler`` (the MLA kernels as ``kv_cache_store``, ``attention_decode`` and
        ``attention_prefill``, the tensor-parallel collectives as ``all_reduce``; its layer attribution covers the
        main layers); ``None`` restores the plain kernels."""
        ops = self.plain_ops if profiler is None else self.plain_ops.timed(profiler)
        self.ops = ops
        if self.tp is not None:
            all_reduce, all_gather = self.tp.all_reduce, self.tp.all_gather_last_dim
            if profiler is not None:
                all_reduce, all_gather = profiler.wrap("all_reduce", all_reduce), profiler.wrap("all_reduce", all_gather)
            self.all_reduce, self.all_gather = all_reduce, all_gather
        for layer in [*self.layers, *(m.block for m in self.mtp_layers)]:
            layer.set_ops(ops)
            if self.tp is not None:
                layer.set_all_reduce(self.all_reduce)
            attn = layer.self_attn
            attn.store, attn.decode_attention, attn.prefill_attention = (
                mla.store_latent, mla.mla_decode_attention, mla.mla_prefill_attention)
            if profiler is not None:
                attn.store = profiler.wrap("kv_cache_store", attn.store)
                attn.decode_attention = profiler.wrap("attention_decode", attn.decode_attention)
                attn.prefill_attention = profiler.wrap("attention_prefill", attn.prefill_attention)
        self.profiler = profiler

    # ---- forward --------------------------------------------------------------------------------------------
    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_cos_sin(positions, self.inv_freq, self.attention_scaling, self.shape.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVLayer],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final-normed hidden states ``[T, hidden]``; ``kv_caches`` may carry the MTP layers after the main
        ones (only the first ``num_layers`` are read here)."""
        hidden = self._embed(input_ids, self.embed_weight)
        cos, sin = self._rotary(positions)
        residual = None
        profiler, num_repeats = self.profiler, self.layer_forward_round - 1
        for index, layer in enumerate(self.layers):
            if profiler is not None:
                profiler.layer = index
            for _ in range(num_repeats):
                layer(hidden, residual, cos, sin, kv_caches[index], meta)
            hidden, residual = layer(hidden, residual, cos, sin, kv_caches[index], meta)
        if profiler is not None:
            profiler.layer = None
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, self.norm_weight, self.eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(self.ops.embedding, input_ids, table, self.vocab_start, self.num_vocab_rows,
                                        self.all_reduce)

    def _logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return gathered_logits(self.ops.lm_head, hidden, head, self.shape.vocab_size, self.all_gather)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden, self.lm_head_weight)

    def mtp_forward(
        self,
        layer_index: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        kv_cache: KVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """MTP module ``layer_index`` over a packed batch (see the module docstring); ``kv_cache`` is its layer,
        ``kv_caches[num_layers + layer_index]`` of the engine's cache."""
        module = self.mtp_layers[layer_index]
        embedded = self._embed(input_ids, module.embed_weight)
        joined = torch.cat((self.ops.rms_norm(embedded, module.enorm_weight, self.eps),
                            self.ops.rms_norm(previous_hidden.to(embedded.dtype), module.hnorm_weight, self.eps)),
                           dim=-1)
        hidden = F.linear(joined, module.eh_proj_weight)
        cos, sin = self._rotary(positions)
        hidden, residual = module.block(hidden, None, cos, sin, kv_cache, meta, first_key=1)
        return hidden + residual

    def mtp_compute_logits(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` (``mtp_forward``'s rows) -> ``[N, vocab]`` float32 logits of the token after next."""
        module = self.mtp_layers[layer_index]
        normed = self.ops.rms_norm(hidden, module.head_norm_weight, self.eps)
        return self._logits(normed, module.head_weight)
