/*
 * What a P2P engine that consumes the trigger FIFO on the GPU itself would give, before the
 * library is changed to one: the all-gather of c_examples/cuda/allgather.cu (putWithSignal,
 * flush, wait; 10 kernels per CUDA graph, 10 graph launches) over 2 GPUs of one process, with
 *   - the FIFO's slots, ticket counter, tail and done word in device memory,
 *   - a resident engine kernel per GPU whose blocks all poll the FIFO in L2: a job above
 *     soloBytes is shared by every block (the last to finish publishes it), a smaller one is
 *     done by block ticket % blocks alone; jobs are published (flag, done word, tail) in
 *     ticket order,
 *   - flush() = wait until the done word reaches the ticket counter (no Sync trigger).
 * No CPU on the path. Every byte is checked after each size.
 *
 * With --mode direct, no FIFO and no engine: the all-gather kernel's B blocks store into the
 * peer themselves and signal (the floor of any proxy design).
 *
 *   fifo_engine_proto [--mode fifo|direct] [--blocks B] [--threads T] [--solo BYTES]
 *                     [--fence sys|gpu]
 *                     [--sizes 1M,64M,1G]
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 -o fifo_engine_proto fifo_engine_proto.cu
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d: %s: %s (device spin at line %d)\n", __FILE__, __LINE__, #x,        \
              cudaGetErrorString(e_), gHostWhere ? *gHostWhere : 0);                            \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static volatile int* gHostWhere;
typedef unsigned long long u64;
static const u64 kSlots = 128;

/* Device memory of one GPU's FIFO and engine. */
struct Fifo {
  u64* slots;     /* 2 words per slot; 0,0 = empty */
  u64* head;      /* ticket counter */
  u64* tail;      /* tickets below it completed and their slots zeroed (the room check) */
  u64* done;      /* same value: the done word flush() polls */
  u64* signals;   /* signals sent on the one connection */
  u64* expected;  /* wait()'s count */
  u64* epoch;     /* written by the peer's engine */
  unsigned* arrive; /* per slot: blocks done with it */
};

__device__ __forceinline__ u64 ldv(const u64* p) { return *(const volatile u64*)p; }

/* Every spin loop of this program ends: after 3 s of spinning the thread records where it was
 * in host-mapped memory and traps, so a bug shows as an error, not a hang. */
