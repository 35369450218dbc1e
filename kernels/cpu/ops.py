"""The native CPU kernels behind the torch reference signatures, so ``KernelOps`` can swap them in.

The kernels are torch operators (``torch.ops.ksana``, see ``registration.cpp``), which check their arguments and
raise on what they cannot take. Each wrapper here checks what the kernels take (a supported dtype, unit stride in
the last dimension, head rows ``head_dim`` apart) first and otherwise returns the torch reference's result, so
callers never have to care.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

import attrs
import torch
import torch.nn.functional as F

from .. import activation, attention, norm, rotary
from ..attention_metadata import AttentionMetadata
from ..dispatch import DecodeLayers, DecodeLayerWeights
from .build import DTYPES
from .huge_pages import huge_page_empty
from .packed import PANEL, PackedWeight, packed_numel

# Fewer rows keep the logits path: the fused kernel works on 16 rows at once whatever their number, so at a few rows
# its lm_head costs more than the sampling it saves (tools/decode_phases.py times the lm_head after the fused step).
FUSED_GREEDY_MIN_ROWS = 8
# Lookups of up to this many ids from a packed embedding run natively, one thread (a decode step's batch); a
# prefill's go through torch's indexing.
NATIVE_EMBEDDING_MAX_ROWS = 64
# From this many rows a bfloat16 matmul over a packed weight goes to torch's oneDNN matmul where the CPU has AMX:
# its tiles run bfloat16 several times faster than the native kernel, which widens to float32. The panels are first
# unpacked into a scratch [K, N] matrix, about one read and write of the weight, which 32 rows repay
# (bench/kernel_ops.py).
AMX_MIN_ROWS = 32
# Queries per SDPA call of a bfloat16 prefill on AMX CPUs (elsewhere ``attention.PREFILL_QUERY_CHUNK``): there
# torch's flash attention runs bfloat16 on AMX tiles, which longer chunks keep busier than the masked work they add
# costs, with or without a cached prefix.
AMX_PREFILL_QUERY_CHUNK = 256


# The same route on AMD CPUs with AVX512_BF16 (Zen 4 and later) from this many rows: oneDNN's ``vdpbf16ps`` matmuls
# outrun the native kernel enough to repay the unpacking for every projection from 128 rows, not yet for all at 64
# (bench/kernel_ops.py). Not on Intel's AVX-512 CPUs without AMX, where the native kernel is the faster of the
# two.
AVX512_BF16_MIN_ROWS = 128


# The AVX-512 packed linear's tiles of fewer input rows than this leave their weight streams to the hardware
# prefetchers on AMD CPUs, which stream the panels faster alone at batches 1-4 and need the software prefetches
# from batch 8 (tools/decode_ab.py, same bits either way). Intel CPUs keep them at every row count. AVX2 builds
# have their own tiles, which this does not touch.
AMD_PACKED_PREFETCH_MIN_ROWS = 5


def packed_prefetch_min_rows() -> int:
    """From how many input rows the packed linear's tiles prefetch their weights in software on this CPU."""
    return AMD_PACKED_PREFETCH_MIN_ROWS if _cpu_vendor() == "AuthenticAMD" else 1


def amx_bf16_available() -> bool:
    """Whether this CPU (and OS) runs AMX bfloat16 tiles, which torch's oneDNN matmuls then use."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe() and torch.backends.mkldnn.is_available())


def amd_avx512_bf16_available() -> bool:
    """Whether this is an AMD CPU whose AVX512_BF16 instructions torch's oneDNN matmuls use (Zen 4 and later)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe is not None and probe() and torch.backends.mkldnn.is_available()
                and _cpu_vendor() == "AuthenticAMD")


def bf16_onednn_min_rows() -> int | None:
    """From how many rows a bfloat16 matmul over a packed weight is faster through oneDNN on this CPU; None: never."""
    if amx_bf16_available():
        return AMX_MIN_ROWS
    return AVX512_BF16_MIN_ROWS if amd_avx512_bf16_available() else None


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


