"""Simulated ranks: each strategy's per-rank compute on one GPU, against one flash-attn-4 call.

Every rank r of a simulated group of W runs its real forward + backward (the strategy's own plan, block
kernels and accumulations) with a stand-in communicator that moves nothing, so the time is the compute a
rank must do even with communication perfectly hidden:

    compute-only efficiency = T_single(S) / (W * max_r T_rank)

T_single: one flash-attn-4 forward + backward over the whole sequence (the fastest single-GPU kernel; for
packed documents one flash-attn-4 varlen call over the pack); measured once per (S, heads, mask, documents)
and shared by the rows of every W and layout. Every time is the median over ``--iters`` calls, each timed on its
own CUDA events after ``--warmup`` calls.
Beside it: the cost model's exposed communication for NVLink and for a 50 GB/s inter-node link, the
modelled efficiency with it, the cost model's pick and the measured fastest.

    python scripts/bench_strategies.py --out docs/bench/strategies.json
    python scripts/bench_strategies.py --cases 131072x8 --heads 32/8 --docs lognormal,one_long --out docs.json
    python scripts/bench_strategies.py --cases 524288x32 --heads 32/8 --docs pareto \
        --layouts contiguous,zigzag,balanced,auto --ranks 2 --out big.json

Document mixes (cu_seqlens over S tokens, seed 0):
    "lognormal"  log-normal lengths (median 2k, clipped to [64, 9k]); the last document cut at S
                 (S = 128k: 55 documents; 512k: 203)
    "one_long"   one document of S / 2, then documents of 1k
    "pareto"     heavy-tailed: lengths int(256 * paretovariate(1.1)) (random.Random(seed)), at least 1, the
                 last document cut at S (S = 128k: 95 documents, the longest 26k; 512k: 250, the longest 224k)
    "short"      hundreds of short documents: log-normal lengths of mean ~500 tokens (sigma 0.8, clipped to
                 [16, 9k]; S = 128k: 262 documents, 90% under 1k; 512k: 1015)
    "one"        a single document, cu_seqlens = [0, S]: plain causal attention through the varlen path

Layouts of the document rows (--layouts): the static "contiguous", "zigzag", "striped", and the data-dependent
"balanced" and "auto" (distcomm_attention/planning/balance.py), turned into the planner's layout with
``balance.resolve`` (an Assignment or a static name; "auto" records the layout it chose). Each row records
the planning time on cold caches (``plan_resolve_s``: resolve alone; ``plan_first_rank_s``: resolve + one
rank's ring plan, what each rank of a real group pays; ``plan_s``: resolve + the ring plans of all W ranks)
and the planner's work imbalance: max / mean over ranks of the causal visible (query, key) pairs
(``balance.rank_work``), and of the kernel's time as the balanced layout counts it (``cost_imbalance``,
``balance.rank_cost``).

Ranks timed (--ranks): "all", or k: the k ranks with the most planned compute (the cost model's per-rank
compute of the strategy's own plan) plus rank 0, per strategy (``timed_ranks``); the efficiency then uses
the max over the timed ranks, and ``imbalance`` (measured max / mean) is left out (None) for that strategy:
``planned_imbalance`` has the cost model's over every rank. Ulysses' kernel time does not depend on the
layout: it is measured once per (S, W, heads, mask, documents); only its re-ordering into natural order (and
back) is timed per layout and added. A row whose layout resolves to one that an earlier row of the run
measured (same S, W, heads, documents; "auto" choosing "balanced", say) takes that row's timings
(``timings_from``: its layout) instead of measuring them again. Peak memory: the allocator's peak during a
rank's forward + backward above what the inputs hold.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning import balance, cost, layouts, plans, visibility  # noqa: E402
from distcomm_attention.planning.layouts import Assignment  # noqa: E402
from distcomm_attention.planning.plans import gathered_plan, local_plan, natural_order  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402
from distcomm_attention.strategies.allgather import local_backward  # noqa: E402
from distcomm_attention.strategies.ring import ring_backward, ring_forward  # noqa: E402
from distcomm_attention.strategies.ulysses import kv_head_index  # noqa: E402


class _Handle:
    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors


class SimComm:
    """A ring position that hands back whatever it is given (no communication)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def send_recv(self, *tensors, shift: int = 1, **_):
        return _Handle(tensors)


