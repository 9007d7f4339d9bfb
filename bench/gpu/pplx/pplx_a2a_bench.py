#!/usr/bin/env python3
"""pplx-kernels intranode MoE dispatch + combine: several ranks on one GPU (CUDA MPS), or one per GPU.

Shape: max 128 tokens per rank, hidden 7168 BF16 (no scales), 256 experts, top-8, dp_size 1.
Per token count (default 1 8 32 128): a correctness check, then --steps timed steps per mode
(eager: the Python ops; graph: one CUDA graph per op, replayed), CUDA events around each op.
Prints per rank median and p99 of dispatch, combine, their sum (step) and the idle gap between
steps (a gap well above ~2 us means the host, not the GPU, set the pace); rank 0 also writes
JSON to --json. Where each rank has a GPU of its own, also pplx's torch all-to-all baseline
(one NCCL all_to_all_single of every (rank, local expert) slot at the token count).

No NVSHMEM is initialized: pplx's intranode path (csrc/all_to_all/intranode.cpp) shares buffers
with cudaIpcGetMemHandle/cudaIpcOpenMemHandle over a torch.distributed group (gloo here; NCCL
refuses two ranks on one GPU). pplx_kernels/__init__.py imports nvshmem.core (nvshmem4py), which
is not installed: placeholder modules stand in for it.

Run: CUDA_VISIBLE_DEVICES=0 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/R)) PPLX_NUM_SMS=$((64/R))
python3 pplx_a2a_bench.py --ranks R --src DIR (all on one GPU), or without those three, one rank
per GPU
with an MPS daemon up. --dry-run stops before any CUDA call (checks the Python plumbing).
"""

import argparse
import faulthandler
import json
import math
import os
import socket
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 7168, 256, 8, 128


def log(rank, msg):
    print(f"[rank {rank}] {msg}", flush=True)


def load_pplx(src):
    try:
        import nvshmem.core  # noqa: F401  (nvshmem4py, if present)
    except ImportError:
        pkg, core = types.ModuleType("nvshmem"), types.ModuleType("nvshmem.core")
        pkg.core = core
        sys.modules["nvshmem"], sys.modules["nvshmem.core"] = pkg, core
    sys.path.insert(0, os.path.join(os.path.abspath(src), "src"))
    from pplx_kernels import ops
    from pplx_kernels.all_to_all import AllToAll

    if not hasattr(ops._ops, "all_to_all_intranode_create"):
        raise RuntimeError("libpplx_kernels.so did not load (see the error logged above)")
    return AllToAll, ops._lib_path


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(xs):
    return {"median": pct(xs, 0.5), "p99": pct(xs, 0.99), "min": min(xs), "max": max(xs), "n": len(xs)}


def timed(run_d, run_c, steps, skip):
    """Back-to-back steps, no host sync inside; events around each op. Drops the first `skip`."""
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(steps + skip)]
    torch.cuda.synchronize()
    dist.barrier()
    for e0, e1, e2 in evs:
        e0.record()
        run_d()
        e1.record()
        run_c()
        e2.record()
    torch.cuda.synchronize()
    evs = evs[skip:]
    d = [a.elapsed_time(b) * 1e3 for a, b, _ in evs]
    c = [b.elapsed_time(e) * 1e3 for _, b, e in evs]
    s = [a.elapsed_time(e) * 1e3 for a, _, e in evs]
    g = [evs[i][2].elapsed_time(evs[i + 1][0]) * 1e3 for i in range(len(evs) - 1)]
    return {"dispatch_us": summary(d), "combine_us": summary(c), "step_us": summary(s), "gap_us": summary(g)}


