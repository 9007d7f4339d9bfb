/*
 * A kernel whose wait never ends on its own (issue 28 item 2): the device wait timeout ends it,
 * the proxy reports what it waited for, and the communicator fails with a timeout.
 *
 *   MSCCLPP_WAIT_TIMEOUT=2 MSCCLPP_DEVICE_WAIT_TIMEOUT=5 \
 *     stuck [-r R -n 2 -a IP:PORT] --case wait|flush|push|deadlock|handover [--warn 2] [--limit 5]
 *
 * `--warn` / `--limit` must be the two variables' values (the program only checks timings
 * against them). Rank 0 runs the stuck kernel; rank 1 only takes part in the barriers.
 *   wait:  the proxies run; rank 0's kernel wait()s for a signal rank 1 never sends. Expected:
 *          the WARN naming the wait at ~warn s, the kernel back at ~limit s, then
 *          mscclppCommGetAsyncError = mscclppRemoteError with the same record in the error.
 *   flush: rank 0's kernel put()s its whole 2 MiB buffer and flush()es before the proxy is
 *          launched (a program that launched its proxy too late): the kernel is back at
 *          ~limit s with no proxy running; once mscclppProxyLaunch runs, the proxy reads the
 *          expired record and the communicator fails with it ("flush() ... for ticket 1").
 *          (2 MiB: more than any P2P direct put, MSCCLPP_P2P_DIRECT_BYTES at most 1 MiB, so
 *          it is a trigger; a direct one would need no proxy.)
 *   push:  as flush, the 2 MiB put then 300 signal()s into the 128-slot FIFO (queued behind
 *          the put, which never completes: none goes the direct path): the 128th signal waits
 *          for room until the limit, and the 172 after it return at once (the expired wait
 *          raised the FIFO's abort word): the kernel is back at ~limit s, not 173 x limit.
 *   deadlock: both ranks' kernels wait() before they signal() (a planted deadlock): at ~warn s
 *          each rank's hang report names the cycle ("cycle 0 -> 1 -> 0"), at ~limit s the
 *          kernels are back and both communicators have failed.
 *   handover: two connections to rank 1 (tags 0 and 1) on one FIFO; rank 0's block 0 waits on
 *          the first, block 1 (0.5 s later) on the second, for signals rank 1 does not send.
 *          At ~warn s block 0's wait owns the FIFO's one wait record (its WARN); block 1's
 *          lost the claim. Rank 1 then signals the first connection (at warn + 1.5 s): block
 *          0's wait ends and frees the record, and block 1's, still stuck, must take it over:
 *          a WARN naming connection 1 before the kernel returns (at limit + 0.5 s), whose
 *          error carries that record.
 * Once a communicator failed, its peer learns it as a lost peer: rank 1's stop may then
 * return mscclppRemoteError too, and the bootstrap barrier after the kernels may fail.
 * Every log line is printed with its time since the kernel's launch. Then both ranks stop
 * their proxies (rank 0: the sticky error, whose text is printed) and destroy, timed.
 * Prints "stuck <case>: PASSED" on rank 0, exits 1 on any failed expectation.
 */
#include "common.cuh"

#include <atomic>
#include <mutex>
#include <string>

enum Case { kWait, kFlush, kPush, kDeadlock, kHandover };

static std::atomic<double> gT0{0};
static std::mutex gLogMu;
static std::string gLog;  /* every line, for the checks */
static double gWarnAt = -1; /* when the WARN about a waiting kernel came */
static double gWarn1At = -1; /* the same, naming connection 1 (handover) */

static void logHandler(const char* msg)
{
  const double t = now_sec() - gT0.load();
  std::lock_guard<std::mutex> g(gLogMu);
  fprintf(stderr, "[%7.3f s] %s\n", t, msg);
  gLog += msg;
  gLog += '\n';
  if (gWarnAt < 0 && strstr(msg, "a kernel has waited") != nullptr) gWarnAt = t;
  if (gWarn1At < 0 && strstr(msg, "a kernel has waited") != nullptr &&
      strstr(msg, "wait() on connection 1 ") != nullptr)
    gWarn1At = t;
}

