"""Plots bench/perf-peers.sh results files: bus bandwidth and time against size, ours against
each peer measured in the same run (median of the rounds on the line, every round as a dot).

    /usr/bin/python3 bench/plot_perf.py OUT.png RESULTS.txt [RESULTS.txt ...]

Each MACHINE TRANSPORT OP found becomes one row of two panels (one file may hold several).
Rows are nccl-tests' (size count type redop root time algbw busbw #wrong ...; the out-of-place
columns are used), each run's after a line `## run IMPL ROUND MACHINE TRANSPORT OP`. Run it through bench/plot.sh, which installs
matplotlib (Debian's python3-matplotlib).
"""

import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

NAMES = {"ours": "libmscclpp", "raw": "raw libfabric", "nccl": "NCCL", "nvshmem": "NVSHMEM",
         "nvshmem-sig": "NVSHMEM, put-with-signal kernel"}


def read(paths):
    """{title: {impl: {size: [(time_us, busbw)...]}}}, titles in the order first seen."""
    data = {}
    for path in paths:
        impl, title = None, None
        for line in open(path, encoding="utf-8"):
            if line.startswith("## run "):
                f = line.split()
                impl, title = f[2], " ".join(f[4:])
                data.setdefault(title, defaultdict(lambda: defaultdict(list)))
                continue
            f = line.split()
            if impl is None or len(f) < 8 or not f[0].isdigit():
                continue
            data[title][impl][int(f[0])].append((float(f[5]), float(f[7])))
    return data


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, paths = sys.argv[1], sys.argv[2:]
    data = read(paths)
    if not data:
        sys.exit(f"no '## run' sections in {paths}")
    fig, axes = plt.subplots(len(data), 2, figsize=(12, 4.5 * len(data)), squeeze=False)
    for row, (title, by_impl) in enumerate(data.items()):
        for impl, by_size in sorted(by_impl.items()):
            xs = sorted(by_size)
            for col, k in ((0, 1), (1, 0)):
                ax = axes[row][col]
                med = [statistics.median(v[k] for v in by_size[x]) for x in xs]
                (line,) = ax.plot(xs, med, marker="o", label=NAMES.get(impl, impl))
                for x in xs:
                    ax.scatter([x] * len(by_size[x]), [v[k] for v in by_size[x]], s=8,
                               color=line.get_color(), alpha=0.35)
        for col, what in ((0, "bus bandwidth (GB/s)"), (1, "time per operation (us)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if col == 1:
                ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(what)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
