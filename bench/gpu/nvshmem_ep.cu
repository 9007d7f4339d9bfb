/*
 * nvshmem_ep: the NVSHMEM peer of our expert-parallel (MoE) dispatch/combine benchmark
 * (examples/ep). Ours, written as NVSHMEM's users write an EP all-to-all (the pplx-kernels /
 * DeepEP shape: pack by expert, one put-with-signal per (peer, expert) batch, the count in the
 * signal, a wait per signal); pplx-kernels itself is not built here. It shares examples/ep/ep.h
 * with our implementation: the shape, the input generators, the expert and the reference
 * reduction, so both move and check the same bytes.
 *
 *   nvshmem_ep RANK NRANKS IDFILE [--tokens 1,8,32,128] [--steps 1000] [--warmup 50]
 *              [--hidden 7168] [--experts 256] [--topk 8] [--blocks 64]
 *
 * --blocks: blocks of 512 threads of the dispatch and combine kernels per PE (examples/ep's
 * default, 64), at most one per batch.
 *
 * One process per PE: PE r on device r % (the devices it sees), so NRANKS of them on one GPU
 * under CUDA MPS with CUDA_VISIBLE_DEVICES naming one, or one per GPU. Each step of T tokens:
 *   prepare (untimed)  PE me's tokens X[t] = ep::token(me, t, ., step), its routing
 *                      idx[t][k] = ep::expertOf(..) and weights w[t][k] = ep::weightOf(..).
 *   dispatch (timed)   one kernel: per-expert bit masks of the T tokens in shared memory give
 *                      each (token, expert) its slot (popcount of the lower bits); each block
 *                      packs its experts' rows into S[e][slot] and sends each (destination PE,
 *                      expert) batch with ONE nvshmemx_putmem_signal_nbi_block into the
 *                      destination's DR[q][me][l][0..count), the signal (me, l) there SET to
 *                      (step + 1) << 32 | count (a batch of 0 rows still signals; our own
 *                      batches go through the same call, NVSHMEM copies them locally). Then
 *                      the last block waits for the R*L signals of this PE's experts, one
 *                      thread each, with nvshmem_signal_wait_until(GE, (step + 1) << 32) alone,
 *                      the counts read from the values.
 *   expert (untimed)   every received row scaled in place, y = ep::expertValue(x, e).
 *   combine (timed)    one kernel: each (source PE, local expert) run goes back to its source
 *                      with one nvshmemx_putmem_signal_nbi_block into CR[q][me][l][..] there,
 *                      and the source waits for its R*L signals the same way; then a reduce
 *                      kernel: out[t][h] = bf16(sum over k in order of fmaf(w[t][k], y_k, acc)),
 *                      ep::combined's arithmetic.
 * Everything received is double-buffered by step parity q = step & 1 (DR, CR and their
 * signals), and signal values carry step + 1, so a signal left from an earlier step never
 * passes a wait. Times: CUDA events around the dispatch kernel, and around the combine and
 * reduce kernels, per step on PE 0; median and p99 over the timed steps as examples/ep/ep.cu
 * takes them (sorted[ceil(p N) - 1], p = 0.5 and 0.99). Check: on the first two steps and the
 * last step of each token count every PE checks its counts, its received rows (after the
 * expert) and its output bit for bit with ep::checkStep, our implementation's check, and that
 * every signal it waited for carries the step (and, from combine, the count it sent).
 *
 * Built with -DEP_STAMPS (e.g. NVSHMEM_PERF_NVCC_FLAGS=-DEP_STAMPS to bench/gpu/nvshmem.sh's
 * nvshmem_build, into a directory of its own), every PE also prints where each timed kernel's
 * time went, as `ep --stamps yes` does for ours (ep.h's printPhases: RESULT ep_phases
 * impl=nvshmem ...); the binary built without it carries none of that code.
 *
 * Bootstrap: NVSHMEM's unique id, through IDFILE (as bench/gpu/nvshmem_pingpong.cu): PE 0
 * writes it and renames it into place, the others wait 30 s at most for it.
 * The waits in the kernels are NVSHMEM's and have no timeout: a PE that is missing or died
 * leaves the others' kernels spinning forever. The caller runs this under `timeout` (the GPU
 * check does).
 * Prints on PE 0, per token count:
 *   RESULT ep impl=nvshmem ranks=R tokens=T hidden=H experts=E topk=K steps=N
 *     dispatch_med_us=X dispatch_p99_us=X combine_med_us=X combine_p99_us=X wrong=W
 *     combine_kernel_med_us=X reduce_med_us=X expert_med_us=X gpus=G
 * (one line; combine's two kernels alone, the untimed expert kernel, the GPUs the PEs use). Exit: 0 all right; 1 a wrong value (the first few are printed by the PE that saw
 * them), a failed call or a missing id; 2 usage.
 */
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "../../examples/ep/ep.h"

