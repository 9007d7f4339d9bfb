"""All-gather of a CuPy array by a CUDA kernel that includes mscclpp.h (allgather_kernel.cuh),
compiled at run time by cupy.RawModule and handed the device connections. Every byte is
checked; a wrong byte makes the program exit 1.

    scripts/run-local-ranks.sh 2 python3 python/examples/allgather_cupy.py
    mpirun -np 2 python3 python/examples/allgather_cupy.py -a HOST:PORT
    ... --compiler nvcc        CuPy's nvcc backend instead of NVRTC
    ... --transport ib|shm     GPU memory over libfabric (staged) instead of CUDA IPC (P2P)

Rank r uses GPU (local rank % GPUs); ranks that share a GPU need an MPS daemon to run their
kernels at once (the kernel of one waits for the other's put).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

import mscclpp_rs as m

KERNEL = Path(__file__).resolve().parent / "allgather_kernel.cuh"


def pattern(rank: int, nbytes: int, round_: int) -> cp.ndarray:
    i = cp.arange(nbytes, dtype=cp.int64)
    return ((rank * 37 + round_ * 11 + i % 251 + (i >> 12)) % 256).astype(cp.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-a", "--root", help="rank 0's ip:port (default: MSCCLPP_ROOT or MASTER_ADDR/PORT)")
    ap.add_argument("--transport", choices=["p2p", "ib", "shm"], default="p2p")
    ap.add_argument("--compiler", choices=["nvrtc", "nvcc"], default="nvrtc")
    ap.add_argument("--sizes", default="4,4084,4194304", help="bytes per rank, comma-separated (multiples of 4)")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()

    env = m.launch_env(args.root)
    cp.cuda.Device(env.local_rank % cp.cuda.runtime.getDeviceCount()).use()
    sizes = [int(s) for s in args.sizes.split(",")]
    kernel = cp.RawModule(
        code=KERNEL.read_text(), options=tuple(m.compile_flags(args.compiler)), backend=args.compiler
    ).get_function("mscclppAllGather")

    with m.Communicator(env.root, env.rank, env.nranks) as comm:
        n, me = comm.size, comm.rank
        buf = cp.zeros(n * max(sizes), dtype=cp.uint8)
        peers = [p for p in range(n) if p != me]
        for p in peers:
            comm.connect(p, buf, transport=args.transport)
        wrong = 0
        with comm.proxy():
            conns = comm.device_connections().to_cupy()  # the mscclppDevConn_t array, on the GPU
            for size in sizes:
                elapsed = 0.0
                for it in range(args.iters):
                    buf.fill(0xEE)  # poison: a byte that did not arrive is seen
                    buf[me * size : (me + 1) * size] = pattern(me, size, it)
                    cp.cuda.get_current_stream().synchronize()
                    comm.barrier()  # nobody puts before every rank has poisoned its buffer
                    t0 = time.perf_counter()
                    kernel((1,), (32 * len(peers),), (conns, np.int32(len(peers)), np.int32(me), np.uint64(size)))
                    cp.cuda.get_current_stream().synchronize()
                    elapsed += time.perf_counter() - t0
                    for r in range(n):
                        bad = int(cp.count_nonzero(buf[r * size : (r + 1) * size] != pattern(r, size, it)))
                        if bad:
                            print(
                                f"rank {me}: {size} bytes, iteration {it}: {bad} wrong bytes in rank {r}'s slice",
                                file=sys.stderr,
                            )
                        wrong += bad
                    comm.barrier()  # nobody overwrites a peer's buffer before it has checked
                if me == 0:
                    print(
                        f"cupy ({args.compiler}) all-gather of {size} bytes per rank, {n} ranks over "
                        f"{args.transport}: {elapsed / args.iters * 1e6:.1f} us"
                    )
        print(f"rank {me}: {'FAILED' if wrong else 'PASSED'} ({wrong} wrong bytes)")
        return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
