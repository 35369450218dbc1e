// The wide schedule's bfloat16 instantiations (packed_wide.h), a compilation of their own beside packed_wide.cpp's.
#include <cstdint>

#include "packed_wide.h"

namespace ksana::packed {

#if KSANA_VEC_AVX512 || defined(KSANA_WIDE_LANES)
template void panel_groups<bf16>(const float *, const bf16 *, const bf16 *, bf16 *, int64_t, int64_t, int64_t,
                                 int64_t *, int64_t, GreedyGroups *);
template void swiglu_groups<bf16>(const float *, const bf16 *, int64_t, int64_t, int64_t, int64_t *, int64_t,
                                  float *);
#endif

}  // namespace ksana::packed
