"""The Llama-style decoder shared by Llama, Qwen2 and Mistral.

Families differ only in biases and per-layer sliding windows, which subclasses state through
``DecoderForCausalLM._biases`` and the config (``ModelShape.sliding_windows``). Parameters are created empty on
the target device in the target dtype and filled by the loader; q/k/v and gate/up are fused into one matmul
each. Every op goes through the ``KernelOps`` picked for the device.

Two whole-model hooks of ``KernelOps`` change how the layers run where a backend offers them (the native CPU
kernels on AVX2 and AVX-512): ``pack_weights`` swaps every projection for the backend's ``PackedWeight`` once the
checkpoint is loaded, and an all-decode step runs every layer and the final norm in one native call
(``DecoderForCausalLM._decode_layers`` -> ``KernelOps.decode_layers`` -> ``NativeCPUOps.decode_layers`` in
``kernels/cpu/ops.py`` -> ``decode_layers`` in ``kernels/cpu/decode_layers.cpp``). Every other step, and every backend
without the hook, runs the layer loop in ``DecoderForCausalLM.forward`` op by op.

Two perf-mode hooks (``set_profiler``, ``set_layer_forward_round``) cost nothing when unused: profiling swaps
timed ``KernelOps`` into every module instead of testing a flag per op, and the layer loop only reads two
attributes per layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch
from torch import nn

from ksana.kernels.attention_metadata import AttentionMetadata
from ksana.kernels.dispatch import (
    DecodeLayers,
    DecodeLayerWeights,
    KernelOps,
    OpTimer,
    PackedWeight,
    Weight,
    get_ops,
)
from ksana.models.base import CausalLM, WeightSlot
from ksana.models.parallel import (
    Shard,
    TPGroup,
    gathered_logits,
    rank_shape,
    vocab_parallel_embedding,
    vocab_range,
)
from ksana.models.shape import ModelShape


class OpProfiler(OpTimer, Protocol):
    """A ``KernelOps`` timer that also attributes ops to the decoder layer running them."""

    layer: int | None


@attrs.frozen
class Biases:
    qkv: bool = False
    o: bool = False
    mlp: bool = False


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


def _swap_in_packed(module: nn.Module, name: str, packed: Weight) -> PackedWeight | None:
    """Swap the parameter ``name`` for its packed form when the backend packed it. The packed storage stays
    registered (as ``<name>_packed``), so ``parameters()`` still counts the bytes the model holds."""
    if not isinstance(packed, PackedWeight):
        return None
    delattr(module, name)
    setattr(module, name, packed)
    module.register_parameter(f"{name}_packed", nn.Parameter(packed.packed, requires_grad=False))
    return packed


def _tp_rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def rope_from_hf_config(config: Any, device: torch.device) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` as ``transformers`` computes them.

    transformers 5 keeps ``rope_theta`` and the scaling in ``config.rope_parameters``; 4.x has ``rope_theta`` and
    ``rope_scaling``. Scaled variants reuse transformers' own init functions so the numbers match exactly.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq.to(device), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} (sequence-length dependent) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"unknown rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.to(device=device, dtype=torch.float32), float(scaling)


class DecoderAttention(nn.Module):
    """Under tensor parallelism (``tp``) this rank's KV-head group: its query heads and the KV heads they read."""

    def __init__(
        self, shape: ModelShape, layer_idx: int, biases: Biases, ops: KernelOps, device: torch.device,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.ops = ops
        rank, num_ranks = _tp_rank_size(tp)
        self.rank = rank
        self.all_reduce = None if tp is None else tp.all_reduce
        self.num_heads = shape.num_heads // num_ranks
        self.num_kv_heads = shape.num_kv_heads // num_ranks
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.sliding_window = shape.sliding_windows[layer_idx]
        dtype = shape.dtype
        self.qkv_weight = _empty((self.q_size + 2 * self.kv_size, shape.hidden_size), dtype, device)
        self.qkv_bias = _empty((self.q_size + 2 * self.kv_size,), dtype, device) if biases.qkv else None
        self.o_weight = _empty((shape.hidden_size, self.q_size), dtype, device)
        # Row-parallel: the bias is added once, by rank 0, before the all-reduce.
        self.o_bias = _empty((shape.hidden_size,), dtype, device) if biases.o and rank == 0 else None
        self.has_qkv_bias = biases.qkv

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        rows = {"q_proj": (0, self.q_size), "k_proj": (self.q_size, self.kv_size)}
        rows["v_proj"] = (self.q_size + self.kv_size, self.kv_size)
        slots = {f"{prefix}.{n}.weight": WeightSlot(self.qkv_weight, s, r) for n, (s, r) in rows.items()}
        if self.qkv_bias is not None:
            slots |= {f"{prefix}.{n}.bias": WeightSlot(self.qkv_bias, s, r) for n, (s, r) in rows.items()}
        slots[f"{prefix}.o_proj.weight"] = WeightSlot(self.o_weight)
        if self.o_bias is not None:
            slots[f"{prefix}.o_proj.bias"] = WeightSlot(self.o_bias)
        return slots

    # The projection weights a backend may repack, in the order a forward reads them.
    packable_weights = ("qkv_weight", "o_weight")

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        """The part of each checkpoint tensor this rank reads (empty without tensor parallelism)."""
        if self.all_reduce is None:
            return {}
        q, kv, r = self.q_size, self.kv_size, self.rank
        rows = {"q_proj": Shard(0, r * q, q), "k_proj": Shard(0, r * kv, kv), "v_proj": Shard(0, r * kv, kv)}
        shards = {f"{prefix}.{n}.weight": s for n, s in rows.items()}
        if self.has_qkv_bias:
            shards |= {f"{prefix}.{n}.bias": s for n, s in rows.items()}
        shards[f"{prefix}.o_proj.weight"] = Shard(1, r * q, q)
        return shards

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.ops.qkv_proj(hidden, self.qkv_weight, self.qkv_bias)
        # Rotate query and key heads together: they are adjacent in the fused output.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        qk = self.ops.apply_rotary(qk, cos, sin)
        query, key = qk[:, : self.num_heads], qk[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.sliding_window is not None and meta.swa is not None:
            meta = meta.swa  # sliding layers read their own SWA block pool (prefix cache on an SWA model)
        out = self.ops.paged_attention(
            query, key, value, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window
        )
        out = self.ops.o_proj(out.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderMLP(nn.Module):
    """Under tensor parallelism gate/up are column-parallel and down row-parallel (then all-reduced)."""

    def __init__(self, shape: ModelShape, biases: Biases, ops: KernelOps, device: torch.device,
                 tp: TPGroup | None = None):
        super().__init__()
        self.ops = ops
        rank, num_ranks = _tp_rank_size(tp)
        self.rank = rank
        self.all_reduce = None if tp is None else tp.all_reduce
        size, dtype = shape.intermediate_size // num_ranks, shape.dtype
        self.gate_up_weight = _empty((2 * size, shape.hidden_size), dtype, device)
        self.gate_up_bias = _empty((2 * size,), dtype, device) if biases.mlp else None
        self.down_weight = _empty((shape.hidden_size, size), dtype, device)
        self.down_bias = _empty((shape.hidden_size,), dtype, device) if biases.mlp and rank == 0 else None

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        size = self.down_weight.shape[1]
        slots = {
            f"{prefix}.gate_proj.weight": WeightSlot(self.gate_up_weight, 0, size),
            f"{prefix}.up_proj.weight": WeightSlot(self.gate_up_weight, size, size),
            f"{prefix}.down_proj.weight": WeightSlot(self.down_weight),
        }
        if self.gate_up_bias is not None:
            slots[f"{prefix}.gate_proj.bias"] = WeightSlot(self.gate_up_bias, 0, size)
            slots[f"{prefix}.up_proj.bias"] = WeightSlot(self.gate_up_bias, size, size)
            if self.down_bias is not None:
                slots[f"{prefix}.down_proj.bias"] = WeightSlot(self.down_bias)
        return slots

    packable_weights = ("gate_up_weight", "down_weight")  # as the attention's

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        if self.all_reduce is None:
            return {}
        size = self.down_weight.shape[1]
        rows = Shard(0, self.rank * size, size)
        shards = {f"{prefix}.gate_proj.weight": rows, f"{prefix}.up_proj.weight": rows,
                  f"{prefix}.down_proj.weight": Shard(1, self.rank * size, size)}
        if self.gate_up_bias is not None:
            shards |= {f"{prefix}.gate_proj.bias": rows, f"{prefix}.up_proj.bias": rows}
        return shards

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.mlp_gate_up(hidden, self.gate_up_weight, self.gate_up_bias)
        out = self.ops.mlp_down(self.ops.silu_and_mul(gate_up), self.down_weight, self.down_bias)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: ModelShape,
        layer_idx: int,
        biases: Biases,
        eps: float,
        ops: KernelOps,
        device: torch.device,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.self_attn = DecoderAttention(shape, layer_idx, biases, ops, device, tp)
        self.mlp = DecoderMLP(shape, biases, ops, device, tp)
        self.input_norm_weight = _empty((shape.hidden_size,), shape.dtype, device)
        self.post_attention_norm_weight = _empty((shape.hidden_size,), shape.dtype, device)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        return {
            **self.self_attn.weight_slots(f"{prefix}.self_attn"),
            **self.mlp.weight_slots(f"{prefix}.mlp"),
            f"{prefix}.input_layernorm.weight": WeightSlot(self.input_norm_weight),
            f"{prefix}.post_attention_layernorm.weight": WeightSlot(self.post_attention_norm_weight),
        }

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        return {**self.self_attn.weight_shards(f"{prefix}.self_attn"), **self.mlp.weight_shards(f"{prefix}.mlp")}

    def decode_weights(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> DecodeLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        return DecodeLayerWeights(self.input_norm_weight, attn.qkv_weight, attn.qkv_bias, attn.o_weight, attn.o_bias,
                                  self.post_attention_norm_weight, mlp.gate_up_weight, mlp.gate_up_bias,
                                  mlp.down_weight, mlp.down_bias, kv_cache[0], kv_cache[1], attn.sliding_window)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_norm_weight, self.eps)
        else:
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, self.input_norm_weight, self.eps)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.ops.fused_add_rms_norm(
            hidden, residual, self.post_attention_norm_weight, self.eps
        )
        return self.mlp(hidden), residual


class DecoderForCausalLM(CausalLM):
    """Llama-architecture causal LM; subclasses set the family's biases."""

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
        self.rank_shape = rank_shape(self.shape, 1 if tp is None else tp.world_size)
        self.ops = self.plain_ops = get_ops(device)
        self.eps = float(config.rms_norm_eps)
        biases = self._biases(config)
        shape = self.shape
        rank, num_ranks = _tp_rank_size(tp)
        self.vocab_start, self.num_vocab_rows, rows_per_rank = vocab_range(shape.vocab_size, rank, num_ranks)
        # Vocabulary-parallel rows; the padding past the vocabulary stays zero (never looked up, logits cut).
        make = _empty if tp is None else _zeros
        self.embed_weight = make((rows_per_rank, shape.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, i, biases, self.eps, self.ops, device, tp) for i in range(shape.num_layers)
        )
        self.norm_weight = _empty((shape.hidden_size,), dtype, device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head_weight = (
            self.embed_weight if self.tied else make(self.embed_weight.shape, dtype, device)
        )
        self.all_reduce = None if tp is None else tp.all_reduce
        self.all_gather = None if tp is None else tp.all_gather_last_dim
        inv_freq, self.attention_scaling = rope_from_hf_config(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.profiler: OpProfiler | None = None
        self.layer_forward_round = 1
        # (the KV cache's addresses, the layers as ``ops.decode_layers`` takes them), made on the first decode step.
        self._decode_layers_of: tuple[tuple[int, ...], DecodeLayers] | None = None

    @property
    def kv_head_major(self) -> bool:
        return self.plain_ops.kv_head_major

    @classmethod
    def _biases(cls, config: Any) -> Biases:
        raise NotImplementedError

    def weight_slots(self) -> dict[str, WeightSlot]:
        return self.stack_weight_slots()

    def weight_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor name -> the part this tensor-parallel rank reads; tensors not named are whole."""
        return self.stack_weight_shards()

    def ignored_weight_names(self) -> frozenset[str]:
        names = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(self.shape.num_layers)}
        if self.tied:
            names.add("lm_head.weight")
        if self.tp is not None and self.tp.rank != 0:  # row-parallel biases live on rank 0
            for i in range(self.shape.num_layers):
                names |= {f"model.layers.{i}.self_attn.o_proj.bias", f"model.layers.{i}.mlp.down_proj.bias"}
        return frozenset(names)

    def tie_lm_head(self) -> None:
        self.tied = True
        self.lm_head_weight = self.embed_weight

    def pack_weights(self) -> None:
        """Every projection, and the head, in ``ops.pack_weights``' layout (the native CPU matmul's panels), in
        the order a decode step reads them, so the backend can lay them out as one stream. A tied embedding is
        the packed head itself: the lookup gathers from the panels, so there is one copy."""
        pack = self.plain_ops.pack_weights
        if pack is None:
            return
        slots = [(module, name) for layer in self.layers for module in (layer.self_attn, layer.mlp)
                 for name in module.packable_weights]
        slots.append((self, "lm_head_weight"))
        tied = self.tied and self.lm_head_weight is self.embed_weight
        weights = [getattr(module, name).data for module, name in slots]
        for i, ((module, name), packed) in enumerate(zip(slots, pack(weights), strict=True)):
            _swap_in_packed(module, name, packed)
            weights[i] = None  # the original goes before the next one is packed (see ``pack_weights``)
        if tied and isinstance(self.lm_head_weight, PackedWeight):
            delattr(self, "embed_weight")
            self.embed_weight = self.lm_head_weight
        self._decode_layers_of = None

    # ---- perf-mode hooks ------------------------------------------------------------------------------------
    def set_profiler(self, profiler: OpProfiler | None) -> None:
        """Time every op through ``profiler`` (its ``layer`` is set to the running layer's index, None outside
        the layers); ``None`` restores the plain kernels."""
        ops = self.plain_ops if profiler is None else self.plain_ops.timed(profiler)
        self.ops = ops
        for layer in self.layers:
            layer.ops = layer.self_attn.ops = layer.mlp.ops = ops
        self.profiler = profiler
        if self.tp is not None:  # the collectives are timed as the "all_reduce" operator
            all_reduce, all_gather = self.tp.all_reduce, self.tp.all_gather_last_dim
            if profiler is not None:
                all_reduce, all_gather = profiler.wrap("all_reduce", all_reduce), profiler.wrap("all_reduce", all_gather)
            self.all_reduce, self.all_gather = all_reduce, all_gather
            for layer in self.layers:
                layer.self_attn.all_reduce = layer.mlp.all_reduce = all_reduce

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self._embed(input_ids)
        cos, sin = self.ops.rotary_cos_sin(positions, self.inv_freq, self.attention_scaling, self.shape.dtype)
        # The fast path: an all-decode step's layers in one backend call (on the CPU, one native call).
        fused = self._decode_layers(hidden, cos, sin, kv_caches, meta)
        if fused is not None:
            return fused[0]  # the final norm ran in the same call
        residual = None
        profiler, num_repeats = self.profiler, self.layer_forward_round - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if profiler is not None:
                profiler.layer = index
            for _ in range(num_repeats):
                layer(hidden, residual, cos, sin, kv_cache, meta)
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if profiler is not None:
            profiler.layer = None
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, self.norm_weight, self.eps)
        return hidden

    def _decode_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers and the final norm in one backend call when the backend fuses them (``ops.decode_layers``;
        on the CPU one native call, ``decode_layers`` in kernels/cpu/decode_layers.cpp) and the step is plain decode
        (one token per sequence, one block pool, no tensor parallelism, no repeated layers): ``(the normed hidden
        states, the residual stream)``; None otherwise, or where the backend declines the step, and ``forward``
        runs the layer loop. The ``DecodeLayers`` handed over is made once per KV cache, so the backend can keep
        what it derives from it."""
        decode_layers = self.ops.decode_layers
        if (decode_layers is None or self.tp is not None or self.layer_forward_round != 1 or meta.swa is not None
                or meta.num_decodes != hidden.shape[0] or meta.num_seqs != hidden.shape[0]):
            return None
        key = tuple(k.data_ptr() for k, _ in kv_caches)
        if self._decode_layers_of is None or self._decode_layers_of[0] != key:
            shape = self.shape
            layers = tuple(layer.decode_weights(kv) for layer, kv in zip(self.layers, kv_caches, strict=True))
            self._decode_layers_of = (key, DecodeLayers(layers, shape.hidden_size, shape.num_heads,
                                                        shape.num_kv_heads, shape.head_dim, shape.intermediate_size,
                                                        self.eps, shape.head_dim**-0.5, self.norm_weight))
        return decode_layers(self._decode_layers_of[1], hidden, cos, sin, meta)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(self.ops.embedding, input_ids, self.embed_weight, self.vocab_start,
                                        self.num_vocab_rows, self.all_reduce)

    def compute_greedy(self, hidden: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """The fused lm_head and greedy pick (the native CPU kernels); not when the vocabulary is split across
        tensor-parallel ranks, whose logits are gathered first."""
        if self.ops.lm_head_greedy is None or self.all_gather is not None:
            return None
        return self.ops.lm_head_greedy(hidden, self.lm_head_weight, self.shape.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gathered_logits(self.ops.lm_head, hidden, self.lm_head_weight, self.shape.vocab_size, self.all_gather)
