/*
 * A stuck job tears down: kernels that wait, flush or push in a loop are released by
 * mscclppProxyStop and mscclppCommDestroy, which return within their documented bound
 * (docs/DESIGN.md section 5), and no memory is freed under a kernel.
 *
 *   stuck_teardown --mode wait|flush|flush-noproxy|push [--no-stop] [-r R -n 2 -a IP:PORT]
 *
 * Modes (2 ranks, one connection each way, P2P by default):
 *   wait           both kernels wait() for a signal the other never sends (a deadlock).
 *   flush          CUDA_DEVICE_MAX_CONNECTIONS=1 (set here, before CUDA starts): rank 0's
 *                  kernel puts, then flush()es; the proxy's copy queues behind that very kernel
 *                  in the one hardware queue, so the flush never ends on its own. Rank 1
 *                  waits for the signal.
 *   flush-noproxy  the proxy is never launched: both kernels put and flush() (a program that
 *                  forgot mscclppProxyLaunch); mscclppProxyStop is refused (mscclppInvalidUsage:
 *                  no proxy runs, stop_rc=5), destroy releases them.
 *   push           the kernels ping-pong putWithSignal + wait() 50000 times; the host stops
 *                  them after 1000 rounds (or a second): the FIFO never goes quiet, the stop
 *                  stops serving it, and the released loops run out.
 * --no-stop: destroy without mscclppProxyStop first.
 *
 * Each rank launches its kernel on a blocking stream, checks after a second (push: after 1000
 * rounds) that the kernel is still running, then calls mscclppProxyStop and mscclppCommDestroy, timing each, and polls
 * the stream to see the kernel end. It prints one line per rank:
 *   RESULT stuck_teardown mode=M rank=R running_before=1 stop_rc=0 stop_s=0.021 ended=1
 *          ended_s=0.022 destroy_rc=0 destroy_s=0.030
 * (ended_s: from the stop's start; with --no-stop, from destroy's) and exits 1 when a call
 * took longer than its bound (MSCCLPP_WAIT_TIMEOUT + 3 s for the stop, + 8 s for destroy), or
 * the kernel did not end within 10 s of the release, and 3 when the watchdog (60 s +
 * MSCCLPP_WAIT_TIMEOUT) fires: a hang.
 */
#include "common.cuh"

#include <signal.h>

enum Mode { kWait, kFlush, kFlushNoProxy, kPush };

__global__ void waitKernel()
{
  mscclppDevConn_t conn = gConns[0];
  conn.wait();
}

__global__ void putFlushKernel(int rank, int waitAfter)
{
  mscclppDevConn_t conn = gConns[0];
  if (rank == 0 || !waitAfter) {
    conn.putWithSignal(0, 0, 64 << 10);
    conn.flush();
  } else {
    conn.wait();
  }
}

/* A ping-pong that outlives the stop: after the abort each push into the full FIFO and each
 * wait() returns early, so the loop runs out quickly. `done` (mapped host memory) counts the
 * rounds for the host. */
__global__ void pushLoopKernel(int rank, int iters, unsigned long long* done)
{
  mscclppDevConn_t conn = gConns[0];
  for (int i = 0; i < iters; i++) {
    if (rank == 0) {
      conn.putWithSignal(0, 0, 8);
      conn.wait();
    } else {
      conn.wait();
      conn.putWithSignal(8, 8, 8);
    }
    *(volatile unsigned long long*)done = (unsigned long long)i + 1;
  }
}

static void onWatchdog(int)
{
  static const char msg[] = "stuck_teardown: HANG: the watchdog fired (stop or destroy did not return)\n";
  ssize_t w = write(2, msg, sizeof msg - 1);
  (void)w;
  _exit(3);
}

/* Polls the kernel's stream until it is idle, at most `bound` seconds; the time it took, or a
 * negative value if it did not end. */
static double waitKernelEnd(cudaStream_t s, double t0, double bound)
{
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return now_sec() - t0;
    if (e != cudaErrorNotReady) {
      fprintf(stderr, "cudaStreamQuery: %s\n", cudaGetErrorString(e));
      return -1;
    }
    if (now_sec() - t0 > bound) return -1;
    usleep(1000);
  }
}

