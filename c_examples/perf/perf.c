/*
 * allgather_perf, alltoall_perf, sendrecv_perf: collective benchmarks in nccl-tests' conventions
 * (options, the header, one row per size, the closing "# Avg bus bandwidth" line), built from
 * this one file with PERF_OP set to the operation. Built as C (no nvcc) it runs on host memory
 * over libfabric, on any machine and in CI; built as CUDA (perf.cu, which defines PERF_GPU and
 * includes this file) it runs on the GPUs, one per rank (local rank % GPUs), a kernel issuing
 * the operation through the device methods, or with `-G 0` on host memory as the C build.
 *
 *   scripts/run-local-ranks.sh 2 ./allgather_perf -b 8 -e 4M -f 4
 *   mpirun -np 4 ./alltoall_perf -b 1K -e 64M -f 2 -T shm
 *
 * Options (nccl-tests'): -b MIN bytes, -e MAX bytes (K, M, G suffixes), -f FACTOR between
 * sizes (or -i STEP bytes), -n ITERS timed (20), -w WARMUP iterations (5), -c CHECK (1:
 * verify every size, counting wrong bytes into #wrong), -g GPUS per process (1), -t THREADS
 * (1); ours: -T p2p|ib|shm|mixed (transport: p2p is CUDA IPC, GPU memory only, the default
 * there; ib is libfabric with the provider from MSCCLPP_NET_PROVIDER, tcp by default, the
 * default on host memory; shm; mixed: p2p (GPU) or shm (host) to ranks on this host, ib to the
 * others), -G 1|0 (GPU or host memory; 1 where the build has CUDA and a GPU is found), -B
 * BLOCKS (GPU: each put split over up to BLOCKS blocks of 512 threads, 64 KiB or more each,
 * by putWithSignalBlock(), the peer waiting once per block, as NVSHMEM's block puts; one block
 * per peer where the chunks would be over the library's block limit, which hands such puts to
 * the proxy; 0: one putWithSignal() per peer by one thread, the 2023 way; default 128 over
 * -T p2p, else 0).
 * Rank, size and root come from launch_env.h (mpirun, srun, torchrun or
 * scripts/run-local-ranks.sh).
 *
 * Each operation is one-sided: every rank puts its data into its peers' buffers with
 * putWithSignal, then waits for each peer's signal (on GPUs: one kernel per operation, a warp
 * per peer; the own slice copied by the same kernel, where the operation needs it); every
 * batch of operations (warm-up, timed) ends with a flush of every connection, timed. The
 * buffer registered with every connection holds the receive area first, then the send area,
 * so out-of-place operations
 * read the send area and write the peers' receive areas; in-place all-gather sends each rank's
 * slice from where it sits in the receive area. Type uint8, so count = bytes.
 * Time: the mean over ranks of each rank's mean per iteration (nccl-tests' default); algbw =
 * size / time; busbw as nccl-tests' PERFORMANCE.md: all-gather and all-to-all algbw * (n-1)/n,
 * sendrecv algbw.
 */
#define _POSIX_C_SOURCE 200809L

#include <mscclpp.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "launch_env.h"

#ifdef PERF_GPU
#include <cuda_runtime.h>

#include "block_puts.h"
/* A failed CUDA call: where and why, then the jump (as MSCCLPP_CHECK_GOTO). */
#define CUDA_CHECK_GOTO(cmd, label)                                                       \
  do {                                                                                    \
    cudaError_t e_ = (cmd);                                                               \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "[rank %d] %s:%d: %s failed: %s\n", example_rank, __FILE__, __LINE__, \
              #cmd, cudaGetErrorString(e_));                                              \
      goto label;                                                                         \
    }                                                                                     \
  } while (0)
#endif

#define OP_ALLGATHER 1
#define OP_ALLTOALL 2
#define OP_SENDRECV 3

#ifndef PERF_OP
#error "build with -DPERF_OP=OP_ALLGATHER, OP_ALLTOALL or OP_SENDRECV"
#endif

