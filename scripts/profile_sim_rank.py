"""Where one simulated rank's time goes: a torch.profiler trace of its forward + backward on one GPU.

    PYTHONPATH=. python scripts/profile_sim_rank.py --case 131072x8 --docs lognormal --layout balanced
    PYTHONPATH=. python scripts/profile_sim_rank.py --case 131072x8 --docs pareto,lognormal \
        --strategy allgather --ranks all --out profile.json

Each profiled rank runs the strategy as it runs (``bench_emulated.rank_step``: its plan, exchange and block kernels)
over a link whose transfers arrive at once (``InstantLink``-like: the real copies, no wait), so the profile is the
rank's compute; ``--links nvlink`` (or ``internode``) times it over that emulated link instead. For each rank
(``--ranks``: "model", the rank the cost model predicts slowest; "all"; or a comma list) one forward + backward is
split (per iteration, µs) into the attention kernels, every other kernel ("other compute": merges, fp32
accumulation, casts, zero fills, the exchange's copies) and GPU idle time (no kernel running), with a GPU sleep
queued ahead of the profiled iterations so that idle time is the rank's own waits, not the host falling behind.
Beside it: the wall time (host included), the GPU time with the host kept ahead, the host time to issue the
iteration, and two references:

- ``ideal``: one flash-attn-4 varlen call over the whole pack (forward + backward) divided by W;
- ``raw``: one flash-attn-4 varlen call (forward + backward) over this rank's own query rows, each run of
  them with the keys it sees (causal, from its document's start; bottom-right aligned), packed into one call:
  the kernel on the same shapes, without the strategy around it.

``--cprofile N`` prints the N Python functions with the most host time.
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
import _bench_util as U  # noqa: E402
import bench_emulated as E  # noqa: E402
import bench_strategies as B  # noqa: E402
from profile_ring_attention import profile_window  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning import layouts  # noqa: E402
from distcomm_attention.planning.visibility import Visibility  # noqa: E402
from distcomm_attention.transport.emulated import EmulatedLink  # noqa: E402


def host_seconds(step, iters: int) -> float:
    """Seconds the host spends issuing one call of ``step`` (no synchronisation inside the timed loop)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters


def query_runs(pos: torch.Tensor, docs: list[int]) -> list[tuple[int, int, int]]:
    """(first position, end position, document start) of each maximal run of consecutive positions of one
    document among ``pos`` (increasing)."""
    starts = torch.tensor(docs[:-1], dtype=torch.int64)
    doc = torch.searchsorted(starts, pos, right=True) - 1
    breaks = ((pos[1:] != pos[:-1] + 1) | (doc[1:] != doc[:-1])).nonzero().flatten() + 1
    cuts = [0] + breaks.tolist() + [pos.numel()]
    return [(int(pos[a]), int(pos[b - 1]) + 1, int(starts[doc[a]])) for a, b in zip(cuts, cuts[1:])]


def raw_step(runs, heads: int, kv_heads: int, d: int, rnd):
    """One flash-attn-4 varlen forward + backward: each run's queries against its keys [doc start, run end)."""
    from distcomm_attention.kernels import fa4

    iface = fa4._interface()
    lq = [b - a for a, b, _ in runs]
    lk = [b - s for _, b, s in runs]
    cu_q = torch.tensor([0] + lq, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk, device="cuda").cumsum(0).to(torch.int32)
    q = rnd(sum(lq), heads, d).requires_grad_()
    k, v = (rnd(sum(lk), kv_heads, d).requires_grad_() for _ in range(2))
    dout = rnd(sum(lq), heads, d)

    def step():
        out = iface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                           max_seqlen_k=max(lk), causal=True)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, (q, k, v), dout)

    return step


