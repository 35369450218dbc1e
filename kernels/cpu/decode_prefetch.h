// A decode attention task's software prefetch (attention_decode.cpp), on its own: the one piece of the task that is
// about the memory system rather than the arithmetic.
#pragma once

#include <cstdint>

namespace ksana {

// A decode task's software prefetch. The task reads its rows in units of (tile, KV head), keys then values, and
// while it computes on one unit it fetches a later one into L2, a share of a row per loop iteration, so that the
// requests go out evenly over the unit's work (every pass over it, not only the first's). The hardware prefetcher
// alone leaves the arithmetic waiting on its rows, and a prefetch a fixed distance ahead from the first query head
// only sends the requests in bursts (tools/attention_ab.py). `step`: rows per iteration, 16.16 fixed point.
template <typename T>
struct DecodePrefetch {
    const T *base = nullptr;
    const int64_t *rows = nullptr;
    int64_t step = 0, at = 0, dim = 0, tile = 0;
    int64_t leave_after = 0;  // > 0: after this many units in a row that follow the one before in memory, the
                              // next such are left to the hardware
    int64_t run = 0;          // how many units in a row have followed the one before in memory
    int64_t ahead = 1;        // the target: this many units after the one computed on
    int streamed = 0;         // bit i: unit i + 1 from the one computed on is left to the hardware

    void next() {
        for (int64_t r = (at * step) >> 16, r1 = ((at + 1) * step) >> 16; r < r1; r++)
            for (int64_t d = 0; d < dim; d += 64 / static_cast<int64_t>(sizeof(T)))
                __builtin_prefetch(base + rows[r] + d, 0, 2);  // into L2 (prefetcht1)
        at++;
    }

    // The unit `ahead` after tile t's KV head h of pass v (0 keys, 1 values; none after the last), over `iters`;
    // none either where the hardware streams it (leave_after).
    void plan(const T *k_cache, const T *v_cache, const int64_t *kv_rows, int64_t n, int64_t nkv,
              int64_t head_stride, int64_t t, int64_t h, int v, int64_t iters) {
        int64_t tiles = (n + tile - 1) / tile, count = 0;
        const T *end = nullptr;  // where the unit before the target ends
        for (int64_t u = 0; u < ahead && v < 2; u++) {
            int64_t last = (t + 1) * tile < n ? (t + 1) * tile - 1 : n - 1;
            end = (v ? v_cache : k_cache) + h * head_stride + kv_rows[last] + dim;
            if (++h == nkv) h = 0, t++;
            if (t == tiles) t = 0, v++;
        }
        int64_t t0 = t * tile;
        if (v < 2) count = n - t0 < tile ? n - t0 : tile;
        base = (v ? v_cache : k_cache) + h * head_stride;
        rows = kv_rows + t0;
        int is_streamed = 0;
        if (leave_after && count) {
            run = base + rows[0] == end ? run + 1 : 0;
            is_streamed = run > leave_after;
            count = is_streamed ? 0 : count;
        }
        streamed = (streamed >> 1) | is_streamed << (ahead - 1);
        step = iters ? (count << 16) / iters : 0;
        at = 0;
    }
};

}  // namespace ksana
