"""Medians of bench/perf-peers.sh results files as Markdown tables: per size, each
implementation's median time per operation in us (its range over the rounds), and ours over each
peer's median (below 1: ours is faster). Wrong bytes in any row are counted under the table.

    python3 bench/gpu/peers_table.py RESULTS.txt [RESULTS.txt ...]

Rows are nccl-tests' (size count type redop root time algbw busbw #wrong ...; the out-of-place
columns), each run's after a line `## run IMPL ROUND MACHINE TRANSPORT OP`.
"""

import statistics
import sys
from collections import defaultdict


def read(path):
    """(title, {impl: {size: [time_us...]}}, wrong rows, impls in the order first seen)."""
    runs = defaultdict(lambda: defaultdict(list))
    title, impl, order, wrong = None, None, [], 0
    for line in open(path, encoding="utf-8"):
        f = line.split()
        if line.startswith("## run "):
            impl, title = f[2], " ".join(f[4:])
            if impl not in order:
                order.append(impl)
            continue
        if impl is None or len(f) < 9 or not f[0].isdigit():
            continue
        runs[impl][int(f[0])].append(float(f[5]))
        wrong += any(w not in ("0", "N/A") for w in f[8::4])
    return title, runs, wrong, order


def size_name(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        title, runs, wrong, order = read(path)
        if not runs:
            print(f"{path}: no rows\n")
            continue
        peers = [i for i in order if i != "ours"]
        head = ["size"] + order + [f"ours/{p}" for p in peers if "ours" in runs]
        print(f"{title} ({path}), time per operation in us, median (min-max) of the rounds\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for size in sorted({s for by in runs.values() for s in by}):
            med, cells = {}, [size_name(size)]
            for impl in order:
                v = runs[impl].get(size)
                if not v:
                    cells.append("")
                    continue
                med[impl] = statistics.median(v)
                cells.append(f"{med[impl]:.2f} ({min(v):.2f}-{max(v):.2f})" if len(v) > 1
                             else f"{med[impl]:.2f}")
            if "ours" in runs:
                cells += [f"{med['ours'] / med[p]:.2f}" if "ours" in med and p in med else ""
                          for p in peers]
            print("| " + " | ".join(cells) + " |")
        print(f"\nrows with wrong bytes: {wrong}\n")


if __name__ == "__main__":
    main()
