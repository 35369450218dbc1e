// The CPU kernels as typed torch operators: each schema below is checked at the call (dtypes, devices, shapes),
// the operators show in the torch profiler under their own names, and Python's fake implementations
// (kernels/cpu/fakes.py) let torch.compile trace them.
//
// The kernels themselves (the C++ families) compile per instruction set and link into the same library; this file
// holds only the checks and the calls, so it builds once for every level (kernels/cpu/build.py).
// The namespace is ksana, or the KSANA_OPS_NAMESPACE environment variable's value when the library loads: the A/B
// tools load other builds beside the engine's under other names, from the same compiled registration.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

// ---- The kernels' C entry points (one family a file). Every dtype pair shares one signature; T* travels as
// void*. ----------------------------------------------------------------------------------------------------------
extern "C" {
#define KSANA_BOTH(ret, name, ...) ret name##_f32(__VA_ARGS__); ret name##_bf16(__VA_ARGS__);
KSANA_BOTH(void, rms_norm, const void *x, int64_t x_stride, const void *add, void *residual_out, const void *w,
           void *out, int64_t rows, int64_t dim, float eps, int nthreads)
KSANA_BOTH(void, rotary_neox, const void *x, int64_t tok_stride, const void *cos, const void *sin, void *out,
           int64_t ntok, int64_t nheads, int64_t dim, int nthreads)
KSANA_BOTH(void, silu_and_mul, const void *x, int64_t x_stride, void *out, int64_t rows, int64_t d, int nthreads)
KSANA_BOTH(void, store_kv, const void *key, int64_t key_stride, const void *value, int64_t value_stride,
           void *k_cache, void *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim,
           int64_t block_size, int64_t slot_stride, int64_t head_stride)
KSANA_BOTH(void, paged_decode, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
           const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, void *out, int64_t batch,
           int64_t nheads, int64_t nkv, int64_t dim, int64_t block_size, int64_t slot_stride, int64_t head_stride,
           float scale, int64_t window, int nthreads)
KSANA_BOTH(void, pack_weight, const void *w, int64_t n, int64_t k, void *packed, int nthreads)
KSANA_BOTH(void, unpack_weight, const void *packed, int64_t panels, int64_t k, void *out, int nthreads)
KSANA_BOTH(int, packed_rows, const void *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out)
KSANA_BOTH(void, packed_linear, const void *x, int64_t x_stride, const void *w, const void *bias, void *out,
           int64_t m, int64_t n, int64_t k, int nthreads)
KSANA_BOTH(void, packed_linear_greedy, const void *x, int64_t x_stride, const void *w, int64_t m, int64_t n,
           int64_t k, int64_t vocab, int64_t *ids, float *logprobs, int nthreads)
KSANA_BOTH(void, decode_layers, const int64_t *table, const int64_t *windows, int64_t nlayers, void *h,
           void *residual, int64_t m, int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter,
           const void *cos, const void *sin, const int64_t *slots, const int64_t *block_tables,
           int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t slot_stride,
           int64_t head_stride, float eps, float scale, int nthreads, const void *final_norm)
#undef KSANA_BOTH
void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs, int nthreads);
void prefill_attention_f32(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *table, int64_t q_len, int64_t seq_len, int64_t nheads, int64_t nkv,
                           int64_t dim, int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale,
                           int64_t window, void *out, int nthreads);
int linear_available(void);
int prefill_attention_available(void);
int wide_lanes(void);
int set_packed_prefetch_min_rows(int rows);
// Only the build tools/decode_phases.py makes (-DKSANA_PHASE_CLOCK) defines these.
int decode_phase_count(void) __attribute__((weak));
void decode_phase_clock(double *out, int threads) __attribute__((weak));
}

namespace {

using at::Tensor;

bool is_bf16(const Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), "ksana: ", name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "ksana: ", name,
                " must be float32 or bfloat16, got ", t.scalar_type());
    return t.scalar_type() == at::kBFloat16;
}

template <typename Fn>
Fn pick(const Tensor &t, const char *name, Fn f32, Fn bf16) {
    return is_bf16(t, name) ? bf16 : f32;
}