def profile_case(seq, world, heads, kv_heads, mix, layout, strategy, args, fwd, bwd) -> list[dict]:
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    docs = B.documents(mix, seq)
    vis = Visibility(True, cu_seqlens=tuple(docs))
    n = seq // world
    concrete = B.plan_layout(layout, seq, world, docs)["concrete"]
    planned = B.planned_rank_s(strategy, concrete, vis, world, n, heads, kv_heads, d, packs=True)
    if args.ranks == "model":
        ranks = [max(range(world), key=lambda r: planned[r])]
    elif args.ranks == "all":
        ranks = list(range(world))
    else:
        ranks = [int(r) for r in args.ranks.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    q, dout = rnd(1, n, heads, d), rnd(1, n, heads, d)
    k, v = rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d)
    key = ("single", seq, mix)
    if key not in B._MEASURED:
        qs, ks, vs = rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
        B._MEASURED[key] = B._timed(B._fa4_single(qs, ks, vs, True, docs), args.iters, args.warmup)
        del qs, ks, vs
    ideal = B._MEASURED[key] / world
    rows = []
    for rank in ranks:
        link = E._Sent(EmulatedLink(world, rank, E.LINKS[args.links]))
        path, step = E.rank_step(strategy, link, q, k, v, dout, concrete, vis, world, rank, fwd, bwd, d ** -0.5)
        wall = B._timed(step, args.iters, args.warmup)
        gpu = U.gpu_seconds(step, args.iters, ahead_s=2 * wall + 1e-3)
        host = host_seconds(step, args.iters)
        runs = query_runs(layouts.positions(concrete, seq, world, rank), docs)
        raw = B._timed(raw_step(runs, heads, kv_heads, d, lambda *s: rnd(*s)), args.iters, args.warmup)

        def ahead_step(first=[True]):  # noqa: B006 - one GPU sleep ahead of the profiled iterations
            if first[0]:
                U.gpu_sleep(dev, (args.iters + 2) * (host + wall))
                first[0] = False
            step()

        trace = None
        if args.trace_dir is not None:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            trace = args.trace_dir / f"trace_{mix}_{layout}_{strategy}_rank{rank}.json.gz"
        prof = profile_window(lambda: ahead_step(), iters=args.iters, warmup=0, device=dev, trace_path=trace)
        if args.cprofile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(lambda: [step() for _ in range(args.iters)])
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
        launches = sum(k["count"] for k in prof.get("top_kernels", []))
        rows.append({"seq": seq, "world": world, "documents": mix, "layout": layout,
                     "chosen": B.layout_name(concrete), "strategy": strategy, "path": path, "rank": rank,
                     "planned_us": planned[rank] * 1e6, "query_runs": len(runs),
                     "wall_us": wall * 1e6, "gpu_us": gpu * 1e6, "host_us": host * 1e6, "ideal_us": ideal * 1e6,
                     "raw_us": raw * 1e6, "efficiency": ideal / wall, "gpu_efficiency": ideal / gpu,
                     "gpu_vs_raw": gpu / raw, "attention_us": prof.get("attention"),
                     "other_us": prof.get("other compute"), "idle_us": prof.get("idle"),
                     "launches_top12": launches, "top_kernels": prof.get("top_kernels")})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="131072x8", help="seq x world")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--docs", default="lognormal", help=f"document mixes ({', '.join(B.MIXES)})")
    p.add_argument("--layout", default="balanced")
    p.add_argument("--strategy", default="allgather", help="ring and/or allgather")
    p.add_argument("--ranks", default="model", help='"model" (the predicted slowest), "all", or a comma list')
    p.add_argument("--backend", default="fa4")
    p.add_argument("--links", default="ideal", choices=sorted(E.LINKS),
                   help="the emulated link (default: transfers take no link time, the copies still run)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="kernels printed per rank")
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most host time")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep each profiled rank's chrome trace (gzip) here")
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
                for r in profile_case(seq, world, heads, kv_heads, mix, layout, strategy, args, fwd, bwd):
                    rows.append(r)
                    print(f"{mix:>9} {layout:>10} {r['path']:>16} rank {r['rank']}: wall {r['wall_us']:.0f} "
                          f"gpu {r['gpu_us']:.0f} host {r['host_us']:.0f} us | ideal {r['ideal_us']:.0f} "
                          f"raw {r['raw_us']:.0f} ({r['query_runs']} runs) planned {r['planned_us']:.0f} | "
                          f"attention {r['attention_us']:.0f} other {r['other_us']:.0f} idle {r['idle_us']:.0f}",
                          flush=True)
                    for k in r["top_kernels"][:args.top]:
                        print(f"      {k['total_us']:8.0f} us x{k['count']:.0f}  {k['name']}")
                    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
