"""The expert-parallel table of one GPU check run: RESULT ep lines (examples/ep/ep.cu and
bench/gpu/nvshmem_ep.cu) to markdown, per rank count and token count, with ours (direct path)
over the NVSHMEM peer where both ran.

    python3 bench/gpu/ep_table.py OUT/ep.txt
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict


def main() -> int:
    rows: dict[tuple[int, int], dict[str, dict[str, str]]] = defaultdict(dict)
    for line in open(sys.argv[1]):
        m = re.match(r"RESULT ep (.*)", line.strip())
        if not m:
            continue
        kv = dict(x.split("=", 1) for x in m.group(1).split() if "=" in x)
        rows[(int(kv["ranks"]), int(kv["tokens"]))][kv["impl"]] = kv
    if not rows:
        print("no RESULT ep lines")
        return 1
    impls = sorted({i for r in rows.values() for i in r}, key=lambda i: (i != "mscclpp-direct", i))
    print("dispatch / combine, median (p99) us per step, one GPU under MPS")
    print("| ranks | tokens | " + " | ".join(impls) + " | ours direct / nvshmem |")
    print("|---" * (3 + len(impls)) + "|")
    for (ranks, tokens), by in sorted(rows.items()):
        cells = []
        for i in impls:
            kv = by.get(i)
            cells.append(
                "-"
                if kv is None
                else f"{kv['dispatch_med_us']} ({kv['dispatch_p99_us']}) / {kv['combine_med_us']} ({kv['combine_p99_us']})"
            )
        ours, peer = by.get("mscclpp-direct"), by.get("nvshmem")
        ratio = "-"
        if ours and peer:
            d = float(ours["dispatch_med_us"]) / float(peer["dispatch_med_us"])
            c = float(ours["combine_med_us"]) / float(peer["combine_med_us"])
            ratio = f"{d:.2f} / {c:.2f}"
        print(f"| {ranks} | {tokens} | " + " | ".join(cells) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
