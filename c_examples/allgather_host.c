/*
 * allgather_host: N processes all-gather a host buffer through one-sided puts over libfabric,
 * driven from the CPU with the host-side device API (mscclppDevConnPutWithSignal, Flush,
 * Wait). Every byte is verified; rank 0 prints the time per all-gather, the bandwidth, and
 * the latency of an 8-byte putWithSignal answered by a wait() between ranks 0 and 1. No GPU
 * needed.
 *
 *   scripts/run-local-ranks.sh 4 ./allgather_host                      tcp on loopback
 *   scripts/run-local-ranks.sh 4 ./allgather_host -t shm -s 16777216   libfabric shm
 *   MSCCLPP_NET_PROVIDER=net scripts/run-local-ranks.sh 2 ./allgather_host
 *
 * Options: -s BYTES per rank (default 4 MiB), -t ib|shm (default ib: mscclppTransportIB over
 * the provider chosen by MSCCLPP_NET_PROVIDER / FI_PROVIDER, tcp by default), -i ITERATIONS
 * timed (default 20), -p ROUNDS of the latency ping-pong (default 2000; 0 skips it: with many
 * ranks on few cores the other ranks would wait that long in the next barrier; it is -p, not
 * -l, because -l is launch_env.h's local rank). Rank, size
 * and root come from launch_env.h. Rank 0 also prints the time
 * of each phase (communicator init, connection setup with proxy launch, the first verified
 * all-gather, proxy stop with destroy) as a RESULT line, which bench/scale.sh collects,
 * with the median and the slowest of every rank's first round (connections are made on first
 * use) and second round ("warm").
 * -v prints, on every rank, a wall-clock stamp as it enters each phase ("TRACE rank R
 * T.TTTTTT what"), so that the ranks' timelines can be laid side by side: which one arrived
 * late at a barrier, and from where.
 */
#define _POSIX_C_SOURCE 200809L

#include <mscclpp.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "launch_env.h"

/* -v: each rank stamps its phases with the wall clock (comparable across processes). */
static int trace_on;
static void trace(const char *what, int k)
{
  struct timespec ts;
  if (!trace_on) {
    return;
  }
  clock_gettime(CLOCK_REALTIME, &ts);
  fprintf(stderr, "TRACE rank %d %lld.%06ld %s %d\n", example_rank, (long long)ts.tv_sec,
          ts.tv_nsec / 1000, what, k);
}

static double now_us(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* The byte that rank `r` contributes at index `i` in round `round`. */
static unsigned char pattern(int r, size_t i, int round)
{
  return (unsigned char)(r * 37 + round * 11 + (int)(i % 251) + (int)(i >> 12));
}

static int cmp_double(const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median and maximum of column `col` of `n` rows of two doubles (sorts a copy). */
static void spread(const double *rows, int n, int col, double *med, double *max)
{
  double *v = malloc((size_t)n * sizeof(double));
  int r;
  if (v == NULL) {
    return;
  }
  for (r = 0; r < n; r++) {
    v[r] = rows[2 * r + col];
  }
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  *med = v[n / 2];
  *max = v[n - 1];
  free(v);
}

/* One all-gather: put our slice to every peer with a signal, flush, then wait for every peer.
 * Returns 0 on success. */
static int allgather(mscclppDevConn_t *conns, int nconns, uint64_t off, uint64_t bytes)
{
  int i;
  trace("puts", nconns);
  for (i = 0; i < nconns; i++) {
    MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(&conns[i], off, off, bytes), fail);
  }
  trace("flushes", nconns);
  for (i = 0; i < nconns; i++) {
    MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(&conns[i]), fail);
  }
  trace("waits", nconns);
  for (i = 0; i < nconns; i++) {
    MSCCLPP_CHECK_GOTO(mscclppDevConnWait(&conns[i]), fail);
  }
  trace("all-gather done", nconns);
  return 0;
fail:
  return 1;
}

static size_t verify(const unsigned char *buf, int nranks, size_t bytes, int round)
{
  size_t bad = 0, i;
  int r;
  for (r = 0; r < nranks; r++) {
    for (i = 0; i < bytes; i++) {
      if (buf[(size_t)r * bytes + i] != pattern(r, i, round)) {
        if (bad++ < 3) {
          fprintf(stderr, "[rank %d] round %d: byte %zu of rank %d's slice is %u, expected %u\n",
                  example_rank, round, i, r, buf[(size_t)r * bytes + i], pattern(r, i, round));
        }
      }
    }
  }
  return bad;
}