__device__ int* gWhere;
__device__ __forceinline__ u64 nowNs()
{
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct Bound {
  u64 start = 0;
  unsigned n = 0;
  __device__ void tick(int line)
  {
    if (++n % 1024) return;
    if (!start) start = nowNs();
    else if (nowNs() - start > 3000000000ull) {
      *(volatile int*)gWhere = line;
      __threadfence_system();
      __trap();
    }
  }
};
#define SPIN(cond)                                                                              \
  do {                                                                                          \
    Bound b_;                                                                                   \
    while (cond) b_.tick(__LINE__);                                                             \
  } while (0)
__device__ __forceinline__ void fenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fenceGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void stRelaxedSys(u64* p, u64 v)
{
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void ldSlot(const u64* p, u64& a, u64& b)
{
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ void stSlot(u64* p, u64 a, u64 b)
{
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

/* The library engine's own copy (its copyShare, taking addresses as integers): the comparison
 * is of the hand-off, not of the copy. The engine kernel comes along, unused. */
#include "../../src/cuda/kernels/p2p_engine.cu"

__device__ __forceinline__ void copyShare(char* dst, const char* src, u64 size, u64 first, u64 stride)
{
  copyShare((u64)dst, (u64)src, size, first, stride);
}

/* The engine: runs until *stop (host memory) is set. */
__global__ void __launch_bounds__(1024)
  engine(Fifo f, char* src, char* dst, u64* peerEpoch, volatile int* stop, u64 soloBytes,
         int workerSys)
{
  __shared__ u64 job[3];
  __shared__ int go;
  const unsigned nb = gridDim.x;
  /* Only this kernel moves the tail, and no earlier engine is running: a stable start. */
  const u64 k0 = ldv(f.tail);
  u64 tailSeen = k0;
  for (u64 k = k0;; k++) {
    if (threadIdx.x == 0) {
      u64* slot = f.slots + 2 * (k % kSlots);
      /* The slot holds ticket k's trigger only once ticket k - kSlots completed (its last
       * block zeroed it before the tail moved): until then it may hold the old one. */
      /* Ends on the trigger or on *stop, which the host sets once every producer finished. */
      unsigned spins = 0;
      while (k >= kSlots && tailSeen < k - kSlots + 1) {
        tailSeen = ldv(f.tail);
        if (++spins % 4096 == 0 && *stop) break;
      }
      u64 a = 0, b = 0;
      for (;;) {
        ldSlot(slot, a, b);
        if (a != 0 && b != 0) break;
        if (++spins % 4096 == 0 && *stop) break;
      }
      if (*stop) a = b = 0;
      go = a != 0 && b != 0;
      if (go) {
        fenceGpu(); /* acquire: the producer's source data before its trigger */
        job[0] = a & 0xffffffffull;         /* size */
        job[1] = a >> 32;                   /* src offset */
        job[2] = b & 0xffffffffull;         /* dst offset */
      }
    }
    __syncthreads();
    if (!go) return;
    const u64 size = job[0];
    const bool solo = size <= soloBytes;
    const bool mine = !solo || (k % nb) == blockIdx.x;
    unsigned* arrive = &f.arrive[k % kSlots];
    if (!mine) {
      /* Every block reads every slot: the publisher zeroes it only once all have. */
      if (threadIdx.x == 0) atomicAdd(arrive, 1u);
    } else {
      if (solo)
        copyShare(dst + job[2], src + job[1], size, threadIdx.x, blockDim.x);
      else
        copyShare(dst + job[2], src + job[1], size, (u64)blockIdx.x * blockDim.x + threadIdx.x,
                  (u64)nb * blockDim.x);
      __syncthreads();
      if (threadIdx.x == 0) {
        if (solo || workerSys) fenceSys(); /* release this block's stores to the system */
        else fenceGpu();
        bool publish = true;
        if (solo) {
          SPIN(*(volatile unsigned*)arrive != nb - 1);
        } else {
          /* Above: each worker's own system fence (or a GPU one: then the publisher's system
           * fence below is cumulative over every block it synchronised with). */
          publish = atomicAdd(arrive, 1u) == nb - 1;
          if (publish) fenceSys(); /* acquire every block's stores, release before the flag */
        }
        if (publish) {
          *arrive = 0;
          /* Publish in ticket order. */
          SPIN(ldv(f.tail) != k);
          /* An atomic, not ++: the publisher changes from block to block and a plain load may
           * hit a stale line in this SM's L1. */
          const u64 n = atomicAdd(f.signals, 1ull) + 1;
          stRelaxedSys(peerEpoch, n);
          stSlot(f.slots + 2 * (k % kSlots), 0, 0);
          fenceGpu();
          *(volatile u64*)f.done = k + 1;
          *(volatile u64*)f.tail = k + 1;
        }
      }
    }
    __syncthreads();
  }
}

/* The producer: one thread, putWithSignal + flush + wait. */
__global__ void allgather(Fifo f, u64 off, u64 bytes)
{
  if (threadIdx.x != 0) return;
  const u64 ticket = atomicAdd(f.head, 1ull);
  SPIN(ticket >= kSlots + ldv(f.tail));
  fenceGpu(); /* release: the engine (this GPU) reads the source after the trigger */
  stSlot(f.slots + 2 * (ticket % kSlots), bytes | off << 32, off | 1ull << 42);
  /* flush: every ticket taken so far done */
  const u64 target = ldv(f.head);
  SPIN(ldv(f.done) < target);
  fenceSys();
  const u64 want = ldv(f.expected) + 1;
  *(volatile u64*)f.expected = want;
  SPIN(ldv(f.epoch) < want);
  fenceSys();
}

/* The floor without any FIFO: the kernel's own blocks write the peer's half directly and the
 * last block to finish signals (no proxy, no engine): what a kernel that uses remoteBuff and
 * remoteSignalEpochId itself gets. */
__global__ void direct(Fifo f, const char* src, char* peerDst, u64 off, u64 bytes, u64* peerEpoch)
{
  copyShare(peerDst + off, src + off, bytes, (u64)blockIdx.x * blockDim.x + threadIdx.x,
            (u64)gridDim.x * blockDim.x);
  __syncthreads();
  if (threadIdx.x != 0) return;
  fenceGpu(); /* this block's stores before its arrival; the last one's system fence covers all */
  if (atomicAdd(f.arrive, 1u) != gridDim.x - 1) return;
  *f.arrive = 0; /* the next kernel on this stream starts after this one ended */
  fenceSys();
  const u64 n = atomicAdd(f.signals, 1ull) + 1;
  stRelaxedSys(peerEpoch, n);
  SPIN(ldv(f.epoch) < n);
  fenceSys();
}

__global__ void fill(uint32_t* buf, u64 words, int rank, uint32_t seed)
{
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x)
    buf[i] = (i < words / 2) == (rank == 0) ? (uint32_t)(i * 2654435761u) ^ seed : 0xdeadbeef;
}

__global__ void countBad(const uint32_t* buf, u64 words, uint32_t seed, unsigned long long* bad)
{
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x)
    if (buf[i] != ((uint32_t)(i * 2654435761u) ^ seed)) atomicAdd(bad, 1ull);
}

static u64 parseSize(const std::string& s)
{
  u64 v = strtoull(s.c_str(), nullptr, 10);
  switch (s.back()) {
  case 'K': return v << 10;
  case 'M': return v << 20;
  case 'G': return v << 30;
  }
  return v;
}

int main(int argc, char** argv)
{
  setvbuf(stdout, nullptr, _IONBF, 0);
  /* Lazy loading would load allgather's module while the engine spins waiting for it, and
   * loading waits for the running kernel: a deadlock. Load everything up front. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  int blocks = 8, threads = 1024;
  u64 solo = 64 << 10;
  int workerSys = 1;
  bool viaFifo = true;
  std::vector<u64> sizes = {1 << 20, 64 << 20, 1ull << 30};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--blocks") blocks = atoi(v.c_str());
    else if (a == "--threads") threads = atoi(v.c_str());
    else if (a == "--solo") solo = parseSize(v);
    else if (a == "--fence") workerSys = v == "sys";
    else if (a == "--mode") viaFifo = v != "direct";
    else if (a == "--sizes") {
      sizes.clear();
      size_t p = 0;
      while (p <= v.size()) {
        size_t q = v.find(',', p);
        if (q == std::string::npos) q = v.size();
        sizes.push_back(parseSize(v.substr(p, q - p)));
        p = q + 1;
      }
    }
  }
  const u64 maxBytes = *std::max_element(sizes.begin(), sizes.end());
  char* buf[2];
  Fifo f[2];
  cudaStream_t es[2], ps[2];
  int* stop;
  CK(cudaHostAlloc(&stop, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  *stop = 0;
  for (int g = 0; g < 2; g++) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&buf[g], maxBytes));
    u64* words;
    CK(cudaMalloc(&words, (2 * kSlots + 16) * 8 + kSlots * 4));
    CK(cudaMemset(words, 0, (2 * kSlots + 16) * 8 + kSlots * 4));
    f[g].slots = words;
    f[g].head = words + 2 * kSlots;
    f[g].tail = f[g].head + 2;
    f[g].done = f[g].head + 4;
    f[g].signals = f[g].head + 6;
    f[g].expected = f[g].head + 8;
    f[g].epoch = f[g].head + 10;
    f[g].arrive = (unsigned*)(f[g].head + 16);
    CK(cudaStreamCreateWithFlags(&es[g], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&ps[g], cudaStreamNonBlocking));
  }
  int* dstop;
  CK(cudaHostGetDevicePointer((void**)&dstop, stop, 0));
  int *where, *dwhere;
  CK(cudaHostAlloc(&where, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  *where = 0;
  gHostWhere = where;
  CK(cudaHostGetDevicePointer((void**)&dwhere, where, 0));
  for (int g = 0; g < 2; g++) {
    CK(cudaSetDevice(g));
    CK(cudaMemcpyToSymbol(gWhere, &dwhere, sizeof(dwhere)));
  }
  cudaEvent_t ev[2][2];
  for (int g = 0; g < 2; g++) {
    CK(cudaSetDevice(g));
    CK(cudaEventCreate(&ev[g][0]));
    CK(cudaEventCreate(&ev[g][1]));
  }
  if (viaFifo)
    printf("fifo_engine_proto: FIFO + engine of %d blocks x %d threads, solo <= %llu bytes, worker "
           "fence %s\n", blocks, threads, solo, workerSys ? "sys" : "gpu");
  else
    printf("fifo_engine_proto: direct, all-gather kernel of %d blocks x %d threads\n", blocks,
           threads);
  printf("%-12s %-14s\n", "total bytes", "us/allgather");
  int failures = 0;
  uint32_t seed = 7;
  for (u64 total : sizes) {
    const u64 half = total / 2;
    for (int g = 0; g < 2; g++) {
      CK(cudaSetDevice(g));
      fill<<<264, 512, 0, ps[g]>>>((uint32_t*)buf[g], total / 4, g, seed);
      CK(cudaStreamSynchronize(ps[g]));
    }
    /* The engines: resident for this size, stopped after. */
    *stop = 0;
    for (int g = 0; g < 2 && viaFifo; g++) {
      CK(cudaSetDevice(g));
      engine<<<blocks, threads, 0, es[g]>>>(f[g], buf[g], buf[1 - g], f[1 - g].epoch, dstop, solo,
                                           workerSys);
      CK(cudaGetLastError());
    }
    cudaGraphExec_t exec[2];
    for (int g = 0; g < 2; g++) {
      CK(cudaSetDevice(g));
      cudaGraph_t graph;
      CK(cudaStreamBeginCapture(ps[g], cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < 10; k++) {
        if (viaFifo) allgather<<<1, 32, 0, ps[g]>>>(f[g], g * half, half);
        else direct<<<blocks, threads, 0, ps[g]>>>(f[g], buf[g], buf[1 - g], g * half, half,
                                                    f[1 - g].epoch);
      }
      CK(cudaStreamEndCapture(ps[g], &graph));
      CK(cudaGraphInstantiate(&exec[g], graph, 0));
      CK(cudaGraphDestroy(graph));
      CK(cudaGraphLaunch(exec[g], ps[g])); /* warm-up */
    }
    for (int g = 0; g < 2; g++) {
      CK(cudaSetDevice(g));
      CK(cudaStreamSynchronize(ps[g]));
    }
    std::vector<double> runs;
    for (int rep = 0; rep < 5; rep++) {
      for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaEventRecord(ev[g][0], ps[g]));
        for (int l = 0; l < 10; l++) CK(cudaGraphLaunch(exec[g], ps[g]));
        CK(cudaEventRecord(ev[g][1], ps[g]));
      }
      double worst = 0;
      for (int g = 0; g < 2; g++) {
        CK(cudaSetDevice(g));
        CK(cudaEventSynchronize(ev[g][1]));
        float ms;
        CK(cudaEventElapsedTime(&ms, ev[g][0], ev[g][1]));
        worst = std::max(worst, ms * 1000.0 / 100);
      }
      runs.push_back(worst);
    }
    *stop = 1;
    for (int g = 0; g < 2; g++) {
      CK(cudaSetDevice(g));
      if (viaFifo) CK(cudaStreamSynchronize(es[g]));
      CK(cudaGraphExecDestroy(exec[g]));
    }
    /* Check: both halves on both GPUs equal the pattern. */
    for (int g = 0; g < 2; g++) {
      CK(cudaSetDevice(g));
      unsigned long long* bad;
      CK(cudaMallocManaged(&bad, 8));
      *bad = 0;
      countBad<<<264, 512>>>((const uint32_t*)buf[g], total / 4, seed, bad);
      CK(cudaDeviceSynchronize());
      if (*bad) {
        printf("GPU %d: %llu bad words at %llu bytes\n", g, *bad, total);
        failures++;
      }
      CK(cudaFree(bad));
    }
    std::sort(runs.begin(), runs.end());
    printf("%-12llu %-8.2f (min %.2f max %.2f, 5 runs of 100)\n", total, runs[2], runs[0], runs[4]);
    fflush(stdout);
    seed++;
  }
  printf("fifo_engine_proto: %s\n", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
