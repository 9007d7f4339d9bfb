"""The expert-parallel table of one GPU check run: RESULT ep lines (examples/ep/ep.cu,
bench/gpu/nvshmem_ep.cu and bench/gpu/pplx/pplx_a2a_bench.py) to markdown, per rank count and
token count, with ours (direct path) over each peer (NVSHMEM, pplx-kernels) where both ran; a run with wrong values shows them instead of times.
With --plot PNG (needs matplotlib) also the medians against the token count.

    python3 bench/gpu/ep_table.py OUT/ep.txt [--plot ep.png]
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict


def main() -> int:
    # (ranks, GPUs, tokens) -> impl -> the line's fields; GPUs 1 where a line has no gpus= (ranks
    # sharing one GPU under MPS).
    rows: dict[tuple[int, int, int], dict[str, dict[str, str]]] = defaultdict(dict)
    for line in open(sys.argv[1]):
        m = re.match(r"RESULT ep (.*)", line.strip())
        if not m:
            continue
        kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
        rows[(int(kv["ranks"]), int(kv.get("gpus", "1")), int(kv["tokens"]))][kv["impl"]] = kv
    if not rows:
        print("no RESULT ep lines")
        return 1
    impls = sorted({i for r in rows.values() for i in r}, key=lambda i: (i != "mscclpp-direct", i))
    print("dispatch / combine, median (p99) us per step; ranks on one GPU share it under MPS")
    peers = [p for p in ("nvshmem", "pplx") if p in impls]
    print("| ranks | GPUs | tokens | " + " | ".join(impls) + "".join(f" | ours direct / {p}" for p in peers) + " |")
    print("|---" * (3 + len(impls) + len(peers)) + "|")
    for (ranks, gpus, tokens), by in sorted(rows.items()):
        cells = []
        for i in impls:
            kv = by.get(i)
            if kv is None:
                cells.append("-")
            elif kv.get("wrong", "0") != "0":
                cells.append(f"FAILED ({kv['wrong']} wrong values)")
            else:
                cells.append(
                    f"{kv['dispatch_med_us']} ({kv['dispatch_p99_us']}) / {kv['combine_med_us']} ({kv['combine_p99_us']})"
                )
        ours, ratios = by.get("mscclpp-direct"), []
        for p in peers:
            peer = by.get(p)
            ok = ours and peer and ours.get("wrong", "0") == "0" and peer.get("wrong", "0") == "0"
            if ok:
                d = float(ours["dispatch_med_us"]) / float(peer["dispatch_med_us"])
                c = float(ours["combine_med_us"]) / float(peer["combine_med_us"])
                ratios.append(f"{d:.2f} / {c:.2f}")
            else:
                ratios.append("-")
        print(f"| {ranks} | {gpus} | {tokens} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios) + " |")
    if "--plot" in sys.argv:
        plot(rows, sys.argv[sys.argv.index("--plot") + 1])
    return 0


def plot(rows: dict[tuple[int, int, int], dict[str, dict[str, str]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r, g) for r, g, _ in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (r, g) in zip(axes[0], panels):
        impls = sorted({i for (rr, gg, _), by in rows.items() if (rr, gg) == (r, g) for i in by})
        for impl in impls:
            pts = [
                (t, by[impl])
                for (rr, gg, t), by in sorted(rows.items())
                if (rr, gg) == (r, g) and impl in by and by[impl].get("wrong", "0") == "0"
            ]
            if not pts:
                continue
            xs = [t for t, _ in pts]
            ax.plot(xs, [float(kv["dispatch_med_us"]) for _, kv in pts], "o-", label=f"{impl} dispatch")
            ax.plot(xs, [float(kv["combine_med_us"]) for _, kv in pts], "s--", label=f"{impl} combine")
        ax.set_xscale("log", base=2)
        # Both axes logarithmic: the peers' and paths' times differ by over 50x (the dense
        # torch all-to-all, the network path), which a linear axis squeezes ours flat against.
        ax.set_yscale("log")
        ticks = sorted({t for rr, gg, t in rows if (rr, gg) == (r, g)})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("median us per step")
        ax.set_title(f"{r} ranks on one GPU (MPS)" if g == 1 else f"{r} ranks on {g} GPUs")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
