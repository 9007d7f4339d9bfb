/*
 * nvshmem_perf: NVSHMEM doing what our nccl-tests-style tools do (c_examples/perf/perf.c, and
 * the pingpong and bandwidth examples), with the same options, sizes and output rows, so that
 * bench/perf-peers.sh can run the two alternately into one results file and bench/plot_perf.py
 * can draw both. The peer in the performance table where NCCL cannot run (two ranks on one GPU).
 *
 *   scripts/run-local-ranks.sh 2 ./nvshmem_perf allgather -b 8 -e 64M -f 4 -n 20 -w 5
 *
 * OP, one per run:
 *   allgather      nvshmemx_fcollectmem_on_stream: NVSHMEM's own all-gather
 *   allgather-sig  one kernel per operation putting this PE's slice to every peer with a signal
 *                  and waiting for every peer's signal: our allgather_perf's kernel, with
 *                  NVSHMEM's put-with-signal (the own slice copied by the same kernel, as ours)
 *   alltoall       nvshmemx_alltoallmem_on_stream
 *   alltoall-sig   as allgather-sig, slice r of the send area to PE r (our alltoall_perf)
 *   sendrecv       put-with-signal to the next PE, wait for the previous PE's (our sendrecv_perf)
 *   pingpong       PE 0 and PE 1: put-with-signal by one thread (nvshmem_putmem_signal_nbi,
 *                  NVSHMEM_SIGNAL_SET), the other waits (nvshmem_signal_wait_until) and
 *                  answers, in one kernel; time = half the round trip (our pingpong --sweep)
 *   pingpong-warp, pingpong-block   the same by a warp, or a block of 512 threads
 *                  (nvshmemx_putmem_signal_nbi_warp/_block; thread 0 waits; our --block sweep)
 *   signal         the ping-pong of a bare nvshmemx_signal_op by one thread (orders nothing)
 *   fence-signal   the same after nvshmem_fence(): the pair that orders earlier puts, as our
 *                  signal() does
 *   putbw          PE 0 to PE 1, one kernel of ITERS puts with a signal, then nvshmem_quiet;
 *                  time = per put, by CUDA events on PE 0 (our bandwidth example)
 * Options (perf.c's): -b MIN -e MAX bytes (K, M, G), -f FACTOR or -i STEP, -n ITERS (20),
 * -w WARMUP (5), -c CHECK (1); ours: -B most blocks per peer for the -sig kernels, putbw (128),
 * -W SECONDS: bound of every wait on the control channel (30; the kernels' waits are
 * NVSHMEM's, unbounded: the launcher's timeout ends a run whose peer is gone).
 * Rank, size and rank 0's address come from c_examples/common/launch_env.h (-r -a -l, or the
 * environment of scripts/run-local-ranks.sh, mpirun, srun, torchrun). GPU: local rank % GPUs;
 * several PEs on one GPU need MPS for NVSHMEM's collectives (see below).
 *
 * Bootstrap: NVSHMEM's unique-id one (nvshmemx_get_uniqueid on PE 0, nvshmemx_init_attr with
 * NVSHMEMX_INIT_WITH_UNIQUEID everywhere). The id travels over a TCP control channel of our own:
 * PE 0 listens at the root address, the others connect. That channel also carries the barriers
 * and the sums over PEs (mean time, wrong bytes), because NVSHMEM refuses its own barriers in a
 * "limited MPG" run (several PEs on one GPU without MPS, or with MPS thread percentages summing
 * over 100): such a run still does the -sig kernels, sendrecv, pingpong and putbw, and exits 3
 * for allgather and alltoall, saying why.
 *
 * Every byte is checked (-c 1): before the timed operations each PE's receive area is filled
 * with the complement of what it must receive, so a byte that did not arrive cannot pass.
 * Rows: nccl-tests' out-of-place columns (size count type redop root time algbw busbw #wrong),
 * rank 0 prints them; time = mean over PEs of each PE's mean per operation, host clock around
 * ITERS operations and a quiet (perf.c's timing with its flush); busbw as nccl-tests'
 * PERFORMANCE.md (all-gather and all-to-all algbw * (n-1)/n, the others algbw).
 * Exit status: 0 every byte right; 1 a wrong byte or a failed call or wait (the message says
 * which PE, call and size); 2 usage; 3 the operation is refused in a limited MPG run.
 */
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuda_runtime.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "launch_env.h"

static int g_rank = -1;

#define DIE(...)                                  \
  do {                                            \
    fprintf(stderr, "[rank %d] ", g_rank);        \
    fprintf(stderr, __VA_ARGS__);                 \
    fprintf(stderr, "\n");                        \
    exit(1);                                      \
  } while (0)

