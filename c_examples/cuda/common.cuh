/*
 * Shared by the CUDA examples: return-code checks, the rank environment, device choice, the
 * connection array in __constant__ memory, data patterns and timing helpers.
 */
#ifndef MSCCLPP_CUDA_EXAMPLES_COMMON_CUH_
#define MSCCLPP_CUDA_EXAMPLES_COMMON_CUH_

#include <cuda_runtime.h>

#include <mscclpp.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#include "launch_env.h"

/* Every CUDA and mscclpp call is checked: a failure prints where and why, then exits 1. */
#define CUDACHECK(cmd)                                                                          \
  do {                                                                                          \
    cudaError_t e_ = (cmd);                                                                     \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #cmd,                       \
              cudaGetErrorString(e_));                                                          \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#define MSCCLPPCHECK(cmd)                                                                       \
  do {                                                                                          \
    mscclppResult_t r_ = (cmd);                                                                 \
    if (r_ != mscclppSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #cmd,                  \
              mscclppGetErrorString(r_), mscclppGetLastError());                                \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

/* After a kernel launch: the launch itself, then (when asked) its execution. */
#define KERNELCHECK()                                                                           \
  do {                                                                                          \
    CUDACHECK(cudaGetLastError());                                                              \
  } while (0)

/* The connections of this rank, one per peer, for kernels (copied with cudaMemcpyToSymbol). */
#define MAX_CONNS 64
__constant__ mscclppDevConn_t gConns[MAX_CONNS];

struct Ctx {
  int rank = 0;
  int nranks = 1;
  int device = 0;
  int ndevices = 0;
  char root[256] = {0};
  mscclppComm_t comm = nullptr;
  int nconns = 0;
  std::vector<int> peerOfConn; /* remote rank of connection i */
  bool allP2P = true;          /* every connection has remoteBuff (kernels may store to peers) */
};

/* Rank, size and root from the launcher (launch_env.h; its options are removed from argv),
 * GPU local_rank % ngpus, then the communicator. */
static inline void setupRank(Ctx& c, int* argc, char** argv)
{
  launch_env env;
  if (launch_env_parse(argc, argv, &env) != 0) exit(2);
  c.rank = env.rank;
  c.nranks = env.nranks;
  snprintf(c.root, sizeof c.root, "%s", env.root);
  CUDACHECK(cudaGetDeviceCount(&c.ndevices));
  if (c.ndevices <= 0) {
    fprintf(stderr, "no CUDA device\n");
    exit(1);
  }
  c.device = env.local_rank % c.ndevices;
  CUDACHECK(cudaSetDevice(c.device));
  CUDACHECK(cudaFree(0)); /* create the primary context before the library looks at pointers */
  MSCCLPPCHECK(mscclppCommInitRank(&c.comm, c.nranks, c.root, c.rank));
}

/* The transport to `peer`, from MSCCLPP_EXAMPLE_TRANSPORT: p2p (default), ib (libfabric; the
 * provider from MSCCLPP_NET_PROVIDER), shm, or mixed (ib when rank + peer is odd, else p2p: the
 * same answer on both sides, and with 3+ ranks both kinds in one communicator). */
static inline mscclppTransport_t transportTo(const Ctx& c, int peer)
{
  const char* t = getenv("MSCCLPP_EXAMPLE_TRANSPORT");
  if (t == nullptr || strcmp(t, "p2p") == 0) return mscclppTransportP2P;
  if (strcmp(t, "ib") == 0) return mscclppTransportIB;
  if (strcmp(t, "shm") == 0) return mscclppTransportSHM;
  if (strcmp(t, "mixed") == 0) return (c.rank + peer) % 2 ? mscclppTransportIB : mscclppTransportP2P;
  fprintf(stderr, "MSCCLPP_EXAMPLE_TRANSPORT=%s: expected p2p, ib, shm or mixed\n", t);
  exit(2);
}

/* Connects `buf` (bytes) to every peer in `peers` (transport: transportTo), sets up, copies the
 * connections into gConns in the order of `peers`, and launches the proxy (unless
 * `launchProxy` is false: the caller launches it later). */
static inline void connectPeers(Ctx& c, void* buf, uint64_t bytes, const std::vector<int>& peers,
                                bool launchProxy = true)
{
  if ((int)peers.size() > MAX_CONNS) {
    fprintf(stderr, "too many peers\n");
    exit(1);
  }
  for (int p : peers) {
    const mscclppTransport_t t = transportTo(c, p);
    if (t != mscclppTransportP2P) c.allP2P = false;
    MSCCLPPCHECK(mscclppConnect(c.comm, p, 0, buf, bytes, t));
  }
  MSCCLPPCHECK(mscclppConnectionSetup(c.comm));
  mscclppDevConn_t* conns = nullptr;
  int n = 0;
  MSCCLPPCHECK(mscclppGetAllDeviceConnections(c.comm, &conns, &n));
  if (n != (int)peers.size()) {
    fprintf(stderr, "rank %d: %d connections, expected %zu\n", c.rank, n, peers.size());
    exit(1);
  }
  for (int i = 0; i < n; i++) {
    /* Only P2P connections map the peer's memory (remoteBuff, remoteSignalEpochId). */
    const bool p2p = transportTo(c, peers[i]) == mscclppTransportP2P;
    if (conns[i].remoteRank != peers[i] ||
        (p2p && (conns[i].remoteBuff == nullptr || conns[i].remoteSignalEpochId == nullptr))) {
      fprintf(stderr, "rank %d: connection %d: remoteRank %d (expected %d), remoteBuff %p, remoteSignalEpochId %p\n",
              c.rank, i, conns[i].remoteRank, peers[i], conns[i].remoteBuff,
              (void*)conns[i].remoteSignalEpochId);
      exit(1);
    }
    /* The lookup by (remoteRank, tag) must name the same connection. */
    mscclppDevConn_t* one = nullptr;
    MSCCLPPCHECK(mscclppGetDeviceConnection(c.comm, peers[i], 0, &one));
    if (memcmp(one, &conns[i], sizeof *one) != 0) {
      fprintf(stderr, "rank %d: mscclppGetDeviceConnection disagrees for peer %d\n", c.rank, peers[i]);
      exit(1);
    }
  }
  CUDACHECK(cudaMemcpyToSymbol(gConns, conns, n * sizeof(mscclppDevConn_t)));
  c.nconns = n;
  c.peerOfConn = peers;
  if (launchProxy) MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
}

/* Seconds on a monotonic clock. */
static inline double now_sec()
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Ends the rank: reports a background (proxy) error of the communicator, then stops and
 * destroys it. Returns 1 if there was such an error, else 0 (to add to the failures). */
/* The communicator's asynchronous error once it has one, or mscclppSuccess after `seconds`
 * (a refusal or timeout the proxy reports on its own). */
static inline mscclppResult_t awaitAsyncError(Ctx& c, double seconds)
{
  mscclppResult_t async = mscclppSuccess;
  const double until = now_sec() + seconds;
  /* Ends at the first error, or after `seconds`. */
  while (async == mscclppSuccess && now_sec() < until) {
    MSCCLPPCHECK(mscclppCommGetAsyncError(c.comm, &async));
    if (async == mscclppSuccess) usleep(1000);
  }
  return async;
}

static inline int teardown(Ctx& c)
{
  enum mscclppResult_t async = mscclppSuccess;
  MSCCLPPCHECK(mscclppCommGetAsyncError(c.comm, &async));
  if (async != mscclppSuccess)
    fprintf(stderr, "rank %d: asynchronous error %d: %s\n", c.rank, (int)async,
            mscclppGetLastError());
  /* Every kernel of this rank has finished (each example waits for its stream), and after the
   * barrier every peer's too. The proxies stop before the device-wide synchronization on
   * purpose: nothing the library runs on the GPU (its P2P copy kernel) may outlive
   * mscclppProxyStop, or this call would wait for it forever. */
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  MSCCLPPCHECK(mscclppProxyStop(c.comm));
  CUDACHECK(cudaDeviceSynchronize());
  /* MSCCLPP_EXAMPLE_DESTROY_DELAY_MS: ranks other than 0 destroy that much later (the GPU
   * check shows rank 0's destroy waiting for its CUDA IPC peers to close their mappings). */
  const char* delay = getenv("MSCCLPP_EXAMPLE_DESTROY_DELAY_MS");
  if (delay != nullptr && c.rank != 0) usleep((useconds_t)atoi(delay) * 1000);
  double t_destroy = now_sec();
  MSCCLPPCHECK(mscclppCommDestroy(c.comm));
  if (delay != nullptr)
    printf("rank %d: mscclppCommDestroy took %.3f s\n", c.rank, now_sec() - t_destroy);
  c.comm = nullptr;
  return async != mscclppSuccess;
}

/* A position- and owner-dependent 32-bit pattern: a word that landed in the wrong place, or
 * came from the wrong rank or iteration, differs. */
__host__ __device__ inline uint32_t pattern(int owner, uint64_t word, uint32_t seed)
{
  uint64_t x = (word + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(owner + 1) << 40) ^
               ((uint64_t)seed << 20);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return (uint32_t)x;
}

/* Word i of a buffer of `nranks` slices belongs to rank i / wordsPerRank. Own slice: the
 * pattern; the others: its complement (so an untouched word never passes). */
__global__ void fillKernel(uint32_t* buf, uint64_t wordsPerRank, int rank, int nranks,
                           uint32_t seed)
{
  const uint64_t total = wordsPerRank * nranks;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < total;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const int owner = (int)(i / wordsPerRank);
    const uint32_t v = pattern(owner, i, seed);
    buf[i] = owner == rank ? v : ~v;
  }
}