int main(int argc, char** argv)
{
  const char* m = flagValue(argc, argv, "--mode");
  Mode mode = kWait;
  if (m == nullptr || strcmp(m, "wait") == 0) mode = kWait;
  else if (strcmp(m, "flush") == 0) mode = kFlush;
  else if (strcmp(m, "flush-noproxy") == 0) mode = kFlushNoProxy;
  else if (strcmp(m, "push") == 0) mode = kPush;
  else {
    fprintf(stderr, "--mode %s: expected wait, flush, flush-noproxy or push\n", m);
    return 2;
  }
  const char* modeName = m ? m : "wait";
  const bool stop = !hasFlag(argc, argv, "--no-stop");
  /* One hardware work queue: must be set before the CUDA context exists. */
  if (mode == kFlush) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
  const char* wt = getenv("MSCCLPP_WAIT_TIMEOUT");
  const double waitTimeout = wt ? atof(wt) : 30.0;
  signal(SIGALRM, onWatchdog);
  alarm((unsigned)(60 + waitTimeout));

  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "stuck_teardown runs on exactly 2 ranks\n");
    return 2;
  }
  const uint64_t bytes = 1 << 20;
  void* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, bytes));
  CUDACHECK(cudaMemset(buf, c.rank + 1, bytes));
  unsigned long long* done = nullptr; /* rounds of the push loop, mapped host memory */
  CUDACHECK(cudaHostAlloc(&done, sizeof *done, cudaHostAllocMapped));
  *done = 0;
  unsigned long long* doneDev = nullptr;
  CUDACHECK(cudaHostGetDevicePointer(&doneDev, done, 0));

  if (mode == kFlushNoProxy) {
    /* connectPeers launches the proxy; this mode must not. */
    const int peer = 1 - c.rank;
    MSCCLPPCHECK(mscclppConnect(c.comm, peer, 0, buf, bytes, transportTo(c, peer)));
    MSCCLPPCHECK(mscclppConnectionSetup(c.comm));
    mscclppDevConn_t* conns = nullptr;
    int n = 0;
    MSCCLPPCHECK(mscclppGetAllDeviceConnections(c.comm, &conns, &n));
    CUDACHECK(cudaMemcpyToSymbol(gConns, conns, sizeof(mscclppDevConn_t)));
  } else {
    connectPeers(c, buf, bytes, {1 - c.rank});
  }
  /* A blocking stream, as most programs use (the legacy default stream waits for it). */
  cudaStream_t s;
  CUDACHECK(cudaStreamCreate(&s));
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  switch (mode) {
    case kWait: waitKernel<<<1, 1, 0, s>>>(); break;
    case kFlush: putFlushKernel<<<1, 1, 0, s>>>(c.rank, 1); break;
    case kFlushNoProxy: putFlushKernel<<<1, 1, 0, s>>>(c.rank, 0); break;
    case kPush: pushLoopKernel<<<1, 1, 0, s>>>(c.rank, 50000, doneDev); break;
  }
  KERNELCHECK();
  /* Let the kernels get stuck (push: well into their loop, at most a second). */
  for (const double t = now_sec(); now_sec() - t < 1.0;) {
    if (mode == kPush && *(volatile unsigned long long*)done >= 1000) break;
    usleep(1000);
  }
  const int runningBefore = cudaStreamQuery(s) == cudaErrorNotReady;
  /* Both ranks release together: the host side of the bootstrap still works. */
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));

  const double t0 = now_sec();
  mscclppResult_t stopRc = mscclppSuccess;
  double stopS = 0;
  if (stop) {
    stopRc = mscclppProxyStop(c.comm);
    stopS = now_sec() - t0;
    if (stopRc != mscclppSuccess)
      printf("rank %d: mscclppProxyStop: %s (%s)\n", c.rank, mscclppGetErrorString(stopRc),
             mscclppGetLastError());
  }
  /* After the stop the kernel must end by itself; without a stop (or one that was refused
   * because no proxy ran), destroy releases it. */
  double endedS = stop && mode != kFlushNoProxy ? waitKernelEnd(s, t0, 10.0) : -1;
  const double t1 = now_sec();
  const mscclppResult_t destroyRc = mscclppCommDestroy(c.comm);
  const double destroyS = now_sec() - t1;
  if (destroyRc != mscclppSuccess)
    printf("rank %d: mscclppCommDestroy: %s (%s)\n", c.rank, mscclppGetErrorString(destroyRc),
           mscclppGetLastError());
  if (endedS < 0) {
    const double e = waitKernelEnd(s, t1, 10.0);
    endedS = e < 0 ? -1 : e + (t1 - t0);
  }
  const unsigned long long iters = *(volatile unsigned long long*)done;
  printf("RESULT stuck_teardown mode=%s stop=%d rank=%d running_before=%d stop_rc=%d stop_s=%.3f "
         "ended=%d ended_s=%.3f destroy_rc=%d destroy_s=%.3f iters=%llu\n",
         modeName, stop ? 1 : 0, c.rank, runningBefore, (int)stopRc, stopS, endedS >= 0 ? 1 : 0,
         endedS, (int)destroyRc, destroyS, iters);
  int failures = 0;
  if (!runningBefore) {
    fprintf(stderr, "rank %d: the kernel was no longer running before the stop: nothing was tested\n",
            c.rank);
    failures++;
  }
  if (stopS > waitTimeout + 3) {
    fprintf(stderr, "rank %d: mscclppProxyStop took %.3f s (bound %.0f s)\n", c.rank, stopS, waitTimeout + 3);
    failures++;
  }
  if (destroyS > waitTimeout + 8) {
    fprintf(stderr, "rank %d: mscclppCommDestroy took %.3f s (bound %.0f s)\n", c.rank, destroyS,
            waitTimeout + 8);
    failures++;
  }
  if (endedS < 0) {
    fprintf(stderr, "rank %d: the kernel did not end after the release\n", c.rank);
    failures++;
  } else {
    CUDACHECK(cudaStreamDestroy(s));
    CUDACHECK(cudaFreeHost(done));
    CUDACHECK(cudaFree(buf));
  }
  printf("rank %d: stuck_teardown %s%s: %s\n", c.rank, modeName, stop ? "" : " --no-stop",
         failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
