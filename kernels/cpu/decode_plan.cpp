// How paged decode attention divides a step into tasks, and how a task split along its positions is put back
// together (decode_plan.h says why); shared by the paged_decode operator and the fused decode step.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "decode_plan.h"
#include "vec.h"

// Worth waking the pool: context positions x query heads x head_dim. Waking it for a small batch's attention costs
// a time slice when the server's loop holds a core (bench/serving_vs_offline.py).
#define PARALLEL_MIN_ATTENTION_WORK (1 << 20)
// Lower where few sequences' tasks split: there both threads halve a long context's attention, worth waking the
// pool for at batch 1 (bench/roofline.py's decode); the same threshold for every batch slows serving's many small
// steps (bench/serving_vs_offline.py).
#define PARALLEL_MIN_SPLIT_WORK (1 << 18)
// Few long sequences split into about 8 tasks a thread of at least 128 positions each (bench/roofline.py's decode
// at batch 1, context 512: its attention 2.3-2.6 ms a step whole, 1.7-1.9 split).
#define DECODE_SPLIT_TASKS 8
#define DECODE_SPLIT_MIN 128

namespace ksana {
namespace {

// One whole task's output from its split parts: out = sum_c w_c acc_c / sum_c w_c sum_c, w_c = e^(max_c - max);
// an empty chunk weighs 0.
template <typename T>
void combine(const decode_plan *plan, int64_t whole, const float *parts, T *out, int64_t nheads, int64_t dim) {
    const int64_t splits = plan->splits, part_len = plan->part_len, heads = plan->heads_per_task;
    const int64_t b = whole / plan->tasks_per_seq, kv0 = (whole % plan->tasks_per_seq) * plan->kv_per_task;
    T *o = out + (b * nheads + kv0 * plan->group) * dim;
    const float *whole_parts = parts + whole * splits * part_len;
    float stack[512];
    float *sum_v = dim <= 512 ? stack : static_cast<float *>(std::malloc(sizeof(float) * dim));
    for (int64_t g = 0; g < heads; g++) {
        float top = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < splits; c++)
            top = whole_parts[c * part_len + g] > top ? whole_parts[c * part_len + g] : top;
        for (int64_t d = 0; d < dim; d++) sum_v[d] = 0.f;
        for (int64_t c = 0; c < splits; c++) {
            const float *part = whole_parts + c * part_len;
            if (part[g] == -INFINITY) continue;
            float wc = std::exp(part[g] - top);
            total += wc * part[heads + g];
            const float *acc = part + 2 * heads + g * dim;
            for (int64_t d = 0; d < dim; d++) sum_v[d] += wc * acc[d];
        }
        float inv = total > 0.f ? 1.0f / total : 0.f;
        for (int64_t d = 0; d < dim; d++) store1(o + g * dim + d, sum_v[d] * inv);
    }
    if (sum_v != stack) std::free(sum_v);
}

}  // namespace
}  // namespace ksana

using ksana::bf16;

extern "C" {
decode_plan plan_decode(const int64_t *seq_lens, int64_t batch, int64_t nheads, int64_t nkv, int64_t dim,
                        int64_t window, int64_t slot_stride, int64_t head_stride, int nthreads) {
    decode_plan plan{};
    plan.group = nheads / nkv, plan.row = nkv * dim, plan.slot_stride = slot_stride, plan.head_stride = head_stride;
    int64_t positions = 0, longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t n = (window > 0 && seq_lens[b] > window) ? window : seq_lens[b];
        positions += n;
        longest = n > longest ? n : longest;
    }
    plan.kv_per_task = batch >= 2 * nthreads ? nkv : 1;
    plan.parallel = nthreads > 1 && positions * nheads * dim >= (plan.kv_per_task == 1 ? PARALLEL_MIN_SPLIT_WORK
                                                                                       : PARALLEL_MIN_ATTENTION_WORK);
    plan.tasks_per_seq = nkv / plan.kv_per_task;
    plan.heads_per_task = plan.kv_per_task * plan.group;
    plan.whole_tasks = batch * plan.tasks_per_seq;
    plan.splits = 1;
    if (plan.parallel && plan.kv_per_task == 1) {
        int64_t wanted = (DECODE_SPLIT_TASKS * nthreads + plan.whole_tasks - 1) / plan.whole_tasks;
        int64_t most = longest / DECODE_SPLIT_MIN;
        plan.splits = wanted < most ? wanted : most;
        plan.splits = plan.splits < 1 ? 1 : plan.splits;
    }
    plan.part_len = plan.heads_per_task * (2 + dim);
    return plan;
}

void decode_combine_f32(const decode_plan *plan, int64_t whole, const float *parts, float *out, int64_t nheads,
                        int64_t dim) {
    ksana::combine(plan, whole, parts, out, nheads, dim);
}
void decode_combine_bf16(const decode_plan *plan, int64_t whole, const float *parts, bf16 *out, int64_t nheads,
                         int64_t dim) {
    ksana::combine(plan, whole, parts, out, nheads, dim);
}
}
