/*
 * nvshmem_pingpong: the smallest NVSHMEM ping-pong we could write, sharing nothing with
 * bench/gpu/nvshmem_perf.cu (its bootstrap, timing and kernels are its own), so that the peer
 * tool's NVSHMEM numbers can be checked against an independent reading (issue 42).
 *
 *   nvshmem_pingpong RANK IDFILE [ITERS] [BYTES]     (two processes: RANK 0 and 1)
 *
 * PE 0 puts BYTES (8) with nvshmem_putmem_signal_nbi by one thread, the signal set to the
 * round's number, and waits for PE 1's answer with nvshmem_signal_wait_until; PE 1 waits and
 * answers. Nothing else in the loop: this is NVSHMEM's own perftest
 * (shmem_put_signal_ping_pong_latency.cu) with the signal-wait call. Time: CUDA events around
 * the kernel of ITERS (10000) rounds on PE 0, after a warm-up kernel; half the round trip.
 * Bootstrap: PE 0 writes NVSHMEM's unique id into IDFILE (then renames it into place), PE 1
 * reads it, waiting 30 s at most.
 * Each PE's message is its own byte (PE + 1) in every place, written before the first round.
 * Prints on PE 0: `RESULT nvshmem_pingpong bytes=N us=U`. Exit 1 on a failed call, a missing
 * id, or a message that did not arrive.
 */
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(cond, ...)                \
  do {                                  \
    if (!(cond)) {                      \
      fprintf(stderr, "nvshmem_pingpong: "); \
      fprintf(stderr, __VA_ARGS__);     \
      fprintf(stderr, "\n");            \
      exit(1);                          \
    }                                   \
  } while (0)
#define CUDA(cmd)                                                                        \
  do {                                                                                   \
    cudaError_t e = (cmd);                                                               \
    CHECK(e == cudaSuccess, "%s: %s", #cmd, cudaGetErrorString(e));                      \
  } while (0)

/* Round i sets the signal to base + i; the message is the sender's bytes, written once. */
__global__ void pingpong(void *recv, const void *send, size_t bytes, uint64_t *sig, int me, int rounds,
                         uint64_t base)
{
  const int peer = 1 - me;
  for (int i = 1; i <= rounds; i++) {
    const uint64_t v = base + i;
    if (me == 1) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, v);
    nvshmem_putmem_signal_nbi(recv, send, bytes, sig, v, NVSHMEM_SIGNAL_SET, peer);
    if (me == 0) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, v);
  }
}

int main(int argc, char **argv)
{
  CHECK(argc >= 3, "usage: nvshmem_pingpong RANK IDFILE [ITERS] [BYTES]");
  const int me = atoi(argv[1]);
  const char *idfile = argv[2];
  const int iters = argc > 3 ? atoi(argv[3]) : 10000;
  const size_t bytes = argc > 4 ? strtoull(argv[4], NULL, 10) : 8;
  CHECK((me == 0 || me == 1) && iters > 0 && bytes > 0, "RANK is 0 or 1, ITERS > 0, BYTES > 0");
  int ndev = 0;
  CUDA(cudaGetDeviceCount(&ndev));
  CUDA(cudaSetDevice(me % ndev));

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (me == 0) {
    CHECK(nvshmemx_get_uniqueid(&id) == 0, "nvshmemx_get_uniqueid failed");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", idfile);
    FILE *f = fopen(tmp, "wb");
    CHECK(f && fwrite(&id, sizeof id, 1, f) == 1 && fclose(f) == 0, "cannot write %s", tmp);
    CHECK(rename(tmp, idfile) == 0, "cannot rename %s to %s", tmp, idfile);
  } else {
    FILE *f = NULL;
    /* Bounded: PE 0 writes the file once it is up. */
    for (int t = 0; t < 3000 && (f = fopen(idfile, "rb")) == NULL; t++) usleep(10000);
    CHECK(f != NULL, "no unique id in %s after 30 s (is PE 0 running?)", idfile);
    CHECK(fread(&id, sizeof id, 1, f) == 1, "short unique id in %s", idfile);
    fclose(f);
  }
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  CHECK(nvshmemx_set_attr_uniqueid_args(me, 2, &id, &attr) == 0, "nvshmemx_set_attr_uniqueid_args failed");
  CHECK(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) == 0, "nvshmemx_init_attr failed");

  void *recv = nvshmem_malloc(bytes);
  void *send = nvshmem_malloc(bytes);
  uint64_t *sig = (uint64_t *)nvshmem_malloc(8);
  CHECK(recv && send && sig, "nvshmem_malloc failed");
  CUDA(cudaMemset(sig, 0, 8));
  CUDA(cudaMemset(recv, 0, bytes));
  CUDA(cudaMemset(send, me + 1, bytes));
  CUDA(cudaDeviceSynchronize());
  nvshmem_barrier_all();

  cudaStream_t s;
  cudaEvent_t e0, e1;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(cudaEventCreate(&e0));
  CUDA(cudaEventCreate(&e1));
  const int warm = 1000;
  pingpong<<<1, 1, 0, s>>>(recv, send, bytes, sig, me, warm, 0);
  CUDA(cudaGetLastError());
  CUDA(cudaStreamSynchronize(s));
  nvshmem_barrier_all();
  CUDA(cudaEventRecord(e0, s));
  pingpong<<<1, 1, 0, s>>>(recv, send, bytes, sig, me, iters, warm);
  CUDA(cudaEventRecord(e1, s));
  CUDA(cudaStreamSynchronize(s));
  float ms = 0;
  CUDA(cudaEventElapsedTime(&ms, e0, e1));
  nvshmem_barrier_all();

  unsigned char *got = (unsigned char *)malloc(bytes);
  CHECK(got != NULL, "malloc");
  CUDA(cudaMemcpy(got, recv, bytes, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < bytes; i++) bad += got[i] != (unsigned char)(2 - me);
  if (me == 0) printf("RESULT nvshmem_pingpong bytes=%zu us=%.3f\n", bytes, ms * 1e3 / (2.0 * iters));
  free(got);
  nvshmem_free(sig);
  nvshmem_free(send);
  nvshmem_free(recv);
  nvshmem_finalize();
  CHECK(bad == 0, "PE %d: %zu of %zu bytes received are not PE %d's", me, bad, bytes, 1 - me);
  return 0;
}