static int g_me = -1;

#define CHECK(cond, ...)                          \
  do {                                            \
    if (!(cond)) {                                \
      fprintf(stderr, "nvshmem_ep PE %d: ", g_me); \
      fprintf(stderr, __VA_ARGS__);               \
      fprintf(stderr, "\n");                      \
      exit(1);                                    \
    }                                             \
  } while (0)
#define CUDA(cmd)                                                       \
  do {                                                                  \
    cudaError_t e_ = (cmd);                                             \
    CHECK(e_ == cudaSuccess, "%s: %s", #cmd, cudaGetErrorString(e_));   \
  } while (0)

/* Threads of the communication kernels: at least Tmax (one thread per token computes its
 * slot), and a block of 512 copies a 14 KiB row in two passes of 16-byte words. */
static const int kCommThreads = 512;
static const int kReduceThreads = 128;
static const int kMaxTokens = 128; /* the slot masks are 4 words */
static const int kMaxTopK = 16;    /* ep::expertOf's bound */
static const int kMaxExperts = 2048; /* the masks' shared memory (E * 16 bytes) stays under 48 KiB */

/* What every kernel of one step gets; the symmetric pointers are this step's parity. */
struct Args {
  ep::Shape s;
  int me, T;
  uint32_t step;
  char *S;               /* symmetric: S[e][slot], E * Tmax rows (the send buffer) */
  char *DR, *CR;         /* symmetric: DR[src][l][slot], CR[expert PE][l][slot] of parity q */
  uint64_t *dsig, *csig; /* symmetric: dsig[src * L + l], csig[expert PE * L + l] of parity q */
  ep::bf16 *X;           /* T rows */
  int *idx;              /* idx[t * K + k]: expert */
  float *w;              /* w[t * K + k]: weight */
  int *slot;             /* slot[t * K + k]: row of token t in its k-th expert's run */
  uint64_t *dval, *cval; /* the signal values waited for (the count in the low half) */
  ep::bf16 *out;         /* T rows */
#ifdef EP_STAMPS
  unsigned long long *stamps; /* nullptr, or this step's ep::kStamps times */
#endif
};

/* Built with -DEP_STAMPS (a binary of its own, so the timed peer carries none of it): the
 * phases of ep.h's printPhases, stamped as examples/ep stamps ours. The waiting block's "put"
 * stamp is its own sends done (the others' may still run), and its signals go with its puts:
 * "signal" is 0. */
#ifdef EP_STAMPS
#define EP_STAMP_ENTRY(a, at)                                                       \
  do {                                                                              \
    if ((a).stamps && threadIdx.x == 0) atomicMin(&(a).stamps[(at)], ep::globalNs()); \
  } while (0)
#define EP_STAMP(a, at, which)                                                       \
  do {                                                                               \
    if ((a).stamps) {                                                                \
      __syncthreads();                                                               \
      if (threadIdx.x == 0) (a).stamps[(at) + (which)] = ep::globalNs();             \
    }                                                                                \
  } while (0)
#else
#define EP_STAMP_ENTRY(a, at) \
  do {                        \
  } while (0)
#define EP_STAMP(a, at, which) \
  do {                         \
  } while (0)
#endif

__device__ __forceinline__ uint64_t stamp(uint32_t step) { return (uint64_t)(step + 1) << 32; }

__global__ void prepare_kernel(Args a)
{
  const int t = blockIdx.x, K = a.s.K, H = a.s.H;
  for (int h = threadIdx.x; h < H; h += blockDim.x) a.X[(uint64_t)t * H + h] = ep::token(a.me, t, h, a.step);
  if ((int)threadIdx.x < K) {
    const int k = threadIdx.x;
    a.idx[t * K + k] = ep::expertOf(a.s, a.me, t, k, a.step);
    a.w[t * K + k] = ep::weightOf(a.me, t, k, a.step);
  }
}

/* Each block sends every gridDim.x-th (PE, expert) batch; then the last block waits for the
 * R * L signals, one thread each. Only one block per PE spins, after its own sends, so a
 * grid of any size cannot fill the GPU (shared by the PEs under MPS) with waiting blocks while
 * a sender of the same step is still unscheduled. The batches start at this PE's own experts,
 * so that the PEs do not all begin with PE 0's. */
__global__ void __launch_bounds__(kCommThreads) dispatch_kernel(Args a)
{
  extern __shared__ uint32_t mask[]; /* mask[e * 4 + t / 32]: token t chose expert e */
  __shared__ int tok[kMaxTokens];    /* the token in each slot of the current expert */
  const int L = a.s.L(), E = a.s.E, K = a.s.K, T = a.T, V = a.s.H / 8;
  const uint64_t row = a.s.row();
  EP_STAMP_ENTRY(a, ep::kStampDispatch);
  for (int i = threadIdx.x; i < E * 4; i += blockDim.x) mask[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < T * K; i += blockDim.x) {
    const int t = i / K;
    atomicOr(&mask[a.idx[i] * 4 + t / 32], 1u << (t % 32));
  }
  __syncthreads();
  const int4 *x = (const int4 *)a.X;
  for (int b = blockIdx.x; b < E; b += gridDim.x) {
    const int e = (b + a.me * L) % E, pe = e / L, l = e % L;
    const uint32_t *m = mask + e * 4;
    const uint32_t count = __popc(m[0]) + __popc(m[1]) + __popc(m[2]) + __popc(m[3]);
    const int t = threadIdx.x;
    if (t < T && ((m[t / 32] >> (t % 32)) & 1u)) {
      int sl = __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
      for (int j = 0; j < t / 32; j++) sl += __popc(m[j]);
      tok[sl] = t;
      /* The reduce finds token t's k-th expert row by it. */
      for (int k = 0; k < K; k++)
        if (a.idx[t * K + k] == e) a.slot[t * K + k] = sl;
    }
    __syncthreads();
    int4 *send = (int4 *)(a.S + (uint64_t)e * a.s.Tmax * row);
    for (uint32_t i = threadIdx.x; i < count * (uint32_t)V; i += blockDim.x) {
      const uint32_t r = i / V, v = i % V;
      send[(uint64_t)r * V + v] = x[(uint64_t)tok[r] * V + v];
    }
    /* The whole block's rows are packed before the block's put reads them (and tok[] is
     * rewritten only after every thread has used it). */
    __syncthreads();
    nvshmemx_putmem_signal_nbi_block(a.DR + (uint64_t)(a.me * L + l) * a.s.Tmax * row, send, count * row,
                                     a.dsig + a.me * L + l, stamp(a.step) | count, NVSHMEM_SIGNAL_SET, pe);
  }
  if (blockIdx.x != gridDim.x - 1) return;
  EP_STAMP(a, ep::kStampDispatch, ep::kStampPut);
  EP_STAMP(a, ep::kStampDispatch, ep::kStampSignalled);
  for (int i = threadIdx.x; i < a.s.R * L; i += blockDim.x)
    a.dval[i] = nvshmem_signal_wait_until(a.dsig + i, NVSHMEM_CMP_GE, stamp(a.step));
  EP_STAMP(a, ep::kStampDispatch, ep::kStampWaited);
}

/* The expert, as ours (ep.h's expertRun): block i scales run i, i + gridDim.x, ... */
__global__ void expert_kernel(Args a)
{
  const int L = a.s.L(), RL = a.s.R * L;
  for (int i = blockIdx.x; i < RL; i += gridDim.x)
    ep::expertRun((uint8_t *)a.DR + (uint64_t)i * a.s.Tmax * a.s.row(), (uint32_t)a.dval[i], a.s.H, a.me * L + i % L);
}

/* Each block returns every gridDim.x-th (source PE, local expert) run; the last block waits
 * for the R * L runs coming back, one thread each (as dispatch_kernel, for the same reason). */
__global__ void __launch_bounds__(kCommThreads) combine_kernel(Args a)
{
  const int L = a.s.L(), RL = a.s.R * L;
  const uint64_t row = a.s.row();
  EP_STAMP_ENTRY(a, ep::kStampCombine);
  for (int b = blockIdx.x; b < RL; b += gridDim.x) {
    const int i = (b + a.me * L) % RL, src = i / L, l = i % L;
    const uint32_t count = (uint32_t)a.dval[i];
    nvshmemx_putmem_signal_nbi_block(a.CR + (uint64_t)(a.me * L + l) * a.s.Tmax * row,
                                     a.DR + (uint64_t)i * a.s.Tmax * row, count * row, a.csig + a.me * L + l,
                                     stamp(a.step) | count, NVSHMEM_SIGNAL_SET, src);
  }
  if (blockIdx.x != gridDim.x - 1) return;
  EP_STAMP(a, ep::kStampCombine, ep::kStampPut);
  EP_STAMP(a, ep::kStampCombine, ep::kStampSignalled);
  for (int i = threadIdx.x; i < RL; i += blockDim.x)
    a.cval[i] = nvshmem_signal_wait_until(a.csig + i, NVSHMEM_CMP_GE, stamp(a.step));
  EP_STAMP(a, ep::kStampCombine, ep::kStampWaited);
}

/* Block (c, t): 16-byte word c * blockDim.x + threadIdx.x of token t's output (ep.h's
 * combineWord: ep::combined's arithmetic, so the result is its bits). */
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(Args a)
{
  __shared__ uint64_t off[kMaxTopK];
  __shared__ float wk[kMaxTopK];
  const int t = blockIdx.y, K = a.s.K, V = a.s.H / 8;
  if ((int)threadIdx.x < K) {
    const int k = threadIdx.x;
    /* CR[e / L][e % L][slot] is row e * Tmax + slot. */
    off[k] = ((uint64_t)a.idx[t * K + k] * a.s.Tmax + a.slot[t * K + k]) * a.s.row();
    wk[k] = a.w[t * K + k];
  }
  __syncthreads();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v < V) ((int4 *)a.out)[(uint64_t)t * V + v] = ep::combineWord(K, wk, (const uint8_t *)a.CR, off, v);
}