#if PERF_OP == OP_ALLGATHER
static const char *op_name = "allgather";
#elif PERF_OP == OP_ALLTOALL
static const char *op_name = "alltoall";
#else
static const char *op_name = "sendrecv";
#endif

static double now_us(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* The byte that rank `from` sends to rank `to` at index `i` of a message, for size `size`. */
static unsigned char pattern(int from, int to, size_t i, size_t size)
{
  return (unsigned char)(from * 29 + to * 7 + (int)(i % 251) + (int)(i >> 12) + (int)(size % 13));
}

/* "8", "4K", "64M", "1G" -> bytes; 0 on a bad value. */
static size_t parse_size(const char *s)
{
  char *end;
  double v = strtod(s, &end);
  size_t m = 1;
  if (end == s || v < 0) {
    return 0;
  }
  switch (*end) {
  case 'K': case 'k': m = 1u << 10; end++; break;
  case 'M': case 'm': m = 1u << 20; end++; break;
  case 'G': case 'g': m = 1u << 30; end++; break;
  default: break;
  }
  return *end == '\0' ? (size_t)(v * (double)m) : 0;
}

typedef struct perf {
  mscclppComm_t comm;
  mscclppDevConn_t *conns; /* one per peer, in rank order without us */
  int nconns, rank, nranks;
  unsigned char *buf;       /* host memory: the buffer; GPU: its host mirror (fill, check) */
  size_t recv_bytes;        /* the receive area: nranks * max per-rank bytes */
  size_t bytes;             /* the whole buffer: receive area, then send area */
  mscclppDevConn_t **to;    /* to[r]: the connection to rank r (NULL for us) */
  int gpu;                  /* the buffer is GPU memory (PERF_GPU builds, -G 1) */
  int blocks;               /* -B: blocks per peer at most (block puts); 0: one thread */
  uint64_t block_limit;     /* -B: the largest block put the library copies directly */
#ifdef PERF_GPU
  unsigned char *dbuf;      /* the buffer in GPU memory */
  mscclppDevConn_t *dconns; /* the connections, copied to GPU memory for the kernel */
  cudaStream_t stream;
#endif
} perf;

/* Per-rank bytes of an operation of `size` (nccl-tests' size column) and its send area use. */
static size_t per_rank(size_t size, int nranks)
{
#if PERF_OP == OP_SENDRECV
  (void)nranks;
  return size;
#else
  return size / (size_t)nranks;
#endif
}

/* Fills what this rank sends for `size`. */
static void fill(perf *p, size_t size, int in_place)
{
  size_t n = per_rank(size, p->nranks), i;
  unsigned char *send = p->buf + p->recv_bytes;
  int r;
#if PERF_OP == OP_ALLGATHER
  unsigned char *dst = in_place ? p->buf + (size_t)p->rank * n : send;
  for (i = 0; i < n; i++) dst[i] = pattern(p->rank, 0, i, size);
  (void)r;
#elif PERF_OP == OP_ALLTOALL
  (void)in_place;
  for (r = 0; r < p->nranks; r++)
    for (i = 0; i < n; i++) send[(size_t)r * n + i] = pattern(p->rank, r, i, size);
#else
  (void)in_place;
  (void)r;
  for (i = 0; i < n; i++) send[i] = pattern(p->rank, (p->rank + 1) % p->nranks, i, size);
#endif
}

/* GPU: the mirror to the GPU buffer (after fill) or back (before check). 0 on success. */
static int sync_mirror(perf *p, int to_gpu)
{
#ifdef PERF_GPU
  if (p->gpu) {
    CUDA_CHECK_GOTO(cudaMemcpy(to_gpu ? (void *)p->dbuf : (void *)p->buf,
                               to_gpu ? (const void *)p->buf : (const void *)p->dbuf, p->bytes,
                               to_gpu ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
                    fail);
  }
  return 0;
fail:
  return 1;
#else
  (void)p;
  (void)to_gpu;
  return 0;
#endif
}

#ifdef PERF_GPU
/* Where this rank's own slice of the result comes from, as an offset into its buffer (all-gather
 * out of place and all-to-all; the caller skips the copy where there is none). */
static __device__ uint64_t own_from(int rank, uint64_t n, uint64_t send)
{
#if PERF_OP == OP_ALLGATHER
  (void)rank;
  (void)n;
  return send;
#else
  return send + (uint64_t)rank * n;
#endif
}

/* Whether an operation copies the own slice locally (`own_from`). */
static int own_copy(int in_place)
{
  return PERF_OP == OP_ALLTOALL || (PERF_OP == OP_ALLGATHER && !in_place);
}

/* One operation on the GPU: warp w drives connection w (lane 0), as the host loop below does
 * for every connection in turn. The block's threads first copy the own slice into place
 * (`own`: the buffer, 0 where there is nothing to copy), inside the kernel as NVSHMEM's
 * collectives do: a cudaMemcpyAsync before each kernel cost 1-2 us per small operation.
 * `send`: the send area. */
__global__ void perf_kernel(mscclppDevConn_t *conns, int nconns, int rank, int nranks, uint64_t n,
                            uint64_t send, int in_place, char *own)
{
  const int w = threadIdx.x / 32;
  if (own != 0)
    mscclpp::device::copyBlock(own + (uint64_t)rank * n, own + own_from(rank, n, send), n);
  if (w >= nconns || threadIdx.x % 32 != 0) return;
  mscclppDevConn_t c = conns[w];
#if PERF_OP == OP_ALLGATHER
  const uint64_t mine = (uint64_t)rank * n;
  (void)nranks;
  c.putWithSignal(mine, in_place ? mine : send, n);
  c.wait();
#elif PERF_OP == OP_ALLTOALL
  (void)nranks;
  (void)in_place;
  c.putWithSignal((uint64_t)rank * n, send + (uint64_t)c.remoteRank * n, n);
  c.wait();
#else
  (void)in_place;
  if (c.remoteRank == (rank + 1) % nranks) c.putWithSignal(0, send, n);
  if (c.remoteRank == (rank + nranks - 1) % nranks) c.wait();
#endif
}

/* The same with block puts (-B): block b puts chunk b % bpp of the n bytes for connection
 * b / bpp with one signal, the blocks of connection 0 also copy their chunk of the own slice
 * (`own`, as perf_kernel), and the first block of each connection waits for its bpp signals. */
__global__ void perf_block_kernel(mscclppDevConn_t *conns, int rank, int nranks, uint64_t n,
                                  uint64_t send, int in_place, int bpp, uint64_t chunk, char *own)
{
  const int w = blockIdx.x / bpp, k = blockIdx.x % bpp;
  int i;
  const mscclppDevConn_t c = conns[w];
  const uint64_t start = (uint64_t)k * chunk;
  const uint64_t len = start < n ? (chunk < n - start ? chunk : n - start) : 0;
  const int waiter = k == 0 && threadIdx.x == 0;
#if PERF_OP == OP_ALLGATHER
  const uint64_t mine = (uint64_t)rank * n;
  (void)nranks;
  c.putWithSignalBlock(mine + start, (in_place ? mine : send) + start, len);
#elif PERF_OP == OP_ALLTOALL
  (void)nranks;
  (void)in_place;
  c.putWithSignalBlock((uint64_t)rank * n + start, send + (uint64_t)c.remoteRank * n + start, len);
#else
  (void)in_place;
  if (c.remoteRank == (rank + 1) % nranks) c.putWithSignalBlock(start, send + start, len);
  if (c.remoteRank != (rank + nranks - 1) % nranks) return;
#endif
  if (own != 0 && w == 0)
    mscclpp::device::copyBlock(own + (uint64_t)rank * n + start,
                               own + own_from(rank, n, send) + start, len);
  if (waiter)
    for (i = 0; i < bpp; i++) c.wait();
}

/* flush() on every connection: see `flush_all`. */
__global__ void perf_flush_kernel(mscclppDevConn_t *conns, int nconns)
{
  const int w = threadIdx.x / 32;
  if (w < nconns && threadIdx.x % 32 == 0) conns[w].flush();
}
#endif

/* Wrong bytes in what this rank received for `size`. */
static size_t check(perf *p, size_t size)
{
  size_t n = per_rank(size, p->nranks), i, bad = 0;
  int r;
#if PERF_OP == OP_ALLGATHER
  for (r = 0; r < p->nranks; r++)
    for (i = 0; i < n; i++) bad += p->buf[(size_t)r * n + i] != pattern(r, 0, i, size);
#elif PERF_OP == OP_ALLTOALL
  for (r = 0; r < p->nranks; r++)
    for (i = 0; i < n; i++) bad += p->buf[(size_t)r * n + i] != pattern(r, p->rank, i, size);
#else
  int from = (p->rank + p->nranks - 1) % p->nranks;
  (void)r;
  for (i = 0; i < n; i++) bad += p->buf[i] != pattern(from, p->rank, i, size);
#endif
  return bad;
}

#ifdef PERF_GPU
/* run_op on the GPU: queued on the stream (the caller synchronizes). 0 on success. */
static int run_op_gpu(perf *p, size_t size, int in_place)
{
  size_t n = per_rank(size, p->nranks);
  uint64_t send = (uint64_t)p->recv_bytes;
  /* The own slice of the result, copied by the kernel (the host path's memcpy). */
  char *own = own_copy(in_place) ? (char *)p->dbuf : NULL;
  if (p->blocks > 0) {
    uint64_t bpp, chunk;
    block_split(n, (uint64_t)p->blocks, p->block_limit, &bpp, &chunk);
    perf_block_kernel<<<(unsigned)(bpp * (uint64_t)p->nconns), 512, 0, p->stream>>>(
      p->dconns, p->rank, p->nranks, n, send, in_place, (int)bpp, chunk, own);
  } else {
    perf_kernel<<<1, 32 * p->nconns, 0, p->stream>>>(p->dconns, p->nconns, p->rank, p->nranks, n,
                                                     send, in_place, own);
  }
  CUDA_CHECK_GOTO(cudaGetLastError(), fail);
  return 0;
fail:
  return 1;
}
#endif

/* One operation of `size`: puts with signals, then waits. 0 on success. */
static int run_op(perf *p, size_t size, int in_place)
{
#ifdef PERF_GPU
  if (p->gpu) return run_op_gpu(p, size, in_place);
#endif
  size_t n = per_rank(size, p->nranks);
  uint64_t send = (uint64_t)p->recv_bytes;
  int r;
#if PERF_OP == OP_ALLGATHER
  uint64_t mine = (uint64_t)p->rank * n;
  if (!in_place) memcpy(p->buf + mine, p->buf + send, n);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[r], mine, in_place ? mine : send, n), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnWait(p->to[r]), fail);
#elif PERF_OP == OP_ALLTOALL
  (void)in_place;
  memcpy(p->buf + (size_t)p->rank * n, p->buf + send + (size_t)p->rank * n, n);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r])
      MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[r], (uint64_t)p->rank * n, send + (uint64_t)r * n, n), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnWait(p->to[r]), fail);