void check_like(const Tensor &t, const Tensor &like, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == like.scalar_type(), "ksana: ", name, " must be a CPU ",
                like.scalar_type(), " tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_ids(const Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong, "ksana: ", name, " must be a CPU int64 tensor");
    TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, "ksana: ", name, " must be contiguous in its last dimension");
}

void check_rows(const Tensor &x, const char *name) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "ksana: ", name, " must be 2-D rows of unit stride, got sizes ",
                x.sizes(), " strides ", x.strides());
}

// [tokens, heads, head_dim] with each token's heads packed (tokens may be `stride(0)` apart).
void check_heads(const Tensor &x, const char *name) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "ksana: ", name,
                " must be [tokens, heads, head_dim] with each token's heads packed, got sizes ", x.sizes(),
                " strides ", x.strides());
}

// A [blocks, block_size, kv_heads, head_dim] cache pair whose blocks are back to back: its (slot, head) strides.
std::pair<int64_t, int64_t> cache_layout(const Tensor &k_cache, const Tensor &v_cache) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
                "ksana: k_cache and v_cache must be alike [blocks, block_size, kv_heads, head_dim]");
    check_like(v_cache, k_cache, "v_cache");
    int64_t block_size = k_cache.size(1), heads = k_cache.size(2), dim = k_cache.size(3);
    int64_t slot = k_cache.stride(1), head = k_cache.stride(2);
    bool slot_major = slot == heads * dim && head == dim, head_major = slot == dim && head == block_size * dim;
    TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(0) == block_size * heads * dim && (slot_major || head_major),
                "ksana: the KV cache must be slot-major or head-major blocks back to back, got strides ",
                k_cache.strides());
    return {slot, head};
}

int threads() { return at::get_num_threads(); }

template <typename T = void>
T *ptr(const Tensor &t) {
    return static_cast<T *>(t.data_ptr());
}

const void *ptr_or_null(const std::optional<Tensor> &t) { return t.has_value() ? t->data_ptr() : nullptr; }

// ---- norms and elementwise --------------------------------------------------------------------------------------
Tensor rms_norm(const Tensor &x, const Tensor &weight, double eps) {
    auto fn = pick(x, "x", rms_norm_f32, rms_norm_bf16);
    check_rows(x, "x");
    check_like(weight, x, "weight");
    TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "ksana: weight must be [", x.size(1), "]");
    Tensor out = at::empty(x.sizes(), x.options());
    fn(ptr(x), x.stride(0), nullptr, nullptr, ptr(weight), ptr(out), x.size(0), x.size(1), (float)eps, threads());
    return out;
}

std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor &x, const Tensor &residual, const Tensor &weight,
                                              double eps) {
    auto fn = pick(x, "x", rms_norm_f32, rms_norm_bf16);
    check_rows(x, "x");
    check_like(weight, x, "weight");
    check_like(residual, x, "residual");
    TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "ksana: weight must be [", x.size(1), "]");
    TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "ksana: residual must be contiguous ",
                x.sizes());
    Tensor out = at::empty(x.sizes(), x.options()), new_residual = at::empty(x.sizes(), x.options());
    fn(ptr(x), x.stride(0), ptr(residual), ptr(new_residual), ptr(weight), ptr(out), x.size(0), x.size(1),
       (float)eps, threads());
    return {out, new_residual};
}

Tensor rotary_neox(const Tensor &x, const Tensor &cos, const Tensor &sin) {
    auto fn = pick(x, "x", rotary_neox_f32, rotary_neox_bf16);
    check_heads(x, "x");
    int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
    for (const Tensor *t : {&cos, &sin}) {
        check_like(*t, x, "cos and sin");
        TORCH_CHECK(t->is_contiguous() && t->numel() == tokens * dim, "ksana: cos and sin must be [", tokens, ", ",
                    dim, "]");
    }
    Tensor out = at::empty({tokens, heads, dim}, x.options());
    fn(ptr(x), x.stride(0), ptr(cos), ptr(sin), ptr(out), tokens, heads, dim, threads());
    return out;
}

