/*
 * mscclppRegisteredBufferWrite from GPU memory, 2 ranks (P2P unless MSCCLPP_EXAMPLE_TRANSPORT
 * says otherwise): rank 0 writes into rank 1's registered buffer, rank 1 checks every byte.
 *
 *   regwrite [-r R -n 2 -a IP:PORT]
 *
 * 1. A source freed with cudaFree and allocated again at the same address delivers its new
 *    bytes: the library keeps no registration of a source past its call. If CUDA hands out
 *    another address, the line says SKIPPED for the reuse and the bytes are still checked.
 * 2. 10^4 writes of 8 bytes, each from a different source range (srcOffset i): every byte
 *    arrives (the P2P endpoint's source table stays at one entry; unit-tested in the library).
 * 3. This file is built with --default-stream per-thread. A kernel on that default stream
 *    spins 20 ms, then fills the source; the write with stream = cudaStreamPerThread must send
 *    the kernel's bytes. The same with stream = 0 is only reported: 0 is the legacy stream,
 *    which does not wait for that kernel (the header says so).
 * 4. mscclppUnregisterBuffer: a second buffer (its own allocation) and the connection's own
 *    buffer registered besides; the first registration unregistered on both ranks: a write
 *    with it is refused (mscclppInvalidArgument), and rank 1 frees that memory at once (the
 *    peer's CUDA IPC mapping of it is closed); the second buffer's writes still arrive; the
 *    connection's buffer unregistered, and a put through the connection (a kernel's
 *    putWithSignal) still lands: the mapping the connection uses stays.
 * Rank 1 prints "regwrite: ok" and every rank exits 0 when everything holds; else exit 1.
 *
 * Every case is a handshake: rank 0 writes, a barrier, rank 1 checks, a second barrier, and
 * only then the next case's write. With the first barrier alone, rank 0 may leave it and write
 * the next case's bytes into the same range before rank 1 has read the previous case's (seen
 * on an H100: case 1 read "1048576 bytes wrong"; zeros would have matched ~1/256 of the
 * pattern, and no two of this file's seeds agree at any offset, so the range held another
 * write's bytes: case 2's).
 */
#include "common.cuh"

static __host__ __device__ inline uint8_t byteOf(uint32_t seed, uint64_t i)
{
  return (uint8_t)pattern(0, i, seed);
}

/* Fills p[0, n) with byteOf(seed, i), each thread first spinning `spinNs` nanoseconds. */
__global__ void fillBytes(uint8_t* p, uint64_t n, uint32_t seed, uint64_t spinNs)
{
  const uint64_t t0 = globalTimerNs();
  /* Ends after spinNs by the global timer. */
  while (globalTimerNs() - t0 < spinNs) {
  }
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = byteOf(seed, i);
}

/* Bytes of target[off, off + n) that are not byteOf(seed, srcOff + i) (rank 1). When some
 * are, says what is there instead: zeros (nothing arrived: the buffer was zeroed, and only
 * ~1/256 of the pattern's bytes are 0) or another seed's bytes (the pattern's bytes of two
 * seeds differ at every position, so a whole range wrong is one other write). */
static uint64_t countBadBytes(const uint8_t* target, uint64_t off, uint64_t n, uint32_t seed,
                              uint64_t srcOff)
{
  std::vector<uint8_t> h(n);
  CUDACHECK(cudaMemcpy(h.data(), target + off, n, cudaMemcpyDeviceToHost));
  uint64_t bad = 0, zeros = 0, first = n;
  for (uint64_t i = 0; i < n; i++) {
    const bool wrong = h[i] != byteOf(seed, srcOff + i);
    if (wrong && first == n) first = i;
    bad += wrong;
    zeros += h[i] == 0;
  }
  if (bad) {
    int other = -1; /* the seed (1..5, this file's) whose bytes the first wrong one is */
    for (uint32_t s = 1; s <= 5 && other < 0; s++)
      if (s != seed && h[first] == byteOf(s, srcOff + first)) other = (int)s;
    printf("rank 1: first wrong byte at offset %llu: 0x%02x, expected 0x%02x (seed %u); "
           "%llu of %llu bytes are 0; that byte is seed %d's (-1: none)\n",
           (unsigned long long)(off + first), h[first], byteOf(seed, srcOff + first), seed,
           (unsigned long long)zeros, (unsigned long long)n, other);
  }
  return bad;
}

