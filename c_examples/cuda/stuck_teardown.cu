/*
 * A stuck job tears down: kernels that wait, flush or push in a loop are released by
 * mscclppProxyStop and mscclppCommDestroy, which return within their documented bound
 * (docs/DESIGN.md section 5), and no memory is freed under a kernel.
 *
 *   stuck_teardown --mode wait|flush|flush-noproxy|push|store|flushrace [--no-stop]
 *                  [-r R -n 2 -a IP:PORT]
 *
 * Modes (2 ranks, one connection each way, P2P by default):
 *   wait           both kernels wait() for a signal the other never sends (a deadlock).
 *   flush          CUDA_DEVICE_MAX_CONNECTIONS=1, one hardware work queue: rank 0's kernel
 *                  puts, then flush()es; rank 1's waits for the signal. Behind each kernel the
 *                  host records an event on the kernel's stream, and only then lets the kernel
 *                  push its put (a word in mapped memory): the event waits for the kernel, and
 *                  the proxy's copy, queued after the event in the one queue, waits for the
 *                  event, so the flush never ends on its own (the one-queue step of
 *                  scripts/gpu-check.sh stalls the same way: bandwidth.cu records an event
 *                  after its kernel). In an H100 run with neither this event nor the variable
 *                  in the starting environment (set by setenv in main), both kernels had ended
 *                  within the second: a kernel alone ahead of the copy may not hold it back.
 *                  The variable is in the environment the process starts with, as there (the
 *                  program re-executes itself with it otherwise): what reads it, CUDA or an MPS
 *                  server, cannot have read it before it was set. If both kernels still
 *                  end by themselves (the put was delivered: rank 1's wait ended too), there
 *                  was no stuck flush to tear down: each rank says SKIPPED and exits 0.
 *   flush-noproxy  the proxy is never launched: both kernels put and flush() (a program that
 *                  forgot mscclppProxyLaunch); mscclppProxyStop is refused (mscclppInvalidUsage:
 *                  no proxy runs, stop_rc=5), destroy releases them.
 *   push           the kernels ping-pong putWithSignal + wait() 50000 times; the host stops
 *                  them after 1000 rounds (or a second): the FIFO never goes quiet, the stop
 *                  stops serving it, and the released loops run out.
 *   store          rank 0's kernel put()s 64 bytes again and again for 6 s (the direct path:
 *                  its own stores into rank 1's buffer through the CUDA IPC mapping), released
 *                  or not; rank 1's kernel waits for a signal that never comes. Rank 0's
 *                  destroy finds its kernel still running, keeps the endpoint and its mappings
 *                  of rank 1's memory, and must not tell rank 1 they are unmapped (its log:
 *                  "not telling ranks [1]"); rank 1's destroy then waits for that word until
 *                  its deadline and keeps its memory ("leaking the GPU memory rank 0 maps").
 *                  scripts/gpu-check.sh checks both lines.
 *   flushrace      rank 0's kernel streams rounds for 4 s: a 64 KiB put of the round's bytes
 *                  (through the proxy) into one of 8 slots, flush(), then an 8-byte put of the
 *                  round number with a signal, which goes direct once the flush said the put
 *                  completed. The stop's drain ends while it streams: what the proxy holds
 *                  then is never executed, and a flush waiting on it must not say "done".
 *                  After both kernels ended, rank 1 checks that the round its last word names
 *                  has its bytes in place (a flush that claimed a put it never made would
 *                  leave the slot 8 rounds old). Rank 1's kernel waits until 4 s are up.
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

#include <vector>

enum Mode { kWait, kFlush, kFlushNoProxy, kPush, kStore, kFlushRace };

/* flushrace: the slots of the rounds' puts, and the word that names the last round. */
constexpr uint64_t kRaceSlot = 64 << 10, kRaceSlots = 8, kRaceLast = kRaceSlots * kRaceSlot;

__global__ void waitKernel()
{
  mscclppDevConn_t conn = gConns[0];
  conn.wait();
}

/* Waits until the host stores 1 into `go` (mapped host memory): after it queued what must
 * precede the put in the hardware queue (flush mode). */
__device__ void waitForGo(const volatile unsigned* go)
{
  const uint64_t t0 = globalTimerNs();
  /* Ends when the host says go, or after 10 s (a host that died: the put goes anyway). */
  while (*go == 0 && globalTimerNs() - t0 < 10ull * 1000 * 1000 * 1000) {
  }
}

