"""NCCL all-gather through PyTorch, timed the way c_examples/cuda/allgather.cu times ours.

Launched by scripts/gpu-check.sh with torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Per total size: each rank contributes total / world bytes; 10 all-gathers are
captured in a CUDA graph and the graph is replayed 10 times between two CUDA events (eager
launches over 100 iterations if capture fails). Prints `RESULT nccl bytes=N us=T method=M`
(the slowest rank's time per all-gather) on rank 0, and checks every byte.
"""

import os
import sys

import torch
import torch.distributed as dist

SIZES = [1 << 20, 64 << 20, 1 << 30]
PER_GRAPH, LAUNCHES = 10, 10


def timed_graph(out, inp):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream, as PyTorch recommends
        for _ in range(3):
            dist.all_gather_into_tensor(out, inp)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(PER_GRAPH):
            dist.all_gather_into_tensor(out, inp)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(LAUNCHES):
        g.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (PER_GRAPH * LAUNCHES)


def timed_eager(out, inp):
    for _ in range(5):
        dist.all_gather_into_tensor(out, inp)
    torch.cuda.synchronize()
    dist.barrier()
    n = PER_GRAPH * LAUNCHES
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(n):
        dist.all_gather_into_tensor(out, inp)
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3 / n


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    failures = 0
    for total in SIZES:
        per = total // world
        # A byte pattern that depends on the owner and the position.
        inp = ((torch.arange(per, device=dev, dtype=torch.int64) * 7 + rank * 31) % 251).to(
            torch.uint8
        )
        out = torch.zeros(total, dtype=torch.uint8, device=dev)
        method = "graph"
        try:
            us = timed_graph(out, inp)
        except Exception as e:  # capture unsupported here: fall back, and say so
            if rank == 0:
                print(f"graph capture failed ({e}); timing eager launches", flush=True)
            torch.cuda.synchronize()
            method = "eager"
            us = timed_eager(out, inp)
        expect = torch.cat(
            [
                ((torch.arange(per, device=dev, dtype=torch.int64) * 7 + r * 31) % 251).to(
                    torch.uint8
                )
                for r in range(world)
            ]
        )
        bad = torch.tensor([int((out != expect).sum().item())], device=dev)
        t = torch.tensor([us], device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(bad, op=dist.ReduceOp.SUM)
        if bad.item():
            failures += 1
        if rank == 0:
            print(
                f"RESULT nccl bytes={total} us={t.item():.2f} method={method} "
                f"check={'FAIL' if bad.item() else 'ok'}",
                flush=True,
            )
        del inp, out, expect
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
