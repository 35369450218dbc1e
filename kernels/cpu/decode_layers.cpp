// A decode step's decoder layers in one call: the same ops, in the same order, as DecoderLayer.forward over the
// native kernels, so the results are identical to the op-by-op path; what goes is Python between the ops. Each op
// called from Python costs tens of microseconds once the matmul before it has streamed megabytes of weights through
// the caches (the interpreter's own working set is evicted), about ten calls a layer. bench/throughput.py and
// bench/roofline.py measure it; tools/decode_ab.py compares two builds' steps and bits, tools/decode_phases.py
// times its phases.
//
// The whole step is one OpenMP region: the team meets at a barrier between phases instead of forking and joining
// for each op. Every thread runs the row-wise ops on all the rows, into its own residual stream, normed rows and
// packed matmul input: they are microseconds of work, and a thread that computes them itself needs no barrier
// before the matmul that reads them (five barriers a layer, not eight). Each sequence's rotary and KV store run in
// its attention task when a task is a whole sequence.
#include <sched.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "decode_plan.h"
#include "packed_linear.h"
#include "parallel.h"

#ifdef KSANA_PHASE_CLOCK
#include <time.h>
#endif

extern "C" {
void rms_norm_row_f32(const float *src, const float *add, float *residual_out, const float *w, float *o, int64_t dim,
                      float eps);
void rms_norm_row_bf16(const uint16_t *src, const uint16_t *add, uint16_t *residual_out, const uint16_t *w,
                       uint16_t *o, int64_t dim, float eps);
void rotary_token_f32(const float *x, const float *c, const float *s, float *out, int64_t nheads, int64_t dim);
void rotary_token_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out, int64_t nheads,
                       int64_t dim);
void store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, float *k_cache,
                  float *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim, int64_t block_size,
                  int64_t slot_stride, int64_t head_stride);
void store_kv_bf16(const uint16_t *key, int64_t key_stride, const uint16_t *value, int64_t value_stride,
                   uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t ntok, int64_t nkv, int64_t dim,
                   int64_t block_size, int64_t slot_stride, int64_t head_stride);
}

