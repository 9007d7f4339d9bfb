"""All-gather of a PyTorch tensor under torchrun, by a CUDA kernel that includes mscclpp.h
(allgather_kernel.cuh) built with torch.utils.cpp_extension.load_inline and launched on
PyTorch's current stream. Every byte is checked; a wrong byte makes the program exit 1.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        python/examples/allgather_torch.py

The bootstrap root is MASTER_ADDR:(MASTER_PORT + 1) (torchrun's store has MASTER_PORT). Rank
r uses GPU (LOCAL_RANK % GPUs); ranks that share a GPU need an MPS daemon. --transport ib|shm
moves GPU memory over libfabric instead of CUDA IPC.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import mscclpp_rs as m

KERNEL = Path(__file__).resolve().parent / "allgather_kernel.cuh"

LAUNCHER = r"""
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

void launch_allgather(torch::Tensor conns, int64_t npeers, int64_t rank, int64_t slice_bytes)
{
  TORCH_CHECK(conns.is_cuda() && conns.numel() >= npeers * 80, "conns: the device connections on the GPU");
  mscclppAllGather<<<1, 32 * npeers, 0, c10::cuda::getCurrentCUDAStream().stream()>>>(
      reinterpret_cast<const mscclppDevConn_t*>(conns.data_ptr()), (int)npeers, (int)rank,
      (uint64_t)slice_bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def pattern(rank: int, nbytes: int, round_: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(nbytes, dtype=torch.int64, device=device)
    return ((rank * 37 + round_ * 11 + i % 251 + (i >> 12)) % 256).to(torch.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["p2p", "ib", "shm"], default="p2p")
    ap.add_argument("--sizes", default="4,4084,4194304", help="bytes per rank, comma-separated (multiples of 4)")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()

    env = m.launch_env()  # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from torchrun
    torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    ext = load_inline(
        name="mscclpp_rs_allgather",
        cpp_sources="void launch_allgather(torch::Tensor conns, int64_t npeers, int64_t rank, int64_t slice_bytes);",
        cuda_sources=KERNEL.read_text() + LAUNCHER,
        functions=["launch_allgather"],
        extra_cuda_cflags=m.compile_flags("nvcc"),
        extra_ldflags=m.link_flags(),
    )
    sizes = [int(s) for s in args.sizes.split(",")]

    with m.Communicator(env.root, env.rank, env.nranks) as comm:
        n, me = comm.size, comm.rank
        buf = torch.zeros(n * max(sizes), dtype=torch.uint8, device=device)
        peers = [p for p in range(n) if p != me]
        for p in peers:
            comm.connect(p, buf, transport=args.transport)
        wrong = 0
        with comm.proxy():
            conns = comm.device_connections().to_torch(device)
            for size in sizes:
                elapsed = 0.0
                for it in range(args.iters):
                    buf.fill_(0xEE)  # poison: a byte that did not arrive is seen
                    buf[me * size : (me + 1) * size] = pattern(me, size, it, device)
                    torch.cuda.synchronize()
                    comm.barrier()  # nobody puts before every rank has poisoned its buffer
                    t0 = time.perf_counter()
                    ext.launch_allgather(conns, len(peers), me, size)
                    torch.cuda.synchronize()
                    elapsed += time.perf_counter() - t0
                    for r in range(n):
                        bad = int((buf[r * size : (r + 1) * size] != pattern(r, size, it, device)).sum())
                        if bad:
                            print(
                                f"rank {me}: {size} bytes, iteration {it}: {bad} wrong bytes in rank {r}'s slice",
                                file=sys.stderr,
                            )
                        wrong += bad
                    comm.barrier()  # nobody overwrites a peer's buffer before it has checked
                if me == 0:
                    print(
                        f"torch all-gather of {size} bytes per rank, {n} ranks over {args.transport}: "
                        f"{elapsed / args.iters * 1e6:.1f} us"
                    )
        print(f"rank {me}: {'FAILED' if wrong else 'PASSED'} ({wrong} wrong bytes)")
        return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
