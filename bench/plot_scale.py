"""Plots bench/scale.sh tables: seconds against ranks, one line per phase and transport.

    /usr/bin/python3 bench/plot_scale.py OUT.png TABLE.md [TABLE.md ...]

Reads the Markdown rows bench/scale.sh prints (failed rows and repeated counts are kept: a
failure is marked on the axis, repeats are drawn as separate points with their median on the
line). Run it through bench/plot.sh, which installs matplotlib (Debian's python3-matplotlib).
"""

import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

# Column of each phase in scale.sh's table (0-based, after the leading "|").
PHASES = {"setup": 3, "first round (median)": 5, "warm round (slowest)": 6, "teardown": 7}


def seconds(cell, pick):
    """'1.25 s' -> 1.25; 'a / b s' -> a (pick 0) or b (pick 1)."""
    nums = re.findall(r"[0-9.]+", cell)
    return float(nums[min(pick, len(nums) - 1)]) if nums else None


def read(paths):
    """{(transport, phase): {ranks: [seconds...]}}, and the failed (transport, ranks)."""
    data = defaultdict(lambda: defaultdict(list))
    failed = []
    for path in paths:
        for line in open(path, encoding="utf-8"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 9 or not cells[0].isdigit():
                continue
            ranks, transport = int(cells[0]), cells[1]
            if cells[2].startswith("FAILED"):
                failed.append((transport, ranks))
                continue
            for phase, col in PHASES.items():
                v = seconds(cells[col], 1 if "slowest" in phase else 0)
                if v is not None:
                    data[(transport, phase)][ranks].append(v)
    return data, failed


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, paths = sys.argv[1], sys.argv[2:]
    data, failed = read(paths)
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"ib": "-", "shm": "--"}
    for (transport, phase), by_ranks in sorted(data.items()):
        xs = sorted(by_ranks)
        med = [statistics.median(by_ranks[x]) for x in xs]
        label = f"{phase}, {'IB (tcp)' if transport == 'ib' else 'SHM'}"
        (line,) = ax.plot(xs, med, styles.get(transport, ":"), marker="o", label=label)
        for x in xs:
            if len(by_ranks[x]) > 1:
                ax.scatter([x] * len(by_ranks[x]), by_ranks[x], s=8, color=line.get_color())
    for transport, ranks in failed:
        ax.annotate(f"{transport} failed", (ranks, 0), rotation=90, fontsize=7)
    ax.set_xlabel("ranks on one host (2 cores)")
    ax.set_ylabel("seconds (rank 0; rounds over all ranks)")
    ax.set_title("Communicator phases against the number of ranks (bench/scale.sh)")
    # Linear: a phase that grows linearly with the ranks is a straight line.
    ticks = sorted({x for by_ranks in data.values() for x in by_ranks})
    ax.set_xticks(ticks)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