def worker(rank, args):
    world = args.ranks
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a deadlocked kernel ends the rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    # pplx resolves its group by name (bindings/all_to_all_ops.cpp:95); its tests register "default"
    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    AllToAll, lib = load_pplx(args.src)
    log(rank, f"loaded {lib}")
    if args.dry_run:
        names = [None] * world
        dist.all_gather_object(names, socket.gethostname())
        log(rank, f"dry run: gloo group of {world} up ({names}), pplx ops registered; no CUDA call made")
        dist.destroy_process_group()
        return

    # Rank r on GPU r % (the GPUs it sees): all on one with CUDA_VISIBLE_DEVICES naming one (the
    # ranks share it under MPS), one each where there are as many (pplx's tests: local rank).
    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    props = torch.cuda.get_device_properties(gpu)
    sms = props.multi_processor_count
    all_sms = [None] * world
    dist.all_gather_object(all_sms, (gpu, sms))
    per_gpu, ranks_on = {}, {}
    for g, n in all_sms:
        per_gpu[g] = per_gpu.get(g, 0) + n
        ranks_on[g] = ranks_on.get(g, 0) + 1
    gpus = len(per_gpu)
    # Only GPUs with several ranks can hold grids that wait for each other (a rank alone on its
    # GPU sees them all, whatever their number).
    shared = [per_gpu[g] for g in per_gpu if ranks_on[g] > 1]
    mps_pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    log(rank, f"{props.name} (GPU {gpu}): {sms} SMs visible to this rank (MPS active thread % {mps_pct})")
    # pplx sizes every cooperative grid from the SM count (core/cuda_utils.h get_sm_count). The
    # combine kernel (1024 threads, 56 registers) fits one block per SM, so the combine grids of
    # the ranks on one GPU only run at once if their sizes add up to at most its SMs; otherwise
    # each rank's combine spins on data from a rank whose grid cannot start: a deadlock.
    if shared and max(shared) > args.total_sms and not os.environ.get("PPLX_NUM_SMS"):
        with open(lib, "rb") as f:
            patched = b"PPLX_NUM_SMS" in f.read()
        if not (args.sm_fallback and patched):
            raise SystemExit(
                f"ranks see {all_sms} (GPU, SMs) (sum on one GPU > {args.total_sms}): their combine grids cannot run at once "
                "and would deadlock; set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/ranks, or build with "
                "PPLX_SM_PATCH=1 and pass --sm-fallback")
        os.environ["PPLX_NUM_SMS"] = str(args.total_sms // -(-world // gpus))
        log(rank, f"MPS cap not seen in the SM count: grids capped to {os.environ['PPLX_NUM_SMS']} (PPLX_NUM_SMS)")
    grid = min(int(os.environ.get("PPLX_NUM_SMS", sms)), sms)
    # dispatch grid as pplx sizes it (intranode_dispatch.cu:301-306). Its send loop (:97) gives a block
    # ceil(n / grid) tokens; above 1 an unpatched build races on the shared-memory token stage (no
    # __syncthreads at the end of the loop body, :180-181) and corrupts expert_x rows.
    dgrid = min(max(-(-EXPERTS // 16), MAX_TOKENS * TOPK), grid)
    log(rank, f"dispatch grid {dgrid} blocks: token counts above {dgrid} put >1 token per block "
              "(wrong rows unless intranode_dispatch.cu has the WAR barrier)")
    proj = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(99), dtype=torch.float64)

    nle = EXPERTS // world
    ata = AllToAll.intranode(
        max_num_tokens=MAX_TOKENS, num_experts=EXPERTS, experts_per_token=TOPK, rank=rank,
        world_size=world, dp_size=1, hidden_dim=HIDDEN, hidden_dim_bytes=HIDDEN * 2,
        hidden_dim_scale_bytes=0, group_name="default")
    expert_num_tokens = torch.empty(nle, dtype=torch.int32, device=dev)
    expert_x = torch.empty((nle, MAX_TOKENS * world, HIDDEN), dtype=torch.bfloat16, device=dev)
    expert_y = torch.empty_like(expert_x)
    gen = torch.Generator().manual_seed(1234 + rank)
    results = []

    cases = {}
    for n in args.tokens:  # data and the correctness check, once per token count
        assert 1 <= n <= MAX_TOKENS
        x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16).to(dev)
        idx = torch.rand(n, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK].to(torch.int32)
        indices = idx.to(dev).to(torch.uint32)
        weights = torch.rand(n, TOPK, generator=gen).to(dev)
        y = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev)

        def run_d(x=x, indices=indices):
            ata.dispatch(out_expert_num_tokens=expert_num_tokens, out_expert_x=expert_x,
                         out_expert_x_scale=None, dp_x=x, dp_x_scale=None, indices=indices, bound_m=None)

        def run_c(y=y, indices=indices, weights=weights):
            ata.combine(out_tokens=y, indices=indices, weights=weights, expert_y=expert_y, bound_m=None)

        # Token counts per local expert; then combine through identity experts: y = x * sum(w).
        t0 = time.time()
        run_d()
        torch.cuda.synchronize()
        all_idx = [None] * world
        dist.all_gather_object(all_idx, idx)
        want = sum(torch.bincount(t.flatten().long(), minlength=EXPERTS) for t in all_idx)[rank * nle:(rank + 1) * nle]
        counts_ok = torch.equal(expert_num_tokens.cpu().long(), want)
        # Dispatch rows: per local expert, the multiset of received rows must equal the rows routed
        # to it (order within an expert is unspecified), compared through a fixed projection.
        all_x = [None] * world
        dist.all_gather_object(all_x, x.cpu())
        ex = expert_x.cpu()
        rows_ok = counts_ok
        for e in range(nle) if counts_ok else ():
            g = rank * nle + e
            src = torch.cat([all_x[r][(all_idx[r] == g).any(1)] for r in range(world)])
            got = ex[e, :src.shape[0]].double() @ proj
            rows_ok &= bool(torch.allclose(got.sort().values, (src.double() @ proj).sort().values, rtol=0, atol=1e-6))
        expert_y.copy_(expert_x)
        run_c()
        torch.cuda.synchronize()
        ref = x.float() * weights.sum(1, keepdim=True)
        err = (y.float() - ref).abs().max().item()
        values_ok = bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2))
        log(rank, f"tokens {n}: counts {'ok' if counts_ok else 'WRONG'}, dispatch rows {'ok' if rows_ok else 'WRONG'}, "
                  f"combine max|err| {err:.3g} "
                  f"{'ok' if values_ok else 'WRONG'} ({time.time() - t0:.2f} s)")
        cases[n] = (run_d, run_c, dict(counts_ok=counts_ok, rows_ok=bool(rows_ok), values_ok=values_ok, max_abs_err=err))

    # Every eager row before any graph capture: a failing capture then loses no eager row.
    for mode in args.modes:
        for n in args.tokens:
            run_d, run_c, check = cases[n]
            if mode == "eager":
                r = timed(run_d, run_c, args.steps, args.skip)
            else:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        run_d()
                        run_c()
                torch.cuda.current_stream().wait_stream(s)
                gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(gd):
                    run_d()
                with torch.cuda.graph(gc):
                    run_c()
                r = timed(gd.replay, gc.replay, args.steps, args.skip)
                del gd, gc
            r.update(rank=rank, tokens=n, mode=mode, grid=grid, sms_visible=sms, **check)
            d, c, g = r["dispatch_us"], r["combine_us"], r["gap_us"]
            log(rank, f"{mode} tokens {n}: dispatch {d['median']:.1f}/{d['p99']:.1f} us, "
                      f"combine {c['median']:.1f}/{c['p99']:.1f} us (median/p99), gap {g['median']:.1f} us")
            results.append(r)

    # pplx's own benchmark (tests/bench_all_to_all.py) times, beside its kernels, a dense
    # torch.distributed.all_to_all_single of (ranks, local experts, tokens x row bytes) over
    # NCCL: what an MoE layer without a dispatch kernel sends (every expert's slots at the
    # token count). NCCL needs a GPU per rank, so only where each rank has one. One such
    # all-to-all stands for dispatch and one for combine (the same bytes back).
    # Timed eagerly, as pplx times it: at a few tokens its time is the host's call as much as
    # the transfer. A failure here costs this row only, not pplx's rows above.
    if gpus == world and args.torch_a2a:
        try:
            nccl = dist.new_group(backend="nccl")
            for n in args.tokens:
                inp = torch.zeros((world, nle, n * HIDDEN * 2), dtype=torch.uint8, device=dev)
                out = torch.empty_like(inp)

                def a2a(inp=inp, out=out):
                    dist.all_to_all_single(out, inp, group=nccl)

                for _ in range(3):
                    a2a()
                r = timed(a2a, a2a, min(args.steps, args.a2a_steps), args.skip)
                r.update(rank=rank, tokens=n, mode="torch-a2a", grid=0, sms_visible=sms,
                         counts_ok=True, rows_ok=True, values_ok=True, max_abs_err=0.0)
                d = r["dispatch_us"]
                log(rank, f"torch-a2a tokens {n}: {inp.numel() / 1e6:.1f} MB, all_to_all_single "
                          f"{d['median']:.1f}/{d['p99']:.1f} us (median/p99)")
                results.append(r)
            dist.destroy_process_group(nccl)
        except Exception as e:  # noqa: BLE001 (any failure of the baseline: say it, keep the rest)
            log(rank, f"torch-a2a row FAILED: {e!r}")

    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    torch.cuda.synchronize()
    dist.barrier()
    ata.destroy()
    dist.barrier()
    if rank == 0:
        print(f"\nranks {world} on {gpus} GPU(s), grid {grid} blocks, MPS % {mps_pct}, steps {args.steps}; times in us")
        print("mode   tok rank | dispatch med   p99 | combine med   p99 | step med   p99 | gap med | check")
        rows = sorted((r for rr in everyone for r in rr), key=lambda r: (r["mode"], r["tokens"], r["rank"]))
        for r in rows:
            d, c, s, g = r["dispatch_us"], r["combine_us"], r["step_us"], r["gap_us"]
            ok = "ok" if r["counts_ok"] and r["rows_ok"] and r["values_ok"] else "WRONG"
            print(f"{r['mode']:6} {r['tokens']:3} {r['rank']:4} | {d['median']:8.1f} {d['p99']:6.1f} | "
                  f"{c['median']:7.1f} {c['p99']:6.1f} | {s['median']:7.1f} {s['p99']:6.1f} | {g['median']:6.1f}  | {ok}")
        # Rank 0's graph rows (the kernels' pace, not Python's) as RESULT lines in examples/ep's
        # format, which bench/gpu/ep_table.py reads: wrong = the checks that failed (counts,
        # dispatched rows, combined values).
        for r in rows:
            if r["mode"] not in ("graph", "torch-a2a") or r["rank"] != 0:
                continue
            d, c = r["dispatch_us"], r["combine_us"]
            bad = sum(not r[k] for k in ("counts_ok", "rows_ok", "values_ok"))
            impl = "pplx" if r["mode"] == "graph" else "torch-a2a"
            print(f"RESULT ep impl={impl} ranks={world} tokens={r['tokens']} hidden={HIDDEN} experts={EXPERTS} "
                  f"topk={TOPK} steps={d['n']} dispatch_med_us={d['median']:.2f} dispatch_p99_us={d['p99']:.2f} "
                  f"combine_med_us={c['median']:.2f} combine_p99_us={c['p99']:.2f} wrong={bad} grid={r['grid']} gpus={gpus}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world, "mps_pct": mps_pct, "grid": grid, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--src", required=True, help="the pplx-kernels tree, built by build.sh")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--skip", type=int, default=50, help="untimed steps before the timed ones")
    p.add_argument("--total-sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    p.add_argument("--sm-fallback", action="store_true",
                   help="if the MPS cap is not reflected, cap grids via PPLX_NUM_SMS (needs build.sh's patch)")
    p.add_argument("--hang-s", type=int, default=180, help="per-rank wall-clock budget; past it the rank dumps its stack and exits")
    p.add_argument("--torch-a2a", type=int, default=1,
                   help="1: also time pplx's torch all-to-all row (NCCL), where each rank has a GPU")
    p.add_argument("--a2a-steps", type=int, default=200, help="timed steps of the torch all-to-all row")
    p.add_argument("--json", default="")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    assert EXPERTS % args.ranks == 0 and args.ranks >= 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    mp.spawn(worker, args=(args,), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
