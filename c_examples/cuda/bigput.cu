/*
 * Device puts of 4 GiB and more, and at offsets past 4 GiB, over one P2P connection (issue
 * 28 item 4): every byte moves, the bytes past the end stay untouched, and a put of exactly
 * 2^32 bytes (whose low 32 bits are 0: an empty FIFO slot in the 2023 encoding) completes.
 *
 *   bigput [-r R -n 2 -a IP:PORT] [--gib 5] [--case range]
 *
 * Both ranks register a buffer of `--gib` GiB (default 5). Rank 0 fills its buffer with
 * pattern 1, rank 1 fills its own with 0xEE.
 *   Round 1, rank 0's kernel: putWithSignal(0, 0, 4 GiB + 4096); put(4 GiB + 8192, same,
 *     1 MiB); signal(); flush(). Rank 1 waits for both signals, then checks the first and
 *     last byte of each put, the chunk boundary of the first (2 GiB), and that the bytes just
 *     before and past each put are still 0xEE.
 *   Round 2: rank 0 refills with pattern 2; its kernel: put(0, 0, 2^32); flush() (timed);
 *     signal(). Rank 1 checks bytes 0 and 2^32 - 1 (pattern 2) and byte 2^32 (still pattern 1
 *     from round 1).
 * --case range: rank 0's kernel puts 4 GiB + 4096 bytes at offset 1 GiB of rank 1's 5 GiB
 *   buffer (it would end 4096 bytes past it): the put is refused whole before its first 2 GiB
 *   trigger moves (rank 0: mscclppInvalidArgument naming where it would end), and rank 1's
 *   buffer keeps its 0xEE at the first and last byte of each chunk it would have written.
 * Prints one line per check and "bigput: PASSED"; exits 1 on any wrong byte or error.
 */
#include "common.cuh"

static const uint64_t kGiB = 1ull << 30;

/* Byte i of pattern `seed`: depends on every bit of i, so a byte that landed elsewhere, or a
 * wrapped offset, differs. (main() checks that the pattern is not 0xEE where a byte must stay
 * 0xEE, or the check could not tell.) */
__host__ __device__ inline uint8_t patternByte(uint64_t i, uint32_t seed)
{
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)seed << 56);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return (uint8_t)x;
}

__global__ void fillPattern(uint8_t* buf, uint64_t bytes, uint32_t seed)
{
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < bytes;
       i += (uint64_t)gridDim.x * blockDim.x)
    buf[i] = patternByte(i, seed);
}

__global__ void round1Sender()
{
  mscclppDevConn_t conn = gConns[0];
  conn.putWithSignal(0, 0, 4 * kGiB + 4096);
  conn.put(4 * kGiB + 8192, 4 * kGiB + 8192, 1 << 20);
  conn.signal();
  conn.flush();
}

__global__ void round2Sender(unsigned long long* flushNs)
{
  mscclppDevConn_t conn = gConns[0];
  const uint64_t t0 = globalTimerNs();
  conn.put(0, 0, 1ull << 32);
  conn.flush();
  *flushNs = globalTimerNs() - t0;
  conn.signal();
  conn.flush();
}

__global__ void rangeSender()
{
  mscclppDevConn_t conn = gConns[0];
  conn.putWithSignal(kGiB, 0, 4 * kGiB + 4096);
}

static int expectByte(const uint8_t* buf, uint64_t at, int want, const char* what);

/* --case range: the refusal, and rank 1's bytes untouched. */
static int runRange(Ctx& c, cudaStream_t s, const uint8_t* buf)
{
  int failures = 0;
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  if (c.rank == 0) {
    rangeSender<<<1, 1, 0, s>>>();
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
    const mscclppResult_t async = awaitAsyncError(c, 5);
    const bool ok = async == mscclppInvalidArgument;
    printf("rank 0: the put past the buffer: %s (%s)\n", ok ? "refused: ok" : "FAILED",
           mscclppGetErrorString(async));
    failures += !ok;
  }
  /* Fails on both ranks once rank 0 aborted (after the refusal), which orders rank 1's
   * checks after it (as direct.cu's range case). */
  const mscclppResult_t bar = mscclppBootstrapBarrier(c.comm);
  printf("rank %d: barrier after the refusal: %s\n", c.rank, mscclppGetErrorString(bar));
  const mscclppResult_t stop = mscclppProxyStop(c.comm);
  printf("rank %d: mscclppProxyStop: %s: %s\n", c.rank, mscclppGetErrorString(stop),
         stop == mscclppSuccess ? "" : mscclppGetLastError());
  if (c.rank == 0) {
    const char* why = mscclppGetLastError();
    /* The stop returns mscclppRemoteError ("an earlier asynchronous error is pending"), its
     * text the refusal. */
    const bool named = stop != mscclppSuccess && strstr(why, "before any of it moved") != nullptr &&
                       strstr(why, "ends at byte 5368713216") != nullptr;
    printf("rank 0: the error names the refusal before any chunk moved: %s\n", named ? "ok" : "FAILED");
    failures += !named;
  } else {
    if (stop != mscclppRemoteError && stop != mscclppSuccess) failures++;
    const uint64_t at[] = {kGiB, 3 * kGiB - 1, 3 * kGiB, 5 * kGiB - 1};
    for (uint64_t p : at) failures += expectByte(buf, p, 0xEE, "untouched by the refused put");
  }
  CUDACHECK(cudaDeviceSynchronize());
  MSCCLPPCHECK(mscclppCommDestroy(c.comm));
  return failures;
}

__global__ void receiver(int signals)
{
  mscclppDevConn_t conn = gConns[0];
  for (int i = 0; i < signals; i++) conn.wait();
}

