/*
 * What each step of the P2P proxy costs on this machine: CPU time per driver call, and the
 * latency from submitting a copy to seeing it complete. The P2P transport (src/transport/p2p)
 * is a chain of these calls, so this decides how it issues work.
 *
 *   driver_costs LOCAL_GPU REMOTE_GPU
 *
 * The destination is memory of REMOTE_GPU owned by a forked child process and opened through
 * CUDA IPC, as a peer rank's buffer is. Every figure is the median of many repetitions.
 * Build: nvcc -O2 -arch=sm_90 -o driver_costs driver_costs.cu -lcuda
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    CUresult r_ = (x);                                                                          \
    if (r_ != CUDA_SUCCESS) {                                                                   \
      const char* s_ = nullptr;                                                                 \
      cuGetErrorString(r_, &s_);                                                                \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?");               \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#define RCK(x)                                                                                  \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static const size_t kBytes = 64ull << 20;

static double nowUs()
{
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__global__ void emptyKernel() {}

/* Copies n16 16-byte words, then the last block to finish writes `seq` to `done`. */
__global__ void copyKernel(const int4* src, int4* dst, size_t n16, unsigned long long* done,
                           unsigned long long seq, unsigned int* finished)
{
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(finished, 1u) == gridDim.x - 1) {
      *finished = 0;
      __threadfence_system();
      *(volatile unsigned long long*)done = seq;
    }
  }
}

static void launchEmpty(CUstream s)
{
  emptyKernel<<<1, 1, 0, (cudaStream_t)s>>>();
  RCK(cudaGetLastError());
}

/* CPU microseconds per call: `batch` calls back to back on an idle stream, then a sync. */
template <class F>
static double perCall(CUstream s, int batch, int reps, F f)
{
  std::vector<double> v;
  for (int r = 0; r < reps; r++) {
    CK(cuStreamSynchronize(s));
    const double t0 = nowUs();
    for (int i = 0; i < batch; i++) f(i);
    v.push_back((nowUs() - t0) / batch);
  }
  CK(cuStreamSynchronize(s));
  return median(v);
}

static uint64_t gSeq = 0;

/* Microseconds from the start of `submit(seq)` until `word` reads seq (bounded: 2 s). */
template <class F>
static double untilWord(CUstream s, volatile uint64_t* word, int reps, F submit)
{
  std::vector<double> v;
  for (int r = 0; r < reps; r++) {
    CK(cuStreamSynchronize(s));
    const uint64_t seq = ++gSeq;
    const double t0 = nowUs();
    submit(seq);
    uint64_t spins = 0;
    while (*word != seq) {
      if (++spins % (1u << 20) == 0 && nowUs() - t0 > 2e6) {
        fprintf(stderr, "timed out waiting for the completion word\n");
        exit(1);
      }
    }
    v.push_back(nowUs() - t0);
  }
  return median(v);
}

/* Microseconds from the start of `submit()` until cuStreamQuery reports the stream idle, and
 * the median number of queries that took. */
template <class F>
static double untilIdle(CUstream s, int reps, double* queries, F submit)
{
  std::vector<double> v, q;
  for (int r = 0; r < reps; r++) {
    CK(cuStreamSynchronize(s));
    const double t0 = nowUs();
    submit();
    int n = 0;
    CUresult res;
    while ((res = cuStreamQuery(s)) == CUDA_ERROR_NOT_READY) n++;
    CK(res);
    v.push_back(nowUs() - t0);
    q.push_back(n);
  }
  *queries = median(q);
  return median(v);
}

