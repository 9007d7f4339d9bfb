"""All-gather of a NumPy array in host memory, driven from Python: every rank puts its slice
to every peer with a signal (one-sided, over libfabric), flushes, and waits for the peers'
signals. Every byte is checked; a wrong byte makes the program exit 1. No GPU needed.

    scripts/run-local-ranks.sh 4 python3 python/examples/allgather_numpy.py            # tcp
    scripts/run-local-ranks.sh 4 python3 python/examples/allgather_numpy.py --transport shm

Ranks also come from torchrun, mpirun or srun (mscclpp_rs.launch_env); rank 0 prints the
time per all-gather.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import mscclpp_rs as m


def pattern(rank: int, nbytes: int, round_: int) -> np.ndarray:
    i = np.arange(nbytes, dtype=np.int64)
    return ((rank * 37 + round_ * 11 + i % 251) % 256).astype(np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["ib", "shm"], default="ib")
    ap.add_argument("--bytes", type=int, default=1 << 20, help="bytes per rank (default 1 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    with m.Communicator.from_env() as comm:
        n, me, size = comm.size, comm.rank, args.bytes
        buf = np.zeros(n * size, dtype=np.uint8)
        conns = [comm.connect(p, buf, transport=args.transport) for p in range(n) if p != me]
        wrong = 0
        with comm.proxy():
            elapsed = 0.0
            for it in range(args.iters):
                buf[:] = 0xEE  # poison: a byte that did not arrive is seen
                buf[me * size : (me + 1) * size] = pattern(me, size, it)
                comm.barrier()  # nobody puts before every rank has poisoned its buffer
                t0 = time.perf_counter()
                for c in conns:
                    c.put_with_signal(me * size, size)
                for c in conns:
                    c.flush()
                for c in conns:
                    c.wait()
                elapsed += time.perf_counter() - t0
                for r in range(n):
                    bad = int(np.count_nonzero(buf[r * size : (r + 1) * size] != pattern(r, size, it)))
                    if bad:
                        print(f"rank {me}: iteration {it}: {bad} wrong bytes in rank {r}'s slice", file=sys.stderr)
                    wrong += bad
                comm.barrier()  # nobody overwrites a peer's buffer before it has checked
        if me == 0:
            print(
                f"all-gather of {size} bytes per rank, {n} ranks over {args.transport}: "
                f"{elapsed / args.iters * 1e6:.1f} us per all-gather, {wrong} wrong bytes on rank 0"
            )
        return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