class NativeCPUOps:
    """The operators of one loaded library; methods mirror the torch reference functions."""

    def __init__(self, library, bf16_blas_min_rows: int | None = None,
                 bf16_prefill_query_chunk: int | None = None, prefetch_min_rows: int | None = None) -> None:
        """``bf16_blas_min_rows``: bfloat16 matmuls over packed weights with at least this many rows go to torch's
        matmul (``cpu_ops`` sets ``bf16_onednn_min_rows()``); None: never. ``bf16_prefill_query_chunk``: the
        queries per SDPA call of a bfloat16 prefill (``cpu_ops`` sets ``AMX_PREFILL_QUERY_CHUNK`` on AMX CPUs);
        None: the reference's. ``prefetch_min_rows``: from how many input rows the packed linear prefetches
        its weights in software, set in the library, so for every user of it in this process; None: this CPU's
        (``packed_prefetch_min_rows()``). ``library``: ``torch.ops.ksana`` (``load_library``), or another build's
        namespace."""
        self.library = library
        self.has_linear = bool(library.linear_available())
        rows = packed_prefetch_min_rows() if prefetch_min_rows is None else prefetch_min_rows
        library.set_packed_prefetch_min_rows(rows)
        self.bf16_blas_min_rows = bf16_blas_min_rows if self.has_linear else None
        self.bf16_prefill_query_chunk = bf16_prefill_query_chunk
        self._scratch = threading.local()  # each thread's unpacked weight (the worker's, perf mode's)
        self.has_prefill_attention = bool(library.prefill_attention_available())
        # The address table, windows and cache layout of the last ``DecodeLayers`` seen: a model passes the same
        # one each step (a new KV cache makes a new one).
        self._table_of: tuple[weakref.ref, torch.Tensor, torch.Tensor, tuple[int, int]] | None = None

    def decode_layers(self, model: DecodeLayers, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer of an all-decode step in one native call (see decode_layers.cpp):
        ``(hidden, residual)`` as the layer loop leaves them (with ``model.final_norm``, ``hidden`` is that norm of
        their sum and ``residual`` the sum), or None when the step is not one it takes (weights not packed, an
        unsupported dtype or layout), and the caller runs the loop."""
        rows = hidden.shape[0]
        if not (self.has_linear and rows > 0 and hidden.dtype in DTYPES
                and hidden.is_contiguous() and cos.dtype == sin.dtype == hidden.dtype and cos.is_contiguous()
                and sin.is_contiguous() and meta.block_tables.stride(-1) == 1 and meta.seq_lens.is_contiguous()
                and meta.slot_mapping.is_contiguous()
                and meta.block_tables.dtype == meta.seq_lens.dtype == meta.slot_mapping.dtype == torch.int64
                and (model.final_norm is None or _rows_ok(hidden, model.final_norm))):
            return None
        layers = model.layers
        if self._table_of is None or self._table_of[0]() is not model:
            layout = _cache_layout(layers[0].k_cache, layers[0].v_cache)
            if layout is None or not all(_decode_layer_ok(layer, hidden.dtype, layout) for layer in layers):
                return None
            table = torch.tensor([a for layer in layers for a in _addresses(layer)], dtype=torch.int64)
            windows = torch.tensor([layer.sliding_window or 0 for layer in layers], dtype=torch.int64)
            self._table_of = (weakref.ref(model), table, windows, layout)
        _, table, windows, layout = self._table_of
        hidden = hidden.clone()  # overwritten in place: the embedding's output may be someone else's
        residual = torch.empty_like(hidden)
        self.library.decode_layers(
            table, windows, hidden, residual, model.num_heads, model.num_kv_heads, model.head_dim,
            model.intermediate_size, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.block_size,
            *layout, model.eps, model.scale, model.final_norm)
        return hidden, residual

    def greedy_logprobs(self, logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Each row's argmax and log_softmax at it, without the [rows, vocab] log_softmax (float32 rows, as the
        sampler has them; None otherwise)."""
        if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()
                and logits.device.type == "cpu"):
            return None
        ids, logprobs = self.library.greedy_logprobs(logits)
        return ids.tolist(), logprobs.tolist()

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor | PackedWeight:
        """``weight [N, K]`` as ``linear`` runs it fastest: packed panels on AVX2 and AVX-512 CPUs for the native
        dtypes, else the tensor itself (which ``linear`` hands to BLAS)."""
        return next(self.pack_weights([weight]))

    def pack_weights(self, weights: list[torch.Tensor | None]) -> Iterator[torch.Tensor | PackedWeight]:
        """``pack_weight`` of each, in order, with the packed ones back to back in one buffer per dtype.

        A model passes its weights in the order a decode step reads them, so the end of one projection's panels
        runs straight into the next one's: one stream for the hardware prefetcher, where separate allocations
        restart it at every call. The buffers ask for huge pages (see ``kernels/cpu/huge_pages.py``).
        Each result is yielded as soon as it is packed and ``weights[i]`` is read only then, so a caller that
        swaps it in and sets ``weights[i] = None`` frees each original before the next is packed: the buffer's
        pages are touched one weight at a time, and the peak stays near one copy of the weights."""
        shapes = [(w.dtype, tuple(w.shape)) if self._packable(w) else None for w in weights]
        sizes: dict[torch.dtype, int] = {}
        for dtype, (out_features, in_features) in filter(None, shapes):
            sizes[dtype] = sizes.get(dtype, 0) + packed_numel(out_features, in_features)
        buffers = {dtype: huge_page_empty((size,), dtype) for dtype, size in sizes.items()}
        offsets = dict.fromkeys(buffers, 0)
        for i, shape in enumerate(shapes):
            weight = weights[i]
            if shape is None:
                yield weight
                continue
            dtype, (out_features, in_features) = shape
            start, size = offsets[dtype], packed_numel(out_features, in_features)
            offsets[dtype] = start + size
            packed = buffers[dtype][start:start + size].view(-1, in_features, PANEL)
            weight = weight.contiguous()
            self.library.pack_weight(weight, packed)
            del weight
            yield PackedWeight(packed, out_features, in_features)

    def _packable(self, weight: torch.Tensor) -> bool:
        return (self.has_linear and weight.dim() == 2 and weight.dtype in DTYPES
                and weight.device.type == "cpu" and weight.numel() > 0)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` over a packed weight (the native matmul, any number of rows); BLAS for a plain one."""
        if not isinstance(weight, PackedWeight):
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if not (rows.dtype == weight.dtype and rows.stride(-1) == 1 and rows.shape[-1] == weight.in_features
                and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))):
            return F.linear(x, weight.dense(), bias)
        if self.bf16_blas_min_rows is not None and rows.dtype == torch.bfloat16 and (
                rows.shape[0] >= self.bf16_blas_min_rows):
            return self._blas_linear(rows, weight, bias).view(*x.shape[:-1], weight.out_features)
        out = self.library.packed_linear(rows, weight.packed, bias, weight.out_features)
        return out.view(*x.shape[:-1], weight.out_features)

    def _blas_linear(self, rows: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``rows @ weight.T (+ bias)`` through torch's matmul, from the panels unpacked into this thread's scratch
        matrix (kept between calls: a fresh one would fault in its pages every time). The scratch grows to the
        largest weight routed here, the lm_head's once a step brings it 32 rows (56 MB for smollm2)."""
        panels, in_features = weight.packed.shape[0], weight.in_features
        size = panels * PANEL * in_features
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.dtype != rows.dtype or scratch.numel() < size:
            scratch = self._scratch.buffer = torch.empty(size, dtype=rows.dtype)
        unpacked = scratch[:size].view(in_features, panels * PANEL)
        self.library.unpack_weight(weight.packed, unpacked)
        transposed = unpacked[:, : weight.out_features]
        return torch.mm(rows, transposed) if bias is None else torch.addmm(bias, rows, transposed)

    def lm_head_greedy(self, hidden: torch.Tensor, weight: torch.Tensor | PackedWeight, vocab_size: int,
                       min_rows: int = FUSED_GREEDY_MIN_ROWS) -> tuple[list[int], list[float]] | None:
        """Greedy decoding's token and log-probability per row of ``hidden @ weight.T`` over the first
        ``vocab_size`` columns, without the logits: what ``greedy_logprobs`` gives on ``linear``'s output, to float32
        rounding in the log-probability (see ``linear_greedy`` in packed_linear.cpp). None where it does not apply
        (a plain weight, fewer than ``min_rows`` rows, a layout the native matmul does not take)."""
        if not (isinstance(weight, PackedWeight) and hidden.dim() == 2 and max(min_rows, 1) <= hidden.shape[0]
                and hidden.dtype == weight.dtype and hidden.dtype in DTYPES and hidden.stride(-1) == 1
                and hidden.shape[-1] == weight.in_features and 0 < vocab_size <= weight.out_features):
            return None
        ids, logprobs = self.library.packed_linear_greedy(hidden, weight.packed, weight.out_features, vocab_size)
        return ids.tolist(), logprobs.tolist()

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
        """``F.embedding``; a packed table (tied to the head) is gathered from its panels: a decode step's few
        rows natively (one call, where torch's indexing takes three ops), more
        (a prefill) or an id out of range by ``PackedWeight.rows``."""
        if not isinstance(weight, PackedWeight):
            return F.embedding(ids, weight)
        n = ids.numel()
        if (ids.dim() != 1 or ids.dtype != torch.int64 or not ids.is_contiguous()
                or n > NATIVE_EMBEDDING_MAX_ROWS):
            return weight.rows(ids)
        try:
            return self.library.packed_rows(weight.packed, weight.out_features, ids)
        except IndexError:  # an id outside [0, out_features): as the indexing treats it
            return weight.rows(ids)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _rows_ok(x, weight):
            return norm.rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        return self.library.rms_norm(rows, weight, eps).view(x.shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_rows_ok(x, weight) and residual.is_contiguous() and residual.shape == x.shape
                and residual.dtype == x.dtype):
            return norm.fused_add_rms_norm(x, residual, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        out, new_residual = self.library.fused_add_rms_norm(rows, residual.view(rows.shape), weight, eps)
        return out.view(x.shape), new_residual.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPES or x.stride(-1) != 1:
            return activation.silu_and_mul(x)
        rows = x.reshape(-1, x.shape[-1])
        return self.library.silu_and_mul(rows).view(*x.shape[:-1], rows.shape[1] // 2)

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox: bool = True) -> torch.Tensor:
        if not (is_neox and _heads_ok(x) and cos.dtype == sin.dtype == x.dtype and cos.is_contiguous()
                and sin.is_contiguous()):
            return rotary.apply_rotary(x, cos, sin, is_neox)
        return self.library.rotary_neox(x, cos, sin)

    def store_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        layout = _cache_layout(k_cache, v_cache)
        if not (_heads_ok(key) and _heads_ok(value) and key.dtype == value.dtype == k_cache.dtype
                and layout is not None and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            return attention.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        self.library.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return None

    def paged_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
        layout = _cache_layout(k_cache, v_cache)
        if not (_heads_ok(query) and query.dtype == k_cache.dtype and layout is not None
                and block_tables.dtype == seq_lens.dtype == torch.int64 and block_tables.stride(-1) == 1
                and seq_lens.is_contiguous()):
            return attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                    sliding_window, max_seq_len)
        return self.library.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0)

    def paged_prefill_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """``attention.paged_prefill_attention`` in float32 on AVX2 CPUs (``prefill_attention`` in
        attention_prefill.cpp reads every key, the new ones too, from the cache, where the store already put them);
        the reference otherwise, bfloat16 in ``bf16_prefill_query_chunk`` queries a call where that is set."""
        layout = _cache_layout(k_cache, v_cache)
        q_len, num_heads, head_dim = query.shape
        if not (self.has_prefill_attention and query.dtype == k_cache.dtype == torch.float32
                and _heads_ok(query) and layout is not None and head_dim % 8 == 0 and q_len > 0
                and block_table.dtype == torch.int64 and block_table.is_contiguous()):
            chunk = self.bf16_prefill_query_chunk if query.dtype == torch.bfloat16 else None
            return attention.paged_prefill_attention(query, key, value, k_cache, v_cache, block_table, seq_len,
                                                     scale, sliding_window, query_chunk=chunk)
        return self.library.prefill_attention(query, k_cache, v_cache, block_table, seq_len, scale,
                                              sliding_window or 0)


def _addresses(layer: DecodeLayerWeights) -> list[int]:
    """The layer's tensors' addresses in the C table's order (0 for a missing bias)."""
    tensors = attrs.astuple(layer, recurse=False)[:-1]
    return [0 if t is None else _storage(t).data_ptr() for t in tensors]


def _decode_layer_ok(layer: DecodeLayerWeights, dtype: torch.dtype, layout: tuple[int, int]) -> bool:
    """Packed projections, contiguous weights of ``dtype``, and caches of the first layer's layout (the C table
    has one layout for all)."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    weights = [_storage(t) for t in attrs.astuple(layer, recurse=False)[:-3] if t is not None]
    return (all(isinstance(p, PackedWeight) for p in projections)
            and all(t.dtype == dtype and t.is_contiguous() for t in weights)
            and layer.k_cache.dtype == layer.v_cache.dtype == dtype
            and _cache_layout(layer.k_cache, layer.v_cache) == layout)


def _cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int] | None:
    """``(slot_stride, head_stride)`` of a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache pair the C
    code can index: blocks contiguous and back to back, each slot-major (``(heads * dim, dim)``) or head-major
    (``(dim, block_size * dim)``, see ``KVCache``), and both caches alike; None otherwise."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        return None
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_stride, slot_stride, head_stride, dim_stride = k_cache.stride()
    layouts = ((num_kv_heads * head_dim, head_dim), (head_dim, block_size * head_dim))
    if dim_stride != 1 or block_stride != block_size * num_kv_heads * head_dim:
        return None
    return (slot_stride, head_stride) if (slot_stride, head_stride) in layouts else None


def _storage(t: torch.Tensor | PackedWeight) -> torch.Tensor:
    return t.packed if isinstance(t, PackedWeight) else t


def _rows_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A row-wise op can run natively: supported dtype, the weight's too, and contiguous rows."""
    return (x.dtype in DTYPES and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
            and (x.dim() == 1 or x.dim() == 2 or x.is_contiguous()))


def _heads_ok(x: torch.Tensor) -> bool:
    """``[T, heads, head_dim]`` with each token's heads packed (the C code steps tokens by ``stride(0)``)."""
    return x.dim() == 3 and x.dtype in DTYPES and x.stride(2) == 1 and x.stride(1) == x.shape[2]