Tensor silu_and_mul(const Tensor &x) {
    auto fn = pick(x, "x", silu_and_mul_f32, silu_and_mul_bf16);
    check_rows(x, "x");
    TORCH_CHECK(x.size(1) % 2 == 0, "ksana: silu_and_mul needs an even width, got ", x.size(1));
    int64_t d = x.size(1) / 2;
    Tensor out = at::empty({x.size(0), d}, x.options());
    fn(ptr(x), x.stride(0), ptr(out), x.size(0), d, threads());
    return out;
}

// ---- KV cache and attention --------------------------------------------------------------------------------------
void store_kv(const Tensor &key, const Tensor &value, Tensor &k_cache, Tensor &v_cache, const Tensor &slot_mapping) {
    auto fn = pick(key, "key", store_kv_f32, store_kv_bf16);
    check_heads(key, "key");
    check_heads(value, "value");
    check_like(value, key, "value");
    check_like(k_cache, key, "k_cache");
    check_ids(slot_mapping, "slot_mapping");
    auto [slot_stride, head_stride] = cache_layout(k_cache, v_cache);
    TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3) &&
                    slot_mapping.numel() == key.size(0),
                "ksana: store_kv got key ", key.sizes(), ", value ", value.sizes(), ", cache ", k_cache.sizes(),
                ", slots ", slot_mapping.sizes());
    fn(ptr(key), key.stride(0), ptr(value), value.stride(0), ptr(k_cache), ptr(v_cache), ptr<int64_t>(slot_mapping),
       key.size(0), key.size(1), key.size(2), k_cache.size(1), slot_stride, head_stride);
}

Tensor paged_decode(const Tensor &query, const Tensor &k_cache, const Tensor &v_cache, const Tensor &block_tables,
                    const Tensor &seq_lens, double scale, int64_t sliding_window) {
    auto fn = pick(query, "query", paged_decode_f32, paged_decode_bf16);
    check_heads(query, "query");
    check_like(k_cache, query, "k_cache");
    check_ids(block_tables, "block_tables");
    check_ids(seq_lens, "seq_lens");
    auto [slot_stride, head_stride] = cache_layout(k_cache, v_cache);
    int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(2);
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && seq_lens.is_contiguous() &&
                    seq_lens.numel() == batch && k_cache.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0,
                "ksana: paged_decode got query ", query.sizes(), ", cache ", k_cache.sizes(), ", block_tables ",
                block_tables.sizes(), ", seq_lens ", seq_lens.sizes());
    Tensor out = at::empty({batch, heads, dim}, query.options());
    fn(ptr(query), query.stride(0), ptr(k_cache), ptr(v_cache), ptr<int64_t>(block_tables), block_tables.stride(0),
       ptr<int64_t>(seq_lens), ptr(out), batch, heads, kv_heads, dim, k_cache.size(1), slot_stride, head_stride,
       (float)scale, sliding_window, threads());
    return out;
}

Tensor prefill_attention(const Tensor &query, const Tensor &k_cache, const Tensor &v_cache, const Tensor &block_table,
                         int64_t seq_len, double scale, int64_t sliding_window) {
    TORCH_CHECK(prefill_attention_available(), "ksana: this build has no prefill attention (it needs AVX2)");
    TORCH_CHECK(query.scalar_type() == at::kFloat && query.device().is_cpu(), "ksana: query must be float32 on CPU");
    check_heads(query, "query");
    check_like(k_cache, query, "k_cache");
    check_ids(block_table, "block_table");
    auto [slot_stride, head_stride] = cache_layout(k_cache, v_cache);
    int64_t q_len = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(2);
    int64_t block_size = k_cache.size(1);
    TORCH_CHECK(q_len > 0 && dim % 8 == 0 && k_cache.size(3) == dim && heads % kv_heads == 0 && seq_len >= q_len &&
                    block_table.is_contiguous() && block_table.numel() * block_size >= seq_len,
                "ksana: prefill_attention got query ", query.sizes(), ", cache ", k_cache.sizes(), ", ",
                block_table.numel(), " blocks for ", seq_len, " positions");
    Tensor out = at::empty({q_len, heads, dim}, query.options());
    prefill_attention_f32(ptr(query), query.stride(0), ptr(k_cache), ptr(v_cache), ptr<int64_t>(block_table), q_len,
                          seq_len, heads, kv_heads, dim, block_size, slot_stride, head_stride, (float)scale,
                          sliding_window, ptr(out), threads());
    return out;
}

