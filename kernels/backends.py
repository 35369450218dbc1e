"""Builders for the non-reference ``KernelOps`` sets: Triton (CUDA) and torch-npu (Ascend).

Kept apart from ``kernels.dispatch`` so that importing the dispatch layer never imports ``triton`` or
``torch_npu``: each builder imports its backend only when first called, and caches the result.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

from . import attention, rotary
from .dispatch import KernelOps


@functools.cache
def is_triton_available() -> bool:
    """``triton`` is installed (it is not on every platform; without it CUDA uses the torch path)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_ops() -> KernelOps:
    """Triton kernels for every op except ``rotary_cos_sin`` (computed once per forward pass, left to torch).

    ``paged_attention`` is one store, one decode and one variable-length prefill launch, not the reference's
    per-sequence composition, so its halves are left unset: a timed copy (``KernelOps.timed``) times the
    launches that really run, as one call.
    """
    from .triton import activation, cache, norm
    from .triton import attention as triton_attention
    from .triton import rotary as triton_rotary

    return KernelOps(
        name="triton",
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        rotary_cos_sin=rotary.rotary_cos_sin,
        apply_rotary=triton_rotary.apply_rotary,
        store_kv_cache=cache.store_kv_cache,
        paged_attention=triton_attention.paged_attention,
        attend_cached=triton_attention.attend_cached,
    )


@functools.cache
def npu_ops() -> KernelOps:
    """torch-npu's fused norm, rotary and SwiGLU; the reference for the rest (see ``kernels.npu``)."""
    from . import npu

    return KernelOps(
        name="npu" if npu.torch_npu is not None else "npu-reference",
        rms_norm=npu.rms_norm,
        fused_add_rms_norm=npu.fused_add_rms_norm,
        silu_and_mul=npu.silu_and_mul,
        rotary_cos_sin=rotary.rotary_cos_sin,
        apply_rotary=npu.apply_rotary,
        store_kv_cache=attention.store_kv_cache,
        paged_attention=attention.paged_attention,
        paged_decode_attention=attention.paged_decode_attention,
        paged_prefill_attention=attention.paged_prefill_attention,
    )


@functools.cache
def cpu_ops() -> KernelOps:
    """The native CPU kernels (``kernels/cpu``) for everything but ``rotary_cos_sin``; the projections over packed
    weights, all layers of a decode step in one call, and float32 prefill attention only on AVX2 and AVX-512 CPUs
    (BLAS and SDPA otherwise; bfloat16 projections of many rows go to oneDNN where the CPU has AMX or is an AMD one
    with AVX512_BF16); the torch reference when the library cannot be built (no C compiler: ``load_library``
    warns once). Attention keeps the reference's store/decode/prefill composition, with native parts, so perf mode
    still times the two halves apart."""
    from .cpu import load_library

    library = load_library()
    if library is None:
        from .dispatch import TORCH_OPS

        return TORCH_OPS
    from .cpu.ops import (
        AMX_PREFILL_QUERY_CHUNK,
        NativeCPUOps,
        amx_bf16_available,
        bf16_onednn_min_rows,
    )

    native = NativeCPUOps(library, bf16_blas_min_rows=bf16_onednn_min_rows(),
                          bf16_prefill_query_chunk=AMX_PREFILL_QUERY_CHUNK if amx_bf16_available() else None)
    projections: dict[str, Callable] = dict.fromkeys(
        ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down", "lm_head"), native.linear
    )
    projections |= {"decode_layers": native.decode_layers, "pack_weights": native.pack_weights,
                    "embedding": native.embedding, "lm_head_greedy": native.lm_head_greedy}
    return KernelOps(
        name="cpu-native",
        rms_norm=native.rms_norm,
        fused_add_rms_norm=native.fused_add_rms_norm,
        silu_and_mul=native.silu_and_mul,
        rotary_cos_sin=rotary.rotary_cos_sin,
        apply_rotary=native.apply_rotary,
        store_kv_cache=native.store_kv_cache,
        paged_attention=attention.compose_paged_attention(
            native.store_kv_cache, native.paged_decode_attention, native.paged_prefill_attention
        ),
        paged_decode_attention=native.paged_decode_attention,
        paged_prefill_attention=native.paged_prefill_attention,
        greedy_logprobs=native.greedy_logprobs,
        kv_head_major=True,
        **(projections if native.has_linear else {}),
    )