/* The sum over PEs of each PE's word (after a barrier: every word is written). */
__global__ void sum_kernel(uint64_t *word, int npes, unsigned long long *sum)
{
  unsigned long long s = 0;
  for (int p = 0; p < npes; p++) s += nvshmem_uint64_g(word, p);
  *sum = s;
}

/* ---------------------------------------------------------------------------------------- */

struct Bufs {
  char *S, *DR[2], *CR[2];
  uint64_t *dsig[2], *csig[2];
  ep::bf16 *X, *out;
  int *idx, *slot;
  float *w;
  uint64_t *dval, *cval;
};

static Args step_args(const ep::Shape &s, const Bufs &b, int me, int T, uint32_t step)
{
  const int q = step & 1;
  Args a;
  a.s = s;
  a.me = me;
  a.T = T;
  a.step = step;
  a.S = b.S;
  a.DR = b.DR[q];
  a.CR = b.CR[q];
  a.dsig = b.dsig[q];
  a.csig = b.csig[q];
  a.X = b.X;
  a.idx = b.idx;
  a.w = b.w;
  a.slot = b.slot;
  a.dval = b.dval;
  a.cval = b.cval;
  a.out = b.out;
  return a;
}

/* Wrong values of this PE after step `step` (its stream is idle). The counts, every row its
 * experts received (after the expert) and its output are checked by ep::checkStep, the check
 * our implementation runs, given this layout's rows (DR[src][l][slot]) and the counts, the
 * low halves of the signals waited for. Here besides: every signal waited for carries this
 * step, and the counts that came back with combine are the ones this PE sent. Prints the
 * first few of each. */
