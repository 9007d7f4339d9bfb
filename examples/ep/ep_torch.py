"""Expert-parallel dispatch and combine from Python: examples/ep's kernels (ep_kernels.cuh, the
ones ep.cu runs) built with torch.utils.cpp_extension.load_inline and launched on PyTorch's
current stream over torch tensors, one mscclpp_rs communicator per rank.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/ep/ep_torch.py [--tokens 1,8,32,128] [--steps 200] [--transport p2p|ib|shm]
        [--blocks 64] [--fuse-tokens 1]

The inputs are torch tensors made by torch: per rank and step (repeating every 3 steps),
from a CPU generator seeded by both, tokens in BF16 (multiples of 1/64 in (-2, 2)), top-K routing of random scores, weights
(multiples of 1/256). Every rank can remake any rank's inputs, so each checks what it
received against a torch reference: on the first two steps and the last of each token count,
the counts per (source, expert), every received row after the expert (bit for bit), and the
combined output, bf16(sum over k of w * bf16(x * s_e)) computed by torch in float32: exact for
these inputs (examples/ep/ep.h says why), so compared bit for bit too. A wrong value makes the
program exit 1.

The bootstrap root is MASTER_ADDR:(MASTER_PORT + 1) (torchrun's store has MASTER_PORT). Rank r
uses GPU (LOCAL_RANK % GPUs); ranks that share a GPU need an MPS daemon. Rank 0 prints, per
token count, the median and p99 of the dispatch kernel and of combine + reduce (CUDA events):
    RESULT ep impl=mscclpp-torch ranks=R tokens=T ... dispatch_med_us=.. wrong=0
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import mscclpp_rs as m

HERE = Path(__file__).resolve().parent

SOURCE = r"""
#include <mscclpp.h>
#include "ep.h"
#include "ep_kernels.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

static ep::Shape shapeOf(const std::vector<int64_t>& v)
{
  TORCH_CHECK(v.size() == 5, "shape: [ranks, experts, topk, hidden, max tokens]");
  return ep::Shape{(int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4]};
}

/* Offsets of ep.h's layout, so that Python reads the buffer where the kernels write it:
 * what 0 the buffer's size, 1 token t's row in X, 2 row r of DR[rank], 3 row r of CR[rank],
 * 4 the counts received from rank. */
int64_t ep_offset(std::vector<int64_t> shape, int64_t what, int64_t q, int64_t rank, int64_t r)
{
  const ep::Shape s = shapeOf(shape);
  switch (what) {
  case 0: return (int64_t)s.bytes();
  case 1: return (int64_t)s.x((int)r);
  case 2: return (int64_t)s.dr((int)q, (int)rank, (uint64_t)r);
  case 3: return (int64_t)s.cr((int)q, (int)rank, (uint64_t)r);
  case 4: return (int64_t)s.dc((int)q, (int)rank);
  }
  TORCH_CHECK(false, "ep_offset: what ", what);
  return 0;
}

