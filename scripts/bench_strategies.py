"""Simulated ranks: each strategy's per-rank compute on one GPU, against one flash-attn-4 call.

Every rank r of a simulated group of W runs its real forward + backward (the strategy's own plan, block
kernels and accumulations) with a stand-in communicator that moves nothing, so the time is the compute a
rank must do even with communication perfectly hidden:

    compute-only efficiency = T_single(S) / (W * max_r T_rank)

T_single: one flash-attn-4 forward + backward over the whole sequence (the fastest single-GPU kernel; for
packed documents one flash-attn-4 varlen call over the pack).
Beside it: the cost model's exposed communication for NVLink and for a 50 GB/s inter-node link, the
modelled efficiency with it, the cost model's pick and the measured fastest.

    python scripts/bench_strategies.py --out docs/bench/strategies.json
    python scripts/bench_strategies.py --cases 131072x8 --heads 32/8 --docs lognormal,one_long --out docs.json

Document mixes (S = 128k at the default seed): "lognormal" (log-normal lengths, median 2k, capped at 9k),
"one_long" (one document of S / 2 and documents of 1k after it). Peak memory: the allocator's peak during a
rank's forward + backward above what the inputs hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning import cost, layouts  # noqa: E402
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


def _timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters / 1e3


def _peak(fn) -> int:
    """Bytes the allocator's peak rose above its level before ``fn`` ran once."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def documents(kind: str, seq: int, seed: int = 0) -> list[int]:
    """cu_seqlens of a document mix over ``seq`` tokens (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one_long":
        return [0] + list(range(seq // 2, seq + 1, 1024))
    cu = [0]
    while cu[-1] < seq:
        length = int(min(9216, max(64, float(torch.empty(1).log_normal_(7.6, 0.8, generator=g)))))
        cu.append(min(seq, cu[-1] + length))
    return cu


def _fa4_single(q, k, v, causal, docs=None):
    from distcomm_attention.kernels import fa4

    iface = fa4._interface()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    if docs is not None:
        cu = torch.tensor(docs, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(docs, docs[1:]))

        def step():
            out = iface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                               max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)
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


def bench_case(seq, world, heads, kv_heads, causal, layout, args, fwd, bwd, docs=None, mix=None):
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    scale = d ** -0.5
    vis = Visibility(causal, cu_seqlens=None if docs is None else tuple(docs))
    n = seq // world
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    res = {"seq": seq, "world": world, "heads": heads, "kv_heads": kv_heads, "causal": causal, "layout": layout,
           "documents": mix, "num_documents": None if docs is None else len(docs) - 1}
    q, k, v = rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
    res["single_s"] = _timed(_fa4_single(q, k, v, causal, docs), args.iters, args.warmup)
    del q, k, v
    times, peaks = {}, {}
    # ring: every rank's whole loop
    ql, kl, vl, dl = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    steps = [_plan_step(ql, kl, vl, dl, ring_plan(layout, vis, world, r, n), SimComm(world, r), fwd, bwd, scale,
                        False) for r in range(world)]
    times["ring"] = [_timed(f, args.iters, args.warmup) for f in steps]
    peaks["ring"] = max(_peak(f) for f in steps)
    # all-gather KV: the rank's queries against the gathered buffer
    kg, vg = rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d)
    steps = [_plan_step(ql, kg, vg, dl, gathered_plan(layout, vis, world, r, n), SimComm(1, 0), fwd, bwd, scale,
                        True) for r in range(world)]
    times["allgather"] = [_timed(f, args.iters, args.warmup) for f in steps]
    peaks["allgather"] = max(_peak(f) for f in steps) + 2 * kg.numel() * kg.element_size()  # + the gathered k, v
    del kg, vg
    # Ulysses: H / W heads over the whole sequence (every rank the same), with the re-ordering it does
    if heads % world == 0:
        index = kv_head_index(heads, kv_heads, world)
        hk = kv_heads // world if index is None else len(index) // world
        qu, ku, vu, du = rnd(1, seq, heads // world, d), rnd(1, seq, hk, d), rnd(1, seq, hk, d), rnd(1, seq, heads // world, d)
        order = natural_order(layout, world, n)
        order = None if order is None else order.to(dev)
        inner = _plan_step(qu, ku, vu, du, local_plan(vis, seq), SimComm(1, 0), fwd, bwd, scale, False)

        def ulysses_step():
            if order is not None:  # Ulysses puts q, k, v, dout into natural order and out, dq, dk, dv back
                for t in (qu, ku, vu, du, qu, ku, vu, du):
                    t.index_select(1, order)
            inner()

        times["ulysses"] = [_timed(ulysses_step, args.iters, args.warmup)]
        # + the head-sharded q, k, v, dout it holds
        peaks["ulysses"] = _peak(ulysses_step) + sum(t.numel() * t.element_size() for t in (qu, ku, vu, du))
        del qu, ku, vu, du
    res["rank_s"] = times
    res["peak_bytes"] = peaks
    res["efficiency"] = {s: res["single_s"] / (world * max(t)) for s, t in times.items()}
    res["imbalance"] = {s: max(t) / (sum(t) / len(t)) for s, t in times.items()}
    call = cost.Call(1, n, heads, kv_heads, d, 2, layout, vis, world)
    for link, hw in (("nvlink", cost.Hardware()), ("internode50", cost.Hardware(p2p_gbps=50, a2a_gbps=50, allgather_gbps=50, reduce_scatter_gbps=50))):
        model = {}
        for s in times:
            p = cost.predict(call, s, hw)
            # measured compute + the model's exposed communication (the ring hides hops under its steps)
            ring_hidden = s == "ring"
            comm = p.comm_s if not ring_hidden else p.comm_s
            model[s] = {"predicted_s": p.seconds, "predicted_compute_s": p.compute_s, "comm_s": comm,
                        "modelled_total_s": max(times[s]) + comm,
                        "modelled_efficiency": res["single_s"] / (world * (max(times[s]) + comm)),
                        "memory_bytes": p.memory_bytes}
        pick = cost.choose(call, tuple(times), hw).strategy
        fastest = min(model, key=lambda s: model[s]["modelled_total_s"])
        res[link] = {"model": model, "pick": pick, "fastest": fastest,
                     "pick_vs_fastest": model[pick]["modelled_total_s"] / model[fastest]["modelled_total_s"]}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="32768x8,32768x4,32768x2,131072x8",
                   help="seq x world pairs, comma separated")
    p.add_argument("--heads", default="32/32,32/8", help="heads/kv_heads pairs")
    p.add_argument("--docs", default="", help="document mixes (lognormal, one_long): causal packed batches")
    p.add_argument("--layouts", default="contiguous,zigzag", help="layouts of the document rows")
    p.add_argument("--backend", default="fa4")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("strategies.json"))
    args = p.parse_args()
    probe = torch.empty(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, fwd, bwd = dispatch.select_kernels(args.backend, probe, Visibility(True), 0.0)
    rows = []
    for case in args.cases.split(","):
        seq, world = map(int, case.split("x"))
        for hh in args.heads.split(","):
            heads, kv_heads = map(int, hh.split("/"))
            variants = [(True, "zigzag", None), (False, "contiguous", None)]
            if args.docs:
                variants = [(True, lay, mix) for mix in args.docs.split(",") for lay in args.layouts.split(",")]
            for causal, layout, mix in variants:
                docs = None if mix is None else documents(mix, seq)
                r = bench_case(seq, world, heads, kv_heads, causal, layout, args, fwd, bwd, docs, mix)
                rows.append(r)
                eff = " ".join(f"{s} {e:.2f}" for s, e in r["efficiency"].items())
                nv = r["nvlink"]
                what = f"{mix} docs {layout}" if mix else ("causal " if causal else "full ") + layout
                imb = " ".join(f"{s} {e:.2f}" for s, e in r["imbalance"].items())
                print(f"S={seq} W={world} {heads}/{kv_heads} {what}: max/mean {imb} | "
                      f"single {r['single_s'] * 1e3:.2f} ms | compute-only eff {eff} | nvlink modelled "
                      + " ".join(f"{s} {m['modelled_efficiency']:.2f}" for s, m in nv["model"].items())
                      + f" | pick {nv['pick']} fastest {nv['fastest']} ({nv['pick_vs_fastest']:.3f}x)"
                      + f" | inter-node pick {r['internode50']['pick']} fastest {r['internode50']['fastest']}",
                      flush=True)
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