#else
  int next = (p->rank + 1) % p->nranks, prev = (p->rank + p->nranks - 1) % p->nranks;
  (void)in_place;
  (void)r;
  MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[next], 0, send, n), fail);
  MSCCLPP_CHECK_GOTO(mscclppDevConnWait(p->to[prev]), fail);
#endif
  return 0;
fail:
  return 1;
}

static double bus_factor(int n)
{
#if PERF_OP == OP_SENDRECV
  (void)n;
  return 1.0;
#else
  return (double)(n - 1) / (double)n;
#endif
}

/* The mean of `v` over ranks (through the bootstrap's all-gather). */
static int mean_over_ranks(perf *p, double v, double *out)
{
  double *all = (double *)calloc((size_t)p->nranks, sizeof(double));
  int r;
  if (all == NULL) return 1;
  all[p->rank] = v;
  if (mscclppBootstrapAllGather(p->comm, all, sizeof(double)) != mscclppSuccess) {
    free(all);
    return 1;
  }
  *out = 0;
  for (r = 0; r < p->nranks; r++) *out += all[r] / p->nranks;
  free(all);
  return 0;
}

/* Every put so far has completed, on every connection (its source may change): after each
 * batch of operations, inside the timing. Not per operation: each operation ends with the
 * waits for the peers' signals, which already mean their data arrived, as nccl-tests' ops end
 * when the data is received; a flush per operation (a delivery round trip over tcp) made the
 * host sendrecv at 8 bytes 2.6x raw libfabric's same exchange. 0 on success. */