/* kernel: 0 dispatch, 1 expert, 2 combine, 3 reduce (ep_kernels.cuh), on the current stream. */
void ep_launch(int64_t kernel, std::vector<int64_t> shape, int64_t me, int64_t T, int64_t q,
               int64_t base, int64_t blocks, int64_t fuse_tokens, torch::Tensor buf,
               torch::Tensor conns, torch::Tensor idx, torch::Tensor w, torch::Tensor rows,
               torch::Tensor out, torch::Tensor done, torch::Tensor ops)
{
  ep::Step a{};
  a.s = shapeOf(shape);
  TORCH_CHECK(buf.is_cuda() && buf.scalar_type() == torch::kUInt8 && (uint64_t)buf.numel() >= a.s.bytes(),
              "buf: uint8 on the GPU, ep_offset(shape, 0) bytes");
  TORCH_CHECK(conns.is_cuda() && conns.numel() >= (a.s.R - 1) * 80, "conns: the device connections on the GPU");
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == torch::kInt32 && idx.numel() >= T * a.s.K, "idx: int32 [T, K]");
  TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kFloat32 && w.numel() >= T * a.s.K, "w: float32 [T, K]");
  TORCH_CHECK(rows.is_cuda() && rows.scalar_type() == torch::kInt32 && rows.numel() >= T * a.s.K, "rows: int32 [T, K]");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == torch::kBFloat16 && out.numel() >= T * a.s.H, "out: bfloat16 [T, H]");
  TORCH_CHECK(done.is_cuda() && done.scalar_type() == torch::kInt32 && done.numel() >= 2, "done: int32 [2]");
  TORCH_CHECK(ops.is_cuda() && ops.scalar_type() == torch::kInt64 && ops.numel() >= 1, "ops: int64 [1]");
  TORCH_CHECK(T >= 1 && T <= a.s.Tmax && a.s.E <= EP_MAX_EXPERTS && a.s.Tmax <= EP_MAX_TOKENS, "shape");
  TORCH_CHECK(fuse_tokens >= 0 && fuse_tokens <= EP_FUSE_MAX_TOKENS, "fuse_tokens: 0..", EP_FUSE_MAX_TOKENS);
  /* A reduce launched where combine's last block did the sums would sum twice: refused. */
  TORCH_CHECK(kernel != 3 || T > fuse_tokens, "ep_launch: no reduce where T <= fuse_tokens (combine did it)");
  a.me = (int)me;
  a.T = (int)T;
  a.q = (int)q;
  a.buf = buf.data_ptr<uint8_t>();
  a.conns = reinterpret_cast<const mscclppDevConn_t*>(conns.data_ptr());
  a.idx = idx.data_ptr<int>();
  a.w = w.data_ptr<float>();
  a.rows = rows.data_ptr<int>();
  a.out = reinterpret_cast<ep::bf16*>(out.data_ptr());
  a.done = reinterpret_cast<unsigned int*>(done.data_ptr<int>());
  a.base = (unsigned int)base;
  a.ops = reinterpret_cast<unsigned long long*>(ops.data_ptr<int64_t>());
  a.fuseTokens = (int)fuse_tokens;
  cudaStream_t st = c10::cuda::getCurrentCUDAStream().stream();
  switch (kernel) {
  case 0: ep::dispatchKernel<<<(int)blocks, EP_THREADS, 0, st>>>(a); break;
  case 1: ep::expertKernel<<<a.s.E, EP_THREADS, 0, st>>>(a); break;
  case 2: ep::combineKernel<<<(int)blocks, EP_THREADS, 0, st>>>(a); break;
  case 3:
    ep::reduceKernel<<<dim3((a.s.H / 8 + EP_REDUCE_THREADS - 1) / EP_REDUCE_THREADS, (int)T), EP_REDUCE_THREADS, 0, st>>>(a);
    break;
  default: TORCH_CHECK(false, "ep_launch: kernel ", kernel);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/* Loads every kernel now: under CUDA's lazy loading a kernel's first launch may synchronize the
 * context while a dispatch kernel waits for a peer whose proxied work is stuck behind it (ep.cu). */
void ep_preload()
{
  cudaFuncAttributes fa;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, ep::dispatchKernel));
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, ep::expertKernel));
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, ep::combineKernel));
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, ep::reduceKernel));
}
"""

DECLS = """
int64_t ep_offset(std::vector<int64_t> shape, int64_t what, int64_t q, int64_t rank, int64_t r);
void ep_launch(int64_t kernel, std::vector<int64_t> shape, int64_t me, int64_t T, int64_t q,
               int64_t base, int64_t blocks, int64_t fuse_tokens, torch::Tensor buf,
               torch::Tensor conns, torch::Tensor idx, torch::Tensor w, torch::Tensor rows,
               torch::Tensor out, torch::Tensor done, torch::Tensor ops);