// ---- packed linear and sampling ----------------------------------------------------------------------------------
constexpr int64_t PANEL = 16;  // output columns per packed panel (kernels/cpu/packed.py)

void check_packed(const Tensor &packed, const Tensor &like, int64_t out_features, int64_t in_features) {
    TORCH_CHECK(linear_available(), "ksana: this build has no packed linear (it needs AVX2 or AVX-512)");
    check_like(packed, like, "packed");
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(1) == in_features &&
                    packed.size(2) == PANEL && packed.size(0) == (out_features + PANEL - 1) / PANEL,
                "ksana: packed must be [", (out_features + PANEL - 1) / PANEL, ", ", in_features, ", ", PANEL,
                "] panels, got ", packed.sizes());
}

void pack_weight(const Tensor &weight, Tensor &packed) {
    auto fn = pick(weight, "weight", pack_weight_f32, pack_weight_bf16);
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "ksana: weight must be a contiguous [out, in] matrix");
    check_packed(packed, weight, weight.size(0), weight.size(1));
    fn(ptr(weight), weight.size(0), weight.size(1), ptr(packed), threads());
}

void unpack_weight(const Tensor &packed, Tensor &out) {
    auto fn = pick(packed, "packed", unpack_weight_f32, unpack_weight_bf16);
    int64_t panels = packed.size(0), in_features = packed.size(1);
    check_packed(packed, packed, panels * PANEL, in_features);
    check_like(out, packed, "out");
    TORCH_CHECK(out.is_contiguous() && out.numel() >= panels * PANEL * in_features, "ksana: out must hold [",
                in_features, ", ", panels * PANEL, "] contiguous values");
    fn(ptr(packed), panels, in_features, ptr(out), threads());
}

Tensor packed_rows(const Tensor &packed, int64_t out_features, const Tensor &ids) {
    auto fn = pick(packed, "packed", packed_rows_f32, packed_rows_bf16);
    int64_t in_features = packed.size(1);
    check_packed(packed, packed, out_features, in_features);
    check_ids(ids, "ids");
    TORCH_CHECK(ids.dim() == 1, "ksana: ids must be 1-D");
    Tensor out = at::empty({ids.numel(), in_features}, packed.options());
    TORCH_CHECK_INDEX(fn(ptr(packed), out_features, in_features, ptr<int64_t>(ids), ids.numel(), ptr(out)) == 0,
                      "ksana: an id is outside [0, ", out_features, ")");
    return out;
}

Tensor packed_linear(const Tensor &x, const Tensor &packed, const std::optional<Tensor> &bias, int64_t out_features) {
    auto fn = pick(x, "x", packed_linear_f32, packed_linear_bf16);
    check_rows(x, "x");
    check_packed(packed, x, out_features, x.size(1));
    if (bias.has_value()) {
        check_like(*bias, x, "bias");
        TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features, "ksana: bias must be [", out_features, "]");
    }
    Tensor out = at::empty({x.size(0), out_features}, x.options());
    if (x.size(0) > 0)
        fn(ptr(x), x.stride(0), ptr(packed), ptr_or_null(bias), ptr(out), x.size(0), out_features, x.size(1),
           threads());
    return out;
}

std::tuple<Tensor, Tensor> packed_linear_greedy(const Tensor &x, const Tensor &packed, int64_t out_features,
                                                int64_t vocab_size) {
    auto fn = pick(x, "x", packed_linear_greedy_f32, packed_linear_greedy_bf16);
    check_rows(x, "x");
    check_packed(packed, x, out_features, x.size(1));
    TORCH_CHECK(x.size(0) > 0 && 0 < vocab_size && vocab_size <= out_features, "ksana: vocab_size must be in [1, ",
                out_features, "] and x must have rows");
    Tensor ids = at::empty({x.size(0)}, x.options().dtype(at::kLong));
    Tensor logprobs = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    fn(ptr(x), x.stride(0), ptr(packed), x.size(0), out_features, x.size(1), vocab_size, ptr<int64_t>(ids),
       ptr<float>(logprobs), threads());
    return {ids, logprobs};
}