static int flush_all(perf *p)
{
  int r;
#ifdef PERF_GPU
  if (p->gpu) {
    perf_flush_kernel<<<1, 32 * p->nconns, 0, p->stream>>>(p->dconns, p->nconns);
    CUDA_CHECK_GOTO(cudaGetLastError(), fail);
    CUDA_CHECK_GOTO(cudaStreamSynchronize(p->stream), fail);
    return 0;
  }
#endif
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(p->to[r]), fail);
  return 0;
fail:
  return 1;
}

/* GPU: waits for the operations queued on the stream. 0 on success. */
static int gpu_sync(perf *p)
{
#ifdef PERF_GPU
  if (p->gpu) CUDA_CHECK_GOTO(cudaStreamSynchronize(p->stream), fail);
  return 0;
fail:
  return 1;
#else
  (void)p;
  return 0;
#endif
}

/* Timed iterations of one size (warm-up first), then a check; prints the half row. */
static int measure(perf *p, size_t size, int in_place, int warmup, int iters, int do_check,
                   double *busbw, size_t *wrong_total)
{
  double t0, us, mean;
  double wrong = 0, wrong_all;
  int k;
  fill(p, size, in_place);
  if (sync_mirror(p, 1)) goto fail;
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p->comm), fail);
  for (k = 0; k < warmup; k++)
    if (run_op(p, size, in_place)) goto fail;
  if (gpu_sync(p) || flush_all(p)) goto fail;
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p->comm), fail);
  t0 = now_us();
  for (k = 0; k < iters; k++)
    if (run_op(p, size, in_place)) goto fail;
  if (gpu_sync(p) || flush_all(p)) goto fail;
  us = (now_us() - t0) / iters;
  if (do_check && sync_mirror(p, 0)) goto fail;
  if (do_check) wrong = (double)check(p, size);
  /* No rank refills its send data (next size) while a slower one still reads what arrived. */
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p->comm), fail);
  if (mean_over_ranks(p, us, &mean) || mean_over_ranks(p, wrong, &wrong_all)) goto fail;
  wrong_all *= p->nranks;
  *busbw = (double)size / mean / 1e3 * bus_factor(p->nranks);
  *wrong_total += (size_t)(wrong_all + 0.5);
  if (p->rank == 0) {
    if (do_check)
      printf("  %7.2f  %6.2f  %6.2f  %6zu", mean, (double)size / mean / 1e3, *busbw,
             (size_t)(wrong_all + 0.5));
    else
      printf("  %7.2f  %6.2f  %6.2f  %6s", mean, (double)size / mean / 1e3, *busbw, "N/A");
  }
  return 0;