void ep_preload();
"""


# Inputs repeat with period 3, so that each is made once (on the CPU: a CUDA generator's
# values depend on the GPU's size, and every rank must remake every rank's inputs exactly),
# while a step and the step two before it, which share a parity's buffers, always differ: a
# row left over from the buffer's last use is seen.
INPUT_PERIOD = 3
_inputs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def inputs(rank: int, step: int, T: int, H: int, E: int, K: int, device: torch.device):
    """Rank `rank`'s tokens [T, H] (bf16), experts [T, K] (int32) and weights [T, K] (float32)
    of step `step`, on `device`: the same on every rank that asks."""
    key = (rank, T, step % INPUT_PERIOD)
    if key not in _inputs:
        g = torch.Generator()
        g.manual_seed(1_000_003 * key[2] + 7919 * rank + 131 * T + 17)
        x = (torch.randint(-127, 128, (T, H), generator=g).float() / 64).to(torch.bfloat16)
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)
        w = torch.randint(1, 65, (T, K), generator=g).float() / 256
        _inputs[key] = (x.to(device), idx.to(device), w.to(device))
    return _inputs[key]


def scale(e: torch.Tensor) -> torch.Tensor:
    """s_e = 1 + (e % 8) / 8, ep.h's expert."""
    return 1 + (e % 8).float() / 8