static uint64_t check_step(const ep::Shape &s, const Bufs &b, int me, int T, uint32_t step)
{
  const int L = s.L(), RL = s.R * L, q = step & 1;
  const uint64_t stamp_h = ((uint64_t)step + 1) << 32;
  std::vector<uint64_t> dval(RL), cval(RL);
  std::vector<uint32_t> counts(RL);
  std::vector<ep::bf16> out((size_t)T * s.H);
  CUDA(cudaMemcpy(dval.data(), b.dval, RL * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CUDA(cudaMemcpy(cval.data(), b.cval, RL * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CUDA(cudaMemcpy(out.data(), b.out, out.size() * sizeof(ep::bf16), cudaMemcpyDeviceToHost));
  for (int i = 0; i < RL; i++) counts[i] = (uint32_t)dval[i];
  auto counts_of = [&](int src, uint32_t *c) { memcpy(c, counts.data() + (size_t)src * L, (size_t)L * 4); };
  auto row_of = [&](int src, int l, uint32_t slot, uint64_t, ep::bf16 *dst) {
    CUDA(cudaMemcpy(dst, b.DR[q] + (((uint64_t)src * L + l) * s.Tmax + slot) * s.row(), s.row(),
                    cudaMemcpyDeviceToHost));
  };
  uint64_t wrong = ep::checkStep(s, me, T, step, counts_of, row_of, out.data());

  std::vector<uint32_t> sent(s.E, 0); /* rows this PE sent to each expert */
  for (int t = 0; t < T; t++)
    for (int k = 0; k < s.K; k++) sent[ep::expertOf(s, me, t, k, step)]++;
  int printed = 0;
  for (int i = 0; i < RL; i++) {
    if ((dval[i] >> 32) != stamp_h >> 32) {
      if (printed++ < 5)
        printf("PE %d step %u: dispatch signal from PE %d for expert %d is 0x%016llx: not this step's\n", me,
               step, i / L, me * L + i % L, (unsigned long long)dval[i]);
      wrong++;
    }
    /* csig[i] comes from expert i's PE: expert i's rows of this PE, back. */
    if (cval[i] != (stamp_h | sent[i])) {
      if (printed++ < 5)
        printf("PE %d step %u: combine signal from PE %d for expert %d is 0x%016llx, want 0x%016llx\n", me,
               step, i / L, i, (unsigned long long)cval[i], (unsigned long long)(stamp_h | sent[i]));
      wrong++;
    }
  }
  fflush(stdout);
  return wrong;
}

/* sorted[ceil(p N) - 1], ep.cu's percentile (its median is p = 0.5), in us. */
static double percentile_us(std::vector<double> v, double p)
{
  std::sort(v.begin(), v.end());
  const size_t i = (size_t)ceil(p * (double)v.size());
  return v[i == 0 ? 0 : i - 1];
}

static int usage(void)
{
  fprintf(stderr, "usage: nvshmem_ep RANK NRANKS IDFILE [--tokens 1,8,32,128] [--steps 1000] [--warmup 50]\n"
                  "       [--hidden 7168] [--experts 256] [--topk 8] [--blocks 64]\n");
  return 2;
}

int main(int argc, char **argv)
{
  if (argc < 4) return usage();
  const int me = atoi(argv[1]), R = atoi(argv[2]);
  const char *idfile = argv[3];
  g_me = me;
  std::vector<int> tokens = {1, 8, 32, 128};
  int steps = 1000, warmup = 50, H = 7168, E = 256, K = 8, blocks = 64;
  for (int i = 4; i < argc; i += 2) {
    if (i + 1 >= argc) return usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (strcmp(o, "--tokens") == 0) {
      if (!ep::parseTokens(v, tokens)) return usage();
    } else if (strcmp(o, "--steps") == 0) steps = atoi(v);
    else if (strcmp(o, "--warmup") == 0) warmup = atoi(v);
    else if (strcmp(o, "--hidden") == 0) H = atoi(v);
    else if (strcmp(o, "--experts") == 0) E = atoi(v);
    else if (strcmp(o, "--topk") == 0) K = atoi(v);
    else if (strcmp(o, "--blocks") == 0) blocks = atoi(v);
    else return usage();
  }
  int Tmax = 0;
  for (int t : tokens) {
    if (t < 1 || t > kMaxTokens) return usage();
    Tmax = std::max(Tmax, t);
  }
  if (R < 1 || me < 0 || me >= R || tokens.empty() || steps < 1 || warmup < 0 || H < 8 || H % 8 != 0 ||
      E < R || E % R != 0 || E > kMaxExperts || K < 1 || K > kMaxTopK || K > E || blocks < 1) {
    fprintf(stderr, "nvshmem_ep: need 0 <= RANK < NRANKS, tokens in 1..%d, steps > 0, warmup >= 0, hidden a "
                    "multiple of 8, experts a multiple of NRANKS (at most %d), 1 <= topk <= %d and <= experts, "
                    "blocks > 0\n",
            kMaxTokens, kMaxExperts, kMaxTopK);
    return usage();
  }
  ep::Shape s;
  s.R = R;
  s.E = E;
  s.K = K;
  s.H = H;
  s.Tmax = Tmax;
  const int L = s.L(), RL = R * L;
  const uint64_t row = s.row(), block = (uint64_t)RL * Tmax * row; /* one S, DR or CR: E * Tmax rows */
  const uint64_t sig_bytes = (4 * (uint64_t)RL + 1) * sizeof(uint64_t);

  /* The symmetric heap holds S, DR and CR of both parities (5 blocks of E * Tmax rows: with
   * hidden 7168, 256 experts and Tmax 128 each is 470 MB, about 2.35 GB in all) and the signals;
   * NVSHMEM's default (1 GB) is too small, so ask for that plus room for NVSHMEM's own
   * allocations there, unless the caller chose. Before any NVSHMEM call: nvshmemx_get_uniqueid
   * already reads the environment. */
  if (getenv("NVSHMEM_SYMMETRIC_SIZE") == NULL) {
    char v[32];
    snprintf(v, sizeof v, "%llu", (unsigned long long)(5 * block + sig_bytes + (256ull << 20)));
    CHECK(setenv("NVSHMEM_SYMMETRIC_SIZE", v, 1) == 0, "setenv NVSHMEM_SYMMETRIC_SIZE");
  }

  /* PE me on device me % devices (all on one under MPS where one is visible). The context
   * before NVSHMEM, which takes the current one. */
  int ndev = 0;
  CUDA(cudaGetDeviceCount(&ndev));
  CHECK(ndev > 0, "no CUDA device");
  CUDA(cudaSetDevice(me % ndev));
  CUDA(cudaFree(0));

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (me == 0) {
    CHECK(nvshmemx_get_uniqueid(&id) == 0, "nvshmemx_get_uniqueid failed");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", idfile);
    FILE *f = fopen(tmp, "wb");
    CHECK(f && fwrite(&id, sizeof id, 1, f) == 1 && fclose(f) == 0, "cannot write %s", tmp);
    /* Renamed into place, so a reader never sees half an id. */
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
  CHECK(nvshmemx_set_attr_uniqueid_args(me, R, &id, &attr) == 0, "nvshmemx_set_attr_uniqueid_args failed");
  CHECK(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) == 0, "nvshmemx_init_attr failed");
  CHECK(nvshmem_my_pe() == me && nvshmem_n_pes() == R, "NVSHMEM made this PE %d of %d, not %d of %d",
        nvshmem_my_pe(), nvshmem_n_pes(), me, R);
  /* The host barriers below are refused in limited MPG (several PEs on one GPU without MPS). */
  CHECK(nvshmemx_init_status() != NVSHMEM_STATUS_LIMITED_MPG,
        "NVSHMEM runs in limited MPG mode (several PEs on one GPU without MPS, or MPS thread "
        "percentages over 100): run under MPS");

  Bufs b;
  char *heap = (char *)nvshmem_malloc(5 * block);
  uint64_t *sig = (uint64_t *)nvshmem_malloc(sig_bytes);
  CHECK(heap && sig, "nvshmem_malloc of %llu + %llu bytes failed (NVSHMEM_SYMMETRIC_SIZE too small?)",
        (unsigned long long)(5 * block), (unsigned long long)sig_bytes);
  b.S = heap;
  for (int q = 0; q < 2; q++) {
    b.DR[q] = heap + (1 + q) * block;
    b.CR[q] = heap + (3 + q) * block;
    b.dsig[q] = sig + (uint64_t)q * RL;
    b.csig[q] = sig + (uint64_t)(2 + q) * RL;
  }
  uint64_t *wword = sig + 4 * (uint64_t)RL; /* this PE's wrong count, summed over PEs */
  CUDA(cudaMalloc((void **)&b.X, (size_t)Tmax * row));
  CUDA(cudaMalloc((void **)&b.out, (size_t)Tmax * row));
  CUDA(cudaMalloc((void **)&b.idx, (size_t)Tmax * K * sizeof(int)));
  CUDA(cudaMalloc((void **)&b.slot, (size_t)Tmax * K * sizeof(int)));
  CUDA(cudaMalloc((void **)&b.w, (size_t)Tmax * K * sizeof(float)));
  CUDA(cudaMalloc((void **)&b.dval, (size_t)RL * sizeof(uint64_t)));
  CUDA(cudaMalloc((void **)&b.cval, (size_t)RL * sizeof(uint64_t)));
  unsigned long long *dsum;
  CUDA(cudaMalloc((void **)&dsum, sizeof *dsum));
  CUDA(cudaMemset(heap, 0, 5 * block));
  CUDA(cudaMemset(sig, 0, sig_bytes));
  CUDA(cudaDeviceSynchronize());
  /* No peer signals before every PE's signals are zero. */
  nvshmem_barrier_all();

  const int comm_blocks = std::min(E, blocks); /* a block per batch at most */
  const size_t mask_bytes = (size_t)E * 4 * sizeof(uint32_t);
  cudaStream_t st;
  CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(5 * (size_t)steps);
  for (cudaEvent_t &e : ev) CUDA(cudaEventCreate(&e));
#ifdef EP_STAMPS
  unsigned long long *stamps_dev = NULL;
  CUDA(cudaMalloc(&stamps_dev, (size_t)steps * ep::kStamps * sizeof(unsigned long long)));
#endif

  if (me == 0) {
    int maj = 0, min = 0, patch = 0;
    nvshmemx_vendor_get_version_info(&maj, &min, &patch);
    printf("# nvshmem_ep: NVSHMEM %d.%d.%d, %d PEs, %s; %d blocks of %d threads per PE for dispatch and "
           "combine; heap %.2f GB per PE\n",
           maj, min, patch, R,
           R > 1 && nvshmem_ptr(heap, 1) != NULL ? "peers' memory mapped (loads and stores)"
                                                 : (R > 1 ? "peers' memory NOT mapped (proxy)" : "one PE"),
           comm_blocks, kCommThreads, (double)(5 * block + sig_bytes) / 1e9);
    fflush(stdout);
  }

  uint32_t gstep = 0; /* across token counts: signals keep growing, never reset */
  bool failed = false;
  for (int T : tokens) {
    uint64_t wrong = 0;
    CUDA(cudaStreamSynchronize(st));
    nvshmem_barrier_all();
    const int total = warmup + steps;
#ifdef EP_STAMPS
    /* Every entry stamp starts at the largest value (the blocks keep the earliest). */
    CUDA(cudaMemsetAsync(stamps_dev, 0xff, (size_t)steps * ep::kStamps * sizeof(unsigned long long), st));
#endif
    for (int i = 0; i < total; i++) {
      const uint32_t step = gstep++;
#ifdef EP_STAMPS
      Args a = step_args(s, b, me, T, step);
      a.stamps = i >= warmup ? stamps_dev + (size_t)(i - warmup) * ep::kStamps : NULL;
#else
      const Args a = step_args(s, b, me, T, step);
#endif
      const int j = i - warmup; /* timed step j when >= 0 */
      prepare_kernel<<<T, 256, 0, st>>>(a);
      CUDA(cudaGetLastError());
      if (j >= 0) CUDA(cudaEventRecord(ev[5 * j], st));
      dispatch_kernel<<<comm_blocks, kCommThreads, mask_bytes, st>>>(a);
      CUDA(cudaGetLastError());
      if (j >= 0) CUDA(cudaEventRecord(ev[5 * j + 1], st));
      expert_kernel<<<RL, kCommThreads, 0, st>>>(a); /* a block per run, as ours */
      CUDA(cudaGetLastError());
      if (j >= 0) CUDA(cudaEventRecord(ev[5 * j + 2], st));
      combine_kernel<<<comm_blocks, kCommThreads, 0, st>>>(a);
      CUDA(cudaGetLastError());
      if (j >= 0) CUDA(cudaEventRecord(ev[5 * j + 3], st));
      reduce_kernel<<<dim3((H / 8 + kReduceThreads - 1) / kReduceThreads, T), kReduceThreads, 0, st>>>(a);
      CUDA(cudaGetLastError());
      if (j >= 0) CUDA(cudaEventRecord(ev[5 * j + 4], st));
      if (i < 2 || i == total - 1) {
        /* Nothing of this step's parity is written again before this PE queues the next step
         * (a peer's step + 2 waits for this PE's step + 1), so the copies read this step's. */
        CUDA(cudaStreamSynchronize(st));
        wrong += check_step(s, b, me, T, step);
        /* The PEs leave together, so no step's wait pays for a peer's check. */
        nvshmem_barrier_all();
      }
    }
    CUDA(cudaStreamSynchronize(st));
    std::vector<double> disp(steps), comb(steps), ckern(steps), red(steps), expert(steps);
    for (int j = 0; j < steps; j++) {
      float ms = 0;
      CUDA(cudaEventElapsedTime(&ms, ev[5 * j], ev[5 * j + 1]));
      disp[j] = ms * 1e3;
      CUDA(cudaEventElapsedTime(&ms, ev[5 * j + 1], ev[5 * j + 2]));
      expert[j] = ms * 1e3;
      CUDA(cudaEventElapsedTime(&ms, ev[5 * j + 2], ev[5 * j + 4]));
      comb[j] = ms * 1e3;
      CUDA(cudaEventElapsedTime(&ms, ev[5 * j + 2], ev[5 * j + 3]));
      ckern[j] = ms * 1e3;
      CUDA(cudaEventElapsedTime(&ms, ev[5 * j + 3], ev[5 * j + 4]));
      red[j] = ms * 1e3;
    }
#ifdef EP_STAMPS
    {
      std::vector<unsigned long long> t((size_t)steps * ep::kStamps);
      CUDA(cudaMemcpy(t.data(), stamps_dev, t.size() * sizeof t[0], cudaMemcpyDeviceToHost));
      std::vector<float> dms(steps), cms(steps);
      for (int j = 0; j < steps; j++) {
        dms[j] = (float)(disp[j] / 1e3);
        cms[j] = (float)(ckern[j] / 1e3);
      }
      ep::printPhases("nvshmem", R, T, me, steps, t, dms, cms);
      fflush(stdout);
    }
#endif
    const double dmed = percentile_us(disp, 0.5), dp99 = percentile_us(disp, 0.99);
    const double cmed = percentile_us(comb, 0.5), cp99 = percentile_us(comb, 0.99);

    const uint64_t mine = wrong;
    unsigned long long all = 0;
    CUDA(cudaMemcpy(wword, &mine, sizeof mine, cudaMemcpyHostToDevice));
    nvshmem_barrier_all();
    sum_kernel<<<1, 1, 0, st>>>(wword, R, dsum);
    CUDA(cudaGetLastError());
    CUDA(cudaStreamSynchronize(st));
    CUDA(cudaMemcpy(&all, dsum, sizeof all, cudaMemcpyDeviceToHost));
    /* No PE rewrites its word while another still reads it. */
    nvshmem_barrier_all();
    if (me == 0) {
      printf("RESULT ep impl=nvshmem ranks=%d tokens=%d hidden=%d experts=%d topk=%d steps=%d "
             "dispatch_med_us=%.2f dispatch_p99_us=%.2f combine_med_us=%.2f combine_p99_us=%.2f wrong=%llu "
             "combine_kernel_med_us=%.2f reduce_med_us=%.2f expert_med_us=%.2f gpus=%d\n",
             R, T, H, E, K, steps, dmed, dp99, cmed, cp99, all, percentile_us(ckern, 0.5), percentile_us(red, 0.5),
             percentile_us(expert, 0.5), R < ndev ? R : ndev);
      fflush(stdout);
    }
    if (all != 0) {
      if (mine != 0) fprintf(stderr, "nvshmem_ep PE %d: %llu wrong values with %d tokens\n", me,
                             (unsigned long long)mine, T);
      failed = true;
      break;
    }
  }

  for (cudaEvent_t &e : ev) CUDA(cudaEventDestroy(e));
  CUDA(cudaStreamDestroy(st));
  CUDA(cudaFree(dsum));
  CUDA(cudaFree(b.cval));
  CUDA(cudaFree(b.dval));
  CUDA(cudaFree(b.w));
  CUDA(cudaFree(b.slot));
  CUDA(cudaFree(b.idx));
  CUDA(cudaFree(b.out));
  CUDA(cudaFree(b.X));
  nvshmem_barrier_all();
  nvshmem_free(sig);
  nvshmem_free(heap);
  nvshmem_finalize();
  return failed ? 1 : 0;
}