def _timed(fn, iters: int, warmup: int, host_ahead: bool = False) -> float:
    """Seconds per call of ``fn``: the median over ``iters`` calls, each timed by its own CUDA events (issued
    back to back, no synchronisation between calls), after ``warmup`` calls. The median keeps a rare stall of
    the shared machine (a single call seen at 2x its neighbours) out of a per-rank time. ``host_ahead``: a GPU
    sleep (~0.1 s) is queued first, so that the host has issued every call before the GPU reaches it (the GPU
    time of calls too small to hide their host time)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    if host_ahead:
        torch.cuda._sleep(int(2e8))
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events) / 1e3


def _peak(fn) -> int:
    """Bytes the allocator's peak rose above its level before ``fn`` ran once."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


MIXES = ("lognormal", "one_long", "pareto", "short", "one")
SHORT_MEAN, SHORT_SIGMA = 500, 0.8  # the "short" mix: log-normal lengths of mean ~500 tokens
STRATEGIES = ("ring", "allgather", "ulysses")


def documents(kind: str, seq: int, seed: int = 0) -> list[int]:
    """cu_seqlens of a document mix over ``seq`` tokens (see the module docstring)."""
    if kind == "one":
        return [0, seq]
    if kind == "one_long":
        return [0] + list(range(seq // 2, seq + 1, 1024))
    cu = [0]
    if kind == "pareto":
        rng = random.Random(seed)
        while cu[-1] < seq:
            cu.append(min(seq, cu[-1] + max(1, int(256 * rng.paretovariate(1.1)))))
        return cu
    if kind not in ("lognormal", "short"):
        raise ValueError(f"unknown document mix {kind!r}; one of {', '.join(MIXES)}")
    # "short": mean exp(mu + sigma^2 / 2) = SHORT_MEAN
    mu, sigma, least = (7.6, 0.8, 64) if kind == "lognormal" else (math.log(SHORT_MEAN) - SHORT_SIGMA ** 2 / 2,
                                                                   SHORT_SIGMA, 16)
    g = torch.Generator().manual_seed(seed)
    while cu[-1] < seq:
        length = int(min(9216, max(least, float(torch.empty(1).log_normal_(mu, sigma, generator=g)))))
        cu.append(min(seq, cu[-1] + length))
    return cu


# --- planning (CPU, no kernels): the pure-Python part of a row ---------------------------------------------

_PLAN_CACHES = ((balance, "balanced"), (balance, "choose_layout"), (visibility, "ring_plan"),
                (visibility, "_needed_steps"), (plans, "gathered_plan"), (plans, "natural_order"),
                (cost, "_predictions"))


def clear_plan_caches() -> None:
    """Empty the planner's caches (the balanced assignment, auto's choice, ring / gathered plans)."""
    for module, name in _PLAN_CACHES:
        fn = getattr(module, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def layout_name(concrete) -> str:
    """The name of a planner layout: an Assignment's name or the static name."""
    return concrete.name if isinstance(concrete, Assignment) else str(concrete)


def plan_layout(layout: str, seq: int, world: int, docs=None, causal: bool = True) -> dict:
    """Resolve ``layout`` and build every rank's ring plan on cold caches, timed (time.perf_counter):
    {"concrete", "chosen_layout", "plan_resolve_s", "plan_first_rank_s", "plan_s"} (see the module docstring)."""
    vis = Visibility(causal, cu_seqlens=None if docs is None else tuple(docs))
    n = seq // world
    clear_plan_caches()
    t0 = time.perf_counter()
    concrete = balance.resolve(layout, seq, world, None if docs is None else tuple(docs) or None)
    t1 = time.perf_counter()
    ring_plan(concrete, vis, world, 0, n)
    t2 = time.perf_counter()
    for r in range(1, world):
        ring_plan(concrete, vis, world, r, n)
    t3 = time.perf_counter()
    return {"concrete": concrete, "chosen_layout": layout_name(concrete), "plan_resolve_s": t1 - t0,
            "plan_first_rank_s": t2 - t0, "plan_s": t3 - t0}


def planner_work(layout, seq: int, world: int, docs=None, causal: bool = True) -> list[int]:
    """Visible (query, key) pairs of each rank's queries (``balance.rank_work`` over ``layouts.positions``);
    ``layout``: a name (resolved) or the planner's layout."""
    cu = None if docs is None else tuple(docs)
    concrete = balance.resolve(layout, seq, world, cu)
    if not causal:  # every query sees every key (of its document): work per rank is its token count's
        pos = [layouts.positions(concrete, seq, world, r) for r in range(world)]
        if cu is None:
            return [p.numel() * seq for p in pos]
        bounds = torch.tensor(cu)
        lengths = bounds[1:] - bounds[:-1]
        return [int(lengths[torch.searchsorted(bounds, p, right=True) - 1].sum()) for p in pos]
    return balance.rank_work([layouts.positions(concrete, seq, world, r) for r in range(world)], cu, seq)


def planner_cost(layout, seq: int, world: int, docs=None) -> list[float]:
    """The kernel's time of each rank's causal queries in tiles of work, what ``layout="balanced"`` balances
    (``balance.rank_cost`` over ``layouts.positions``)."""
    cu = None if docs is None else tuple(docs)
    concrete = balance.resolve(layout, seq, world, cu)
    return balance.rank_cost([layouts.positions(concrete, seq, world, r) for r in range(world)], cu, seq)


def planner_imbalance(layout, seq: int, world: int, docs=None, causal: bool = True) -> float:
    """max / mean of ``planner_work`` (1.0 = every rank the same number of visible pairs)."""
    work = planner_work(layout, seq, world, docs, causal)
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def planned_rank_s(strategy: str, concrete, vis: Visibility, world: int, local_len: int, heads: int,
                   kv_heads: int, head_dim: int = 128, hw: cost.Hardware = cost.Hardware(),
                   packs: bool = True) -> list[float]:
    """The cost model's compute seconds (no communication) of every rank's ring or gathered plan, its kernel
    calls counted as a packing backend (flash-attn-4, ``packs``) issues them, the gathered plan's as the
    all-gather runs it (own keys first, the sparse exchange's buffer): the ranks the benchmarks time as the
    busiest are the model's, whose call counts can set a rank apart where its pairs do not."""
    call = cost.Call(1, local_len, heads, kv_heads, head_dim, 2, concrete, vis, world, packs=packs)
    if strategy != "ring":
        return [s for s, _, _ in cost._gathered_ranks_s(call, world, local_len, heads, kv_heads, hw)[2]]
    return [sum(cost._compute_s(c, call, heads, kv_heads, hw)
                for c in cost._step_costs(ring_plan(concrete, vis, world, r, local_len), packs))
            for r in range(world)]


def pick_ranks(work, k) -> list[int]:
    """The ranks to time: all for k None (or k >= W), else the k with the most planned work (ties: lower
    rank) plus rank 0, increasing."""
    world = len(work)
    if k is None or k >= world:
        return list(range(world))
    top = sorted(range(world), key=lambda r: (-work[r], r))[:max(k, 0)]
    return sorted(set(top) | {0})


def parse_ranks(text: str):
    """--ranks: "all" -> None, else an int >= 1."""
    if text == "all":
        return None
    k = int(text)
    if k < 1:
        raise argparse.ArgumentTypeError(f"--ranks must be 'all' or an int >= 1, got {text!r}")
    return k


def _fa4_single(q, k, v, causal, docs=None, key_docs=None):
    """One flash-attn-4 forward + backward as a step function: dense, or varlen over documents ``docs`` (the
    queries' boundaries; ``key_docs`` the keys' where they differ: bottom-right causal)."""
    from distcomm_attention.kernels import fa4

    iface = fa4._interface()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    if docs is not None:
        key_docs = docs if key_docs is None else key_docs
        cu, cu_k = (torch.tensor(x, dtype=torch.int32, device=q.device) for x in (docs, key_docs))
        longest, longest_k = (max(b - a for a, b in zip(x, x[1:])) for x in (docs, key_docs))

        def step():
            out = iface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                                               max_seqlen_q=longest, max_seqlen_k=longest_k, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, (q, k, v), dout[0])

        return step

    def step():
        out = iface.flash_attn_func(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, (q, k, v), dout)

    return step


def _plan_step(q, k, v, dout, plan, comm, fwd, bwd, scale, single_step: bool):
    def step():
        out, lse = ring_forward(q, k, v, None, comm, plan, 0.0, scale, fwd)
        if single_step:
            local_backward(dout, q, k, v, out, lse, None, plan, 0.0, scale, bwd)
        else:
            ring_backward(dout, q, k, v, out, lse, None, comm, plan, 0.0, scale, bwd)

    return step


_MEASURED: dict = {}  # timings shared by rows: the single call, Ulysses' kernels, a layout's measured row


def bench_case(seq, world, heads, kv_heads, causal, layout, args, fwd, bwd, docs=None, mix=None):
    dev, dt, d = torch.device(getattr(args, "device", "cuda")), torch.bfloat16, getattr(args, "head_dim", 128)
    scale = d ** -0.5
    vis = Visibility(causal, cu_seqlens=None if docs is None else tuple(docs))
    n = seq // world
    strategies = getattr(args, "strategies", STRATEGIES)
    k = getattr(args, "ranks", None)
    planned = plan_layout(layout, seq, world, docs, causal)
    concrete = planned.pop("concrete")
    work = planner_work(concrete, seq, world, docs, causal)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    res = {"seq": seq, "world": world, "heads": heads, "kv_heads": kv_heads, "causal": causal, "layout": layout,
           "documents": mix, "num_documents": None if docs is None else len(docs) - 1, **planned,
           "rank_work": work, "work_imbalance": max(work) / (sum(work) / len(work)) if sum(work) else 1.0}
    if causal:  # the kernel's time as the balance counts it (``planner_cost``)
        costs = planner_cost(concrete, seq, world, docs)
        res["cost_imbalance"] = max(costs) / (sum(costs) / len(costs))
    key = (seq, heads, kv_heads, causal, mix)
    row_key = ("row", world, concrete, k, tuple(strategies)) + key
    if row_key in _MEASURED:  # "auto" chose a layout this run has measured: its timings, not measured again
        earlier = _MEASURED[row_key]
        res.update({f: v for f, v in earlier.items() if f not in res})
        res["timings_from"] = earlier["layout"]
        return res
    if ("single",) + key not in _MEASURED:
        q, k_, v = rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
        _MEASURED[("single",) + key] = _timed(_fa4_single(q, k_, v, causal, docs), args.iters, args.warmup)
        del q, k_, v
    res["single_s"] = _MEASURED[("single",) + key]
    times, peaks, timed, planned_s = {}, {}, {}, {}
    ql, kl, vl, dl = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    # ring: every (timed) rank's whole loop
    if "ring" in strategies:
        planned_s["ring"] = planned_rank_s("ring", concrete, vis, world, n, heads, kv_heads, d,
                                           packs=getattr(fwd, "packs", False))
        timed["ring"] = pick_ranks(planned_s["ring"], k)
        steps = [_plan_step(ql, kl, vl, dl, ring_plan(concrete, vis, world, r, n), SimComm(world, r), fwd, bwd,
                            scale, False) for r in timed["ring"]]
        times["ring"] = [_timed(f, args.iters, args.warmup) for f in steps]
        peaks["ring"] = max(_peak(f) for f in steps)
    # all-gather KV: the rank's queries against the gathered buffer
    if "allgather" in strategies:
        planned_s["allgather"] = planned_rank_s("allgather", concrete, vis, world, n, heads, kv_heads, d,
                                                packs=getattr(fwd, "packs", False))
        timed["allgather"] = pick_ranks(planned_s["allgather"], k)
        kg, vg = rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
        steps = [_plan_step(ql, kg, vg, dl, gathered_plan(concrete, vis, world, r, n), SimComm(1, 0), fwd, bwd,
                            scale, True) for r in timed["allgather"]]
        times["allgather"] = [_timed(f, args.iters, args.warmup) for f in steps]
        peaks["allgather"] = max(_peak(f) for f in steps) + 2 * kg.numel() * kg.element_size()  # + gathered k, v
        del kg, vg
    del ql, kl, vl, dl
    # Ulysses: H / W heads over the whole sequence (every rank the same), with the re-ordering it does
    if "ulysses" in strategies and heads % world == 0:
        index = kv_head_index(heads, kv_heads, world)
        hk = kv_heads // world if index is None else len(index) // world
        qu, ku, vu, du = rnd(1, seq, heads // world, d), rnd(1, seq, hk, d), rnd(1, seq, hk, d), rnd(1, seq, heads // world, d)
        held = sum(t.numel() * t.element_size() for t in (qu, ku, vu, du))  # the head-sharded q, k, v, dout
        if ("ulysses", world) + key not in _MEASURED:  # the kernels: the same for every layout
            inner = _plan_step(qu, ku, vu, du, local_plan(vis, seq), SimComm(1, 0), fwd, bwd, scale, False)
            _MEASURED[("ulysses", world) + key] = (_timed(inner, args.iters, args.warmup), _peak(inner))
        inner_s, inner_peak = _MEASURED[("ulysses", world) + key]
        order = natural_order(concrete, world, n)
        reorder_s, reorder_peak = 0.0, 0
        if order is not None:  # Ulysses puts q, k, v, dout into natural order and out, dq, dk, dv back
            order = order.to(dev)

            def reorder():
                for t in (qu, ku, vu, du, qu, ku, vu, du):
                    t.index_select(1, order)

            reorder_s, reorder_peak = _timed(reorder, args.iters, args.warmup), _peak(reorder)
        times["ulysses"] = [inner_s + reorder_s]
        timed["ulysses"] = [0]
        res["ulysses_reorder_s"] = reorder_s
        peaks["ulysses"] = max(inner_peak, reorder_peak) + held
        del qu, ku, vu, du
    res["rank_s"] = times
    res["timed_ranks"] = timed
    res["peak_bytes"] = peaks
    res["planned_rank_s"] = planned_s
    res["planned_imbalance"] = {s: max(t) / (sum(t) / len(t)) for s, t in planned_s.items()}
    res["efficiency"] = {s: res["single_s"] / (world * max(t)) for s, t in times.items()}
    # measured max / mean: only where every rank was timed (Ulysses: every rank the same)
    res["imbalance"] = {s: max(t) / (sum(t) / len(t)) if s == "ulysses" or len(t) == world else None
                        for s, t in times.items()}
    call = cost.Call(1, n, heads, kv_heads, d, 2, concrete, vis, world)
    links = (("nvlink", cost.Hardware()),
             ("internode50", cost.Hardware(p2p_gbps=50, a2a_gbps=50, allgather_gbps=50, reduce_scatter_gbps=50)))
    for link, hw in links if times else ():
        model = {}
        for s in times:
            p = cost.predict(call, s, hw)
            # measured compute + the model's exposed communication (the ring hides hops under its steps)
            comm = p.comm_s
            model[s] = {"predicted_s": p.seconds, "predicted_compute_s": p.compute_s, "comm_s": comm,
                        "modelled_total_s": max(times[s]) + comm,
                        "modelled_efficiency": res["single_s"] / (world * (max(times[s]) + comm)),
                        "memory_bytes": p.memory_bytes}
        pick = cost.choose(call, tuple(times), hw).strategy
        fastest = min(model, key=lambda s: model[s]["modelled_total_s"])
        res[link] = {"model": model, "pick": pick, "fastest": fastest,
                     "pick_vs_fastest": model[pick]["modelled_total_s"] / model[fastest]["modelled_total_s"]}
    _MEASURED[row_key] = res
    return res


def _line(r) -> str:
    """The printed line of a row."""
    seq, world, mix, layout = r["seq"], r["world"], r["documents"], r["layout"]
    eff = " ".join(f"{s} {e:.2f}" for s, e in r["efficiency"].items())
    nv = r.get("nvlink")
    if r["chosen_layout"] != layout:
        layout = f"{layout}->{r['chosen_layout']}"
    if "timings_from" in r:
        layout += f" (timings of the {r['timings_from']} row)"
    what = f"{mix} docs {layout}" if mix else ("causal " if r["causal"] else "full ") + layout
    imb = " ".join(f"{s} {e:.2f}" if e is not None else f"{s} ~{r['planned_imbalance'][s]:.2f}(model)"
                   for s, e in r["imbalance"].items())
    partial = {s: t for s, t in r["timed_ranks"].items() if s != "ulysses" and len(t) < world}
    timed = (" | timed ranks " + " ".join(f"{s} {t}" for s, t in partial.items())) if partial else ""
    return (f"S={seq} W={world} {r['heads']}/{r['kv_heads']} {what}: max/mean {imb} | "
            f"work max/mean {r['work_imbalance']:.3f}"
            + (f" (kernel {r['cost_imbalance']:.3f})" if "cost_imbalance" in r else "")
            + f" | plan {r['plan_s'] * 1e3:.0f} ms | "
            f"single {r['single_s'] * 1e3:.2f} ms | compute-only eff {eff}"
            + ("" if nv is None else " | nvlink modelled "
               + " ".join(f"{s} {m['modelled_efficiency']:.2f}" for s, m in nv["model"].items())
               + f" | pick {nv['pick']} fastest {nv['fastest']} ({nv['pick_vs_fastest']:.3f}x)"
               + f" | inter-node pick {r['internode50']['pick']} fastest {r['internode50']['fastest']}") + timed)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="32768x8,32768x4,32768x2,131072x8",
                   help="seq x world pairs, comma separated (issue 23: 131072x4,131072x8,131072x16,131072x32,"
                        "524288x16,524288x32)")
    p.add_argument("--heads", default="32/32,32/8", help="heads/kv_heads pairs")
    p.add_argument("--docs", default="", help=f"document mixes ({', '.join(MIXES)}): causal packed batches")
    p.add_argument("--layouts", default="contiguous,zigzag",
                   help=f"layouts of the document rows ({', '.join(layouts.LAYOUTS)})")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="strategies to run")
    p.add_argument("--ranks", type=parse_ranks, default=None,
                   help="'all', or k: time the k ranks with the most planned compute, plus rank 0")
    p.add_argument("--backend", default="fa4")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("strategies.json"))
    args = p.parse_args()
    args.strategies = tuple(args.strategies.split(","))
    for s in args.strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r}; one of {', '.join(STRATEGIES)}")
    mixes, lays = [m for m in args.docs.split(",") if m], args.layouts.split(",")
    for m in mixes:
        if m not in MIXES:
            p.error(f"unknown document mix {m!r}; one of {', '.join(MIXES)}")
    for lay in lays:
        if lay not in layouts.LAYOUTS:
            p.error(f"unknown layout {lay!r}; one of {', '.join(layouts.LAYOUTS)}")
    probe = torch.empty(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, fwd, bwd = dispatch.select_kernels(args.backend, probe, Visibility(True), 0.0)
    rows = []
    for case in args.cases.split(","):
        seq, world = map(int, case.split("x"))
        for hh in args.heads.split(","):
            heads, kv_heads = map(int, hh.split("/"))
            variants = [(True, "zigzag", None), (False, "contiguous", None)]
            if mixes:
                variants = [(True, lay, mix) for mix in mixes for lay in lays]
            for causal, layout, mix in variants:
                docs = None if mix is None else documents(mix, seq)
                r = bench_case(seq, world, heads, kv_heads, causal, layout, args, fwd, bwd, docs, mix)
                rows.append(r)
                print(_line(r), flush=True)
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))

if __name__ == "__main__":
    main()
