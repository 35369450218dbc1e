"""The dimensions of a model that the rest of the engine sizes things by (KV cache, perf models).

A multi-head latent attention model (DeepSeek-V3: ``kv_lora_rank > 0``) caches one latent "head" per token
instead of per-head keys and values: the K cache holds the normed latent (``kv_lora_rank`` wide) and the V cache
the rotated decoupled key (``qk_rope_head_dim`` wide), one head each (``kv_cache_heads``, ``k_cache_dim``,
``v_cache_dim``). Its ``num_kv_heads`` is 1 and ``head_dim`` the query/key head size
(``qk_nope_head_dim + qk_rope_head_dim``), so the perf tools' per-head formulas stay defined.

``num_mtp_layers``: the multi-token-prediction modules the model carries beyond ``num_layers`` (DeepSeek's
next-n layers); each gets a KV cache layer of the same layout when the engine asks for them
(``KVCache.allocate(..., extra_layers=shape.num_mtp_layers)``).

``moe_intermediate_size`` and ``first_k_dense_replace``: a mixture-of-experts model's expert size and where its
MoE layers start (the dense ones before use ``intermediate_size``); tensor parallelism splits both sizes.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class ModelShape:
    """Sizes of a decoder-only model; ``sliding_windows[i]`` is layer i's window (None: full attention)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_windows: list[int | None]
    eos_token_ids: list[int]
    dtype: torch.dtype
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (see the module docstring)
    qk_rope_head_dim: int = 0
    num_mtp_layers: int = 0
    moe_intermediate_size: int = 0  # > 0: a mixture of experts (DeepSeek-V3), each routed expert's MLP size
    first_k_dense_replace: int = 0  # with experts: the layers before this one have a dense MLP (intermediate_size)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer has a dense MLP of ``intermediate_size`` (every layer of a model without experts)."""
        return not self.moe_intermediate_size or self.first_k_dense_replace > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_cache_heads(self) -> int:
        """Heads per token in each layer's K and V cache."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def k_cache_dim(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.head_dim

    @property
    def v_cache_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @classmethod
    def from_hf_config(
        cls, config: Any, dtype: torch.dtype, eos_token_ids: list[int] | None = None
    ) -> ModelShape:
        """Read a ``transformers`` config (llama, qwen2, mistral-style field names; DeepSeek-V3's MLA fields)."""
        num_heads = config.num_attention_heads
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(getattr(config, "eos_token_id", None))
        if getattr(config, "kv_lora_rank", None):
            return cls._from_mla_config(config, dtype, eos_token_ids)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            sliding_windows=sliding_windows_from_hf_config(config),
            eos_token_ids=eos_token_ids,
            dtype=dtype,
        )


    @classmethod
    def _from_mla_config(cls, config: Any, dtype: torch.dtype, eos_token_ids: list[int]) -> ModelShape:
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=1,
            head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            sliding_windows=[None] * config.num_hidden_layers,
            eos_token_ids=eos_token_ids,
            dtype=dtype,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim,
            num_mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            first_k_dense_replace=int(getattr(config, "first_k_dense_replace", 0) or 0),
        )


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def sliding_windows_from_hf_config(config: Any) -> list[int | None]:
    """Per-layer windows as ``transformers`` applies them.

    ``layer_types`` wins when present (Qwen2 in transformers 5 derives it from ``use_sliding_window`` and
    ``max_window_layers``; a "sliding_attention" layer uses ``sliding_window``, which Qwen2Config nulls when
    ``use_sliding_window`` is off). Without it: Qwen2 (older transformers) slides layers ``>= max_window_layers``
    when ``use_sliding_window``; Mistral-style configs slide every layer when ``sliding_window`` is set.
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
        return [window if t == "sliding_attention" else None for t in layer_types]
    if window is None:
        return [None] * num_layers
    if config.model_type == "qwen2":
        if not getattr(config, "use_sliding_window", False):
            return [None] * num_layers
        first = getattr(config, "max_window_layers", 0)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers
