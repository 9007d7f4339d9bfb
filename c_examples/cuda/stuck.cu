/*
 * A kernel whose wait never ends on its own (issue 28 item 2): the device wait timeout ends it,
 * the proxy reports what it waited for, and the communicator fails with a timeout.
 *
 *   MSCCLPP_WAIT_TIMEOUT=2 MSCCLPP_DEVICE_WAIT_TIMEOUT=5 \
 *     stuck [-r R -n 2 -a IP:PORT] --case wait|flush|push|deadlock [--warn 2] [--limit 5]
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

enum Case { kWait, kFlush, kPush, kDeadlock };

static std::atomic<double> gT0{0};
static std::mutex gLogMu;
static std::string gLog;  /* every line, for the checks */
static double gWarnAt = -1; /* when the WARN about a waiting kernel came */

static void logHandler(const char* msg)
{
  const double t = now_sec() - gT0.load();
  std::lock_guard<std::mutex> g(gLogMu);
  fprintf(stderr, "[%7.3f s] %s\n", t, msg);
  gLog += msg;
  gLog += '\n';
  if (gWarnAt < 0 && strstr(msg, "a kernel has waited") != nullptr) gWarnAt = t;
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
                                                             : (Case)-1;
  if ((int)which < 0) {
    fprintf(stderr, "--case wait|flush|push|deadlock\n");
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
  const bool proxied = which == kWait || which == kDeadlock;
  connectPeers(c, buf, bytes, {1 - c.rank}, /*launchProxy=*/proxied);
  if (!proxied && c.rank == 1) MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));

  int failures = 0;
  if (c.rank == 0 || which == kDeadlock) {
    gT0.store(now_sec());
    if (which == kDeadlock)
      deadlockKernel<<<1, 1, 0, s>>>();
    else if (which == kWait)
      waitKernel<<<1, 1, 0, s>>>();
    else if (which == kFlush)
      flushKernel<<<1, 1, 0, s>>>();
    else
      pushKernel<<<1, 1, 0, s>>>(300);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    const double back = now_sec() - gT0.load();
    printf("rank %d: the kernel returned after %.3f s\n", c.rank, back);
    failures += expect(back >= 0.9 * limit && back <= limit + 3,
                       "the kernel returned at the device wait timeout");
    if (!proxied) {
      /* The proxy starts only now: it must find the expired record. */
      MSCCLPPCHECK(mscclppProxyLaunch(c.comm));
    }
    /* The proxy looks at the record every ~10 ms: the failure is there within 2 s. */
    enum mscclppResult_t async = mscclppSuccess;
    const double until = now_sec() + 2;
    while (async == mscclppSuccess && now_sec() < until) {
      MSCCLPPCHECK(mscclppCommGetAsyncError(c.comm, &async));
      if (async == mscclppSuccess) usleep(1000);
    }
    printf("rank %d: mscclppCommGetAsyncError: %s (%d) after %.3f s\n", c.rank,
           mscclppGetErrorString(async), (int)async, now_sec() - gT0.load());
    failures += expect(async == mscclppRemoteError, "the communicator failed with mscclppRemoteError");
    const std::string waitRecord =
      "wait() on connection 0 (to rank " + std::to_string(1 - c.rank) + ") for signal 1, has 0";
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
