"""Where one simulated rank's time goes: a torch.profiler trace of its forward + backward on one GPU.

    PYTHONPATH=. python scripts/profile_sim_rank.py --case 131072x8 --docs lognormal --layout balanced
    PYTHONPATH=. python scripts/profile_sim_rank.py --case 131072x8 --docs one_long,pareto \
        --layout balanced,contiguous --strategy ring,allgather --out profile.json

The rank runs its real plan and block kernels with the communicator of ``bench_strategies.py`` that moves
nothing (simulated ranks). For the rank the cost model predicts slowest, one forward + backward is split
(per iteration, µs) into the attention kernels, every other kernel ("other compute": merges, fp32
accumulation, casts, zero fills) and GPU idle time (no kernel running: host work between launches), beside
the host time to issue the iteration (Python and launches, measured without waiting for the GPU: when it is
close to the wall time, the rank is bound by the host, not the GPU) and the kernel launches per iteration;
``--cprofile N`` prints the N Python functions with the most host time.
``ideal`` is one flash-attn-4 varlen call over the whole pack (forward + backward) divided by W.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_strategies as B  # noqa: E402
from profile_ring_attention import profile_window  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning.plans import gathered_plan  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402


def host_seconds(step, iters: int) -> float:
    """Seconds the host spends issuing one call of ``step`` (no synchronisation inside the timed loop)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters


def profile_case(seq, world, heads, kv_heads, mix, layout, strategy, args, fwd, bwd) -> dict:
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    docs = B.documents(mix, seq)
    vis = Visibility(True, cu_seqlens=tuple(docs))
    n = seq // world
    concrete = B.plan_layout(layout, seq, world, docs)["concrete"]
    planned = B.planned_rank_s(strategy, concrete, vis, world, n, heads, kv_heads, d)
    rank = max(range(world), key=lambda r: planned[r])
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    q, dout = rnd(1, n, heads, d), rnd(1, n, heads, d)
    if strategy == "ring":
        k, v = rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d)
        plan, comm = ring_plan(concrete, vis, world, rank, n), B.SimComm(world, rank)
    else:
        k, v = rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
        plan, comm = gathered_plan(concrete, vis, world, rank, n), B.SimComm(1, 0)
    calls = sum(len(step) for step in plan.blocks)
    step = B._plan_step(q, k, v, dout, plan, comm, fwd, bwd, d ** -0.5, strategy != "ring")
    wall = B._timed(step, args.iters, args.warmup)
    host = host_seconds(step, args.iters)
    prof = profile_window(step, iters=args.iters, warmup=1, device=dev)
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(args.iters)])
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    key = ("single", seq, mix)
    if key not in B._MEASURED:
        qs, ks, vs = rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
        B._MEASURED[key] = B._timed(B._fa4_single(qs, ks, vs, True, docs), args.iters, args.warmup)
    ideal = B._MEASURED[key] / world
    launches = sum(k["count"] for k in prof.get("top_kernels", []))
    return {"seq": seq, "world": world, "documents": mix, "layout": layout, "chosen": B.layout_name(concrete),
            "strategy": strategy, "rank": rank, "steps": len(plan.steps), "block_calls": calls,
            "wall_us": wall * 1e6, "ideal_us": ideal * 1e6, "efficiency": ideal / wall, "host_us": host * 1e6,
            "attention_us": prof.get("attention"), "other_us": prof.get("other compute"),
            "idle_us": prof.get("idle"), "launches_top12": launches, "top_kernels": prof.get("top_kernels")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="131072x8", help="seq x world")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--docs", default="lognormal", help=f"document mixes ({', '.join(B.MIXES)})")
    p.add_argument("--layout", default="balanced")
    p.add_argument("--strategy", default="ring", help="ring and/or allgather")
    p.add_argument("--backend", default="fa4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most host time")
    p.add_argument("--out", type=Path, default=Path("profile_sim_rank.json"))
    args = p.parse_args()
    seq, world = map(int, args.case.split("x"))
    heads, kv_heads = map(int, args.heads.split("/"))
    probe = torch.empty(1, 1, heads, 128, device="cuda", dtype=torch.bfloat16)
    _, fwd, bwd = dispatch.select_kernels(args.backend, probe, Visibility(True), 0.0)
    rows = []
    for mix in args.docs.split(","):
        for layout in args.layout.split(","):
            for strategy in args.strategy.split(","):
                r = profile_case(seq, world, heads, kv_heads, mix, layout, strategy, args, fwd, bwd)
                rows.append(r)
                print(f"{mix:>9} {layout:>10} {strategy:>9} rank {r['rank']}: wall {r['wall_us']:.0f} us "
                      f"(ideal {r['ideal_us']:.0f}, eff {r['efficiency']:.2f}) host {r['host_us']:.0f} "
                      f"attention {r['attention_us']:.0f} other {r['other_us']:.0f} idle {r['idle_us']:.0f} "
                      f"steps {r['steps']} calls {r['block_calls']}", flush=True)
                for k in r["top_kernels"][:8]:
                    print(f"      {k['total_us']:8.0f} us x{k['count']:.0f}  {k['name']}")
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