fail:
  return 1;
}

/* One of our options with its value; nonzero on a bad one. */
static int parse_opt(const char *o, const char *v, size_t *min_b, size_t *max_b, double *factor,
                     size_t *step, int *iters, int *warmup, int *do_check, int *gpus, int *threads,
                     int *gpu_mem, const char **transport, int *blocks)
{
  switch (o[1]) {
  case 'b': *min_b = parse_size(v); break;
  case 'e': *max_b = parse_size(v); break;
  case 'f': *factor = atof(v); break;
  case 'i': *step = parse_size(v); break;
  case 'n': *iters = atoi(v); break;
  case 'w': *warmup = atoi(v); break;
  case 'c': *do_check = atoi(v); break;
  case 'g': *gpus = atoi(v); break;
  case 't': *threads = atoi(v); break;
  case 'G': *gpu_mem = atoi(v); break;
  case 'B': *blocks = atoi(v); break;
  case 'T':
    if (strcmp(v, "p2p") && strcmp(v, "shm") && strcmp(v, "ib") && strcmp(v, "mixed")) return 1;
    *transport = v;
    break;
  default: return 1;
  }
  return 0;
}

/* The transport to rank `r` for the -T choice; `hosts`: every rank's host name (64 bytes each). */
static mscclppTransport_t transport_to(const perf *p, const char *t, const char *hosts, int r)
{
  int same_host = strncmp(hosts + 64 * r, hosts + 64 * p->rank, 64) == 0;
  if (!strcmp(t, "p2p")) return mscclppTransportP2P;
  if (!strcmp(t, "shm")) return mscclppTransportSHM;
  if (!strcmp(t, "mixed") && same_host) return p->gpu ? mscclppTransportP2P : mscclppTransportSHM;
  return mscclppTransportIB;
}

