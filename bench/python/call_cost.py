"""What an interruptible call costs (mscclpp_rs.set_interruptible): a host-memory ping-pong
between 2 ranks, 8 bytes put_with_signal + wait per half round trip, with the blocking calls
made through the worker thread (interruptible, the default) and directly, alternated.

    PYTHONPATH=... scripts/run-local-ranks.sh 2 python3 bench/python/call_cost.py [shm|ib] [ROUNDS]

Rank 0 prints one line per setting: the median over 5 batches of us per round trip.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import mscclpp_rs as m


def main() -> None:
    transport = sys.argv[1] if len(sys.argv) > 1 else "shm"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    with m.Communicator.from_env() as comm:
        me = comm.rank
        buf = np.zeros(64, dtype=np.uint8)
        conn = comm.connect(1 - me, buf, transport=transport)
        with comm.proxy():
            times: dict[bool, list[float]] = {True: [], False: []}
            for batch in range(11):
                on = batch % 2 == 1  # batch 0 warms up, then off/on alternate
                m.set_interruptible(on)
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(rounds):
                    if me == 0:
                        conn.put_with_signal(8, 8, src_offset=0)
                        conn.wait()
                    else:
                        conn.wait()
                        conn.put_with_signal(8, 8, src_offset=0)
                us = (time.perf_counter() - t0) / rounds * 1e6
                if batch:
                    times[on].append(us)
            for c in (conn,):
                c.flush()
            comm.barrier()
    if me == 0:
        for on in (False, True):
            print(
                f"RESULT {transport} interruptible={on}: {statistics.median(times[on]):.1f} us per round trip "
                f"(batches: {', '.join(f'{x:.1f}' for x in times[on])})"
            )


if __name__ == "__main__":
    main()