std::tuple<Tensor, Tensor> greedy_logprobs_op(const Tensor &logits) {
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                    logits.is_contiguous(),
                "ksana: logits must be contiguous float32 [rows, vocab] on CPU");
    Tensor ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
    Tensor logprobs = at::empty({logits.size(0)}, logits.options());
    greedy_logprobs(ptr<float>(logits), logits.size(0), logits.size(1), ptr<int64_t>(ids), ptr<float>(logprobs),
                    threads());
    return {ids, logprobs};
}

// ---- a decode step's layers -------------------------------------------------------------------------------------
constexpr int64_t DECODE_LAYER_FIELDS = 12;  // addresses per layer in `table` (DecodeLayerWeights' fields)

void decode_layers(const Tensor &table, const Tensor &windows, Tensor &hidden, Tensor &residual, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, const Tensor &cos,
                   const Tensor &sin, const Tensor &slot_mapping, const Tensor &block_tables, const Tensor &seq_lens,
                   int64_t block_size, int64_t slot_stride, int64_t head_stride, double eps, double scale,
                   const std::optional<Tensor> &final_norm) {
    auto fn = pick(hidden, "hidden", decode_layers_f32, decode_layers_bf16);
    TORCH_CHECK(linear_available(), "ksana: this build has no fused decode step (it needs AVX2 or AVX-512)");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.size(0) > 0, "ksana: hidden must be contiguous "
                "[rows, hidden_size]");
    check_like(residual, hidden, "residual");
    TORCH_CHECK(residual.is_contiguous() && residual.sizes() == hidden.sizes(), "ksana: residual must be like hidden");
    check_ids(table, "table");
    check_ids(windows, "windows");
    int64_t layers = windows.numel(), rows = hidden.size(0);
    TORCH_CHECK(table.is_contiguous() && table.numel() == layers * DECODE_LAYER_FIELDS && windows.is_contiguous(),
                "ksana: table must hold ", DECODE_LAYER_FIELDS, " addresses for each of the ", layers, " layers");
    for (const Tensor *t : {&cos, &sin}) {
        check_like(*t, hidden, "cos and sin");
        TORCH_CHECK(t->is_contiguous() && t->numel() == rows * head_dim, "ksana: cos and sin must be [", rows, ", ",
                    head_dim, "]");
    }
    check_ids(slot_mapping, "slot_mapping");
    check_ids(block_tables, "block_tables");
    check_ids(seq_lens, "seq_lens");
    TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.numel() == rows && seq_lens.is_contiguous() &&
                    seq_lens.numel() == rows && block_tables.dim() == 2 && block_tables.size(0) == rows,
                "ksana: slot_mapping, seq_lens and block_tables must have one row per hidden row");
    if (final_norm.has_value()) {
        check_like(*final_norm, hidden, "final_norm");
        TORCH_CHECK(final_norm->is_contiguous() && final_norm->numel() == hidden.size(1), "ksana: final_norm must be [",
                    hidden.size(1), "]");
    }
    fn(ptr<int64_t>(table), ptr<int64_t>(windows), layers, ptr(hidden), ptr(residual), rows, hidden.size(1),
       num_heads, num_kv_heads, head_dim, intermediate_size, ptr(cos), ptr(sin), ptr<int64_t>(slot_mapping),
       ptr<int64_t>(block_tables), block_tables.stride(0), ptr<int64_t>(seq_lens), block_size, slot_stride,
       head_stride, (float)eps, (float)scale, threads(), ptr_or_null(final_norm));
}

// ---- what the build holds, and its settings ---------------------------------------------------------------------
bool has_linear() { return linear_available() != 0; }
bool has_prefill_attention() { return prefill_attention_available() != 0; }
int64_t vector_lanes() { return wide_lanes(); }
int64_t set_prefetch_min_rows(int64_t rows) { return set_packed_prefetch_min_rows((int)rows); }
int64_t phase_count() { return decode_phase_count ? decode_phase_count() : 0; }