int main(int argc, char **argv)
{
  launch_env env;
  perf p;
  size_t min_b = 32u << 20, max_b = 32u << 20, step = 0, size, wrong_total = 0, max_per;
  double factor = 0, bus_sum = 0;
  int iters = 20, warmup = 5, do_check = 1, gpus = 1, threads = 1, gpu_mem = -1, ndev = 0;
  int rows = 0, k, r, rc = 1, proxy = 0, blocks = -1;
  const char *transport = NULL;
  char host[64] = "?", dev_desc[160] = "[host memory]";
  char *hosts = NULL;
  void *conn_buf;

  memset(&p, 0, sizeof(p));
  /* Our options first (nccl-tests' -n is the iteration count here, not launch_env's rank
   * count: ranks come from the launcher), then what is left for launch_env (-r, -a, -l). */
  {
    int left = 1;
    for (k = 1; k < argc; k++) {
      const char *o = argv[k], *v = k + 1 < argc ? argv[k + 1] : NULL;
      int ours = strlen(o) == 2 && o[0] == '-' && strchr("befinwcgtGTB", o[1]) != NULL;
      if (!ours) {
        argv[left++] = argv[k];
        continue;
      }
      if (v == NULL) goto usage;
      if (parse_opt(o, v, &min_b, &max_b, &factor, &step, &iters, &warmup, &do_check, &gpus,
                    &threads, &gpu_mem, &transport, &blocks))
        goto usage;
      k++;
    }
    argc = left;
  }
  if (launch_env_parse(&argc, argv, &env) != 0) return 2;
  if (argc > 1) goto usage;
  if (factor == 0 && step == 0) factor = 2;
  if (min_b == 0 || max_b < min_b || iters <= 0 || warmup < 0 || (factor != 0 && factor <= 1)) {
    fprintf(stderr, "%s_perf: need 0 < -b <= -e, -n > 0, -w >= 0, -f > 1 (or -i > 0)\n", op_name);
    return 2;
  }
  if (gpus != 1 || threads != 1) {
    fprintf(stderr, "%s_perf: one GPU (or host buffer) per process and one thread: -g 1 -t 1\n", op_name);
    return 2;
  }
  p.rank = env.rank;
  p.nranks = env.nranks;
  example_rank = p.rank;
#ifdef PERF_GPU
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
#endif
  if (gpu_mem < 0) gpu_mem = ndev > 0;
  if (gpu_mem != 0 && gpu_mem != 1) goto usage;
  if (gpu_mem == 1 && ndev == 0) {
#ifdef PERF_GPU
    fprintf(stderr, "%s_perf: -G 1 but no CUDA device is visible (-G 0: host memory)\n", op_name);
#else
    fprintf(stderr, "%s_perf: this build has no CUDA (no nvcc when it was built): host memory only, -G 0\n", op_name);
#endif
    return 2;
  }
  p.gpu = gpu_mem;
  if (transport == NULL) transport = p.gpu ? "p2p" : "ib";
  if (blocks < 0) blocks = p.gpu && !strcmp(transport, "p2p") ? 128 : 0;
  if (blocks > 1024 || (blocks > 0 && !p.gpu)) {
    fprintf(stderr, "%s_perf: -B is 0..1024, and block puts need GPU memory (-G 1)\n", op_name);
    return 2;
  }
  p.blocks = blocks;
  if (!p.gpu && !strcmp(transport, "p2p")) {
    fprintf(stderr, "%s_perf: -T p2p needs GPU memory (-G 1)\n", op_name);
    return 2;
  }
  if (p.nranks < 2) {
    fprintf(stderr, "%s_perf: needs at least 2 ranks\n", op_name);
    return 2;
  }
  max_per = per_rank(max_b, p.nranks) + 64;
  p.recv_bytes = (size_t)p.nranks * max_per;
  /* receive area, then the send area (all-to-all sends one slice per rank) */
  p.bytes = p.recv_bytes + (size_t)p.nranks * max_per;
  p.buf = (unsigned char *)calloc(1, p.bytes);
  p.to = (mscclppDevConn_t **)calloc((size_t)p.nranks, sizeof(*p.to));
  hosts = (char *)calloc((size_t)p.nranks, 64);
  if (p.buf == NULL || p.to == NULL || hosts == NULL) {
    fprintf(stderr, "[rank %d] out of memory\n", p.rank);
    goto out;
  }
  conn_buf = p.buf;
#ifdef PERF_GPU
  if (p.gpu) {
    struct cudaDeviceProp prop;
    int dev = env.local_rank % ndev;
    CUDA_CHECK_GOTO(cudaSetDevice(dev), out);
    CUDA_CHECK_GOTO(cudaFree(0), out); /* the context, before the library looks at pointers */
    CUDA_CHECK_GOTO(cudaGetDeviceProperties(&prop, dev), out);
    snprintf(dev_desc, sizeof(dev_desc), "%2d [%04x:%02x:%02x.0] %s", dev, prop.pciDomainID,
             prop.pciBusID, prop.pciDeviceID, prop.name);
    CUDA_CHECK_GOTO(cudaMalloc((void **)&p.dbuf, p.bytes), out);
    CUDA_CHECK_GOTO(cudaMemset(p.dbuf, 0, p.bytes), out);
    CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking), out);
    conn_buf = p.dbuf;
  }