namespace ksana {
namespace {

using packed::kDecodeRows;
using packed::kRowTile;

// The row ops' C entries (norms.cpp, elementwise.cpp, attention_decode.cpp) for either dtype.
inline void rms_norm_row(const float *src, const float *add, float *res, const float *w, float *o, int64_t d,
                         float eps) {
    rms_norm_row_f32(src, add, res, w, o, d, eps);
}
inline void rms_norm_row(const bf16 *src, const bf16 *add, bf16 *res, const bf16 *w, bf16 *o, int64_t d, float eps) {
    rms_norm_row_bf16(src, add, res, w, o, d, eps);
}
inline void rotary_token(const float *x, const float *c, const float *s, float *o, int64_t h, int64_t d) {
    rotary_token_f32(x, c, s, o, h, d);
}
inline void rotary_token(const bf16 *x, const bf16 *c, const bf16 *s, bf16 *o, int64_t h, int64_t d) {
    rotary_token_bf16(x, c, s, o, h, d);
}
template <typename... A>
inline void store_kv(const float *key, int64_t ks, const float *value, int64_t vs, float *kc, float *vc, A... rest) {
    store_kv_f32(key, ks, value, vs, kc, vc, rest...);
}
template <typename... A>
inline void store_kv(const bf16 *key, int64_t ks, const bf16 *value, int64_t vs, bf16 *kc, bf16 *vc, A... rest) {
    store_kv_bf16(key, ks, value, vs, kc, vc, rest...);
}
template <typename... A>
inline void run_task(const decode_plan *plan, int64_t task, const float *q, A... rest) {
    decode_run_task_f32(plan, task, q, rest...);
}
template <typename... A>
inline void run_task(const decode_plan *plan, int64_t task, const bf16 *q, A... rest) {
    decode_run_task_bf16(plan, task, q, rest...);
}
inline void combine(const decode_plan *plan, int64_t whole, const float *parts, float *out, int64_t h, int64_t d) {
    decode_combine_f32(plan, whole, parts, out, h, d);
}
inline void combine(const decode_plan *plan, int64_t whole, const float *parts, bf16 *out, int64_t h, int64_t d) {
    decode_combine_bf16(plan, whole, parts, out, h, d);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// The team's barrier between the phases. libgomp's barrier spins only 100 times before it sleeps in the kernel once
// its pools hold more threads than there are CPUs (see ksana/worker/fresh_thread.py, which keeps the engine's own
// process clear of that). A caller that is not clear pays a futex wake at each of a step's 270 waits: 4-34 us each,
// about 4 ms of a batch-16 step, in a script that ran the layers from its main thread after the engine's forward
// thread had. This one spins with pause, then yields the CPU in a loop, so a thread the OS preempted (a server's
// event loop shares the cores) gets a core back soon. Sense-reversing: the last thread to arrive flips `sense`.
constexpr int64_t kTeamSpins = 1 << 12;  // pauses before it yields: tens of microseconds
struct TeamBarrier {
    alignas(64) int64_t arrived = 0;
    alignas(64) int sense = 0;

    void wait(int nthreads, int *my_sense) {
        const int sense_now = !*my_sense;
        *my_sense = sense_now;
        if (__atomic_add_fetch(&arrived, 1, __ATOMIC_ACQ_REL) == nthreads) {
            __atomic_store_n(&arrived, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&sense, sense_now, __ATOMIC_RELEASE);
            return;
        }
        for (int64_t spins = 0; __atomic_load_n(&sense, __ATOMIC_ACQUIRE) != sense_now; spins++) {
            if (spins < kTeamSpins) cpu_relax();
            else sched_yield();
        }
    }
};

// The step's phases. In the build tools/decode_phases.py makes (-DKSANA_PHASE_CLOCK) each thread adds, per phase,
// the time from leaving the previous barrier to reaching this phase's (work) and the time it then waits there
// (wait); decode_phase_clock hands the sums over and clears them. Without the flag the clock compiles to nothing and
// the kernel is the one the engine runs.
enum Phase { PHASE_NORM, PHASE_QKV, PHASE_STORE, PHASE_ATTENTION, PHASE_COMBINE, PHASE_PACK, PHASE_O, PHASE_POST_NORM,
             PHASE_GATE_UP, PHASE_SILU, PHASE_DOWN, PHASES };
constexpr int kClockedThreads = 64;  // threads clocked; more run unclocked

#ifdef KSANA_PHASE_CLOCK
struct PhaseClock {
    alignas(64) double work[PHASES], wait[PHASES], mark;
};
PhaseClock phase_clocks[kClockedThreads];

double phase_now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
#endif

// A thread's place in the team: its barrier waits, clocked per phase where the build clocks them.
struct TeamMember {
    TeamBarrier &barrier;
    int tid, nth, sense = 0;

    TeamMember(TeamBarrier &b, int t, int n) : barrier(b), tid(t), nth(n) {
#ifdef KSANA_PHASE_CLOCK
        if (tid < kClockedThreads) phase_clocks[tid].mark = phase_now();
#endif
    }
    void wait([[maybe_unused]] Phase phase) {
#ifdef KSANA_PHASE_CLOCK
        const double arrived = phase_now();
        barrier.wait(nth, &sense);
        if (tid >= kClockedThreads) return;
        PhaseClock &clock = phase_clocks[tid];
        const double left = phase_now();
        clock.work[phase] += arrived - clock.mark;
        clock.wait[phase] += left - arrived;
        clock.mark = left;
#else
        barrier.wait(nth, &sense);
#endif
    }
    // A phase that ends without a barrier: its work only.
    void mark([[maybe_unused]] Phase phase) {
#ifdef KSANA_PHASE_CLOCK
        if (tid >= kClockedThreads) return;
        const double now = phase_now();
        phase_clocks[tid].work[phase] += now - phase_clocks[tid].mark;
        phase_clocks[tid].mark = now;
#endif
    }
};

// One layer's weights and caches: DecodeLayerWeights (kernels/dispatch.py) as kernels/cpu/ops.py lays out its
// kLayerFields addresses; biases may be 0.
constexpr int64_t kLayerFields = 12;
template <typename T>
struct LayerWeights {
    const T *in_norm, *qkv_w, *qkv_b, *o_w, *o_b, *post_norm, *gate_up_w, *gate_up_b, *down_w, *down_b;
    T *k_cache, *v_cache;

    explicit LayerWeights(const int64_t *f)
        : in_norm(at<const T>(f[0])), qkv_w(at<const T>(f[1])), qkv_b(at<const T>(f[2])), o_w(at<const T>(f[3])),
          o_b(at<const T>(f[4])), post_norm(at<const T>(f[5])), gate_up_w(at<const T>(f[6])),
          gate_up_b(at<const T>(f[7])), down_w(at<const T>(f[8])), down_b(at<const T>(f[9])),
          k_cache(at<T>(f[10])), v_cache(at<T>(f[11])) {}

    template <typename P>
    static P *at(int64_t address) { return reinterpret_cast<P *>(static_cast<intptr_t>(address)); }
};

// The step's shapes and the attention's inputs, as decode_layers takes them.
template <typename T>
struct Step {
    int64_t M, hidden, nheads, nkv, dim, inter;
    const T *cos, *sin;
    const int64_t *slots, *block_tables;
    int64_t table_stride;
    const int64_t *seq_lens;
    int64_t block_size, slot_stride, head_stride;
    float eps, scale;
    int64_t q() const { return nheads * dim; }
    int64_t kv() const { return nkv * dim; }
    int64_t qkv_n() const { return q() + 2 * kv(); }
};

// Row b's q and k rotated into qk, its k and v stored in the KV cache.
template <typename T>
inline void rotate_and_store(const Step<T> &s, const T *qkv, T *qk, T *k_cache, T *v_cache, int64_t b) {
    const int64_t q = s.q(), kv = s.kv(), qkv_n = s.qkv_n();
    rotary_token(qkv + b * qkv_n, s.cos + b * s.dim, s.sin + b * s.dim, qk + b * (q + kv), s.nheads + s.nkv, s.dim);
    store_kv(qk + b * (q + kv) + q, q + kv, qkv + b * qkv_n + q + kv, qkv_n, k_cache, v_cache, s.slots + b,
             int64_t{1}, s.nkv, s.dim, s.block_size, s.slot_stride, s.head_stride);
}

// The KV blocks sequence `seq`'s task reads in a layer, keys then values, for the warming during the qkv
// projection (packed::KvWarm): each thread's first task is sequence `tid`.
template <typename T>
packed::KvWarm warm_list(const Step<T> &s, const T *k_cache, const T *v_cache, int64_t window, int64_t seq,
                         const char **blocks) {
    const int64_t len = s.seq_lens[seq], start = window > 0 && len > window ? len - window : 0;
    const int64_t block_bytes = s.block_size * s.nkv * s.dim * static_cast<int64_t>(sizeof(T));
    int64_t count = 0;
    for (int v = 0; v < 2; v++)
        for (int64_t i = start / s.block_size; i * s.block_size < len; i++)
            blocks[count++] = reinterpret_cast<const char *>(v ? v_cache : k_cache) +
                              s.block_tables[seq * s.table_stride + i] * block_bytes;
    packed::KvWarm warm;
    warm.blocks = blocks, warm.left = count, warm.block_bytes = block_bytes;
    return warm;
}

// `table` holds kLayerFields addresses per layer; `h` [M, hidden] is the embedding on entry and, on return, the
// last layer's MLP output, or with `final_norm` the model's final norm of it; `residual` receives the residual
// stream (with `final_norm`, the sum that norm took).
template <typename T>
void decode_layers(const int64_t *table, const int64_t *windows, int64_t nlayers, T *h, T *residual, const Step<T> &s,
                   int nthreads, const T *final_norm) {
    const int64_t M = s.M, hidden = s.hidden, inter = s.inter, q = s.q(), kv = s.kv(), qkv_n = s.qkv_n();
    int64_t k_most = hidden > q ? hidden : q;
    k_most = k_most > inter ? k_most : inter;
    const int64_t row_tiles = (M + kRowTile - 1) / kRowTile;
    T *qkv = static_cast<T *>(std::malloc(sizeof(T) * M * qkv_n));
    T *qk = static_cast<T *>(std::malloc(sizeof(T) * M * (q + kv)));
    T *attn = static_cast<T *>(std::malloc(sizeof(T) * M * q));
    T *gate_up = static_cast<T *>(std::malloc(sizeof(T) * M * 2 * inter));
    // down's packed input from the fused gate_up and SwiGLU pass; calloc: a partial last tile's padding rows stay 0
    const bool fuse_mlp = packed::swiglu_fusable(M, inter);
    float *a_act = fuse_mlp ? static_cast<float *>(std::calloc(row_tiles * kRowTile * inter, sizeof(float))) : nullptr;
    // work counters, 0 at the start: per layer four matmuls' panel groups and the attention's tasks
    int64_t *next_work = static_cast<int64_t *>(std::calloc(5 * nlayers, sizeof(int64_t)));
    int64_t parts_len = 0;  // split attention tasks' partial results: room for the layer that needs most
    for (int64_t l = 0; l < nlayers; l++) {
        const decode_plan plan = plan_decode(s.seq_lens, M, s.nheads, s.nkv, s.dim, windows[l], s.slot_stride,
                                             s.head_stride, nthreads);
        const int64_t len = plan.splits > 1 ? plan.whole_tasks * plan.splits * plan.part_len : 0;
        parts_len = len > parts_len ? len : parts_len;
    }
    float *parts = parts_len ? static_cast<float *>(std::malloc(sizeof(float) * parts_len)) : nullptr;
    TeamBarrier barrier;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        TeamMember team(barrier, tid, nth);
        // The row-wise ops run on every row in every thread, each into its own copy of the residual stream (thread
        // 0's is `residual`), the normed rows and the matmul's packed input: the same bits in each, and no barrier
        // between them and the matmul that reads them.
        T *res = tid == 0 ? residual : static_cast<T *>(std::malloc(sizeof(T) * M * hidden));
        T *x = static_cast<T *>(std::malloc(sizeof(T) * M * (inter > hidden ? inter : hidden)));  // or SwiGLU's
        float *a = static_cast<float *>(std::calloc(row_tiles * kRowTile * k_most, sizeof(float)));
        int64_t most_blocks = 0;  // the longest sequence's, for this thread's warm list
        for (int64_t b = 0; b < M; b++) {
            const int64_t blocks = (s.seq_lens[b] + s.block_size - 1) / s.block_size;
            most_blocks = blocks > most_blocks ? blocks : most_blocks;
        }
        const char **warm_blocks = static_cast<const char **>(std::malloc(sizeof(char *) * (2 * most_blocks + 1)));
        packed::KvWarm warm;
        for (int64_t l = 0; l < nlayers; l++) {
            const LayerWeights<T> lw(table + l * kLayerFields);
            int64_t *next_group = next_work + 5 * l, *next_task = next_work + 5 * l + 4;
            // res = h (first layer) or res + h; x = norm(res). h is read here before this thread reaches the qkv
            // barrier, which the o projection's writes to h come after.
            for (int64_t r = 0; r < M; r++) {
                if (l == 0) {
                    std::memcpy(res + r * hidden, h + r * hidden, sizeof(T) * hidden);
                    rms_norm_row(h + r * hidden, nullptr, nullptr, lw.in_norm, x + r * hidden, hidden, s.eps);
                } else {
                    rms_norm_row(h + r * hidden, res + r * hidden, res + r * hidden, lw.in_norm, x + r * hidden, hidden,
                                 s.eps);
                }
            }
            packed::pack_tiles(x, hidden, hidden, a, M, 0, 1);
            team.mark(PHASE_NORM);
            const decode_plan plan = plan_decode(s.seq_lens, M, s.nheads, s.nkv, s.dim, windows[l], s.slot_stride,
                                                 s.head_stride, nthreads);
            const bool whole_seqs = plan.kv_per_task == s.nkv && plan.splits == 1;  // a task is a whole sequence
            // Each thread's first task is sequence `tid` (the rest are taken as they come), whose KV the split tile
            // warms during the qkv projection. A thread the OS preempts holds up only that task. Same bits: which
            // thread runs a task does not change its result.
            const bool warm_first = packed::kWideSchedule && whole_seqs && M > kRowTile && M <= kDecodeRows &&
                                    plan.whole_tasks >= nth;
            if (warm_first) {
                warm = warm_list(s, lw.k_cache, lw.v_cache, windows[l], tid, warm_blocks);
                packed::kv_warming = &warm;
            }
            packed::panel_groups(a, lw.qkv_w, lw.qkv_b, qkv, M, qkv_n, hidden, next_group, nth, nullptr);
            team.wait(PHASE_QKV);
            packed::kv_warming = nullptr;
            if (!whole_seqs) {  // tasks share sequences: rotary and KV store first
                for (int64_t t = tid; t * kRowTile < M; t += nth)
                    for (int64_t r = t * kRowTile; r < M && r < (t + 1) * kRowTile; r++)
                        rotate_and_store(s, qkv, qk, lw.k_cache, lw.v_cache, r);
                team.wait(PHASE_STORE);
            }
            for (int64_t tasks = plan.whole_tasks * plan.splits, first = warm_first;; first = 0) {
                const int64_t task = first ? tid : nth * warm_first + __atomic_fetch_add(next_task, 1, __ATOMIC_RELAXED);
                if (task >= tasks) break;
                if (whole_seqs) rotate_and_store(s, qkv, qk, lw.k_cache, lw.v_cache, task);
                run_task(&plan, task, static_cast<const T *>(qk), q + kv, static_cast<const T *>(lw.k_cache),
                         static_cast<const T *>(lw.v_cache), s.block_tables, s.table_stride, s.seq_lens, attn,
                         s.nheads, s.dim, s.block_size, s.scale, windows[l], plan.splits > 1 ? parts : nullptr);
            }
            team.wait(PHASE_ATTENTION);
            if (plan.splits > 1) {  // the split parts combined, whole tasks shared out in turn
                for (int64_t whole = tid; whole < plan.whole_tasks; whole += nth)
                    combine(&plan, whole, parts, attn, s.nheads, s.dim);
                team.wait(PHASE_COMBINE);
            }
            packed::pack_tiles(attn, q, q, a, M, 0, 1);
            team.mark(PHASE_PACK);
            packed::panel_groups(a, lw.o_w, lw.o_b, h, M, hidden, q, next_group + 1, nth, nullptr);
            team.wait(PHASE_O);
            // res += h; x = norm(res): read before the gate_up barrier, which down's writes to h follow
            for (int64_t r = 0; r < M; r++)
                rms_norm_row(h + r * hidden, res + r * hidden, res + r * hidden, lw.post_norm, x + r * hidden, hidden,
                             s.eps);
            packed::pack_tiles(x, hidden, hidden, a, M, 0, 1);
            team.mark(PHASE_POST_NORM);
            const bool fused = fuse_mlp && !lw.gate_up_b;  // the one pass adds no bias
            if (fused) {
                packed::swiglu_groups(a, lw.gate_up_w, M, inter, hidden, next_group + 2, nth, a_act);
                team.wait(PHASE_GATE_UP);
            } else {
                packed::panel_groups(a, lw.gate_up_w, lw.gate_up_b, gate_up, M, 2 * inter, hidden, next_group + 2, nth,
                                     nullptr);
                team.wait(PHASE_GATE_UP);
                for (int64_t r = 0; r < M; r++) packed::silu_and_mul_row(gate_up + r * 2 * inter, x + r * inter, inter);
                packed::pack_tiles(x, inter, inter, a, M, 0, 1);
                team.mark(PHASE_SILU);
            }
            packed::panel_groups(fused ? a_act : a, lw.down_w, lw.down_b, h, M, hidden, inter, next_group + 3, nth,
                                 nullptr);
            team.wait(PHASE_DOWN);
        }
        // the model's final norm, this thread's row tiles: h = norm(res + h), the sum into `residual`
        for (int64_t t = tid; final_norm && t * kRowTile < M; t += nth)
            for (int64_t r = t * kRowTile; r < M && r < (t + 1) * kRowTile; r++)
                rms_norm_row(h + r * hidden, res + r * hidden, residual + r * hidden, final_norm, h + r * hidden, hidden,
                             s.eps);
        std::free(warm_blocks);
        if (tid != 0) std::free(res);
        std::free(x);
        std::free(a);
    }
    std::free(qkv);
    std::free(qk);
    std::free(attn);
    std::free(gate_up);
    std::free(a_act);
    std::free(next_work);
    std::free(parts);
}

template <typename T>
void decode_layers_entry(const int64_t *table, const int64_t *windows, int64_t nlayers, T *h, T *residual, int64_t M,
                         int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter, const T *cos,
                         const T *sin, const int64_t *slots, const int64_t *block_tables, int64_t table_stride,
                         const int64_t *seq_lens, int64_t block_size, int64_t slot_stride, int64_t head_stride,
                         float eps, float scale, int nthreads, const T *final_norm) {
    const Step<T> step{M,      hidden,       nheads,       nkv,      dim,        inter,       cos,         sin,
                       slots,  block_tables, table_stride, seq_lens, block_size, slot_stride, head_stride, eps,
                       scale};
    decode_layers(table, windows, nlayers, h, residual, step, nthreads, final_norm);
}

}  // namespace
}  // namespace ksana