/* Counts words of slices [first, first + count) that differ from their owner's pattern. */
__global__ void checkKernel(const uint32_t* buf, uint64_t wordsPerRank, int first, int count,
                            uint32_t seed, unsigned long long* bad)
{
  const uint64_t begin = wordsPerRank * first, end = wordsPerRank * (first + count);
  unsigned long long mine = 0;
  for (uint64_t i = begin + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < end;
       i += (uint64_t)gridDim.x * blockDim.x) {
    if (buf[i] != pattern((int)(i / wordsPerRank), i, seed)) mine++;
  }
  if (mine) atomicAdd(bad, mine);
}

static inline unsigned long long countBad(const uint32_t* buf, uint64_t wordsPerRank, int first,
                                          int count, uint32_t seed, cudaStream_t s)
{
  unsigned long long* d = nullptr;
  unsigned long long h = 0;
  CUDACHECK(cudaMallocAsync(&d, sizeof h, s));
  CUDACHECK(cudaMemsetAsync(d, 0, sizeof h, s));
  checkKernel<<<264, 512, 0, s>>>(buf, wordsPerRank, first, count, seed, d);
  KERNELCHECK();
  CUDACHECK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, s));
  CUDACHECK(cudaFreeAsync(d, s));
  CUDACHECK(cudaStreamSynchronize(s));
  return h;
}

/* The largest of every rank's value (collective). */
static inline double maxOverRanks(Ctx& c, double v)
{
  std::vector<double> all(c.nranks);
  all[c.rank] = v;
  MSCCLPPCHECK(mscclppBootstrapAllGather(c.comm, all.data(), sizeof(double)));
  double m = all[0];
  for (double x : all) m = x > m ? x : m;
  return m;
}

static inline uint64_t parseBytes(const char* s)
{
  char* end = nullptr;
  double v = strtod(s, &end);
  uint64_t mul = 1;
  if (end && (*end == 'K' || *end == 'k')) mul = 1ull << 10;
  if (end && (*end == 'M' || *end == 'm')) mul = 1ull << 20;
  if (end && (*end == 'G' || *end == 'g')) mul = 1ull << 30;
  return (uint64_t)(v * (double)mul);
}

static inline bool hasFlag(int argc, char** argv, const char* f)
{
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], f) == 0) return true;
  return false;
}

static inline const char* flagValue(int argc, char** argv, const char* f)
{
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], f) == 0) return argv[i + 1];
  return nullptr;
}

/* Device nanosecond clock (coarse, but steady across SM clock changes). */
__device__ inline uint64_t globalTimerNs()
{
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#endif
