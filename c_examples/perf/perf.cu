/* The CUDA build of the nccl-tests-style tools: perf.c with PERF_GPU (GPU buffers, a kernel per
 * operation). CMake builds this instead of perf.c where nvcc is found. */
#define PERF_GPU 1
#include "perf.c"