__global__ void putFlushKernel(int rank, int waitAfter, const volatile unsigned* go)
{
  mscclppDevConn_t conn = gConns[0];
  waitForGo(go);
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

/* Rank 0 (store): puts into the peer's buffer for 6 s, whatever happens meanwhile (a released
 * program that does not look at what its calls returned). */
__global__ void storeKernel()
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  /* Ends after 6 s. */
  while (globalTimerNs() - t0 < 6ull * 1000 * 1000 * 1000) conn.put(0, 0, 64);
}

/* flushrace, rank 0 (see the modes above): 4 s of rounds. The round's bytes and its number
 * are written by the block before its thread 0 puts them. */
__global__ void flushRaceKernel(unsigned long long* rounds)
{
  mscclppDevConn_t conn = gConns[0];
  uint8_t* buf = (uint8_t*)conn.localBuff;
  const uint64_t t0 = globalTimerNs();
  uint64_t r = 0;
  /* Ends after 4 s (t0 is the same in every thread: one block, read once; the loop's
   * condition is read by thread 0 and handed to the block by the barrier). */
  for (;;) {
    __shared__ int go;
    if (threadIdx.x == 0) go = globalTimerNs() - t0 < 4ull * 1000 * 1000 * 1000;
    __syncthreads();
    if (!go) break;
    r++;
    const uint64_t slot = (r % kRaceSlots) * kRaceSlot;
    for (uint64_t i = threadIdx.x; i < kRaceSlot; i += blockDim.x) buf[slot + i] = (uint8_t)(r * 131 + i);
    if (threadIdx.x == 0) *(volatile uint64_t*)(buf + kRaceLast + 8) = r;
    __syncthreads();
    if (threadIdx.x == 0) {
      conn.put(slot, slot, kRaceSlot);
      conn.flush();
      conn.putWithSignal(kRaceLast, kRaceLast + 8, 8);
      *(volatile unsigned long long*)rounds = r;
    }
    __syncthreads();
  }
}