/* Case 4's put through the connection (a kernel: the connection is over CUDA memory):
 * rank 0 puts its 4 KiB with a signal and flushes, rank 1 waits. */
__global__ void putOrWait(int rank)
{
  if (rank == 0) {
    gConns[0].putWithSignal(0, 0, 4096);
    gConns[0].flush();
  } else {
    gConns[0].wait();
  }
}

static void fill(uint8_t* p, uint64_t n, uint32_t seed)
{
  fillBytes<<<64, 256>>>(p, n, seed, 0);
  KERNELCHECK();
  CUDACHECK(cudaDeviceSynchronize());
}

int main(int argc, char** argv)
{
  Ctx c;
  setupRank(c, &argc, argv);
  if (c.nranks != 2) {
    fprintf(stderr, "regwrite runs with 2 ranks\n");
    return 2;
  }
  void* connBuf = nullptr;
  CUDACHECK(cudaMalloc(&connBuf, 4096));
  connectPeers(c, connBuf, 4096, {1 - c.rank});
  const uint64_t L = 1 << 20, N = 10000, T = 2 << 20;
  uint8_t* target = nullptr;
  CUDACHECK(cudaMalloc(&target, T));
  CUDACHECK(cudaMemset(target, 0, T));
  CUDACHECK(cudaDeviceSynchronize());
  mscclppRegisteredMemory reg;
  MSCCLPPCHECK(mscclppRegisterBuffer(c.comm, target, T, &reg));
  int failures = 0;
  auto expect = [&](const char* what, uint64_t bad) {
    if (c.rank != 1) return;
    printf("rank 1: %s: %s (%llu bytes wrong)\n", what, bad ? "FAILED" : "ok",
           (unsigned long long)bad);
    failures += bad != 0;
  };

  /* 1. Freed and allocated again at the same address. */
  uint8_t* first = nullptr;
  if (c.rank == 0) {
    CUDACHECK(cudaMalloc(&first, L));
    fill(first, L, 1);
    MSCCLPPCHECK(mscclppRegisteredBufferWrite(c.comm, &reg, first, L, 0, 0, 0));
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  expect("first source", c.rank == 1 ? countBadBytes(target, 0, L, 1, 0) : 0);
  /* Rank 1 has read the range: only now may the next case write into it. */
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  if (c.rank == 0) {
    CUDACHECK(cudaFree(first));
    uint8_t* second = nullptr;
    CUDACHECK(cudaMalloc(&second, L));
    printf("rank 0: %s: the second source is at %p, the freed one was at %p\n",
           second == first ? "address reused" : "SKIPPED the reuse case", (void*)second,
           (void*)first);
    fill(second, L, 2);
    MSCCLPPCHECK(mscclppRegisteredBufferWrite(c.comm, &reg, second, L, 0, 0, 0));
    CUDACHECK(cudaFree(second));
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  expect("source at a reused address sends its new bytes",
         c.rank == 1 ? countBadBytes(target, 0, L, 2, 0) : 0);
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm)); /* rank 1 has read it (as above) */

  /* 2. 10^4 different source ranges. */
  if (c.rank == 0) {
    uint8_t* src = nullptr;
    CUDACHECK(cudaMalloc(&src, N + 8));
    fill(src, N + 8, 3);
    const double t0 = now_sec();
    for (uint64_t i = 0; i < N; i++)
      MSCCLPPCHECK(mscclppRegisteredBufferWrite(c.comm, &reg, src, 8, (uint32_t)i,
                                                (uint32_t)(8 * i), 0));
    printf("rank 0: %llu writes from different source ranges took %.3f s\n",
           (unsigned long long)N, now_sec() - t0);
    CUDACHECK(cudaFree(src));
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  if (c.rank == 1) {
    std::vector<uint8_t> h(8 * N);
    CUDACHECK(cudaMemcpy(h.data(), target, 8 * N, cudaMemcpyDeviceToHost));
    uint64_t bad = 0;
    for (uint64_t i = 0; i < N; i++)
      for (uint64_t k = 0; k < 8; k++) bad += h[8 * i + k] != byteOf(3, i + k);
    expect("10^4 writes from different source ranges", bad);
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm)); /* rank 1 has read it (as above) */

  /* 3. The per-thread default stream: 0 (reported only), then cudaStreamPerThread. */
  const struct {
    int64_t stream;
    uint32_t seed;
    const char* name;
  } cases[2] = {{0, 4, "stream 0"},
                {(int64_t)(uintptr_t)cudaStreamPerThread, 5, "cudaStreamPerThread"}};
  uint8_t* src = nullptr;
  if (c.rank == 0) CUDACHECK(cudaMalloc(&src, L));
  for (const auto& k : cases) {
    if (c.rank == 0) {
      CUDACHECK(cudaMemset(src, 0, L));
      CUDACHECK(cudaDeviceSynchronize());
      fillBytes<<<64, 256>>>(src, L, k.seed, 20 * 1000 * 1000);
      KERNELCHECK();
      MSCCLPPCHECK(mscclppRegisteredBufferWrite(c.comm, &reg, src, L, 0, 0, k.stream));
      CUDACHECK(cudaDeviceSynchronize());
    }
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
    if (c.rank == 1) {
      const uint64_t bad = countBadBytes(target, 0, L, k.seed, 0);
      if (k.stream == 0)
        printf("rank 1: per-thread default stream, %s (reported only): %llu of %llu bytes were "
               "not yet the kernel's\n",
               k.name, (unsigned long long)bad, (unsigned long long)L);
      else
        expect("per-thread default stream, cudaStreamPerThread waits for the kernel", bad);
    }
    /* Rank 1 has read it (as above): the kernel's 20 ms spin is no handshake. */
    MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  }
  if (c.rank == 0) CUDACHECK(cudaFree(src));

  /* 4. Unregistering. */
  uint8_t* target2 = nullptr;
  CUDACHECK(cudaMalloc(&target2, L));
  CUDACHECK(cudaMemset(target2, 0, L));
  CUDACHECK(cudaDeviceSynchronize());
  mscclppRegisteredMemory reg2, regConn;
  MSCCLPPCHECK(mscclppRegisterBuffer(c.comm, target2, L, &reg2));
  MSCCLPPCHECK(mscclppRegisterBuffer(c.comm, connBuf, 4096, &regConn));
  MSCCLPPCHECK(mscclppUnregisterBuffer(c.comm, &reg));
  if (c.rank == 1) {
    CUDACHECK(cudaFree(target)); /* nothing of it is held any more, on either rank */
    target = nullptr;
  }
  uint8_t* src2 = nullptr;
  CUDACHECK(cudaMalloc(&src2, L));
  fill(src2, L, 6);
  if (c.rank == 0) {
    const mscclppResult_t r = mscclppRegisteredBufferWrite(c.comm, &reg, src2, L, 0, 0, 0);
    const bool refused = r == mscclppInvalidArgument && strstr(mscclppGetLastError(), "unregistered");
    printf("rank 0: a write with the unregistered handle: %s (%d: %s)\n",
           refused ? "refused" : "FAILED", (int)r, mscclppGetLastError());
    failures += !refused;
    MSCCLPPCHECK(mscclppRegisteredBufferWrite(c.comm, &reg2, src2, L, 0, 0, 0));
  }
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  expect("after an unregister, the other registration's write", c.rank == 1 ? countBadBytes(target2, 0, L, 6, 0) : 0);
  MSCCLPPCHECK(mscclppBootstrapBarrier(c.comm));
  MSCCLPPCHECK(mscclppUnregisterBuffer(c.comm, &regConn));
  MSCCLPPCHECK(mscclppUnregisterBuffer(c.comm, &reg2));
  if (c.rank == 0) CUDACHECK(cudaMemcpy(connBuf, src2, 4096, cudaMemcpyDeviceToDevice));
  putOrWait<<<1, 1>>>(c.rank);
  KERNELCHECK();
  CUDACHECK(cudaDeviceSynchronize());
  expect("after unregistering the connection's buffer, a put through the connection",
         c.rank == 1 ? countBadBytes((const uint8_t*)connBuf, 0, 4096, 6, 0) : 0);
  CUDACHECK(cudaFree(src2));
  CUDACHECK(cudaFree(target2));

  failures += teardown(c);
  if (target) CUDACHECK(cudaFree(target));
  CUDACHECK(cudaFree(connBuf));
  if (c.rank == 1 && failures == 0) printf("regwrite: ok\n");
  return failures ? 1 : 0;
}