#define CK_CUDA(cmd)                                                                           \
  do {                                                                                         \
    cudaError_t e_ = (cmd);                                                                    \
    if (e_ != cudaSuccess)                                                                     \
      DIE("%s:%d: %s failed: %s", __FILE__, __LINE__, #cmd, cudaGetErrorString(e_));           \
  } while (0)

/* NVSHMEM calls that return a status: 0 is success. */
#define CK_NVSHMEM(cmd)                                                                        \
  do {                                                                                         \
    int s_ = (cmd);                                                                            \
    if (s_ != 0) DIE("%s:%d: %s failed: NVSHMEM status %d", __FILE__, __LINE__, #cmd, s_);     \
  } while (0)

enum Op { OP_ALLGATHER, OP_ALLGATHER_SIG, OP_ALLTOALL, OP_ALLTOALL_SIG, OP_SENDRECV, OP_PINGPONG,
          OP_PINGPONG_WARP, OP_PINGPONG_BLOCK, OP_SIGNAL, OP_FENCE_SIGNAL, OP_PUTBW };
static const char *const kOpNames[] = {"allgather",     "allgather-sig",  "alltoall", "alltoall-sig",
                                       "sendrecv",      "pingpong",       "pingpong-warp",
                                       "pingpong-block", "signal",        "fence-signal", "putbw"};

/* Threads of a -sig / putbw block, and the least bytes a block of them is given: a block per
 * 64 KiB up to -B blocks per peer, so that small puts stay one block (one signal to wait for)
 * and large ones spread over SMs as a tuned NVSHMEM kernel would (bench/RESULTS.md has the -B
 * sweep behind the default). */
static const int kBlockThreads = 512;
static const uint64_t kMinChunk = 64 << 10;

/* ---------------------------------------------------------------------------------------- */
/* The control channel                                                                       */

static double now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct Ctl {
  int rank = 0, nranks = 0;
  std::vector<int> fd; /* rank 0: fd[r] is rank r's connection (r >= 1); others: fd[0], rank 0 */
  double timeout_s = 30;
};

/* Reads or writes exactly `len` bytes on `fd` within `timeout_s`; dies naming the peer (-1:
 * not known yet) and what was being exchanged. */
static void io_exact(int fd, int peer, void *buf, size_t len, bool write_, const char *what, double timeout_s)
{
  const double deadline = now_s() + timeout_s;
  char *p = (char *)buf;
  while (len > 0) {
    const double left = deadline - now_s();
    if (left <= 0)
      DIE("control channel: no %s %s rank %d within %.0f s (is it still running?)", what,
          write_ ? "sent to" : "from", peer, timeout_s);
    struct pollfd pfd = {fd, (short)(write_ ? POLLOUT : POLLIN), 0};
    const int pr = poll(&pfd, 1, (int)(left * 1000) + 1);
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) DIE("control channel: poll: %s", strerror(errno));
    if (pr == 0) continue; /* the deadline check above ends it */
    const ssize_t k = write_ ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k == 0) DIE("control channel: rank %d closed the connection during %s (it exited)", peer, what);
    if (k < 0) DIE("control channel: %s rank %d: %s", write_ ? "send to" : "recv from", peer, strerror(errno));
    p += k;
    len -= (size_t)k;
  }
}

static void ctl_io(const Ctl &c, int peer, void *buf, size_t len, bool write_, const char *what)
{
  io_exact(c.fd[c.rank == 0 ? peer : 0], peer, buf, len, write_, what, c.timeout_s);
}

/* "host:port" or "[v6]:port" into its parts; false if there is no port. */
static bool split_root(const char *root, std::string &host, std::string &port)
{
  const char *colon = strrchr(root, ':');
  if (colon == NULL || colon[1] == '\0') return false;
  host.assign(root, (size_t)(colon - root));
  port = colon + 1;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return !host.empty();
}

static void set_nodelay(int fd)
{
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Rank 0: listens at `root` and takes every other rank's connection; the others connect,
 * retrying until the bound (rank 0 may not listen yet), and say their rank. */
static void ctl_open(Ctl &c, const char *root)
{
  std::string host, port;
  if (!split_root(root, host, port)) DIE("root address '%s' is not HOST:PORT", root);
  struct addrinfo hints, *ai = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const int gr = getaddrinfo(host.c_str(), port.c_str(), &hints, &ai);
  if (gr != 0) DIE("root address %s: %s", root, gai_strerror(gr));
  const double deadline = now_s() + c.timeout_s;
  if (c.rank == 0) {
    c.fd.assign((size_t)c.nranks, -1);
    const int ls = socket(ai->ai_family, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ls < 0 || bind(ls, ai->ai_addr, ai->ai_addrlen) != 0 || listen(ls, c.nranks) != 0)
      DIE("control channel: listen at %s: %s", root, strerror(errno));
    for (int joined = 1; joined < c.nranks;) {
      const double left = deadline - now_s();
      if (left <= 0)
        DIE("control channel: %d of %d ranks connected to %s within %.0f s", joined - 1,
            c.nranks - 1, root, c.timeout_s);
      struct pollfd pfd = {ls, POLLIN, 0};
      if (poll(&pfd, 1, (int)(left * 1000) + 1) <= 0) continue;
      const int fd = accept(ls, NULL, NULL);
      if (fd < 0) continue;
      set_nodelay(fd);
      int32_t r = -1;
      io_exact(fd, -1, &r, sizeof r, false, "rank number", c.timeout_s);
      if (r <= 0 || r >= c.nranks || c.fd[(size_t)r] >= 0)
        DIE("control channel: a connection said it is rank %d (want 1..%d, once each)", r, c.nranks - 1);
      c.fd[(size_t)r] = fd;
      joined++;
    }
    close(ls);
  } else {
    c.fd.assign(1, -1);
    for (;;) {
      const int fd = socket(ai->ai_family, SOCK_STREAM, 0);
      if (fd < 0) DIE("control channel: socket: %s", strerror(errno));
      if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        c.fd[0] = fd;
        break;
      }
      const int e = errno;
      close(fd);
      if (now_s() >= deadline)
        DIE("control channel: could not reach rank 0 at %s within %.0f s: %s", root, c.timeout_s, strerror(e));
      usleep(50 * 1000);
    }
    set_nodelay(c.fd[0]);
    int32_t r = c.rank;
    ctl_io(c, 0, &r, sizeof r, true, "our rank");
  }
  freeaddrinfo(ai);
}