#endif
  MSCCLPP_CHECK_GOTO(mscclppCommInitRank(&p.comm, p.nranks, env.root, p.rank), out);
  gethostname(host, sizeof(host) - 1);
  memcpy(hosts + 64 * p.rank, host, 64);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapAllGather(p.comm, hosts, 64), out);
  for (r = 0; r < p.nranks; r++)
    if (r != p.rank)
      MSCCLPP_CHECK_GOTO(mscclppConnect(p.comm, r, 0, conn_buf, p.bytes,
                                        transport_to(&p, transport, hosts, r), NULL), out);
  MSCCLPP_CHECK_GOTO(mscclppConnectionSetup(p.comm), out);
  MSCCLPP_CHECK_GOTO(mscclppProxyLaunch(p.comm), out);
  proxy = 1;
  MSCCLPP_CHECK_GOTO(mscclppGetAllDeviceConnections(p.comm, &p.conns, &p.nconns), out);
  /* Connections come in the order they were made: every other rank, ascending. */
  for (r = 0, k = 0; r < p.nranks; r++)
    if (r != p.rank) p.to[r] = &p.conns[k++];
#ifdef PERF_GPU
  if (p.gpu) {
    CUDA_CHECK_GOTO(cudaMalloc((void **)&p.dconns, sizeof(*p.conns) * (size_t)p.nconns), out);
    CUDA_CHECK_GOTO(cudaMemcpy(p.dconns, p.conns, sizeof(*p.conns) * (size_t)p.nconns,
                               cudaMemcpyHostToDevice), out);
    /* The first connection's limit: every one of ours is P2P from the same GPU. */
    if (p.blocks > 0) CUDA_CHECK_GOTO(block_limit(&p.conns[0], &p.block_limit), out);
  }