static bool logHas(const char* what)
{
  std::lock_guard<std::mutex> g(gLogMu);
  return gLog.find(what) != std::string::npos;
}

__global__ void waitKernel() { gConns[0].wait(); }

/* The whole buffer: a put through the proxy whatever the direct path's limit. */
constexpr uint64_t kBytes = 2 << 20;

__global__ void flushKernel()
{
  gConns[0].put(0, 0, kBytes);
  gConns[0].flush();
}

__global__ void deadlockKernel()
{
  gConns[0].wait();
  gConns[0].signal();
}

__global__ void pushKernel(int n)
{
  gConns[0].put(0, 0, kBytes);
  for (int i = 0; i < n; i++) gConns[0].signal();
}

/* handover, rank 0: block b waits on connection b, block 1 from 0.5 s on. */
__global__ void handoverKernel()
{
  if (blockIdx.x == 1) {
    const uint64_t t0 = globalTimerNs();
    /* Ends after 0.5 s. */
    while (globalTimerNs() - t0 < 500ull * 1000 * 1000) {
    }
  }
  gConns[blockIdx.x].wait();
}

/* handover, rank 1: one signal on connection 0 (tag 0). */
__global__ void signalFirstKernel() { gConns[0].signal(); }

static int gRank = 0;

static int expect(bool ok, const char* what)
{
  printf("rank %d: %s: %s\n", gRank, what, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

int main(int argc, char** argv)
{
  MSCCLPPCHECK(mscclppSetLogHandler(logHandler));
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "stuck runs on exactly 2 ranks\n");
    return 2;
  }
  const char* cs = flagValue(argc, argv, "--case");
  const Case which = cs == nullptr || strcmp(cs, "wait") == 0 ? kWait
                     : strcmp(cs, "flush") == 0              ? kFlush
                     : strcmp(cs, "push") == 0               ? kPush
                     : strcmp(cs, "deadlock") == 0           ? kDeadlock
                     : strcmp(cs, "handover") == 0           ? kHandover
                                                             : (Case)-1;
  if ((int)which < 0) {
    fprintf(stderr, "--case wait|flush|push|deadlock|handover\n");
    return 2;
  }
  double warn = 2, limit = 5;
  if (const char* v = flagValue(argc, argv, "--warn")) warn = atof(v);
  if (const char* v = flagValue(argc, argv, "--limit")) limit = atof(v);
  const uint64_t bytes = kBytes;
  void* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, bytes));
  CUDACHECK(cudaMemset(buf, 0, bytes));
  gRank = c.rank;
  const bool proxied = which == kWait || which == kDeadlock || which == kHandover;
  if (which == kHandover) {
    /* Two connections to the peer, tags 0 and 1: one endpoint, one FIFO. */
    const int peer = 1 - c.rank;
    for (int tag = 0; tag < 2; tag++)
      MSCCLPPCHECK(mscclppConnect(c.comm, peer, tag, buf, bytes, transportTo(c, peer)));
    MSCCLPPCHECK(mscclppConnectionSetup(c.comm));
    mscclppDevConn_t* conns = nullptr;
    int n = 0;
    MSCCLPPCHECK(mscclppGetAllDeviceConnections(c.comm, &conns, &n));
    CUDACHECK(cudaMemcpyToSymbol(gConns, conns, n * sizeof(mscclppDevConn_t)));
    MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
  } else {
    connectPeers(c, buf, bytes, {1 - c.rank}, /*launchProxy=*/proxied);
  }
  if (!proxied && c.rank == 1) MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));

  int failures = 0;
  if (which == kHandover && c.rank == 1) {
    /* Past block 0's warn, before block 1's limit. */
    usleep((useconds_t)((warn + 1.5) * 1e6));
    signalFirstKernel<<<1, 1, 0, s>>>();
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
  }
  if (c.rank == 0 || which == kDeadlock) {
    gT0.store(now_sec());
    if (which == kDeadlock)
      deadlockKernel<<<1, 1, 0, s>>>();
    else if (which == kWait)
      waitKernel<<<1, 1, 0, s>>>();
    else if (which == kHandover)
      handoverKernel<<<2, 1, 0, s>>>();
    else if (which == kFlush)
      flushKernel<<<1, 1, 0, s>>>();
    else
      pushKernel<<<1, 1, 0, s>>>(300);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    const double back = now_sec() - gT0.load();
    printf("rank %d: the kernel returned after %.3f s\n", c.rank, back);
    const double late = which == kHandover ? 0.5 : 0; /* block 1 started waiting later */
    failures += expect(back >= 0.9 * limit + late && back <= limit + late + 3,
                       "the kernel returned at the device wait timeout");
    if (!proxied) {
      /* The proxy starts only now: it must find the expired record. */
      MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
    }
    /* The proxy looks at the record every ~10 ms: the failure is there within 2 s. */
    const mscclppResult_t async = awaitAsyncError(c, 2);
    printf("rank %d: mscclppCommGetAsyncError: %s (%d) after %.3f s\n", c.rank,
           mscclppGetErrorString(async), (int)async, now_sec() - gT0.load());
    failures += expect(async == mscclppRemoteError, "the communicator failed with mscclppRemoteError");
    const std::string waitRecord = "wait() on connection " + std::to_string(which == kHandover) +
                                   " (to rank " + std::to_string(1 - c.rank) + ") for signal 1, has 0";
    const char* record = proxied           ? waitRecord.c_str()
                         : which == kFlush ? "flush() on connection 0 (to rank 1) for ticket 1"
                                           : "push on connection 0 (to rank 1) into the full FIFO for ticket 128";
    /* In the deadlock, the rank whose kernel expired second may have been aborted by its
     * peer first (a lost peer): the record is in its WARN, the sticky error names the peer. */
    failures += expect(logHas(record) && logHas("(sticky for this communicator)") &&
                         (which == kDeadlock || logHas("MSCCLPP_DEVICE_WAIT_TIMEOUT")),
                       "the error in the log carries the record");
    if (which == kDeadlock)
      failures += expect(logHas("cycle 0 -> 1 -> 0"), "the hang report names the cycle");
    if (proxied) {
      double at;
      {
        std::lock_guard<std::mutex> g(gLogMu);
        at = gWarnAt;
      }
      printf("rank 0: the WARN about the waiting kernel came after %.3f s\n", at);
      failures += expect(at >= 0.75 * warn && at <= warn + 2.5 && at < back,
                         "the WARN came at the wait timeout, before the kernel returned");
    }
    if (which == kHandover) {
      double at1;
      {
        std::lock_guard<std::mutex> g(gLogMu);
        at1 = gWarn1At;
      }
      printf("rank 0: the WARN about connection 1's wait came after %.3f s\n", at1);
      failures += expect(at1 > 0 && at1 < back,
                         "once connection 0's wait ended, connection 1's took the record over (its WARN before the kernel returned)");
    }
  }

  /* Fails at once where the failed communicator told its peer (Bootstrap abort). */
  const mscclppResult_t bar = mscclppBootstrapBarrier(c.comm);
  printf("rank %d: barrier after the kernels: %s\n", c.rank, mscclppGetErrorString(bar));
  const mscclppResult_t stop = mscclppProxyStop(c.comm);
  printf("rank %d: mscclppProxyStop: %s%s%s\n", c.rank, mscclppGetErrorString(stop),
         stop == mscclppSuccess ? "" : ": ", stop == mscclppSuccess ? "" : mscclppGetLastError());
  if (c.rank == 0 || which == kDeadlock) {
    failures += expect(stop == mscclppRemoteError, "mscclppProxyStop returns the failure");
  } else {
    failures += expect(stop == mscclppSuccess || stop == mscclppRemoteError,
                       "the peer's mscclppProxyStop returns (its peer failed)");
  }
  CUDACHECK(cudaDeviceSynchronize());
  const double t = now_sec();
  MSCCLPPCHECK(mscclppCommDestroy(c.comm));
  printf("rank %d: mscclppCommDestroy returned in %.3f s\n", c.rank, now_sec() - t);
  CUDACHECK(cudaFree(buf));
  CUDACHECK(cudaStreamDestroy(s));
  if (c.rank == 0 || which == kDeadlock)
    printf("stuck %s: %s\n", cs ? cs : "wait", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