/* One byte of the device buffer against what it should be; prints the check. */
static int expectByte(const uint8_t* buf, uint64_t at, int want, const char* what)
{
  uint8_t got = 0;
  CUDACHECK(cudaMemcpy(&got, buf + at, 1, cudaMemcpyDeviceToHost));
  const bool ok = got == want;
  printf("rank 1: byte %llu (%s): 0x%02x, expected 0x%02x %s\n", (unsigned long long)at, what,
         got, want, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "bigput runs on exactly 2 ranks\n");
    return 2;
  }
  uint64_t gib = 5;
  if (const char* v = flagValue(argc, argv, "--gib")) gib = strtoull(v, nullptr, 10);
  const uint64_t bytes = gib * kGiB;
  if (bytes < 4 * kGiB + 8192 + (1 << 20) + 1) {
    fprintf(stderr, "--gib must be at least 5\n");
    return 2;
  }
  uint8_t* buf = nullptr;
  CUDACHECK(cudaMalloc(&buf, bytes));
  cudaStream_t s;
  CUDACHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (c.rank == 0)
    fillPattern<<<1024, 512, 0, s>>>(buf, bytes, 1);
  else
    CUDACHECK(cudaMemsetAsync(buf, 0xEE, bytes, s));
  KERNELCHECK();
  CUDACHECK(cudaStreamSynchronize(s));
  connectPeers(c, buf, bytes, {1 - c.rank});
  const char* which = flagValue(argc, argv, "--case");
  if (which != nullptr && strcmp(which, "range") == 0) {
    if (bytes != 5 * kGiB) {
      fprintf(stderr, "--case range needs --gib 5\n");
      return 2;
    }
    const int failures = runRange(c, s, buf);
    CUDACHECK(cudaFree(buf));
    CUDACHECK(cudaStreamDestroy(s));
    printf("rank %d: bigput range: %s\n", c.rank, failures ? "FAILED" : "PASSED");
    return failures ? 1 : 0;
  }
  unsigned long long* d = nullptr;
  CUDACHECK(cudaMalloc(&d, sizeof *d));
  int failures = 0;

  /* Round 1. */
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  double t0 = now_sec();
  if (c.rank == 0)
    round1Sender<<<1, 1, 0, s>>>();
  else
    receiver<<<1, 1, 0, s>>>(2);
  KERNELCHECK();
  CUDACHECK(cudaStreamSynchronize(s));
  if (c.rank == 0) printf("rank 0: round 1 (4 GiB + 4096 and 1 MiB at 4 GiB + 8192) in %.3f s\n", now_sec() - t0);
  if (c.rank == 1) {
    const uint64_t big = 4 * kGiB + 4096, at = 4 * kGiB + 8192, small = 1 << 20;
    const uint64_t untouched[] = {big, at - 1, at + small, 1ull << 32};
    for (uint64_t p : untouched) {
      if (patternByte(p, 1) == 0xEE || patternByte(p, 1) == patternByte(p, 2)) {
        fprintf(stderr, "rank 1: the pattern cannot tell byte %llu apart\n", (unsigned long long)p);
        failures++;
      }
    }
    failures += expectByte(buf, 0, patternByte(0, 1), "first of the 4 GiB + 4096 put");
    failures += expectByte(buf, 2 * kGiB - 1, patternByte(2 * kGiB - 1, 1), "end of its first 2 GiB trigger");
    failures += expectByte(buf, 2 * kGiB, patternByte(2 * kGiB, 1), "start of its second trigger");
    failures += expectByte(buf, 4 * kGiB, patternByte(4 * kGiB, 1), "byte 2^32 of it");
    failures += expectByte(buf, big - 1, patternByte(big - 1, 1), "last of the 4 GiB + 4096 put");
    failures += expectByte(buf, big, 0xEE, "past its end: untouched");
    failures += expectByte(buf, at - 1, 0xEE, "before the 1 MiB put: untouched");
    failures += expectByte(buf, at, patternByte(at, 1), "first of the 1 MiB put");
    failures += expectByte(buf, at + small - 1, patternByte(at + small - 1, 1), "last of the 1 MiB put");
    failures += expectByte(buf, at + small, 0xEE, "past its end: untouched");
  }

  /* Round 2: exactly 2^32 bytes, then flush(). */
  if (c.rank == 0) {
    fillPattern<<<1024, 512, 0, s>>>(buf, bytes, 2);
    KERNELCHECK();
    CUDACHECK(cudaStreamSynchronize(s));
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  t0 = now_sec();
  if (c.rank == 0)
    round2Sender<<<1, 1, 0, s>>>(d);
  else
    receiver<<<1, 1, 0, s>>>(1);
  KERNELCHECK();
  CUDACHECK(cudaStreamSynchronize(s));
  if (c.rank == 0) {
    unsigned long long ns = 0;
    CUDACHECK(cudaMemcpy(&ns, d, sizeof ns, cudaMemcpyDeviceToHost));
    printf("rank 0: put of 2^32 bytes then flush() completed in %.3f s (kernel: %.3f s)\n",
           ns / 1e9, now_sec() - t0);
  }
  if (c.rank == 1) {
    failures += expectByte(buf, 0, patternByte(0, 2), "first of the 2^32-byte put");
    failures += expectByte(buf, (1ull << 32) - 1, patternByte((1ull << 32) - 1, 2), "last of the 2^32-byte put");
    failures += expectByte(buf, 1ull << 32, patternByte(1ull << 32, 1), "past its end: round 1's byte");
  }

  failures += teardown(c);
  CUDACHECK(cudaFree(d));
  CUDACHECK(cudaFree(buf));
  CUDACHECK(cudaStreamDestroy(s));
  /* Rank 1 holds the checks; each rank's exit code counts its own. */
  printf("rank %d: bigput: %s\n", c.rank, failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
