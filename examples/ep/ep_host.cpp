/*
 * ep_host: the expert-parallel dispatch and combine of ep.cu on host memory, driven from the
 * host by the C functions of the device methods (mscclppDevConnPut & co., through the proxy
 * over libfabric tcp or shm, or the SHM transport; the C functions rather than the methods,
 * whose host forms return void, so that a failed call stops the run with its error): no GPU. The same layout, routing, arithmetic and
 * check (examples/ep/ep.h) as the GPU kernels, one host thread per rank doing what the
 * kernels' blocks do where every put goes through the proxy, in the same order: the rows of
 * every (token, expert) pair packed per peer, one put per peer and its counts with a signal,
 * a wait per peer; the expert; the rows back in one put per peer, a signal and a wait per
 * peer; the weighted sum. CI runs it (scripts/test.sh, step c_examples).
 *
 *   scripts/run-local-ranks.sh 2 ./ep_host [-t ib|shm] [--tokens 1,5,16] [--steps 20]
 *        [--hidden 256] [--experts 16] [--topk 4]
 *
 * -t: mscclppTransportIB (default; the provider of MSCCLPP_NET_PROVIDER, tcp by default) or
 * mscclppTransportSHM. Every step is checked (every count, every received row after the
 * expert, every output value bit for bit); rank 0 prints the median step time per token
 * count (host memory over the proxy: a correctness path, not a benchmark) and "ep_host: ok".
 * Exit 1 on a wrong value or a failed call.
 */
#include "ep.h"

#include <mscclpp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <vector>

#include "launch_env.h"