/* Rank 0's `len` bytes to every rank. */
static void ctl_bcast(const Ctl &c, void *buf, size_t len, const char *what)
{
  if (c.rank == 0)
    for (int r = 1; r < c.nranks; r++) ctl_io(c, r, buf, len, true, what);
  else
    ctl_io(c, 0, buf, len, false, what);
}

/* The sum of `v` over ranks, on every rank; also a barrier. */
static double ctl_sum(const Ctl &c, double v, const char *what)
{
  double sum = v;
  if (c.rank == 0) {
    for (int r = 1; r < c.nranks; r++) {
      double x;
      ctl_io(c, r, &x, sizeof x, false, what);
      sum += x;
    }
  } else {
    ctl_io(c, 0, &v, sizeof v, true, what);
  }
  ctl_bcast(c, &sum, sizeof sum, what);
  return sum;
}

static void ctl_barrier(const Ctl &c, const char *what) { (void)ctl_sum(c, 0, what); }

/* ---------------------------------------------------------------------------------------- */
/* Kernels                                                                                   */

__device__ __forceinline__ uint64_t global_ns()
{
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* Every wait is NVSHMEM's own nvshmem_signal_wait_until and nothing else, as its users write
 * it: its volatile spin is all the ordering NVSHMEM documents for a put-with-signal's data
 * (NVSHMEM 3.4.5, nvshmem_defines.h: no fence after the spin). Until session 24 this tool
 * ended every wait with a __threadfence_system() of its own, about 1 us per wait that no
 * NVSHMEM program pays (bench/RESULTS.md, issue 42). The waits are unbounded, as NVSHMEM's
 * are: a peer that never signals is ended by the run's timeout (bench/perf-peers.sh). */
__device__ __forceinline__ void wait_signal(uint64_t *sig, uint64_t want)
{
  nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, want);
}

struct SigArgs {
  char *buf;          /* symmetric: receive area at 0, send area at send_off */
  uint64_t *sig;      /* symmetric: sig[p] counts the blocks PE p has put here */
  uint64_t send_off, n, chunk;
  uint64_t want;      /* every awaited slot's count after this operation */
  int op, me, npes, bpp; /* bpp: blocks per peer, each a chunk of the n bytes */
};

/* The calling block copies n bytes within this GPU's memory: 16-byte words where both ends
 * allow, bytes otherwise (the own slice of an all-gather or all-to-all, in the kernel as
 * NVSHMEM's collectives and our perf tools do it). */
