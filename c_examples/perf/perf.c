/*
 * allgather_perf, alltoall_perf, sendrecv_perf: collective benchmarks in nccl-tests' conventions
 * (options, the header, one row per size, the closing "# Avg bus bandwidth" line), built from
 * this one file with PERF_OP set to the operation. This build runs on host memory over
 * libfabric (no GPU: `-G 0`, the only value it accepts), so it runs on any machine and in CI.
 *
 *   scripts/run-local-ranks.sh 2 ./allgather_perf -b 8 -e 4M -f 4
 *   mpirun -np 4 ./alltoall_perf -b 1K -e 64M -f 2 -T shm
 *
 * Options (nccl-tests'): -b MIN bytes, -e MAX bytes (K, M, G suffixes), -f FACTOR between
 * sizes (or -i STEP bytes), -n ITERS timed (20), -w WARMUP iterations (5), -c CHECK (1:
 * verify every size, counting wrong bytes into #wrong), -g GPUS per process (1), -t THREADS
 * (1); ours: -T ib|shm (transport, default ib: libfabric's provider from MSCCLPP_NET_PROVIDER,
 * tcp by default), -G 0 (host memory). Rank, size and root come from launch_env.h (mpirun,
 * srun, torchrun or scripts/run-local-ranks.sh).
 *
 * Each operation is one-sided: every rank puts its data into its peers' buffers with
 * putWithSignal, flushes, then waits for each peer's signal. The buffer registered with every
 * connection holds the receive area first, then the send area, so out-of-place operations
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
  unsigned char *buf;
  size_t recv_bytes;        /* the receive area: nranks * max per-rank bytes */
  mscclppDevConn_t **to;    /* to[r]: the connection to rank r (NULL for us) */
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

/* One operation of `size`: puts with signals, flushes, waits. 0 on success. */
static int run_op(perf *p, size_t size, int in_place)
{
  size_t n = per_rank(size, p->nranks);
  uint64_t send = (uint64_t)p->recv_bytes;
  int r;
#if PERF_OP == OP_ALLGATHER
  uint64_t mine = (uint64_t)p->rank * n;
  if (!in_place) memcpy(p->buf + mine, p->buf + send, n);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[r], mine, in_place ? mine : send, n), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(p->to[r]), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnWait(p->to[r]), fail);
#elif PERF_OP == OP_ALLTOALL
  (void)in_place;
  memcpy(p->buf + (size_t)p->rank * n, p->buf + send + (size_t)p->rank * n, n);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r])
      MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[r], (uint64_t)p->rank * n, send + (uint64_t)r * n, n), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(p->to[r]), fail);
  for (r = 0; r < p->nranks; r++)
    if (p->to[r]) MSCCLPP_CHECK_GOTO(mscclppDevConnWait(p->to[r]), fail);
#else
  int next = (p->rank + 1) % p->nranks, prev = (p->rank + p->nranks - 1) % p->nranks;
  (void)in_place;
  (void)r;
  MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(p->to[next], 0, send, n), fail);
  MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(p->to[next]), fail);
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
  double *all = calloc((size_t)p->nranks, sizeof(double));
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

/* Timed iterations of one size (warm-up first), then a check; prints the half row. */
static int measure(perf *p, size_t size, int in_place, int warmup, int iters, int do_check,
                   double *busbw, size_t *wrong_total)
{
  double t0, us, mean;
  double wrong = 0, wrong_all;
  int k;
  fill(p, size, in_place);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p->comm), fail);
  for (k = 0; k < warmup; k++)
    if (run_op(p, size, in_place)) goto fail;
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p->comm), fail);
  t0 = now_us();
  for (k = 0; k < iters; k++)
    if (run_op(p, size, in_place)) goto fail;
  us = (now_us() - t0) / iters;
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
                     int *gpu_mem, mscclppTransport_t *transport)
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
  case 'T':
    if (!strcmp(v, "shm")) *transport = mscclppTransportSHM;
    else if (!strcmp(v, "ib")) *transport = mscclppTransportIB;
    else return 1;
    break;
  default: return 1;
  }
  return 0;
}