void phase_clock(Tensor &out) {
    TORCH_CHECK(decode_phase_clock != nullptr, "ksana: this build has no phase clock (-DKSANA_PHASE_CLOCK)");
    TORCH_CHECK(out.scalar_type() == at::kDouble && out.is_contiguous() && out.dim() == 3 && out.size(1) == 2 &&
                    out.size(2) == phase_count(),
                "ksana: out must be contiguous float64 [threads, 2, ", phase_count(), "]");
    decode_phase_clock(ptr<double>(out), (int)out.size(0));
}

// Schemas here, CPU kernels below: the tensor operators dispatch on their inputs' device, so fake tensors
// (kernels/cpu/fakes.py) never reach a kernel. The build queries take no tensor and run anywhere.
void define(torch::Library &m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("rotary_neox(Tensor x, Tensor cos, Tensor sin) -> Tensor");
    m.def("silu_and_mul(Tensor x) -> Tensor");
    m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
    m.def("paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, int sliding_window) -> Tensor");
    m.def("prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, "
          "float scale, int sliding_window) -> Tensor");
    m.def("pack_weight(Tensor weight, Tensor(a!) packed) -> ()");
    m.def("unpack_weight(Tensor packed, Tensor(a!) out) -> ()");
    m.def("packed_rows(Tensor packed, int out_features, Tensor ids) -> Tensor");
    m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    m.def("packed_linear_greedy(Tensor x, Tensor packed, int out_features, int vocab_size) -> (Tensor, Tensor)");
    m.def("greedy_logprobs(Tensor logits) -> (Tensor, Tensor)");
    // `table` holds each layer's weight and KV cache addresses (kernels/cpu/ops.py builds it once per model); the
    // caches it points at are written too.
    m.def("decode_layers(Tensor table, Tensor windows, Tensor(a!) hidden, Tensor(b!) residual, int num_heads, "
          "int num_kv_heads, int head_dim, int intermediate_size, Tensor cos, Tensor sin, Tensor slot_mapping, "
          "Tensor block_tables, Tensor seq_lens, int block_size, int slot_stride, int head_stride, float eps, "
          "float scale, Tensor? final_norm) -> ()");
    m.def("decode_phase_clock(Tensor(a!) out) -> ()");
    m.def("linear_available() -> bool", &has_linear);
    m.def("prefill_attention_available() -> bool", &has_prefill_attention);
    m.def("vector_lanes() -> int", &vector_lanes);
    m.def("set_packed_prefetch_min_rows(int rows) -> int", &set_prefetch_min_rows);
    m.def("decode_phase_count() -> int", &phase_count);
}

void implement(torch::Library &m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("fused_add_rms_norm", &fused_add_rms_norm);
    m.impl("rotary_neox", &rotary_neox);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("store_kv", &store_kv);
    m.impl("paged_decode", &paged_decode);
    m.impl("prefill_attention", &prefill_attention);
    m.impl("pack_weight", &pack_weight);
    m.impl("unpack_weight", &unpack_weight);
    m.impl("packed_rows", &packed_rows);
    m.impl("packed_linear", &packed_linear);
    m.impl("packed_linear_greedy", &packed_linear_greedy);
    m.impl("greedy_logprobs", &greedy_logprobs_op);
    m.impl("decode_layers", &decode_layers);
    m.impl("decode_phase_clock", &phase_clock);
}

std::string ops_namespace() {
    const char *name = std::getenv("KSANA_OPS_NAMESPACE");
    return name != nullptr && *name != '\0' ? name : "ksana";
}

// What TORCH_LIBRARY and TORCH_LIBRARY_IMPL declare, with the namespace read when the library loads.
struct Registration {
    torch::Library schemas{torch::Library::DEF, ops_namespace(), std::nullopt, __FILE__, __LINE__};
    torch::Library kernels{torch::Library::IMPL, ops_namespace(), c10::DispatchKey::CPU, __FILE__, __LINE__};
    Registration() {
        define(schemas);
        implement(kernels);
    }
};

const Registration registration;

}  // namespace