__device__ void copy_block(char *dst, const char *src, uint64_t n)
{
  uint64_t i = threadIdx.x, done = 0;
  if (((uintptr_t)dst | (uintptr_t)src) % 16 == 0) {
    for (; i < n / 16; i += blockDim.x) reinterpret_cast<int4 *>(dst)[i] = reinterpret_cast<const int4 *>(src)[i];
    done = n / 16 * 16;
  }
  for (i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

/* allgather-sig / alltoall-sig / sendrecv: block b puts chunk b % bpp of this PE's data for the
 * (b / bpp)-th peer, signalling +1; then the first block of each peer waits for that peer's
 * count; the blocks of the first peer also copy their chunk of the own slice. Peers in
 * staggered order (me+1, me+2, ...), as nccl-tests' tools and ours go. */
__global__ void __launch_bounds__(kBlockThreads) sig_kernel(SigArgs a)
{
  const int k = blockIdx.x / a.bpp, c = blockIdx.x % a.bpp;
  const int to = (a.me + 1 + k) % a.npes, from = (a.me + a.npes - 1 - k) % a.npes;
  uint64_t dst = 0, src = a.send_off;
  if (a.op == OP_ALLGATHER_SIG) {
    dst = (uint64_t)a.me * a.n;
  } else if (a.op == OP_ALLTOALL_SIG) {
    dst = (uint64_t)a.me * a.n;
    src = a.send_off + (uint64_t)to * a.n;
  }
  const uint64_t start = (uint64_t)c * a.chunk;
  const uint64_t len = start < a.n ? min(a.chunk, a.n - start) : 0;
  nvshmemx_putmem_signal_nbi_block(a.buf + dst + start, a.buf + src + start, len, a.sig + a.me, 1,
                                   NVSHMEM_SIGNAL_ADD, to);
  if (k == 0 && a.op != OP_SENDRECV) {
    const uint64_t own = a.op == OP_ALLGATHER_SIG ? a.send_off : a.send_off + (uint64_t)a.me * a.n;
    copy_block(a.buf + (uint64_t)a.me * a.n + start, a.buf + own + start, len);
  }
  if (c == 0 && threadIdx.x == 0) wait_signal(a.sig + from, a.want);
}

/* The put-with-signal of a ping-pong by the thread, warp or block (kScope 0, 1, 2), the
 * signal set to the round's number as NVSHMEM's own ping-pong perftest does
 * (perftest/device/pt-to-pt/shmem_put_signal_ping_pong_latency.cu): NVSHMEM_SIGNAL_SET on a
 * P2P peer is one volatile store after its __threadfence_system(). */
template <int kScope>
__device__ __forceinline__ void put_signal(char *dst, const char *src, uint64_t n, uint64_t *sig, uint64_t v, int pe)
{
  if (kScope == 0) nvshmem_putmem_signal_nbi(dst, src, n, sig, v, NVSHMEM_SIGNAL_SET, pe);
  else if (kScope == 1) nvshmemx_putmem_signal_nbi_warp(dst, src, n, sig, v, NVSHMEM_SIGNAL_SET, pe);
  else nvshmemx_putmem_signal_nbi_block(dst, src, n, sig, v, NVSHMEM_SIGNAL_SET, pe);
}

/* PE 0 and PE 1: `rounds` ping-pongs of n bytes, as NVSHMEM's perftest writes one: PE 0 puts
 * with its signal set to the round's number and waits for PE 1's; PE 1 waits, then answers.
 * Only thread 0 waits; a warp's or block's put begins with NVSHMEM's own barrier, which holds
 * the other threads until it has. *ns: the kernel's time on PE 0. */
template <int kScope>
__global__ void pingpong_kernel(char *buf, uint64_t *sig, uint64_t send_off, uint64_t n, int me,
                                int rounds, uint64_t base, unsigned long long *ns)
{
  const int peer = 1 - me;
  const uint64_t t0 = global_ns();
  for (int i = 1; i <= rounds; i++) {
    if (me == 1 && threadIdx.x == 0) wait_signal(sig + peer, base + i);
    put_signal<kScope>(buf, buf + send_off, n, sig + me, base + i, peer);
    if (me == 0 && threadIdx.x == 0) wait_signal(sig + peer, base + i);
  }
  if (threadIdx.x == 0) *ns = global_ns() - t0;
}

/* A bare signal's ping-pong by one thread: nvshmemx_signal_op alone (kFence false: it orders
 * nothing before it) or after nvshmem_fence() (true: the pair that, like our signal(), orders
 * the caller's earlier puts before the signal). */
template <bool kFence>
__global__ void signal_kernel(uint64_t *sig, int me, int rounds, uint64_t base, unsigned long long *ns)
{
  const int peer = 1 - me;
  const uint64_t t0 = global_ns();
  for (int i = 1; i <= rounds; i++) {
    if (me == 1) wait_signal(sig + peer, base + i);
    if (kFence) nvshmem_fence();
    nvshmemx_signal_op(sig + me, base + i, NVSHMEM_SIGNAL_SET, peer);
    if (me == 0) wait_signal(sig + peer, base + i);
  }
  *ns = global_ns() - t0;
}

/* putbw on PE 0: `iters` puts of the same n bytes to PE 1, chunk per block, each +1 on PE 1's
 * slot 0; then every thread's puts completed (quiet), as our bandwidth example's flush. */
__global__ void __launch_bounds__(kBlockThreads) putbw_kernel(char *buf, uint64_t *sig, uint64_t send_off,
                                                              uint64_t n, uint64_t chunk, int iters)
{
  const uint64_t start = (uint64_t)blockIdx.x * chunk;
  const uint64_t len = start < n ? min(chunk, n - start) : 0;
  for (int i = 0; i < iters; i++)
    nvshmemx_putmem_signal_nbi_block(buf + start, buf + send_off + start, len, sig + 0, 1,
                                     NVSHMEM_SIGNAL_ADD, 1);
  nvshmem_quiet();
}

/* putbw on PE 1: one thread waits for the count of every block of every put. */
__global__ void wait_kernel(uint64_t *sig, int from, uint64_t want)
{
  wait_signal(sig + from, want);
}

/* ---------------------------------------------------------------------------------------- */
/* The benchmark                                                                             */

/* The byte PE `from` sends to PE `to` at index i of a message of `size` (perf.c's). */
static unsigned char pattern(int from, int to, size_t i, size_t size)
{
  return (unsigned char)(from * 29 + to * 7 + (int)(i % 251) + (int)(i >> 12) + (int)(size % 13));
}

static size_t parse_size(const char *s)
{
  char *end;
  double v = strtod(s, &end);
  size_t m = 1;
  if (end == s || v < 0) return 0;
  switch (*end) {
  case 'K': case 'k': m = 1u << 10; end++; break;
  case 'M': case 'm': m = 1u << 20; end++; break;
  case 'G': case 'g': m = 1u << 30; end++; break;
  default: break;
  }
  return *end == '\0' ? (size_t)(v * (double)m) : 0;
}

struct Perf {
  Op op;
  int me = 0, npes = 0, iters = 20, warmup = 5, check = 1, max_bpp = 128;
  double bound_s = 30;
  Ctl ctl;
  char *buf = nullptr;     /* symmetric */
  uint64_t *sig = nullptr; /* symmetric, npes words */
  size_t send_off = 0, bytes = 0;
  std::vector<unsigned char> host; /* mirror of the buffer: fill and check */
  unsigned long long *dns = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  uint64_t count = 0; /* every slot this PE waits on holds this count once the peers are done */
};

static bool is_pingpong(Op op) { return op == OP_PINGPONG || op == OP_PINGPONG_WARP || op == OP_PINGPONG_BLOCK; }
static bool is_signal(Op op) { return op == OP_SIGNAL || op == OP_FENCE_SIGNAL; }
static bool is_collective(Op op) { return op == OP_ALLGATHER || op == OP_ALLGATHER_SIG || op == OP_ALLTOALL || op == OP_ALLTOALL_SIG; }
static size_t recv_slots(const Perf &p) { return is_collective(p.op) ? (size_t)p.npes : 1; }
static size_t send_slots(const Perf &p) { return p.op == OP_ALLTOALL || p.op == OP_ALLTOALL_SIG ? (size_t)p.npes : 1; }
/* Bytes per PE of an operation of `size` (nccl-tests' size column). */
static size_t per_pe(const Perf &p, size_t size) { return is_collective(p.op) ? size / (size_t)p.npes : size; }

/* Blocks per peer and bytes per block for n bytes (see kMinChunk). */
static void split(const Perf &p, uint64_t n, int *bpp, uint64_t *chunk)
{
  uint64_t b = (n + kMinChunk - 1) / kMinChunk;
  if (b < 1) b = 1;
  if (b > (uint64_t)p.max_bpp) b = (uint64_t)p.max_bpp;
  *bpp = (int)b;
  *chunk = ((n + b - 1) / b + 15) / 16 * 16; /* 16-byte aligned chunks: NVSHMEM's vector copies */
}

/* What PE `me` must hold at index i of its receive area after an operation of `size` (n per
 * PE); false where nothing is received there. */
static bool expected(const Perf &p, size_t size, size_t n, size_t idx, unsigned char *v)
{
  const size_t r = idx / n, i = idx % n;
  switch (p.op) {
  case OP_ALLGATHER: case OP_ALLGATHER_SIG: *v = pattern((int)r, 0, i, size); return true;
  case OP_ALLTOALL: case OP_ALLTOALL_SIG: *v = pattern((int)r, p.me, i, size); return true;
  case OP_SENDRECV: *v = pattern((p.me + p.npes - 1) % p.npes, p.me, idx, size); return true;
  case OP_PINGPONG: case OP_PINGPONG_WARP: case OP_PINGPONG_BLOCK:
    if (p.me > 1) return false; *v = pattern(1 - p.me, p.me, idx, size); return true;
  case OP_SIGNAL: case OP_FENCE_SIGNAL: return false; /* no data: the signal alone */
  case OP_PUTBW: if (p.me != 1) return false; *v = pattern(0, 1, idx, size); return true;
  }
  return false;
}

/* The send area for `size`, and the receive area filled with the complement of what must
 * arrive (so a byte not written cannot pass the check). */
static void fill(Perf &p, size_t size, size_t n)
{
  unsigned char *send = p.host.data() + p.send_off, v;
  for (size_t r = 0; r < send_slots(p); r++)
    for (size_t i = 0; i < n; i++) {
      int to = 0;
      if (p.op == OP_ALLTOALL || p.op == OP_ALLTOALL_SIG) to = (int)r;
      else if (p.op == OP_SENDRECV) to = (p.me + 1) % p.npes;
      else if (is_pingpong(p.op) || p.op == OP_PUTBW) to = 1 - (p.me & 1);
      send[r * n + i] = pattern(p.me, to, i, size);
    }
  for (size_t i = 0; i < recv_slots(p) * n; i++)
    p.host[i] = expected(p, size, n, i, &v) ? (unsigned char)~v : 0;
  CK_CUDA(cudaMemcpy(p.buf, p.host.data(), p.send_off + send_slots(p) * n, cudaMemcpyHostToDevice));
}

static void poison(Perf &p, size_t size, size_t n)
{
  unsigned char v;
  for (size_t i = 0; i < recv_slots(p) * n; i++)
    p.host[i] = expected(p, size, n, i, &v) ? (unsigned char)~v : 0;
  CK_CUDA(cudaMemcpy(p.buf, p.host.data(), recv_slots(p) * n, cudaMemcpyHostToDevice));
}

static size_t count_wrong(Perf &p, size_t size, size_t n)
{
  size_t bad = 0;
  unsigned char v;
  CK_CUDA(cudaMemcpy(p.host.data(), p.buf, recv_slots(p) * n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < recv_slots(p) * n; i++)
    if (expected(p, size, n, i, &v)) bad += p.host[i] != v;
  return bad;
}

/* Waits for the stream and completes every put (the tools' flush). */
static void finish(Perf &p)
{
  CK_CUDA(cudaStreamSynchronize(p.stream));
  nvshmemx_quiet_on_stream(p.stream);
  CK_CUDA(cudaStreamSynchronize(p.stream));
}

/* `k` operations of the batch kinds, queued on the stream. */
static void run_ops(Perf &p, size_t n, int k)
{
  for (int it = 0; it < k; it++) {
    switch (p.op) {
    case OP_ALLGATHER:
      CK_NVSHMEM(nvshmemx_fcollectmem_on_stream(NVSHMEM_TEAM_WORLD, p.buf, p.buf + p.send_off, n, p.stream));
      break;
    case OP_ALLTOALL:
      CK_NVSHMEM(nvshmemx_alltoallmem_on_stream(NVSHMEM_TEAM_WORLD, p.buf, p.buf + p.send_off, n, p.stream));
      break;
    default: {
      SigArgs a;
      uint64_t chunk;
      int bpp;
      split(p, n, &bpp, &chunk);
      const int peers = p.op == OP_SENDRECV ? 1 : p.npes - 1;
      p.count += (uint64_t)bpp;
      a.buf = p.buf;
      a.sig = p.sig;
      a.send_off = p.send_off;
      a.n = n;
      a.chunk = chunk;
      a.want = p.count;
      a.op = p.op;
      a.me = p.me;
      a.npes = p.npes;
      a.bpp = bpp;
      sig_kernel<<<peers * bpp, kBlockThreads, 0, p.stream>>>(a);
      CK_CUDA(cudaGetLastError());
    }
    }
  }
}

/* pingpong / putbw: one kernel of `k` rounds or puts; returns PE 0's half round trip or time
 * per put in us (0 elsewhere). */
static double run_loop(Perf &p, size_t n, int k)
{
  float ms = 0;
  unsigned long long ns = 0;
  if (p.me > 1 || k == 0) return 0;
  if (is_pingpong(p.op) || is_signal(p.op)) {
    /* One thread, one warp, or a block of kBlockThreads (our pingpong --block's 512). */
    switch (p.op) {
    case OP_PINGPONG: pingpong_kernel<0><<<1, 1, 0, p.stream>>>(p.buf, p.sig, p.send_off, n, p.me, k, p.count, p.dns); break;
    case OP_PINGPONG_WARP: pingpong_kernel<1><<<1, 32, 0, p.stream>>>(p.buf, p.sig, p.send_off, n, p.me, k, p.count, p.dns); break;
    case OP_PINGPONG_BLOCK:
      pingpong_kernel<2><<<1, kBlockThreads, 0, p.stream>>>(p.buf, p.sig, p.send_off, n, p.me, k, p.count, p.dns);
      break;
    case OP_SIGNAL: signal_kernel<false><<<1, 1, 0, p.stream>>>(p.sig, p.me, k, p.count, p.dns); break;
    default: signal_kernel<true><<<1, 1, 0, p.stream>>>(p.sig, p.me, k, p.count, p.dns); break;
    }
    CK_CUDA(cudaGetLastError());
    p.count += (uint64_t)k;
    finish(p);
    CK_CUDA(cudaMemcpy(&ns, p.dns, sizeof ns, cudaMemcpyDeviceToHost));
    return p.me == 0 ? (double)ns / 1e3 / (2.0 * k) : 0;
  }
  int bpp;
  uint64_t chunk;
  split(p, n, &bpp, &chunk);
  p.count += (uint64_t)bpp * (uint64_t)k;
  if (p.me == 0) {
    CK_CUDA(cudaEventRecord(p.ev0, p.stream));
    putbw_kernel<<<bpp, kBlockThreads, 0, p.stream>>>(p.buf, p.sig, p.send_off, n, chunk, k);
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaEventRecord(p.ev1, p.stream));
  } else {
    wait_kernel<<<1, 1, 0, p.stream>>>(p.sig, 0, p.count);
    CK_CUDA(cudaGetLastError());
  }
  finish(p);
  if (p.me != 0) return 0;
  CK_CUDA(cudaEventElapsedTime(&ms, p.ev0, p.ev1));
  return (double)ms * 1e3 / k;
}

/* One size: warm-up, the receive areas poisoned again, the timed operations, the check.
 * Returns the mean time per operation over PEs (us); adds the wrong bytes of every PE. */
static double measure(Perf &p, size_t size, size_t *wrong_total)
{
  const size_t n = per_pe(p, size);
  const bool loop = is_pingpong(p.op) || is_signal(p.op) || p.op == OP_PUTBW;
  double us;
  fill(p, size, n);
  ctl_barrier(p.ctl, "the barrier before the warm-up");
  if (loop) {
    run_loop(p, n, p.warmup);
  } else {
    run_ops(p, n, p.warmup);
    finish(p);
  }
  /* Every warm-up put has completed everywhere (each PE's quiet came before its arrival
   * here), so the receive areas can be poisoned again: the check then proves the timed ones. */
  ctl_barrier(p.ctl, "the barrier after the warm-up");
  poison(p, size, n);
  ctl_barrier(p.ctl, "the barrier before the timed operations");
  if (loop) {
    us = ctl_sum(p.ctl, run_loop(p, n, p.iters), "the time of PE 0");
  } else {
    const double t0 = now_s();
    run_ops(p, n, p.iters);
    finish(p);
    us = ctl_sum(p.ctl, (now_s() - t0) * 1e6 / p.iters, "the mean time") / p.npes;
  }
  const double wrong = p.check ? (double)count_wrong(p, size, n) : 0;
  /* Also the barrier that keeps a PE from refilling its send area (next size) while a slower
   * one still checks. */
  const double wrong_all = ctl_sum(p.ctl, wrong, "the wrong-byte count");
  *wrong_total += (size_t)(wrong_all + 0.5);
  return us;
}

static int usage(void)
{
  fprintf(stderr,
          "usage: nvshmem_perf allgather|allgather-sig|alltoall|alltoall-sig|sendrecv|pingpong|\n"
          "       pingpong-warp|pingpong-block|signal|fence-signal|putbw\n"
          "       [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-n ITERS] [-w WARMUP] [-c 0|1] [-B BLOCKS]\n"
          "       [-W SECONDS] (+ launch options -r RANK -a IP:PORT -l LOCAL_RANK, or a launcher)\n");
  return 2;
}

int main(int argc, char **argv)
{
  Perf p;
  launch_env env;
  size_t min_b = 32u << 20, max_b = 32u << 20, step = 0, wrong_total = 0;
  double factor = 0, bus_sum = 0;
  int rows = 0, ndev = 0, nargs = 1;
  const char *op_name = NULL;

  /* Our options first (-n is the iteration count here, as in perf.c: ranks come from the
   * launcher), then launch_env's (-r, -a, -l), then the operation. */
  for (int k = 1; k < argc; k++) {
    const char *o = argv[k], *v = k + 1 < argc ? argv[k + 1] : NULL;
    if (strlen(o) != 2 || o[0] != '-' || strchr("befinwcBW", o[1]) == NULL) {
      argv[nargs++] = argv[k];
      continue;
    }
    if (v == NULL) return usage();
    switch (o[1]) {
    case 'b': min_b = parse_size(v); break;
    case 'e': max_b = parse_size(v); break;
    case 'f': factor = atof(v); break;
    case 'i': step = parse_size(v); break;
    case 'n': p.iters = atoi(v); break;
    case 'w': p.warmup = atoi(v); break;
    case 'c': p.check = atoi(v); break;
    case 'B': p.max_bpp = atoi(v); break;
    case 'W': p.bound_s = atof(v); break;
    }
    k++;
  }
  argc = nargs;
  argv[argc] = NULL;
  if (launch_env_parse(&argc, argv, &env) != 0) return 2;
  if (argc != 2) return usage();
  op_name = argv[1];
  {
    size_t i;
    for (i = 0; i < sizeof kOpNames / sizeof kOpNames[0] && strcmp(op_name, kOpNames[i]) != 0; i++) {}
    if (i == sizeof kOpNames / sizeof kOpNames[0]) return usage();
    p.op = (Op)i;
  }
  if (factor == 0 && step == 0) factor = 2;
  if (min_b == 0 || max_b < min_b || p.iters <= 0 || p.warmup < 0 || (factor != 0 && factor <= 1) ||
      p.max_bpp < 1 || p.bound_s <= 0) {
    fprintf(stderr, "nvshmem_perf: need 0 < -b <= -e, -n > 0, -w >= 0, -f > 1 (or -i > 0), -B > 0, -W > 0\n");
    return 2;
  }
  p.me = env.rank;
  p.npes = env.nranks;
  g_rank = p.me;
  if (p.npes < 2) {
    fprintf(stderr, "nvshmem_perf: needs at least 2 PEs\n");
    return 2;
  }

  /* The device before NVSHMEM: it takes the current one. */
  CK_CUDA(cudaGetDeviceCount(&ndev));
  if (ndev <= 0) DIE("no CUDA device");
  const int dev = env.local_rank % ndev;
  CK_CUDA(cudaSetDevice(dev));
  CK_CUDA(cudaFree(0));

  /* The unique id, from PE 0 to every PE over the control channel. */
  p.ctl.rank = p.me;
  p.ctl.nranks = p.npes;
  p.ctl.timeout_s = p.bound_s;
  ctl_open(p.ctl, env.root);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (p.me == 0) CK_NVSHMEM(nvshmemx_get_uniqueid(&id));
  ctl_bcast(p.ctl, &id, sizeof id, "the NVSHMEM unique id");
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  CK_NVSHMEM(nvshmemx_set_attr_uniqueid_args(p.me, p.npes, &id, &attr));
  /* On failure NVSHMEM prints its reason and exits the process itself (status 255): this line
   * says which call that was. */
  fprintf(stderr, "[rank %d] nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID), %d PEs, GPU %d\n", p.me, p.npes, dev);
  CK_NVSHMEM(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr));
  if (nvshmem_my_pe() != p.me || nvshmem_n_pes() != p.npes)
    DIE("NVSHMEM made us PE %d of %d, the launcher rank %d of %d", nvshmem_my_pe(), nvshmem_n_pes(), p.me, p.npes);
  const int status = nvshmemx_init_status();
  const char *mpg = status == NVSHMEM_STATUS_FULL_MPG      ? "full MPG (several PEs per GPU)"
                    : status == NVSHMEM_STATUS_LIMITED_MPG ? "LIMITED MPG (several PEs per GPU, no MPS or over 100% MPS threads)"
                                                           : "one PE per GPU";
  if (status == NVSHMEM_STATUS_LIMITED_MPG && (p.op == OP_ALLGATHER || p.op == OP_ALLTOALL)) {
    if (p.me == 0)
      fprintf(stderr, "nvshmem_perf %s: NVSHMEM runs in limited MPG mode here (several PEs on one GPU "
              "without MPS, or CUDA_MPS_ACTIVE_THREAD_PERCENTAGE summing over 100), where it refuses "
              "its collectives; not run (the -sig, sendrecv, pingpong and putbw operations do run)\n", op_name);
    ctl_barrier(p.ctl, "the refusal");
    nvshmem_finalize();
    return 3;
  }

  /* The buffer: receive area, then the send area, each slot the largest per-PE size, rounded
   * to 256 bytes so every slot starts aligned for the collectives' vector copies. */
  const size_t max_per = (per_pe(p, max_b) + 255) / 256 * 256;
  p.send_off = recv_slots(p) * max_per;
  p.bytes = p.send_off + send_slots(p) * max_per;
  p.buf = (char *)nvshmem_malloc(p.bytes);
  p.sig = (uint64_t *)nvshmem_malloc((size_t)p.npes * sizeof(uint64_t));
  if (p.buf == NULL || p.sig == NULL)
    DIE("nvshmem_malloc of %zu + %zu bytes failed (NVSHMEM_SYMMETRIC_SIZE too small?)", p.bytes,
        (size_t)p.npes * sizeof(uint64_t));
  p.host.assign(p.bytes, 0);
  CK_CUDA(cudaMemset(p.buf, 0, p.bytes));
  CK_CUDA(cudaMemset(p.sig, 0, (size_t)p.npes * sizeof(uint64_t)));
  CK_CUDA(cudaMalloc((void **)&p.dns, sizeof(unsigned long long)));
  CK_CUDA(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking));
  CK_CUDA(cudaEventCreate(&p.ev0));
  CK_CUDA(cudaEventCreate(&p.ev1));
  CK_CUDA(cudaDeviceSynchronize());
  /* No peer signals or puts before every PE's words are zero. */
  ctl_barrier(p.ctl, "the barrier after the allocation");

  if (p.me == 0) {
    int maj = 0, min = 0, patch = 0;
    nvshmemx_vendor_get_version_info(&maj, &min, &patch);
    const int peer = 1;
    printf("# nvshmem_perf %s (NVSHMEM %d.%d.%d, GPU memory, uid bootstrap, %s; PE %d's memory %s; "
           "up to %d blocks of %d threads per peer)\n",
           op_name, maj, min, patch, mpg, peer,
           nvshmem_ptr(p.buf, peer) != NULL ? "mapped here (loads and stores)" : "NOT mapped here (proxy)",
           p.max_bpp, kBlockThreads);
    printf("# nThread 1 nGpus 1 minBytes %zu maxBytes %zu step: %g(%s) warmup iters: %d iters: %d "
           "agg iters: 1 validation: %d graph: 0\n#\n# Using devices\n",
           min_b, max_b, factor != 0 ? factor : (double)step, factor != 0 ? "factor" : "bytes",
           p.warmup, p.iters, p.check);
  }
  for (int r = 0; r < p.npes; r++) {
    ctl_barrier(p.ctl, "the device listing");
    if (r == p.me) {
      struct cudaDeviceProp prop;
      char host[64] = "?";
      CK_CUDA(cudaGetDeviceProperties(&prop, dev));
      gethostname(host, sizeof host - 1);
      printf("#  Rank %2d Group  0 Pid %6d on %10s device %2d [%04x:%02x:%02x.0] %s\n", p.me, (int)getpid(),
             host, dev, prop.pciDomainID, prop.pciBusID, prop.pciDeviceID, prop.name);
      fflush(stdout);
    }
  }
  ctl_barrier(p.ctl, "the device listing");
  if (p.me == 0) {
    printf("#\n#                                                   out-of-place\n");
    printf("#       size         count      type   redop    root     time   algbw   busbw #wrong\n");
    printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)\n");
    fflush(stdout);
  }
  const double bus_factor = is_collective(p.op) ? (double)(p.npes - 1) / p.npes : 1.0;
  for (size_t size = min_b; size <= max_b;
       size = factor != 0 ? (size_t)((double)size * factor) : size + step) {
    const size_t s = is_collective(p.op) ? size / (size_t)p.npes * (size_t)p.npes : size; /* whole slices */
    if (s == 0) continue;
    const size_t before = wrong_total;
    const double us = measure(p, s, &wrong_total);
    const double algbw = (double)s / us / 1e3;
    bus_sum += algbw * bus_factor;
    rows++;
    if (p.me == 0) {
      printf("%12zu  %12zu  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  ", s, s, "uint8", "none", -1, us, algbw,
             algbw * bus_factor);
      if (p.check)
        printf("%6zu\n", wrong_total - before);
      else
        printf("%6s\n", "N/A");
      fflush(stdout);
    }
  }
  if (p.me == 0) {
    printf("# Out of bounds values : %zu %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
    printf("# Avg bus bandwidth    : %g \n#\n", rows ? bus_sum / rows : 0.0);
    fflush(stdout);
  }
  ctl_barrier(p.ctl, "the barrier before finalize");
  nvshmem_free(p.sig);
  nvshmem_free(p.buf);
  CK_CUDA(cudaFree(p.dns));
  CK_CUDA(cudaEventDestroy(p.ev0));
  CK_CUDA(cudaEventDestroy(p.ev1));
  CK_CUDA(cudaStreamDestroy(p.stream));
  nvshmem_finalize();
  return wrong_total != 0;
}