int main(int argc, char **argv)
{
  launch_env env;
  mscclppComm_t comm = NULL;
  mscclppDevConn_t *conns = NULL;
  unsigned char *buf = NULL;
  double *lat = NULL;
  double t_init = 0, t_setup = 0, t_round = 0, t_down = 0, t = 0, mine[2] = {0, 0};
  double first_med = 0, first_max = 0, warm_med = 0, warm_max = 0, *rounds = NULL;
  size_t bytes = 4u << 20, i;
  int iters = 20, nconns = 0, rank, nranks, r, k, rc = 1, proxy = 0;
  mscclppTransport_t transport = mscclppTransportIB;
  const int verified_rounds = 3;
  int lat_rounds = 2000;

  if (launch_env_parse(&argc, argv, &env) != 0) {
    return 2;
  }
  for (k = 1; k < argc; k++) {
    if (strcmp(argv[k], "-s") == 0 && k + 1 < argc) {
      bytes = (size_t)strtoull(argv[++k], NULL, 10);
    } else if (strcmp(argv[k], "-i") == 0 && k + 1 < argc) {
      iters = atoi(argv[++k]);
    } else if (strcmp(argv[k], "-p") == 0 && k + 1 < argc) {
      lat_rounds = atoi(argv[++k]);
    } else if (strcmp(argv[k], "-v") == 0) {
      trace_on = 1;
    } else if (strcmp(argv[k], "-t") == 0 && k + 1 < argc) {
      k++;
      transport = strcmp(argv[k], "shm") == 0 ? mscclppTransportSHM : mscclppTransportIB;
    } else {
      fprintf(stderr, "usage: %s [-s BYTES] [-i ITERS] [-p PINGPONG_ROUNDS] [-t ib|shm] [-v] (+ launch options)\n",
              argv[0]);
      return 2;
    }
  }
  if (bytes == 0 || iters <= 0 || lat_rounds < 0) {
    fprintf(stderr, "bytes and iterations must be > 0, latency rounds >= 0\n");
    return 2;
  }
  rank = env.rank;
  nranks = env.nranks;
  example_rank = rank;
  buf = calloc((size_t)nranks, bytes);
  lat = calloc(lat_rounds > 0 ? (size_t)lat_rounds : 1, sizeof(double));
  if (buf == NULL || lat == NULL) {
    fprintf(stderr, "[rank %d] out of memory\n", rank);
    goto out;
  }

  trace("init", 0);
  t = now_us();
  MSCCLPP_CHECK_GOTO(mscclppCommInitRank(&comm, nranks, env.root, rank), out);
  t_init = now_us() - t;
  t = now_us();
  for (r = 0; r < nranks; r++) {
    if (r != rank) {
      MSCCLPP_CHECK_GOTO(mscclppConnect(comm, r, 0, buf, (uint64_t)nranks * bytes, transport, NULL), out);
    }
  }
  trace("setup", 0);
  MSCCLPP_CHECK_GOTO(mscclppConnectionSetup(comm), out);
  trace("launch", 0);
  MSCCLPP_CHECK_GOTO(mscclppProxyLaunch(comm), out);
  proxy = 1;
  t_setup = now_us() - t;
  MSCCLPP_CHECK_GOTO(mscclppGetAllDeviceConnections(comm, &conns, &nconns), out);

  /* Verified rounds: a fresh pattern each round, a barrier on each side so that no rank
   * overwrites a slice that a slower rank is still checking. */
  for (k = 0; k < verified_rounds; k++) {
    size_t bad;
    for (i = 0; i < bytes; i++) {
      buf[(size_t)rank * bytes + i] = pattern(rank, i, k);
    }
    trace("barrier before verified round", k);
    MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);
    t = now_us();
    if (allgather(conns, nconns, (uint64_t)rank * bytes, bytes) != 0) {
      goto out;
    }
    if (k < 2) {
      mine[k] = now_us() - t;
    }
    if (k == 0) {
      t_round = mine[0];
    }
    bad = verify(buf, nranks, bytes, k);
    if (bad != 0) {
      fprintf(stderr, "[rank %d] round %d: %zu bytes wrong\n", rank, k, bad);
      goto out;
    }
    trace("barrier after verified round", k);
    MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);
  }

  /* Every rank's first round (connections made on first use) and second round, for the
   * spread between the fastest and the slowest rank. */
  rounds = calloc((size_t)nranks * 2, sizeof(double));
  if (rounds == NULL) {
    goto out;
  }
  rounds[2 * rank] = mine[0];
  rounds[2 * rank + 1] = mine[1];
  MSCCLPP_CHECK_GOTO(mscclppBootstrapAllGather(comm, rounds, (int)(2 * sizeof(double))), out);
  if (rank == 0) {
    spread(rounds, nranks, 0, &first_med, &first_max);
    spread(rounds, nranks, 1, &warm_med, &warm_max);
  }

  /* Timed rounds, the last one verified. */
  for (i = 0; i < bytes; i++) {
    buf[(size_t)rank * bytes + i] = pattern(rank, i, verified_rounds);
  }
  trace("barrier before timed rounds", 0);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);
  {
    double t0 = now_us(), per;
    for (k = 0; k < iters; k++) {
      if (allgather(conns, nconns, (uint64_t)rank * bytes, bytes) != 0) {
        goto out;
      }
    }
    per = (now_us() - t0) / iters;
    if (verify(buf, nranks, bytes, verified_rounds) != 0) {
      goto out;
    }
    if (rank == 0) {
      printf("allgather_host: %d ranks, %zu bytes per rank, %s: %.1f us per all-gather, "
             "%.2f GB/s received per rank\n",
             nranks, bytes, transport == mscclppTransportSHM ? "SHM" : "IB (libfabric)", per,
             (double)(nranks - 1) * (double)bytes / per / 1e3);
    }
  }
  trace("barrier after timed rounds", 0);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);

  /* Latency: 8-byte putWithSignal ping-pong between ranks 0 and 1 (conns[0] on each). */
  if (nranks >= 2 && rank <= 1 && lat_rounds > 0) {
    mscclppDevConn_t *c = &conns[0];
    for (k = 0; k < lat_rounds; k++) {
      double t = now_us();
      if (rank == 0) {
        MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(c, 0, 0, 8), out);
        MSCCLPP_CHECK_GOTO(mscclppDevConnWait(c), out);
      } else {
        MSCCLPP_CHECK_GOTO(mscclppDevConnWait(c), out);
        MSCCLPP_CHECK_GOTO(mscclppDevConnPutWithSignal(c, 0, 0, 8), out);
      }
      lat[k] = (now_us() - t) / 2;
    }
    MSCCLPP_CHECK_GOTO(mscclppDevConnFlush(c), out);
    if (rank == 0) {
      qsort(lat, lat_rounds, sizeof(double), cmp_double);
      printf("allgather_host: 8-byte putWithSignal + wait latency rank 0 <-> 1 "
             "(half round trip): median %.2f us, p90 %.2f us\n",
             lat[lat_rounds / 2], lat[lat_rounds * 9 / 10]);
    }
  }
  trace("barrier before teardown", 0);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);
  trace("teardown", 0);
  t = now_us();
  MSCCLPP_CHECK_GOTO(mscclppProxyStop(comm), out);
  proxy = 0;
  printf("all %zu bytes verified on rank %d in %d rounds: OK\n", (size_t)nranks * bytes, rank,
         verified_rounds + 1);
  rc = 0;
out:
  if (proxy) {
    mscclppProxyStop(comm);
  }
  if (comm != NULL && mscclppCommDestroy(comm) != mscclppSuccess && rc == 0) {
    rc = 1;
  }
  if (rc == 0 && rank == 0) {
    t_down = now_us() - t;
    printf("RESULT phases nranks=%d transport=%s bytes=%zu init_s=%.3f setup_s=%.3f "
           "round_s=%.3f teardown_s=%.3f round_med_s=%.3f round_max_s=%.3f warm_med_s=%.3f "
           "warm_max_s=%.3f\n",
           nranks, transport == mscclppTransportSHM ? "shm" : "ib", bytes, t_init / 1e6,
           t_setup / 1e6, t_round / 1e6, t_down / 1e6, first_med / 1e6, first_max / 1e6,
           warm_med / 1e6, warm_max / 1e6);
  }
  free(buf);
  free(lat);
  free(rounds);
  return rc;
}
