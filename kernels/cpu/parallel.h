/* When the CPU kernels wake the OpenMP pool (C and C++ alike). */
#pragma once

/* Parallelise only work big enough to pay for waking the pool: a region costs microseconds on an idle machine
 * but a scheduler time slice when another thread holds a core (the engine's event loop, a neighbour), so decode-
 * sized elementwise ops stay on the calling thread, as torch's own grain size (32768) keeps them. */
#define PARALLEL_MIN_ELEMS 65536

/* The team's thread numbers; a build without OpenMP (the ARM cross-compile check) runs one thread. */
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