/* A failed call: where and why, then exit 1. */
#define CHECK(call)                                                                            \
  do {                                                                                         \
    mscclppResult_t r_ = (call);                                                               \
    if (r_ != mscclppSuccess) {                                                                \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,               \
              mscclppGetErrorString(r_), mscclppGetLastError());                               \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

using ep::bf16;
using ep::Shape;

static double nowUs()
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

int main(int argc, char** argv)
{
  launch_env env;
  if (launch_env_parse(&argc, argv, &env) != 0) return 2;
  mscclppTransport_t transport = mscclppTransportIB;
  std::vector<int> tokens = {1, 5, 16};
  int steps = 20;
  Shape s{env.nranks, 16, 4, 256, 0};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "-t" && strcmp(v, "ib") == 0) transport = mscclppTransportIB;
    else if (k == "-t" && strcmp(v, "shm") == 0) transport = mscclppTransportSHM;
    else if (k == "--tokens") {
      if (!ep::parseTokens(v, tokens)) {
        fprintf(stderr, "--tokens %s: expected numbers separated by commas\n", v);
        return 2;
      }
    } else if (k == "--steps") steps = atoi(v);
    else if (k == "--hidden") s.H = atoi(v);
    else if (k == "--experts") s.E = atoi(v);
    else if (k == "--topk") s.K = atoi(v);
    else {
      fprintf(stderr, "unknown option %s %s\n", argv[i], v);
      return 2;
    }
  }
  for (int t : tokens) s.Tmax = std::max(s.Tmax, t);
  if (s.R < 1 || s.E % s.R || s.Tmax < 1 || s.Tmax > 128 || s.K < 1 || s.K > 16 || s.K > s.E ||
      s.H < 8 || s.H % 8 || steps < 1) {
    fprintf(stderr, "ep_host: experts %d must divide by ranks %d, tokens 1..128, topk 1..16 (at "
                    "most the experts), hidden a multiple of 8\n",
            s.E, s.R);
    return 2;
  }
  const int me = env.rank, L = s.L();
  mscclppComm_t comm;
  CHECK(mscclppCommInitRank(&comm, env.nranks, env.root, me));
  std::vector<uint8_t> buf(s.bytes());
  for (int p = 0; p < s.R; p++)
    if (p != me) CHECK(mscclppConnect(comm, p, 0, buf.data(), buf.size(), transport, NULL));
  CHECK(mscclppConnectionSetup(comm));
  std::vector<mscclppDevConn_t*> conn(s.R, nullptr);
  for (int p = 0; p < s.R; p++)
    if (p != me) CHECK(mscclppGetDeviceConnection(comm, p, 0, &conn[p]));
  CHECK(mscclppProxyLaunch(comm));
  CHECK(mscclppBootstrapBarrier(comm));

  std::vector<int> idx((size_t)s.Tmax * s.K), slots(idx.size());
  std::vector<float> w(idx.size());
  std::vector<bf16> out((size_t)s.Tmax * s.H);
  uint8_t* b = buf.data();
  auto row = [&](uint64_t off) { return reinterpret_cast<bf16*>(b + off); };
  uint64_t wrong = 0;
  uint32_t step = 0;
  for (int T : tokens) {
    std::vector<double> us;
    for (int i = 0; i < steps; i++, step++) {
      const int q = step & 1;
      /* prepare */
      for (int t = 0; t < T; t++) {
        for (int h = 0; h < s.H; h++) row(s.x(t))[h] = ep::token(me, t, h, step);
        for (int k = 0; k < s.K; k++) {
          idx[t * s.K + k] = ep::expertOf(s, me, t, k, step);
          w[t * s.K + k] = ep::weightOf(me, t, k, step);
        }
      }
      const double t0 = nowUs();
      /* dispatch: each row to its place in DR[me] there, row start[e] + slot (ep.h), the
       * slots in token order as the kernels' masks count them; the peers' rows packed into
       * SR[peer] first, then one put per peer (every put goes through the proxy here, as
       * the kernels do where a peer's memory is not written directly), then its counts with
       * the signal. */
      std::vector<uint32_t> count(s.E, 0), start(s.E, 0), slot(s.E, 0);
      for (int i = 0; i < T * s.K; i++) count[idx[i]]++;
      for (int e = 0; e < s.E; e++) start[e] = e % L ? start[e - 1] + count[e - 1] : 0;
      for (int t = 0; t < T; t++)
        for (int k = 0; k < s.K; k++) {
          const int e = idx[t * s.K + k], dst = e / L;
          const uint32_t r = start[e] + slot[e]++;
          slots[t * s.K + k] = (int)r;
          memcpy(b + (dst == me ? s.dr(q, me, r) : s.sr(q, dst, r)), b + s.x(t), s.row());
        }
      for (int p = 0; p < s.R; p++) {
        uint32_t* at = reinterpret_cast<uint32_t*>(b + (p == me ? s.dc(q, me) : s.sc(q, p)));
        for (int l = 0; l < L; l++) at[l] = count[p * L + l];
      }
      for (int p = 0; p < s.R; p++)
        if (p != me) {
          const uint64_t n = start[p * L + L - 1] + count[p * L + L - 1];
          CHECK(mscclppDevConnPut(conn[p], s.dr(q, me, 0), s.sr(q, p, 0), n * s.row()));
          CHECK(mscclppDevConnPutWithSignal(conn[p], s.dc(q, me), s.sc(q, p), (uint64_t)L * 4));
        }
      for (int p = 0; p < s.R; p++)
        if (p != me) CHECK(mscclppDevConnWait(conn[p]));
      /* expert: DR[src]'s rows run by run */
      std::vector<uint64_t> received(s.R, 0);
      for (int src = 0; src < s.R; src++)
        for (int l = 0; l < L; l++) {
          const uint32_t n = reinterpret_cast<const uint32_t*>(b + s.dc(q, src))[l];
          for (uint32_t j = 0; j < n; j++) {
            bf16* r = row(s.dr(q, src, received[src]++));
            for (int h = 0; h < s.H; h++) r[h] = ep::expertValue(r[h], me * L + l);
          }
        }
      /* combine: DR[src] back to CR[me] there, one put per peer */
      for (int src = 0; src < s.R; src++) {
        const uint64_t bytes = received[src] * s.row();
        if (src == me) memcpy(b + s.cr(q, me, 0), b + s.dr(q, me, 0), bytes);
        else CHECK(mscclppDevConnPut(conn[src], s.cr(q, me, 0), s.dr(q, src, 0), bytes));
      }
      for (int p = 0; p < s.R; p++)
        if (p != me) CHECK(mscclppDevConnSignal(conn[p]));
      for (int p = 0; p < s.R; p++)
        if (p != me) CHECK(mscclppDevConnWait(conn[p]));
      /* reduce */
      for (int t = 0; t < T; t++)
        for (int h = 0; h < s.H; h++) {
          float acc = 0.0f;
          for (int k = 0; k < s.K; k++) {
            const int e = idx[t * s.K + k];
            acc = fmaf(w[t * s.K + k], ep::bf16ToFloat(row(s.cr(q, e / L, (uint64_t)slots[t * s.K + k]))[h]), acc);
          }
          out[(size_t)t * s.H + h] = ep::floatToBf16(acc);
        }
      us.push_back(nowUs() - t0);
      auto read = [&](uint64_t off, void* dst, uint64_t bytes) { memcpy(dst, b + off, bytes); };
      wrong += ep::checkStepInBuffer(s, me, T, step, q, read, out.data());
    }
    std::sort(us.begin(), us.end());
    if (me == 0)
      printf("ep_host: ranks %d, %d tokens, hidden %d, %d experts, top-%d, %d steps: median step "
             "%.1f us, wrong values %llu\n",
             s.R, T, s.H, s.E, s.K, steps, us[us.size() / 2], (unsigned long long)wrong);
  }
  /* Every rank's rows have arrived where they go (each waited for all its peers) before any
   * proxy stops. */
  CHECK(mscclppBootstrapBarrier(comm));
  CHECK(mscclppProxyStop(comm));
  CHECK(mscclppCommDestroy(comm));
  if (wrong) {
    printf("ep_host: rank %d: %llu wrong values\n", me, (unsigned long long)wrong);
    return 1;
  }
  if (me == 0) printf("ep_host: ok\n");
  return 0;
}
