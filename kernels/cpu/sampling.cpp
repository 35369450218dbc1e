// Greedy sampling's two numbers per row of float32 logits, on F32x8 lanes (vec.h), with no [rows, vocab]
// temporary: the index of the first maximum (as torch's argmax: a NaN counts as the maximum, the first one wins)
// and log_softmax's value there, -log(sum(exp(x - max))) (NaN where log_softmax gives NaN: a NaN or an infinite
// maximum). The sum's exp and order differ from torch's, so the log-probability agrees to float32 rounding.
// The sampler's greedy rows run it on the logits path (decode under 8 rows), as does the packed lm_head's AVX2
// greedy on the logits it writes; bench/kernel_builds.py's batch-1 decode measures it.
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "vec.h"

namespace ksana {
namespace {

struct RowMax {
    float max;  // over the row's values that are not NaN (-inf if none)
    bool has_nan;
};

// Four independent chains of lanes, so the compare-select latency does not pace the loop; a NaN lane leaves its
// chain as it was (F32x8::max) and is only noted.
RowMax row_max(const float *x, int64_t n) {
    F32x8 m0 = F32x8::splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int nan = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        F32x8 v0 = F32x8::load(x + i), v1 = F32x8::load(x + i + 8);
        F32x8 v2 = F32x8::load(x + i + 16), v3 = F32x8::load(x + i + 24);
        nan |= v0.nan_mask() | v1.nan_mask() | v2.nan_mask() | v3.nan_mask();
        m0 = F32x8::max(v0, m0), m1 = F32x8::max(v1, m1), m2 = F32x8::max(v2, m2), m3 = F32x8::max(v3, m3);
    }
    float m = max_lane(F32x8::max(F32x8::max(m0, m1), F32x8::max(m2, m3)));
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > m) m = x[i];
    }
    return {m, nan != 0};
}

// The first index holding `target` (a NaN target: the first NaN); the row holds it.
int64_t first_index(const float *x, int64_t n, float target) {
    const bool nan = target != target;
    const F32x8 t = F32x8::splat(target);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        F32x8 v = F32x8::load(x + i);
        int mask = nan ? v.nan_mask() : v.eq_mask(t);
        if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == target) return i;
    return 0;
}

// sum(exp(x - m)) over the row, m its (finite) maximum: two chains of lanes, then the tail in order.
float sum_exp(const float *x, int64_t n, float m) {
    const F32x8 vm = F32x8::splat(m);
    F32x8 s0 = F32x8::zero(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = s0 + exp_nonpositive(F32x8::load(x + i) - vm);
        s1 = s1 + exp_nonpositive(F32x8::load(x + i + 8) - vm);
    }
    for (; i + 8 <= n; i += 8) s0 = s0 + exp_nonpositive(F32x8::load(x + i) - vm);
    float sum = (s0 + s1).sum();
    for (; i < n; i++) sum += std::exp(x[i] - m);
    return sum;
}

void greedy_row(const float *x, int64_t vocab, int64_t *id, float *logprob) {
    RowMax row = row_max(x, vocab);
    if (row.has_nan) {
        *id = first_index(x, vocab, NAN);
        *logprob = NAN;
        return;
    }
    *id = first_index(x, vocab, row.max);  // all -inf: index 0, as torch's argmax
    *logprob = std::isfinite(row.max) ? -std::log(sum_exp(x, vocab, row.max)) : NAN;
}

}  // namespace
}  // namespace ksana

extern "C" void greedy_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs,
                                int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * vocab >= 4 * PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) ksana::greedy_row(logits + r * vocab, vocab, ids + r, logprobs + r);
}
