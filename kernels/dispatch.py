"""The one place that picks kernel implementations per device.

Models hold the ``KernelOps`` returned by ``get_ops(device)`` and call ops only through it: CUDA gets the Triton
kernels (``kernels/triton``), an Ascend NPU torch-npu's fused operators (``kernels/npu.py``), the CPU native C
kernels (``kernels/cpu``), falling back to the torch reference path when no compiler is there to build them.

Every op of a forward pass has a field named after its role (the projections too, although each is a plain
``F.linear`` today), so perf mode can time each role by swapping in ``ops.timed(timer)``: the plain ops stay raw
functions, and with profiling off the model pays nothing for the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F

from . import activation, attention, norm, rotary


class OpTimer(Protocol):
    """What ``KernelOps.timed`` needs: a wrapper that times every call of ``fn`` under the operator ``name``."""

    def wrap(self, name: str, fn: Callable) -> Callable: ...


@attrs.frozen
class KernelOps:
    """A consistent set of op implementations (signatures as in the torch modules of this package)."""

    name: str
    rms_norm: Callable = attrs.field(repr=False)
    fused_add_rms_norm: Callable = attrs.field(repr=False)
    silu_and_mul: Callable = attrs.field(repr=False)
    rotary_cos_sin: Callable = attrs.field(repr=False)
    apply_rotary: Callable = attrs.field(repr=False)
    store_kv_cache: Callable = attrs.field(repr=False)
    paged_attention: Callable = attrs.field(repr=False)
    # The decode and prefill halves of ``paged_attention`` when it is their composition (as the reference is):
    # a timed copy then times them apart. None for a fused kernel, which is timed as one call.
    paged_decode_attention: Callable | None = attrs.field(repr=False, default=None)
    paged_prefill_attention: Callable | None = attrs.field(repr=False, default=None)
    # A fused kernel's work after the store, ``(query, k_cache, v_cache, meta, scale, sliding_window)``, where the
    # backend has it apart (Triton): a timed copy then times ``kv_cache_store`` and the attention separately.
    attend_cached: Callable | None = attrs.field(repr=False, default=None)
    # Projections by role: ``(x, weight, bias=None)``; ``embedding`` is ``(ids, weight)``.
    embedding: Callable = attrs.field(repr=False, default=F.embedding)
    qkv_proj: Callable = attrs.field(repr=False, default=F.linear)
    o_proj: Callable = attrs.field(repr=False, default=F.linear)
    mlp_gate_up: Callable = attrs.field(repr=False, default=F.linear)
    mlp_down: Callable = attrs.field(repr=False, default=F.linear)
    lm_head: Callable = attrs.field(repr=False, default=F.linear)
    # All decoder layers of an all-decode step in one call, where a backend fuses them (the native CPU kernels):
    # ``(kernels.cpu.ops.DecodeLayers, hidden, cos, sin, meta) -> (hidden, residual) | None`` (None: not this
    # step; run the layers one by one). A timed copy drops it, so perf mode times every op.
    decode_layers: Callable | None = attrs.field(repr=False, default=None)
    # The KV cache layout these kernels read fastest: head-major blocks (see ``KVCache``) or slot-major. Every op
    # takes either; the engine allocates this one.
    kv_head_major: bool = False
    # ``(weights [N, K] ...) -> what the projections (and ``embedding``) take, one per weight``: a backend's
    # preferred layout, made once after loading (the native CPU matmul's packed panels, back to back in the order
    # given). None: the projections take the tensors as they are.
    pack_weights: Callable | None = attrs.field(repr=False, default=None)
    # Greedy rows' tokens and log-probabilities without a full log_softmax, where a backend has it:
    # ``(float32 logits [N, V]) -> (token ids, logprobs) | None`` (None: not these logits). The sampler's fast path.
    greedy_logprobs: Callable | None = attrs.field(repr=False, default=None)
    # The same from the lm_head directly, without the logits, where a backend fuses the two:
    # ``(hidden [N, H], lm_head weight, vocab_size) -> (token ids, logprobs) | None`` (None: not this call). A timed
    # copy drops it, so perf mode times the lm_head as its own op.
    lm_head_greedy: Callable | None = attrs.field(repr=False, default=None)

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


def _timed_fused_attention(timer: OpTimer, attention_fn: Callable, store: Callable | None = None) -> Callable:
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
    """CUDA → Triton kernels (when triton is installed), NPU → torch-npu's fused ops, CPU → native C kernels (when
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
