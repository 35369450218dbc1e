// The wide schedule's float32 instantiations and its greedy combine (packed_wide.h).
#include <cmath>
#include <cstdint>

#include "packed_wide.h"

namespace ksana::packed {

#if KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES)
int64_t group_count(int64_t M, int64_t N) {
    const int64_t np = panels_per_group(M);
    return ((N + kPanel - 1) / kPanel + np - 1) / np;
}

// Each row's token and log-probability from its groups, in group order, as greedy_logprobs would give them: the
// first NaN wins (logprob NaN); else the first group holding the maximum m gives the token, and its log_softmax is
// -log(sum over groups of sum_g * e^(max_g - m)) (NaN where m is infinite). `slice`'s rows, 16 at most.
void greedy_combine(const GreedyGroups &greedy, int64_t slice, int64_t rows, int64_t *ids, float *logprobs) {
    const int64_t base = slice * greedy.groups;
    const V minus_inf = V::splat(-INFINITY), none = V::splat(-1.0f);
    V m = minus_inf, total = V::zero(), id = none, nan_id = none;
    int nan = 0;
    for (int64_t g = 0; g < greedy.groups; g++) {
        const V group_nan = V::load(greedy.nan_id + 16 * (base + g));
        const int first_nan = (group_nan.gt_mask(none) | none.gt_mask(group_nan)) & ~nan;
        nan_id = V::select(first_nan, group_nan, nan_id), nan |= first_nan;
        const V group_max = V::load(greedy.max + 16 * (base + g));
        const int above = group_max.gt_mask(m);
        m = V::select(above, group_max, m), id = V::select(above, V::load(greedy.id + 16 * (base + g)), id);
    }
    for (int64_t g = 0; g < greedy.groups; g++) {
        const V group_max = V::load(greedy.max + 16 * (base + g));
        const int some = group_max.gt_mask(minus_inf);
        const V scale = exp_nonpositive(group_max - m);
        total = V::select(some, V::fma(V::load(greedy.sum + 16 * (base + g)), scale, total), total);
    }
    float lane_max[16], lane_total[16], lane_id[16], lane_nan[16];
    m.store(lane_max), total.store(lane_total), id.store(lane_id), nan_id.store(lane_nan);
    for (int64_t r = 0; r < rows; r++) {
        if (nan >> r & 1) {
            ids[r] = static_cast<int64_t>(lane_nan[r]), logprobs[r] = NAN;
            continue;
        }
        ids[r] = lane_id[r] < 0 ? 0 : static_cast<int64_t>(lane_id[r]);
        logprobs[r] = std::isfinite(lane_max[r]) ? -std::log(lane_total[r]) : NAN;
    }
}

template void panel_groups<float>(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t,
                                  int64_t *, int64_t, GreedyGroups *);
template void swiglu_groups<float>(const float *, const float *, int64_t, int64_t, int64_t, int64_t *, int64_t,
                                   float *);
#endif

}  // namespace ksana::packed
