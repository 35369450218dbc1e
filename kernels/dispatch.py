"""The one place that picks kernel implementations per device.

Models hold the ``KernelOps`` returned by ``get_ops(device)`` and call ops only through it: CUDA gets the Triton
kernels (``kernels/triton``), an Ascend NPU torch-npu's fused operators (``kernels/npu.py``), the CPU native
C++ kernels (``kernels/cpu``), falling back to the torch reference path when no compiler is there to build them.

Every op of a forward pass has a field named after its role (the projections too, although each is a plain
``F.linear`` on most backends), so perf mode can time each role by swapping in ``ops.timed(timer)``: the plain ops
stay raw functions, and with profiling off the model pays nothing for the hooks.

Besides the per-op fields, a backend may offer whole-model hooks, which this module describes in backend-neutral
types so that models never import a backend: ``pack_weights`` (the projections in the backend's own layout, a
``PackedWeight``), ``decode_layers`` (every decoder layer of an all-decode step in one call, over the model's
``DecodeLayers``) and ``lm_head_greedy``; ``kv_cache_zeros`` allocates the KV cache the way the device's kernels
read it fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Protocol, TypeAlias, TypeVar

import attrs
import torch
import torch.nn.functional as F

from . import activation, attention, norm, rotary
from .attention_metadata import AttentionMetadata
from .cpu.huge_pages import huge_page_zeros
from .cpu.packed import PackedWeight, dense_weight

__all__ = [
    "DecodeLayerWeights",
    "DecodeLayers",
    "KernelOps",
    "OpTimer",
    "PackedWeight",
    "TORCH_OPS",
    "Weight",
    "dense_weight",
    "get_ops",
    "kv_cache_zeros",
]

Tensor: TypeAlias = torch.Tensor
# A projection weight as a model holds it: the checkpoint's ``[out_features, in_features]`` tensor, or the layout
# ``KernelOps.pack_weights`` made of it (the native CPU matmul's panels; ``dense_weight`` gives the tensor back).
Weight: TypeAlias = Tensor | PackedWeight
Greedy: TypeAlias = tuple[list[int], list[float]]  # each row's token id and its log-probability

_Fn = TypeVar("_Fn", bound=Callable)


class OpTimer(Protocol):
    """What ``KernelOps.timed`` needs: a wrapper that times every call of ``fn`` under the operator name ``name``."""

    def wrap(self, name: str, fn: _Fn) -> _Fn: ...


@attrs.frozen
class DecodeLayerWeights:
    """What a fused decode step reads of one decoder layer, in the order of the native table (``decode_layers``
    in ``kernels/cpu/decode_layers.cpp``); biases may be None, and the backend takes only packed projections."""

    input_norm: Tensor
    qkv: Weight
    qkv_bias: Tensor | None
    o: Weight
    o_bias: Tensor | None
    post_attention_norm: Tensor
    gate_up: Weight
    gate_up_bias: Tensor | None
    down: Weight
    down_bias: Tensor | None
    k_cache: Tensor
    v_cache: Tensor
    sliding_window: int | None


@attrs.frozen
class DecodeLayers:
    """A model's layers for ``KernelOps.decode_layers``, with the sizes the fused step needs. The model keeps one
    per KV cache and passes the same object every step, so a backend can cache what it derives from it (the
    native CPU ops keep the address table while the model holds this object)."""

    layers: tuple[DecodeLayerWeights, ...]
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float
    final_norm: Tensor | None = None  # the model's norm after the last layer, applied in the same call


# The ops' signatures (those of the torch reference functions in this package).
RmsNorm: TypeAlias = Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps)
FusedAddRmsNorm: TypeAlias = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # (x, residual, ...)
SiluAndMul: TypeAlias = Callable[[Tensor], Tensor]
RotaryCosSin: TypeAlias = Callable[[Tensor, Tensor, float, torch.dtype], tuple[Tensor, Tensor]]
StoreKVCache: TypeAlias = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]  # (key, value, k, v, slots)
# (query, k_cache, v_cache, meta, scale, sliding_window): attention over what the store put in the caches
AttendCached: TypeAlias = Callable[[Tensor, Tensor, Tensor, AttentionMetadata, float, int | None], Tensor]
Embedding: TypeAlias = Callable[[Tensor, Weight], Tensor]  # (ids, table)
WeightPacker: TypeAlias = Callable[[list[Tensor | None]], Iterator[Weight]]
DecodeLayersFn: TypeAlias = Callable[[DecodeLayers, Tensor, Tensor, Tensor, AttentionMetadata],
                                     tuple[Tensor, Tensor] | None]  # (layers, hidden, cos, sin, meta)
GreedyLogprobs: TypeAlias = Callable[[Tensor], Greedy | None]  # (float32 logits [N, V])
LmHeadGreedy: TypeAlias = Callable[[Tensor, Weight, int], Greedy | None]  # (hidden, lm_head weight, vocab_size)


class ApplyRotary(Protocol):
    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool = True) -> Tensor: ...


class Projection(Protocol):
    def __call__(self, x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor: ...


class PagedAttention(Protocol):
    def __call__(self, query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> Tensor: ...


class PagedDecodeAttention(Protocol):
    def __call__(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 scale: float, sliding_window: int | None = None, max_seq_len: int | None = None) -> Tensor: ...


class PagedPrefillAttention(Protocol):
    def __call__(self, query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 block_table: Tensor, seq_len: int, scale: float, sliding_window: int | None = None) -> Tensor: ...


@attrs.frozen
class KernelOps:
    """A consistent set of op implementations (signatures as in the torch modules of this package)."""

    name: str
    rms_norm: RmsNorm = attrs.field(repr=False)
    fused_add_rms_norm: FusedAddRmsNorm = attrs.field(repr=False)
    silu_and_mul: SiluAndMul = attrs.field(repr=False)
    rotary_cos_sin: RotaryCosSin = attrs.field(repr=False)
    apply_rotary: ApplyRotary = attrs.field(repr=False)
    store_kv_cache: StoreKVCache = attrs.field(repr=False)
    paged_attention: PagedAttention = attrs.field(repr=False)
    # The decode and prefill halves of ``paged_attention`` when it is their composition (as the reference is):
    # a timed copy then times them apart. None for a fused kernel, which is timed as one call.
    paged_decode_attention: PagedDecodeAttention | None = attrs.field(repr=False, default=None)
    paged_prefill_attention: PagedPrefillAttention | None = attrs.field(repr=False, default=None)
    # A fused kernel's work after the store, ``(query, k_cache, v_cache, meta, scale, sliding_window)``, where the
    # backend has it apart (Triton): a timed copy then times ``kv_cache_store`` and the attention separately.
    attend_cached: AttendCached | None = attrs.field(repr=False, default=None)
    # Projections by role: ``(x, weight, bias=None)``; ``embedding`` is ``(ids, weight)``.
    embedding: Embedding = attrs.field(repr=False, default=F.embedding)
    qkv_proj: Projection = attrs.field(repr=False, default=F.linear)
    o_proj: Projection = attrs.field(repr=False, default=F.linear)
    mlp_gate_up: Projection = attrs.field(repr=False, default=F.linear)
    mlp_down: Projection = attrs.field(repr=False, default=F.linear)
    lm_head: Projection = attrs.field(repr=False, default=F.linear)
    # All decoder layers of an all-decode step in one call, where a backend fuses them (the native CPU kernels:
    # ``decode_layers`` in kernels/cpu/decode_layers.cpp): ``(DecodeLayers, hidden, cos, sin, meta) -> (hidden,
    # residual) | None`` (None: not this step; run the layers one by one). A timed copy drops it, so perf mode
    # times every op.
    decode_layers: DecodeLayersFn | None = attrs.field(repr=False, default=None)
    # The KV cache layout these kernels read fastest: head-major blocks (see ``KVCache``) or slot-major. Every op
    # takes either; the engine allocates this one.
    kv_head_major: bool = False
    # ``(weights [N, K] ...) -> what the projections (and ``embedding``) take, one per weight``: a backend's
    # preferred layout, made once after loading (the native CPU matmul's ``PackedWeight`` panels, back to back in
    # the order given; a weight it does not pack comes back as it is). None: the projections take the tensors as
    # they are.
    pack_weights: WeightPacker | None = attrs.field(repr=False, default=None)
    # Greedy rows' tokens and log-probabilities without a full log_softmax, where a backend has it:
    # ``(float32 logits [N, V]) -> (token ids, logprobs) | None`` (None: not these logits). The sampler's fast path.
    greedy_logprobs: GreedyLogprobs | None = attrs.field(repr=False, default=None)
    # The same from the lm_head directly, without the logits, where a backend fuses the two:
    # ``(hidden [N, H], lm_head weight, vocab_size) -> (token ids, logprobs) | None`` (None: not this call). A timed
    # copy drops it, so perf mode times the lm_head as its own op.
    lm_head_greedy: LmHeadGreedy | None = attrs.field(repr=False, default=None)

    def timed(self, timer: OpTimer) -> KernelOps:
        """A copy whose every op is wrapped by ``timer`` under its operator name (see ``OPERATOR_OF_FIELD``).

        When attention is the composition of store, decode and prefill (the reference), the timed copy composes
        the timed parts, so a mixed batch's attention is split into ``attention_decode`` and
        ``attention_prefill``. A fused attention kernel runs unchanged, timed as one call: ``attention_decode``
        for an all-decode step, else ``attention_prefill``; its store apart where the backend gives
        ``attend_cached``.
        """
        decode, prefill = self.paged_decode_attention, self.paged_prefill_attention
        if (decode is None or prefill is None) and self.paged_attention is attention.paged_attention:
            decode, prefill = attention.paged_decode_attention, attention.paged_prefill_attention
        wrapped = {field: timer.wrap(op, getattr(self, field)) for field, op in OPERATOR_OF_FIELD.items()}
        if decode is not None and prefill is not None:
            wrapped["paged_attention"] = attention.compose_paged_attention(
                wrapped["store_kv_cache"],
                timer.wrap("attention_decode", decode),
                timer.wrap("attention_prefill", prefill),
            )
        elif self.attend_cached is not None:
            wrapped["paged_attention"] = _timed_fused_attention(timer, self.attend_cached, wrapped["store_kv_cache"])
        else:
            wrapped["paged_attention"] = _timed_fused_attention(timer, self.paged_attention)
        return attrs.evolve(self, name=f"{self.name}+timed", decode_layers=None, lm_head_greedy=None, **wrapped)


# The operator name each field is timed under; several fields may share one (every norm is "norm").
# Under tensor parallelism an "all_reduce" operator follows o_proj and mlp_down (see ksana/models/parallel.py).
OPERATOR_OF_FIELD: MappingProxyType[str, str] = MappingProxyType(
    {
        "embedding": "embedding",
        "rotary_cos_sin": "rotary",
        "apply_rotary": "rotary",
        "rms_norm": "norm",
        "fused_add_rms_norm": "norm",
        "qkv_proj": "qkv_proj",
        "store_kv_cache": "kv_cache_store",
        "o_proj": "o_proj",
        "mlp_gate_up": "mlp_gate_up",
        "silu_and_mul": "mlp_act",
        "mlp_down": "mlp_down",
        "lm_head": "lm_head",
    }
)


def _timed_fused_attention(timer: OpTimer, attention_fn: PagedAttention | AttendCached,
                           store: StoreKVCache | None = None) -> PagedAttention:
    """A fused kernel timed as one call per step, under the name of the step's kind. With ``store`` (timed),
    ``attention_fn`` is the kernel's ``attend_cached`` and the store runs first; else it is the whole kernel."""
    as_decode = timer.wrap("attention_decode", attention_fn)
    as_prefill = timer.wrap("attention_prefill", attention_fn)

    def timed_paged_attention(query, key, value, k_cache, v_cache, meta, scale, sliding_window=None):
        fn = as_decode if meta.num_decodes == meta.num_seqs else as_prefill
        if store is None:
            return fn(query, key, value, k_cache, v_cache, meta, scale, sliding_window)
        store(key, value, k_cache, v_cache, meta.slot_mapping)
        return fn(query, k_cache, v_cache, meta, scale, sliding_window)

    return timed_paged_attention