using ksana::bf16;

extern "C" {
void decode_layers_f32(const int64_t *table, const int64_t *windows, int64_t nlayers, float *h, float *residual,
                       int64_t M, int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter,
                       const float *cos, const float *sin, const int64_t *slots, const int64_t *block_tables,
                       int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t slot_stride,
                       int64_t head_stride, float eps, float scale, int nthreads, const float *final_norm) {
    ksana::decode_layers_entry(table, windows, nlayers, h, residual, M, hidden, nheads, nkv, dim, inter, cos, sin,
                               slots, block_tables, table_stride, seq_lens, block_size, slot_stride, head_stride, eps,
                               scale, nthreads, final_norm);
}
void decode_layers_bf16(const int64_t *table, const int64_t *windows, int64_t nlayers, bf16 *h, bf16 *residual,
                        int64_t M, int64_t hidden, int64_t nheads, int64_t nkv, int64_t dim, int64_t inter,
                        const bf16 *cos, const bf16 *sin, const int64_t *slots, const int64_t *block_tables,
                        int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t slot_stride,
                        int64_t head_stride, float eps, float scale, int nthreads, const bf16 *final_norm) {
    ksana::decode_layers_entry(table, windows, nlayers, h, residual, M, hidden, nheads, nkv, dim, inter, cos, sin,
                               slots, block_tables, table_stride, seq_lens, block_size, slot_stride, head_stride, eps,
                               scale, nthreads, final_norm);
}

#ifdef KSANA_PHASE_CLOCK
// How many phases the clock has: tools/decode_phases.py's names must match the Phase enum.
int decode_phase_count(void) { return ksana::PHASES; }

// out[t][0][p], out[t][1][p]: thread t's work and wait seconds in phase p since the last call, t < threads.
void decode_phase_clock(double *out, int threads) {
    for (int t = 0; t < threads && t < ksana::kClockedThreads; t++)
        for (int p = 0; p < ksana::PHASES; p++) {
            out[(t * 2) * ksana::PHASES + p] = ksana::phase_clocks[t].work[p];
            out[(t * 2 + 1) * ksana::PHASES + p] = ksana::phase_clocks[t].wait[p];
            ksana::phase_clocks[t].work[p] = ksana::phase_clocks[t].wait[p] = 0.0;
        }
}
#endif
}
