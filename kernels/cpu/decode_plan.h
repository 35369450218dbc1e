/* How paged decode attention divides a step into tasks (decode_plan.cpp), and the tasks (attention_decode.cpp):
 * shared by the paged_decode operator and the fused decode step (decode_layers.cpp), which runs the same tasks
 * from its own thread team.
 *
 * A task is one sequence's KV heads: all of them when the batch alone keeps the threads busy (each position's row
 * is then read whole and in order), else one KV head, whose query heads share its keys and values. Few sequences
 * give few tasks (one sequence: one per KV head, 3 for 2 threads on smollm2), so then a long context's tasks are
 * split along the positions (flash-decoding): each chunk keeps its own max, sum and unnormalised sum of values (a
 * part of `part_len` floats), and the chunks are combined, rescaled to the overall max, at the end. The plan
 * depends on the thread count, not on which thread runs a task, so any thread may run any task with the same
 * result. */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t group, row, kv_per_task, tasks_per_seq, heads_per_task, whole_tasks, splits, part_len;
    int64_t slot_stride, head_stride; /* the cache's layout (see store_kv) */
    int parallel;                     /* worth waking the other threads for */
} decode_plan;

decode_plan plan_decode(const int64_t *seq_lens, int64_t batch, int64_t nheads, int64_t nkv, int64_t dim,
                        int64_t window, int64_t slot_stride, int64_t head_stride, int nthreads);

/* Task `task` of `plan` (a whole task, or with `parts` one split chunk's share, written there), and a whole task's
 * output from its split parts. q, k_cache, v_cache and out hold float (_f32) or bfloat16 (_bf16) values. */
void decode_run_task_f32(const decode_plan *plan, int64_t task, const float *q, int64_t q_stride,
                         const float *k_cache, const float *v_cache, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *seq_lens, float *out, int64_t nheads, int64_t dim,
                         int64_t block_size, float scale, int64_t window, float *parts);
void decode_run_task_bf16(const decode_plan *plan, int64_t task, const uint16_t *q, int64_t q_stride,
                          const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *block_tables,
                          int64_t table_stride, const int64_t *seq_lens, uint16_t *out, int64_t nheads, int64_t dim,
                          int64_t block_size, float scale, int64_t window, float *parts);
void decode_combine_f32(const decode_plan *plan, int64_t whole, const float *parts, float *out, int64_t nheads,
                        int64_t dim);
void decode_combine_bf16(const decode_plan *plan, int64_t whole, const float *parts, uint16_t *out, int64_t nheads,
                         int64_t dim);

#ifdef __cplusplus
}
#endif