TORCH_OPS = KernelOps(
    name="torch",
    rms_norm=norm.rms_norm,
    fused_add_rms_norm=norm.fused_add_rms_norm,
    silu_and_mul=activation.silu_and_mul,
    rotary_cos_sin=rotary.rotary_cos_sin,
    apply_rotary=rotary.apply_rotary,
    store_kv_cache=attention.store_kv_cache,
    paged_attention=attention.paged_attention,
    paged_decode_attention=attention.paged_decode_attention,
    paged_prefill_attention=attention.paged_prefill_attention,
)


def get_ops(device: str | torch.device) -> KernelOps:
    """CUDA → Triton kernels (when triton is installed), NPU → torch-npu's fused ops, CPU → native C++ kernels (when
    they build), anything else → torch."""
    from . import backends  # lazy: backends imports this module; triton/torch_npu load only on demand

    device_type = torch.device(device).type
    if device_type == "cuda" and backends.is_triton_available():
        return backends.triton_ops()
    if device_type == "npu":
        return backends.npu_ops()
    if device_type == "cpu":
        return backends.cpu_ops()
    return TORCH_OPS


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> Tensor:
    """A zero-filled KV cache tensor, allocated the way the device's kernels read it fastest: on the CPU on its
    own huge-page mapping (``kernels/cpu/huge_pages.py``: every decode step streams the cache), elsewhere
    ``torch.zeros``."""
    return huge_page_zeros(shape, dtype, device)