def check(ext, shape, buf, out, me, step, q, T, device) -> int:
    """Wrong values of this rank's step against the torch reference (module docstring)."""
    R, E, K, H, _ = shape
    L = E // R
    wrong = 0

    def rows_at(offset: int, n: int) -> torch.Tensor:
        return buf[offset : offset + n * H * 2].view(torch.bfloat16).view(n, H)

    for src in range(R):
        x, idx, _ = inputs(src, step, T, H, E, K, device)
        # src's (token, k) pairs for this rank's experts, in DR's order: by expert, then token.
        t, k = torch.nonzero((idx // L) == me, as_tuple=True)
        e = idx[t, k].long()
        order = torch.argsort(e * T + t)
        t, e = t[order], e[order]
        counts = buf[ext.ep_offset(shape, 4, q, src, 0) :][: L * 4].view(torch.int32)
        want_counts = torch.bincount(e - me * L, minlength=L).to(torch.int32)
        bad = int((counts != want_counts).sum())
        if bad:
            print(f"rank {me} step {step}: {bad} of the counts from rank {src} are wrong", file=sys.stderr)
            wrong += bad
            continue
        want = (x[t].float() * scale(e)[:, None]).to(torch.bfloat16)
        got = rows_at(ext.ep_offset(shape, 2, q, src, 0), len(t))
        bad = int((got.view(torch.int16) != want.view(torch.int16)).sum())
        if bad:
            print(f"rank {me} step {step}: {bad} wrong values in the rows from rank {src}", file=sys.stderr)
            wrong += bad
    x, idx, w = inputs(me, step, T, H, E, K, device)
    y = (x.float()[:, None, :] * scale(idx.long())[:, :, None]).to(torch.bfloat16)  # [T, K, H]
    ref = (w[:, :, None] * y.float()).sum(dim=1).to(torch.bfloat16)
    bad = int((out[:T].view(torch.int16) != ref.view(torch.int16)).sum())
    if bad:
        print(f"rank {me} step {step}: {bad} wrong output values", file=sys.stderr)
        wrong += bad
    return wrong


def percentile(v: list[float], p: float) -> float:
    """sorted(v)[ceil(p N) - 1] in us (v in ms), as ep.cu takes it."""
    return sorted(v)[max(0, math.ceil(p * len(v)) - 1)] * 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["p2p", "ib", "shm"], default="p2p")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=64)
    # As ep.cu's --fuse-tokens: a step of at most this many tokens has its weighted sums done by
    # combine's last block, and no reduce kernel is launched.
    ap.add_argument("--fuse-tokens", type=int, default=1)
    args = ap.parse_args()
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"--tokens {args.tokens}: expected numbers separated by commas", file=sys.stderr)
        return 2
    env = m.launch_env()
    R, E, K, H = env.nranks, args.experts, args.topk, args.hidden
    if (
        E % R
        or E > 512
        or not 1 <= K <= min(16, E)
        or H < 8
        or H % 8
        or not all(1 <= t <= 128 for t in tokens)
        or args.blocks < 1
        or args.steps < 1
        or args.warmup < 0
        or not 0 <= args.fuse_tokens <= 8
    ):
        print(
            f"experts {E} must divide by ranks {R} (at most 512), topk 1..16, hidden a positive multiple "
            "of 8, tokens 1..128, blocks and steps at least 1, fuse tokens 0..8",
            file=sys.stderr,
        )
        return 2
    Tmax = max(tokens)
    torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    ext = load_inline(
        name="mscclpp_rs_ep",
        cpp_sources=DECLS,
        cuda_sources=SOURCE,
        functions=["ep_offset", "ep_launch", "ep_preload"],
        extra_cuda_cflags=m.compile_flags("nvcc") + ["-std=c++17"],
        extra_include_paths=[str(HERE)],
        extra_ldflags=m.link_flags(),
    )
    ext.ep_preload()
    shape = [R, E, K, H, Tmax]
    wrong = 0
    with m.Communicator(env.root, env.rank, env.nranks) as comm:
        me = comm.rank
        buf = torch.zeros(ext.ep_offset(shape, 0, 0, 0, 0), dtype=torch.uint8, device=device)
        for p in range(R):
            if p != me:
                comm.connect(p, buf, transport=args.transport)
        rows = torch.zeros(Tmax * K, dtype=torch.int32, device=device)
        out = torch.zeros(Tmax, H, dtype=torch.bfloat16, device=device)
        done = torch.zeros(2, dtype=torch.int32, device=device)
        ops = torch.zeros(1, dtype=torch.int64, device=device)
        step = 0
        with comm.proxy():
            conns = comm.device_connections().to_torch(device)  # in connect order: rank order
            comm.barrier()
            for T in tokens:
                times: list[tuple[torch.cuda.Event, ...]] = []
                for i in range(args.warmup + args.steps):
                    q = step & 1
                    x, idx, w = inputs(me, step, T, H, E, K, device)
                    buf[ext.ep_offset(shape, 1, 0, 0, 0) :][: T * H * 2].view(torch.bfloat16).view(T, H).copy_(x)
                    ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))

                    def launch(kernel: int) -> None:
                        ext.ep_launch(kernel, shape, me, T, q, step * args.blocks, args.blocks,
                                      args.fuse_tokens, buf, conns, idx, w, rows, out, done, ops)

                    ev[0].record()
                    launch(0)  # dispatch
                    ev[1].record()
                    launch(1)  # expert
                    ev[2].record()
                    launch(2)  # combine (and the sums, where T <= --fuse-tokens)
                    if T > args.fuse_tokens:
                        launch(3)  # reduce
                    ev[3].record()
                    if i >= args.warmup:
                        times.append(ev)
                    if i < 2 or i == args.warmup + args.steps - 1:
                        torch.cuda.synchronize()
                        wrong += check(ext, shape, buf, out, me, step, q, T, device)
                    step += 1
                torch.cuda.synchronize()
                d = [a.elapsed_time(b) for a, b, _, _ in times]
                c = [b.elapsed_time(e) for _, _, b, e in times]
                if me == 0:
                    print(
                        f"RESULT ep impl=mscclpp-torch ranks={R} tokens={T} hidden={H} experts={E} topk={K} "
                        f"steps={args.steps} dispatch_med_us={percentile(d, 0.5):.2f} "
                        f"dispatch_p99_us={percentile(d, 0.99):.2f} combine_med_us={percentile(c, 0.5):.2f} "
                        f"combine_p99_us={percentile(c, 0.99):.2f} wrong={wrong}",
                        flush=True,
                    )
            comm.barrier()  # every rank's rows have arrived before any proxy stops
        print(f"rank {me}: operations issued to peers {int(ops.item())}; {'FAILED' if wrong else 'PASSED'} ({wrong} wrong values)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
