/*
 * ep.h: the shape, buffer layout, routing and arithmetic of the expert-parallel dispatch and
 * combine (examples/ep), shared by the GPU kernels (ep.cu) and the host-memory driver
 * (ep_host.cpp), so that both move and check the same bytes.
 *
 * Every rank holds T tokens (at most Tmax) of H BF16 values and routes each token to K of E
 * experts (top-K), the experts spread over the R ranks, L = E / R per rank (expert e lives on
 * rank e / L as its local expert e % L).
 *   dispatch: token t of rank src goes to each of its K experts: into the expert's rank's
 *     receive rows from src, DR[src], which hold src's rows for that rank densely, by local
 *     expert l and then by token order: row start[l] + slot, where start[l] is the number of
 *     src's rows for that rank's experts below l and slot the number of src's earlier tokens
 *     that chose the same expert. Then, per peer, the L counts of those runs (put by one block
 *     before its rows where they land directly, after the rows where packed), and one signal
 *     ordered after every row and count (the "tokens, then a count ordered after them" of
 *     every EP library); the receiver waits once per peer and learns start[] from the counts.
 *     Where a peer's memory is not written directly (every put through the proxy), the sender
 *     first packs its rows for that peer in the same order into its own SR[peer], so that
 *     they leave in one put.
 *   expert: each expert scales its rows in place, y = bf16(x * s_e), s_e = 1 + (e % 8) / 8
 *     (stands in for the expert MLP and makes a row that reached the wrong expert visible).
 *   combine: each expert rank puts its rows from src back, DR[src] as it is (one contiguous
 *     range), into src's CR[expert rank], and signals each peer; the source waits once per peer
 *     and reduces out[t] = bf16(sum over k in order of w[t][k] * y_k), its k-th row being
 *     CR[e / L] row start[e % L] + slot of the dispatch.
 *     The inputs make that sum exact in float: x is a multiple of 1/64 below 2 in magnitude and
 *     s_e of 1/8, so x * s_e is a multiple of 1/512 below 4 and stays one when rounded to
 *     BF16's 8 significant bits; w is a multiple of 1/256 at most 1/4; so every product and
 *     partial sum is a multiple of 2^-17 below 16 in magnitude (K <= 16): 21 bits, exact in a
 *     float. Any order of addition, fused or not, gives the reference's bits (a torch
 *     reference in float32 too).
 * Buffers are double-buffered by step parity q = step & 1 (DR, CR, SR, the counts and their
 * staging): step s+1 writes other rows than step s, so nothing waits for the previous step's
 * rows to be read.
 *
 * One buffer per rank, the same layout on every rank (puts name offsets into it on both
 * sides): X (the tokens, Tmax rows), then per parity DR, CR and SR (R regions of P rows each,
 * P = Tmax * min(K, L): a token sends one rank at most min(K, L) rows), the counts received DC
 * (R*L u32) and the counts to send SC (R*L u32, the put's source).
 */
#ifndef MSCCLPP_EXAMPLES_EP_H
#define MSCCLPP_EXAMPLES_EP_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif

namespace ep {

struct Shape {
  int R;    /* ranks */
  int E;    /* experts in all */
  int K;    /* experts per token (top-K) */
  int H;    /* hidden size, BF16 values per token (a multiple of 8) */
  int Tmax; /* tokens per rank the buffers are sized for (at most 128: slot masks) */
  EP_HD int L() const { return E / R; }
  EP_HD uint64_t row() const { return (uint64_t)H * 2; }
  /* Rows of one rank's region in DR, CR or SR: a token sends a rank at most min(K, L) rows. */
  EP_HD uint64_t P() const { return (uint64_t)Tmax * (K < L() ? K : L()); }
  EP_HD uint64_t rows() const { return (uint64_t)R * P(); } /* of one DR, CR or SR */
  /* Offsets of the layout (bytes). */
  EP_HD uint64_t x(int t) const { return (uint64_t)t * row(); }
  EP_HD uint64_t parityBase(int q) const
  {
    const uint64_t counts = align((uint64_t)R * L() * 4);
    return align((uint64_t)Tmax * row()) + (uint64_t)q * (3 * rows() * row() + 2 * counts);
  }
  /* Row `r` of the rows received from rank `src` (r = start[l] + slot). */
  EP_HD uint64_t dr(int q, int src, uint64_t r) const { return parityBase(q) + ((uint64_t)src * P() + r) * row(); }
  /* Row `r` of the rows that came back from rank `expertRank` (the same r as there). */
  EP_HD uint64_t cr(int q, int expertRank, uint64_t r) const
  {
    return parityBase(q) + (rows() + (uint64_t)expertRank * P() + r) * row();
  }
  /* Row `r` of the rows packed for rank `dst` (the same r as in its DR[me]). */
  EP_HD uint64_t sr(int q, int dst, uint64_t r) const
  {
    return parityBase(q) + (2 * rows() + (uint64_t)dst * P() + r) * row();
  }
  /* Counts received from `src`: L u32, and the staging of the L counts sent to `dst`. */
  EP_HD uint64_t dc(int q, int src) const { return parityBase(q) + 3 * rows() * row() + (uint64_t)src * L() * 4; }
  EP_HD uint64_t sc(int q, int dst) const
  {
    return parityBase(q) + 3 * rows() * row() + align((uint64_t)R * L() * 4) + (uint64_t)dst * L() * 4;
  }
  EP_HD uint64_t bytes() const { return parityBase(2); }
  static EP_HD uint64_t align(uint64_t n) { return (n + 255) & ~(uint64_t)255; }
};

/* A hash of (a, b, c), for the inputs. */
EP_HD uint32_t mix(uint32_t a, uint32_t b, uint32_t c)
{
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  return h ^ (h >> 15);
}

/* BF16 as its 16 bits. */
typedef uint16_t bf16;

EP_HD float bf16ToFloat(bf16 v)
{
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest, ties to even (the inputs here are finite). */
EP_HD bf16 floatToBf16(float f)
{
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

/* Token t of rank src, value h: a multiple of 1/64 in [-2, 2) (exact in BF16). `step` varies
 * it from step to step, so a row left from an earlier step is seen. */
EP_HD bf16 token(int src, int t, int h, uint32_t step)
{
  return floatToBf16((float)((int)(mix(src, t * 8191 + h, step) % 255u) - 127) / 64.0f);
}

/* Expert k of token t of rank src: K distinct experts of E, from a hash (probing on). */
EP_HD int expertOf(const Shape& s, int src, int t, int k, uint32_t step)
{
  int chosen[16];
  for (int j = 0; j <= k; j++) {
    int e = (int)(mix(src * 977 + t, j, step ^ 0xE5u) % (uint32_t)s.E);
    for (bool again = true; again;) { /* ends: K <= 16 < E leaves a free expert */
      again = false;
      for (int i = 0; i < j; i++)
        if (chosen[i] == e) {
          e = (e + 1) % s.E;
          again = true;
        }
    }
    chosen[j] = e;
  }
  return chosen[k];
}

/* The weight of expert k of a token: positive, a multiple of 1/256. */
EP_HD float weightOf(int src, int t, int k, uint32_t step)
{
  return (float)(1 + mix(src, t, k ^ (step << 4)) % 64u) / 256.0f;
}

EP_HD float scaleOf(int e) { return 1.0f + (float)(e % 8) / 8.0f; }

/* y = bf16(x * s_e): the expert. */
EP_HD bf16 expertValue(bf16 x, int e) { return floatToBf16(bf16ToFloat(x) * scaleOf(e)); }

/* The combined value of token t, value h, of rank src whose K experts and weights are `es` and
 * `ws`: the reference. The kernels reduce in this order with fmaf too. */
EP_HD bf16 combined(int K, const int* es, const float* ws, int src, int t, int h, uint32_t step)
{
  const bf16 x = token(src, t, h, step);
  float acc = 0.0f;
  for (int k = 0; k < K; k++) acc = fmaf(ws[k], bf16ToFloat(expertValue(x, es[k])), acc);
  return floatToBf16(acc);
}

#if defined(__CUDACC__)
/* The expert on one run of `rows` received rows (of H values) for expert e, in place, 16 bytes
 * per thread per pass, by the calling block: the expert kernel of both implementations (ours
 * and the NVSHMEM peer), a block per (source, local expert) run. It stands in for the MLP and
 * is not timed, but it is alike in both, as the reduce is: each rank's combine waits for its
 * slowest peer's expert kernel to end. */
__device__ __forceinline__ void expertRun(uint8_t* run, uint32_t rows, int H, int e)
{
  int4* p = reinterpret_cast<int4*>(run);
  const uint64_t n = (uint64_t)rows * (H / 8);
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int4 u = p[i];
    uint32_t word[4] = {(uint32_t)u.x, (uint32_t)u.y, (uint32_t)u.z, (uint32_t)u.w};
    for (int j = 0; j < 4; j++)
      word[j] = (uint32_t)expertValue((bf16)(word[j] & 0xFFFFu), e) |
                ((uint32_t)expertValue((bf16)(word[j] >> 16), e) << 16);
    p[i] = make_int4((int)word[0], (int)word[1], (int)word[2], (int)word[3]);
  }
}

/* Output word v (8 values, 16 bytes) of a token: the K rows at base + off[k], loaded 16 bytes
 * at a time, folded in k order with fmaf from 0.0f, as `combined` does, so the result is its
 * bits. kCombineInFlight rows' loads are in flight at once, so top-8 is one memory round trip
 * (a load per row waited out the memory's latency K times in a row; four at a time, twice). The
 * reduce of both implementations (ours, examples/ep/ep.cu, and the NVSHMEM peer): it is not
 * communication, so both do it alike. */
constexpr int kCombineInFlight = 8;
__device__ __forceinline__ int4 combineWord(int K, const float* wk, const uint8_t* base,
                                            const uint64_t* off, int v)
{
  float acc[8];
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += kCombineInFlight) {
    int4 u[kCombineInFlight];
#pragma unroll
    for (int i = 0; i < kCombineInFlight; i++)
      if (k0 + i < K) u[i] = reinterpret_cast<const int4*>(base + off[k0 + i])[v];
#pragma unroll
    for (int i = 0; i < kCombineInFlight; i++) {
      if (k0 + i >= K) break;
      const float w = wk[k0 + i];
      const uint32_t word[4] = {(uint32_t)u[i].x, (uint32_t)u[i].y, (uint32_t)u[i].z, (uint32_t)u[i].w};
      for (int j = 0; j < 4; j++) {
        acc[2 * j] = fmaf(w, bf16ToFloat((bf16)(word[j] & 0xFFFFu)), acc[2 * j]);
        acc[2 * j + 1] = fmaf(w, bf16ToFloat((bf16)(word[j] >> 16)), acc[2 * j + 1]);
      }
    }
  }
  uint32_t o[4];
  for (int j = 0; j < 4; j++)
    o[j] = (uint32_t)floatToBf16(acc[2 * j]) | ((uint32_t)floatToBf16(acc[2 * j + 1]) << 16);
  return make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
}
#endif

/* The phases of a step that `--stamps` times (ep.cu, and nvshmem_ep built with -DEP_STAMPS):
 * per step kStamps %globaltimer values, in each of dispatch and combine the first block's
 * entry, the waiting block's puts issued (ours: the last block leaving lastBlock(), so every
 * block's; the peer's: that block's own), its signals issued (the peer's go with its puts:
 * the same time), its waits returned. */
enum { kStampDispatch = 0, kStampCombine = 4, kStamps = 8 };
enum { kStampEntry = 0, kStampPut = 1, kStampSignalled = 2, kStampWaited = 3 };

#if defined(__CUDACC__)
__device__ __forceinline__ unsigned long long globalNs()
{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

/* Where each timed kernel's time went over `steps` steps, from their stamps (t, kStamps a
 * step) and CUDA-event times (ms, the dispatch kernel's and the combine kernel's): "work" the
 * first block's entry to the puts issued, "signal" to the signals issued, "wait" to the waits
 * returned (the peers' lateness and the signals' flight), "outside" the event time less entry
 * to waited (the launch, the blocks' exit, anything after the waits). Trimmed means (the
 * lowest and highest 5% left out: the clock moves about once a microsecond, so a median would
 * round every gap to it, and the trim keeps a few preempted steps out), in us. One line:
 *   RESULT ep_phases impl=IMPL ranks=R tokens=T rank=r dispatch_work_us=.. dispatch_signal_us=..
 *          dispatch_wait_us=.. dispatch_outside_us=.. combine_work_us=.. (the same four) */
inline void printPhases(const char* impl, int ranks, int tokens, int rank, int steps,
                        const std::vector<unsigned long long>& t, const std::vector<float>& dispatchMs,
                        const std::vector<float>& combineKernelMs)
{
  auto trimmedMeanUs = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t cut = v.size() / 20;
    double sum = 0;
    for (size_t i = cut; i < v.size() - cut; i++) sum += v[i];
    return sum / (double)(v.size() - 2 * cut) / 1000.0;
  };
  /* A gap in integers first: the stamps count from the epoch, where a double keeps only every
   * 256th nanosecond. */
  auto between = [&](int j, int at, int from, int to) {
    return (double)(long long)(t[(size_t)j * kStamps + at + to] - t[(size_t)j * kStamps + at + from]);
  };
  auto gap = [&](int at, int from, int to) {
    std::vector<double> v;
    for (int j = 0; j < steps; j++) v.push_back(between(j, at, from, to));
    return trimmedMeanUs(v);
  };
  auto outside = [&](int at, const std::vector<float>& ms) {
    std::vector<double> v;
    for (int j = 0; j < steps; j++) v.push_back(ms[j] * 1e6 - between(j, at, kStampEntry, kStampWaited));
    return trimmedMeanUs(v);
  };
  printf("RESULT ep_phases impl=%s ranks=%d tokens=%d rank=%d "
         "dispatch_work_us=%.2f dispatch_signal_us=%.2f dispatch_wait_us=%.2f dispatch_outside_us=%.2f "
         "combine_work_us=%.2f combine_signal_us=%.2f combine_wait_us=%.2f combine_outside_us=%.2f\n",
         impl, ranks, tokens, rank, gap(kStampDispatch, kStampEntry, kStampPut),
         gap(kStampDispatch, kStampPut, kStampSignalled), gap(kStampDispatch, kStampSignalled, kStampWaited),
         outside(kStampDispatch, dispatchMs), gap(kStampCombine, kStampEntry, kStampPut),
         gap(kStampCombine, kStampPut, kStampSignalled), gap(kStampCombine, kStampSignalled, kStampWaited),
         outside(kStampCombine, combineKernelMs));
}

/* "1,8,32,128" into `out`; false (out unspecified) on anything else. */
inline bool parseTokens(const char* v, std::vector<int>& out)
{
  out.clear();
  for (const char* p = v; *p;) {
    char* end = nullptr;
    out.push_back((int)strtol(p, &end, 10));
    if (end == p || (*end != ',' && *end != 0)) return false;
    p = *end ? end + 1 : end;
  }
  return !out.empty();
}

/* The check of one step on rank `me`, on the host: the counts received, every received row
 * after the expert, and every output value, against the reference. `counts(src, c)` gives the
 * L counts received from src; `row(src, l, slot, r, dst)` copies the row of src's slot-th
 * token for local expert l, which this layout keeps at row r = start[l] + slot of DR[src] (an
 * implementation with another layout uses src, l and slot); `out` is the step's output on the
 * host. Prints the first few wrong values; returns how many there are. */
template <class Counts, class Row>
uint64_t checkStep(const Shape& s, int me, int T, uint32_t step, Counts counts, Row row, const bf16* out)
{
  const int L = s.L();
  uint64_t wrong = 0;
  std::vector<uint32_t> got(L);
  std::vector<bf16> data(s.H);
  for (int src = 0; src < s.R; src++) {
    /* The tokens of src per local expert of ours, in token order: the runs expected. */
    std::vector<std::vector<int>> runs(L);
    for (int t = 0; t < T; t++)
      for (int k = 0; k < s.K; k++) {
        const int e = expertOf(s, src, t, k, step);
        if (e / L == me) runs[e % L].push_back(t);
      }
    counts(src, got.data());
    uint64_t start = 0;
    for (int l = 0; l < L; l++) {
      if (got[l] != runs[l].size()) {
        if (wrong < 5)
          printf("rank %d step %u: count from rank %d for expert %d is %u, expected %zu\n", me, step,
                 src, me * L + l, got[l], runs[l].size());
        wrong++;
        start += runs[l].size();
        continue;
      }
      for (size_t slot = 0; slot < runs[l].size(); slot++) {
        row(src, l, (uint32_t)slot, start + slot, data.data());
        for (int h = 0; h < s.H; h++) {
          const bf16 want = expertValue(token(src, runs[l][slot], h, step), me * L + l);
          if (data[h] != want && wrong++ < 5)
            printf("rank %d step %u: rank %d's token %d at expert %d, value %d: 0x%04x, expected "
                   "0x%04x\n",
                   me, step, src, runs[l][slot], me * L + l, h, data[h], want);
        }
      }
      start += runs[l].size();
    }
  }
  for (int t = 0; t < T; t++) {
    int es[16];
    float ws[16];
    for (int k = 0; k < s.K; k++) {
      es[k] = expertOf(s, me, t, k, step);
      ws[k] = weightOf(me, t, k, step);
    }
    for (int h = 0; h < s.H; h++) {
      const bf16 want = combined(s.K, es, ws, me, t, h, step);
      if (out[(size_t)t * s.H + h] != want && wrong++ < 5)
        printf("rank %d step %u: output of token %d, value %d: 0x%04x, expected 0x%04x\n", me, step,
               t, h, out[(size_t)t * s.H + h], want);
    }
  }
  return wrong;
}

/* checkStep() of a rank whose buffer has this layout: `read(offset, dst, bytes)` copies from
 * it (device or host memory); q the step's parity. */
template <class Read>
uint64_t checkStepInBuffer(const Shape& s, int me, int T, uint32_t step, int q, Read read, const bf16* out)
{
  return checkStep(
      s, me, T, step, [&](int src, uint32_t* c) { read(s.dc(q, src), c, (uint64_t)s.L() * 4); },
      [&](int src, int, uint32_t, uint64_t r, bf16* dst) { read(s.dr(q, src, r), dst, s.row()); }, out);
}

} // namespace ep

#endif