int main(int argc, char** argv)
{
  if (argc != 3) {
    fprintf(stderr, "usage: %s LOCAL_GPU REMOTE_GPU\n", argv[0]);
    return 2;
  }
  const int localDev = atoi(argv[1]), remoteDev = atoi(argv[2]);
  int toParent[2], toChild[2];
  if (pipe(toParent) || pipe(toChild)) return 1;
  const pid_t pid = fork();
  if (pid == 0) {
    /* The peer: owns REMOTE_GPU memory and exports it; exits when the parent is done. */
    CK(cuInit(0));
    CUdevice d;
    CK(cuDeviceGet(&d, remoteDev));
    CUcontext c;
    CK(cuDevicePrimaryCtxRetain(&c, d));
    CK(cuCtxSetCurrent(c));
    CUdeviceptr p;
    CK(cuMemAlloc(&p, kBytes));
    CK(cuMemsetD8(p, 0, kBytes));
    CUipcMemHandle h;
    CK(cuIpcGetMemHandle(&h, p));
    if (write(toParent[1], &h, sizeof h) != (ssize_t)sizeof h) _exit(1);
    char x;
    if (read(toChild[0], &x, 1) != 1) _exit(1);
    _exit(0);
  }
  CUipcMemHandle h;
  if (read(toParent[0], &h, sizeof h) != (ssize_t)sizeof h) {
    fprintf(stderr, "child failed\n");
    return 1;
  }
  RCK(cudaSetDevice(localDev));
  RCK(cudaFree(0));
  CK(cuInit(0));
  CUdeviceptr remote, local, local2;
  CK(cuIpcOpenMemHandle(&remote, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CK(cuMemAlloc(&local, kBytes));
  CK(cuMemAlloc(&local2, kBytes));
  CK(cuMemsetD8(local, 1, kBytes));
  void* hostp = nullptr;
  CK(cuMemHostAlloc(&hostp, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CUdeviceptr hostd;
  CK(cuMemHostGetDevicePointer(&hostd, hostp, 0));
  volatile uint64_t* word = (volatile uint64_t*)hostp;
  *word = 0;
  unsigned int* finished;
  RCK(cudaMalloc(&finished, 4));
  RCK(cudaMemset(finished, 0, 4));
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent ev;
  CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  const size_t k512 = 512 << 10;

  printf("driver_costs: local GPU %d -> remote GPU %d (CUDA IPC), CPU %d\n", localDev, remoteDev,
         sched_getcpu());
  /* Warm everything up once. */
  for (int i = 0; i < 100; i++) {
    CK(cuMemcpyDtoDAsync(remote, local, k512, s));
    CK(cuStreamWriteValue64(s, remote + k512, i, 0));
    CK(cuStreamWriteValue64(s, hostd + 8, i, 0));
  }
  CK(cuStreamSynchronize(s));

  const int reps = 400;
  printf("CPU us per call (idle stream | 32 queued):\n");
#define COST(name, expr)                                                                        \
  printf("  %-44s %6.2f | %6.2f\n", name, perCall(s, 1, reps, [&](int i) { expr; }),          \
         perCall(s, 32, reps / 8, [&](int i) { expr; }))
  COST("cuMemcpyDtoDAsync 512 KiB -> peer", CK(cuMemcpyDtoDAsync(remote, local, k512, s)));
  COST("cuMemcpyAsync 512 KiB -> peer", CK(cuMemcpyAsync(remote, local, k512, s)));
  COST("cuMemcpyDtoDAsync 8 B -> peer", CK(cuMemcpyDtoDAsync(remote, local, 8, s)));
  COST("cuMemcpyDtoDAsync 512 KiB local", CK(cuMemcpyDtoDAsync(local2, local, k512, s)));
  COST("cuStreamWriteValue64 -> peer", CK(cuStreamWriteValue64(s, remote + 64, i, 0)));
  COST("cuStreamWriteValue64 -> pinned host", CK(cuStreamWriteValue64(s, hostd + 8, i, 0)));
  {
    CUstreamBatchMemOpParams p[2] = {};
    p[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    p[0].writeValue.address = remote + 64;
    p[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    p[1].writeValue.address = hostd + 8;
    COST("cuStreamBatchMemOp 2 writes (peer, host)", p[0].writeValue.value64 = i;
         p[1].writeValue.value64 = i; CK(cuStreamBatchMemOp(s, 2, p, 0)));
  }
  COST("cuEventRecord", CK(cuEventRecord(ev, s)));
  COST("cuStreamQuery (idle)", (void)cuStreamQuery(s));
  COST("emptyKernel<<<1,1>>>", launchEmpty(s));
  COST("cuLaunchHostFunc (no-op)",
       CK(cuLaunchHostFunc(s, [](void*) {}, nullptr)));
  {
    /* Queries while a 64 MiB copy (~170 us) runs. */
    std::vector<double> v;
    for (int r = 0; r < 20; r++) {
      CK(cuMemcpyDtoDAsync(remote, local, kBytes, s));
      const double t0 = nowUs();
      int n = 0;
      while (cuStreamQuery(s) == CUDA_ERROR_NOT_READY && n < 100) n++;
      v.push_back((nowUs() - t0) / (n ? n : 1));
      CK(cuStreamSynchronize(s));
    }
    printf("  %-44s %6.2f\n", "cuStreamQuery (busy)", median(v));
    v.clear();
    for (int r = 0; r < 20; r++) {
      CK(cuMemcpyDtoDAsync(remote, local, kBytes, s));
      CK(cuEventRecord(ev, s));
      const double t0 = nowUs();
      int n = 0;
      while (cuEventQuery(ev) == CUDA_ERROR_NOT_READY && n < 100) n++;
      v.push_back((nowUs() - t0) / (n ? n : 1));
      CK(cuStreamSynchronize(s));
    }
    printf("  %-44s %6.2f\n", "cuEventQuery (busy)", median(v));
  }

  printf("latency, us from the first call to seeing completion on the CPU:\n");
  const size_t sizes[] = {8, 64 << 10, 512 << 10, 4 << 20};
  for (size_t n : sizes) {
    const double a = untilWord(s, word, reps, [&](uint64_t seq) {
      CK(cuMemcpyDtoDAsync(remote, local, n, s));
      CK(cuStreamWriteValue64(s, hostd, seq, 0));
    });
    double q = 0;
    const double b = untilIdle(s, reps, &q, [&] { CK(cuMemcpyDtoDAsync(remote, local, n, s)); });
    const double c = untilWord(s, word, reps, [&](uint64_t seq) {
      copyKernel<<<32, 512, 0, (cudaStream_t)s>>>((const int4*)local, (int4*)remote,
                                                  (n + 15) / 16, (unsigned long long*)hostd, seq,
                                                  finished);
    });
    const double d = untilWord(s, word, reps, [&](uint64_t seq) {
      copyKernel<<<8, 1024, 0, (cudaStream_t)s>>>((const int4*)local, (int4*)remote,
                                                  (n + 15) / 16, (unsigned long long*)hostd, seq,
                                                  finished);
    });
    printf("  %8zu B: memcpy+writeValue(host) %6.2f | memcpy, poll query %6.2f (%.0f queries)"
           " | copy kernel 32x512 %6.2f | 8x1024 %6.2f\n",
           n, a, b, q, c, d);
  }
  const double w = untilWord(s, word, reps, [&](uint64_t seq) {
    CK(cuStreamWriteValue64(s, hostd, seq, 0));
  });
  printf("  writeValue(host) alone: %.2f us\n", w);
  RCK(cudaGetLastError());

  char x = 0;
  if (write(toChild[1], &x, 1) != 1) return 1;
  CK(cuIpcCloseMemHandle(remote));
  int st = 0;
  waitpid(pid, &st, 0);
  return 0;
}