/* flushrace, rank 1: waits until 4 s are up (after the release each wait() returns at once). */
__global__ void waitUntilKernel()
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  while (globalTimerNs() - t0 < 4ull * 1000 * 1000 * 1000) conn.wait();
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
  else if (strcmp(m, "store") == 0) mode = kStore;
  else if (strcmp(m, "flushrace") == 0) mode = kFlushRace;
  else {
    fprintf(stderr, "--mode %s: expected wait, flush, flush-noproxy, push, store or flushrace\n", m);
    return 2;
  }
  const char* modeName = m ? m : "wait";
  const bool stop = !hasFlag(argc, argv, "--no-stop");
  /* One hardware work queue, in the environment the process starts with (see flush above):
   * set it and start again, before anything here touched CUDA. */
  if (mode == kFlush) {
    const char* q = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    if (q == nullptr || strcmp(q, "1") != 0) {
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
      execv("/proc/self/exe", argv);
      perror("stuck_teardown: re-executing itself with CUDA_DEVICE_MAX_CONNECTIONS=1");
      return 2;
    }
  }
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
  unsigned* go = nullptr; /* the flush kernels' go (waitForGo), mapped host memory */
  CUDACHECK(cudaHostAlloc(&go, sizeof *go, cudaHostAllocMapped));
  *go = 0;
  unsigned* goDev = nullptr;
  CUDACHECK(cudaHostGetDevicePointer(&goDev, go, 0));
  cudaEvent_t behind; /* recorded behind the kernel on its stream (flush) */
  CUDACHECK(cudaEventCreate(&behind));

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
    case kFlush: putFlushKernel<<<1, 1, 0, s>>>(c.rank, 1, goDev); break;
    case kFlushNoProxy: putFlushKernel<<<1, 1, 0, s>>>(c.rank, 0, goDev); break;
    case kPush: pushLoopKernel<<<1, 1, 0, s>>>(c.rank, 50000, doneDev); break;
    case kStore:
      if (c.rank == 0)
        storeKernel<<<1, 1, 0, s>>>();
      else
        waitKernel<<<1, 1, 0, s>>>();
      break;
    case kFlushRace:
      if (c.rank == 0)
        flushRaceKernel<<<1, 256, 0, s>>>(doneDev);
      else
        waitUntilKernel<<<1, 1, 0, s>>>();
      break;
  }
  KERNELCHECK();
  /* Work of the kernel's stream that waits for the kernel, queued before the kernel may push
   * its put: with one hardware queue, the proxy's copy for that put queues behind it. */
  if (mode == kFlush) CUDACHECK(cudaEventRecord(behind, s));
  /* Volatile: the kernel polls this word of mapped memory; no other data goes with it. */
  *(volatile unsigned*)go = 1;
  /* Let the kernels get stuck (push: well into their loop, at most a second). */
  for (const double t = now_sec(); now_sec() - t < 1.0;) {
    if (mode == kPush && *(volatile unsigned long long*)done >= 1000) break;
    usleep(1000);
  }
  const int runningBefore = cudaStreamQuery(s) == cudaErrorNotReady;
  /* Whether the peer's kernel still ran then too (flush: neither did means the put went
   * through, and there was nothing stuck to tear down). */
  int running[2] = {0, 0};
  running[c.rank] = runningBefore;
  MSCCLPPCHECK(mscclppBootstrapAllGather(c.comm, running, sizeof(int)));
  const bool noStuckFlush = mode == kFlush && !running[0] && !running[1];
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
   * because no proxy ran), destroy releases it. store: destroy at once, while rank 0's kernel
   * still stores (that is the case). */
  double endedS =
    stop && mode != kFlushNoProxy && mode != kStore ? waitKernelEnd(s, t0, 10.0) : -1;
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
  int raceFailed = 0;
  if (mode == kFlushRace && endedS >= 0) {
    /* Rank 1's destroy returned once rank 0 said it unmapped our memory, which rank 0 says
     * only after its kernel ended (it waited for it before its destroy): every store of rank
     * 0's is in our buffer, which our destroy left to us. */
    if (c.rank == 1) {
      uint64_t last = 0;
      CUDACHECK(cudaMemcpy(&last, (uint8_t*)buf + kRaceLast, 8, cudaMemcpyDeviceToHost));
      std::vector<uint8_t> slot(kRaceSlot);
      const uint64_t at = (last % kRaceSlots) * kRaceSlot;
      CUDACHECK(cudaMemcpy(slot.data(), (uint8_t*)buf + at, kRaceSlot, cudaMemcpyDeviceToHost));
      size_t wrong = 0;
      for (uint64_t i = 0; last > 0 && i < kRaceSlot; i++) wrong += slot[i] != (uint8_t)(last * 131 + i);
      printf("rank 1: flushrace: the last round signalled is %llu; its 64 KiB in place: %s (%zu wrong)\n",
             (unsigned long long)last, last > 0 && wrong == 0 ? "ok" : "FAILED", wrong);
      raceFailed = last == 0 || wrong != 0;
    }
  }
  printf("RESULT stuck_teardown mode=%s stop=%d rank=%d running_before=%d stop_rc=%d stop_s=%.3f "
         "ended=%d ended_s=%.3f destroy_rc=%d destroy_s=%.3f iters=%llu\n",
         modeName, stop ? 1 : 0, c.rank, runningBefore, (int)stopRc, stopS, endedS >= 0 ? 1 : 0,
         endedS, (int)destroyRc, destroyS, iters);
  int failures = raceFailed;
  if (noStuckFlush) {
    printf("rank %d: both kernels ended within a second by themselves: the proxy's copy did not "
           "queue behind the kernel in one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=%s), so "
           "there was no stuck flush to tear down\n",
           c.rank, getenv("CUDA_DEVICE_MAX_CONNECTIONS"));
  } else if (!runningBefore) {
    fprintf(stderr, "rank %d: the kernel was no longer running before the stop%s: nothing was tested\n",
            c.rank,
            mode == kFlush && c.rank == 0 && running[1]
                ? " (its flush() ended, though rank 1 still waited for the put's signal)"
                : "");
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
    CUDACHECK(cudaEventDestroy(behind));
    CUDACHECK(cudaStreamDestroy(s));
    CUDACHECK(cudaFreeHost(go));
    CUDACHECK(cudaFreeHost(done));
    CUDACHECK(cudaFree(buf));
  }
  printf("rank %d: stuck_teardown %s%s: %s\n", c.rank, modeName, stop ? "" : " --no-stop",
         failures ? "FAILED" : noStuckFlush ? "SKIPPED (no stuck flush)" : "PASSED");
  return failures ? 1 : 0;
}