int main(int argc, char **argv)
{
  launch_env env;
  perf p;
  size_t min_b = 32u << 20, max_b = 32u << 20, step = 0, size, wrong_total = 0, max_per;
  double factor = 0, bus_sum = 0;
  int iters = 20, warmup = 5, do_check = 1, gpus = 1, threads = 1, gpu_mem = 0;
  int rows = 0, k, r, rc = 1, proxy = 0;
  mscclppTransport_t transport = mscclppTransportIB;
  char host[256] = "?";

  memset(&p, 0, sizeof(p));
  /* Our options first (nccl-tests' -n is the iteration count here, not launch_env's rank
   * count: ranks come from the launcher), then what is left for launch_env (-r, -a, -l). */
  {
    int left = 1;
    for (k = 1; k < argc; k++) {
      const char *o = argv[k], *v = k + 1 < argc ? argv[k + 1] : NULL;
      int ours = strlen(o) == 2 && o[0] == '-' && strchr("befinwcgtGT", o[1]) != NULL;
      if (!ours) {
        argv[left++] = argv[k];
        continue;
      }
      if (v == NULL) goto usage;
      if (parse_opt(o, v, &min_b, &max_b, &factor, &step, &iters, &warmup, &do_check, &gpus,
                    &threads, &gpu_mem, &transport))
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
  if (gpu_mem != 0) {
    fprintf(stderr, "%s_perf: this build runs on host memory only (-G 0); the GPU tools are the CUDA examples\n", op_name);
    return 2;
  }
  p.rank = env.rank;
  p.nranks = env.nranks;
  example_rank = p.rank;
  if (p.nranks < 2) {
    fprintf(stderr, "%s_perf: needs at least 2 ranks\n", op_name);
    return 2;
  }
  max_per = per_rank(max_b, p.nranks) + 64;
  p.recv_bytes = (size_t)p.nranks * max_per;
  /* receive area, then the send area (all-to-all sends one slice per rank) */
  p.buf = calloc(1, p.recv_bytes + (size_t)p.nranks * max_per);
  p.to = calloc((size_t)p.nranks, sizeof(*p.to));
  if (p.buf == NULL || p.to == NULL) {
    fprintf(stderr, "[rank %d] out of memory\n", p.rank);
    goto out;
  }
  MSCCLPP_CHECK_GOTO(mscclppCommInitRank(&p.comm, p.nranks, env.root, p.rank), out);
  for (r = 0; r < p.nranks; r++)
    if (r != p.rank)
      MSCCLPP_CHECK_GOTO(mscclppConnect(p.comm, r, 0, p.buf, p.recv_bytes + (size_t)p.nranks * max_per,
                                        transport, NULL), out);
  MSCCLPP_CHECK_GOTO(mscclppConnectionSetup(p.comm), out);
  MSCCLPP_CHECK_GOTO(mscclppProxyLaunch(p.comm), out);
  proxy = 1;
  MSCCLPP_CHECK_GOTO(mscclppGetAllDeviceConnections(p.comm, &p.conns, &p.nconns), out);
  /* Connections come in the order they were made: every other rank, ascending. */
  for (r = 0, k = 0; r < p.nranks; r++)
    if (r != p.rank) p.to[r] = &p.conns[k++];

  gethostname(host, sizeof(host) - 1);
  if (p.rank == 0) {
    printf("# %s_perf (libmscclpp, host memory over %s)\n", op_name,
           transport == mscclppTransportSHM ? "the SHM transport" : "the IB transport (libfabric)");
    printf("# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %g(%s) warmup iters: %d iters: %d "
           "agg iters: 1 validation: %d graph: 0\n#\n# Using devices\n",
           threads, gpus, min_b, max_b, factor != 0 ? factor : (double)step,
           factor != 0 ? "factor" : "bytes", warmup, iters, do_check);
  }
  for (r = 0; r < p.nranks; r++) {
    MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(p.comm), out);
    if (r == p.rank) {
      printf("#  Rank %2d Group  0 Pid %6d on %10s device  - [host memory]\n", p.rank, (int)getpid(), host);
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
  free(p.buf);
  free(p.to);
  return rc;
usage:
  fprintf(stderr,
          "usage: %s_perf [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-n ITERS] [-w WARMUP] [-c 0|1]\n"
          "       [-g 1] [-t 1] [-G 0] [-T ib|shm] (+ launch options: -r -n -a, or a launcher)\n",
          op_name);
  return 2;
}
