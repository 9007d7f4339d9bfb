"""NCCL through PyTorch, in the conventions of our allgather_perf / alltoall_perf / sendrecv_perf
(c_examples/perf/perf.c): the same options, sizes, timing and output rows, so the two can be run
alternately and plotted together (bench/perf-peers.sh, bench/plot_perf.py).

    torchrun --standalone --nproc_per_node=2 bench/gpu/nccl_perf.py allgather -b 8 -e 64M -f 4

One rank per GPU (NCCL refuses two ranks on one GPU). Per size: -w warm-up operations, then -n
timed ones launched back to back between two CUDA events; time is the mean over ranks of each
rank's mean per operation, algbw = size / time, busbw as nccl-tests' PERFORMANCE.md (all-gather
and all-to-all * (n-1)/n, sendrecv * 1). Every received byte is checked (#wrong). Type uint8,
out-of-place only.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist


def size_arg(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def pattern(owner, to, n, size, dev):
    i = torch.arange(n, device=dev, dtype=torch.int64)
    return ((owner * 29 + to * 7 + i % 251 + (i >> 12) + size % 13) % 256).to(torch.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["allgather", "alltoall", "sendrecv"])
    ap.add_argument("-b", type=size_arg, default=32 << 20)
    ap.add_argument("-e", type=size_arg, default=32 << 20)
    ap.add_argument("-f", type=float, default=2)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-w", type=int, default=5)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    if rank == 0:
        print(f"# {a.op} (NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} through PyTorch "
              f"{torch.__version__}, GPU memory)")
        print(f"# nThread 1 nGpus 1 minBytes {a.b} maxBytes {a.e} step: {a.f:g}(factor) "
              f"warmup iters: {a.w} iters: {a.n} agg iters: 1 validation: 1 graph: 0\n#")
    names = [None] * world
    dist.all_gather_object(names, f"{socket.gethostname()} device {local} "
                                  f"{torch.cuda.get_device_name(dev)}")
    if rank == 0:
        print("# Using devices")
        for r, n in enumerate(names):
            print(f"#  Rank {r:2d} Group  0 on {n}")
        print("#\n#                                                   out-of-place")
        print("#       size         count      type   redop    root     time   algbw   busbw #wrong")
        print("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    size, wrong_total, bus_sum, rows = a.b, 0, 0.0, 0
    while size <= a.e:
        s = size if a.op == "sendrecv" else size // world * world
        if s == 0:
            size = int(size * a.f)
            continue
        n = s if a.op == "sendrecv" else s // world
        if a.op == "allgather":
            inp = pattern(rank, 0, n, s, dev)
            out = torch.empty(s, dtype=torch.uint8, device=dev)
            expect = torch.cat([pattern(r, 0, n, s, dev) for r in range(world)])
            op = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
        elif a.op == "alltoall":
            inp = torch.cat([pattern(rank, r, n, s, dev) for r in range(world)])
            out = torch.empty(s, dtype=torch.uint8, device=dev)
            expect = torch.cat([pattern(r, rank, n, s, dev) for r in range(world)])
            op = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
        else:
            inp = pattern(rank, nxt, n, s, dev)
            out = torch.empty(n, dtype=torch.uint8, device=dev)
            expect = pattern(prv, rank, n, s, dev)

            def op():
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt),
                                                 dist.P2POp(dist.irecv, out, prv)]):
                    w.wait()
        for _ in range(a.w):
            op()
        torch.cuda.synchronize()
        dist.barrier()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(a.n):
            op()
        t1.record()
        t1.synchronize()
        us = torch.tensor([t0.elapsed_time(t1) * 1e3 / a.n], device=dev)
        wrong = torch.tensor([int((out != expect).sum())], device=dev, dtype=torch.int64)
        dist.all_reduce(us)
        dist.all_reduce(wrong)
        us = us.item() / world
        wrong = int(wrong.item())
        algbw = s / us / 1e3
        busbw = algbw * (1 if a.op == "sendrecv" else (world - 1) / world)
        wrong_total += wrong
        bus_sum += busbw
        rows += 1
        if rank == 0:
            print(f"{s:12d}  {s:12d}  {'uint8':>8s}  {'none':>6s}  {-1:6d}  {us:7.2f}  "
                  f"{algbw:6.2f}  {busbw:6.2f}  {wrong:6d}", flush=True)
        size = int(size * a.f)
    if rank == 0:
        print(f"# Out of bounds values : {wrong_total} {'FAILED' if wrong_total else 'OK'}")
        print(f"# Avg bus bandwidth    : {bus_sum / max(rows, 1):g} \n#")
    dist.destroy_process_group()
    raise SystemExit(1 if wrong_total else 0)


if __name__ == "__main__":
    main()