#endif

  if (p.rank == 0) {
    printf("# %s_perf (libmscclpp, %s over -T %s, %s)\n", op_name,
           p.gpu ? "GPU memory" : "host memory", transport,
           p.blocks ? "block puts (-B)" : "one thread per put");
    printf("# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %g(%s) warmup iters: %d iters: %d "
           "agg iters: 1 validation: %d graph: 0\n#\n# Using devices\n",
           threads, gpus, min_b, max_b, factor != 0 ? factor : (double)step,
           factor != 0 ? "factor" : "bytes", warmup, iters, do_check);
  }
  for (r = 0; r < p.nranks; r++) {
    MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p.comm), out);
    if (r == p.rank) {
      printf("#  Rank %2d Group  0 Pid %6d on %10s device %s\n", p.rank, (int)getpid(), host, dev_desc);
      fflush(stdout);
    }
  }
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p.comm), out);
  if (p.rank == 0) {
#if PERF_OP == OP_ALLGATHER
    printf("#\n#                                                   out-of-place                       in-place\n");
    printf("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n");
#else
    printf("#\n#                                                   out-of-place\n");
    printf("#       size         count      type   redop    root     time   algbw   busbw #wrong\n");
    printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)\n");
#endif
  }
  for (size = min_b; size <= max_b;
       size = factor != 0 ? (size_t)((double)size * factor) : size + step) {
    size_t s = size;
    double bw;
#if PERF_OP != OP_SENDRECV
    s = size / (size_t)p.nranks * (size_t)p.nranks; /* whole slices */
    if (s == 0) continue;
#endif
    if (p.rank == 0) printf("%12zu  %12zu  %8s  %6s  %6d", s, s, "uint8", "none", -1);
    if (measure(&p, s, 0, warmup, iters, do_check, &bw, &wrong_total)) goto out;
    bus_sum += bw;
#if PERF_OP == OP_ALLGATHER
    if (measure(&p, s, 1, warmup, iters, do_check, &bw, &wrong_total)) goto out;
    bus_sum += bw;
    rows++;
#endif
    rows++;
    if (p.rank == 0) {
      printf("\n");
      fflush(stdout);
    }
  }
  if (p.rank == 0) {
    printf("# Out of bounds values : %zu %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
    printf("# Avg bus bandwidth    : %g \n#\n", rows ? bus_sum / rows : 0.0);
  }
  MSCCLPP_CHECK_GOTO(mscclppProxyStop(p.comm), out);
  proxy = 0;
  rc = wrong_total != 0;
out:
  if (proxy) mscclppProxyStop(p.comm);
  if (p.comm != NULL && mscclppCommDestroy(p.comm) != mscclppSuccess && rc == 0) rc = 1;
#ifdef PERF_GPU
  /* After destroy: the library may use the buffer until then. */
  if (p.dconns != NULL) cudaFree(p.dconns);
  if (p.dbuf != NULL) cudaFree(p.dbuf);
  if (p.stream != NULL) cudaStreamDestroy(p.stream);
#endif
  free(p.buf);
  free(p.to);
  free(hosts);
  return rc;
usage:
  fprintf(stderr,
          "usage: %s_perf [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-n ITERS] [-w WARMUP] [-c 0|1]\n"
          "       [-g 1] [-t 1] [-G 1|0] [-T p2p|ib|shm|mixed] [-B BLOCKS] (+ launch options: -r -n -a, or a\n"
          "       launcher)\n",
          op_name);
  return 2;
}
