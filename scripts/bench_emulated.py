"""Emulated links: each strategy's per-rank forward + backward with communication in the loop, on one GPU.

Simulated rank r of W runs its real loop (plan, block kernels, accumulations) and every transfer goes through
an emulated link (distcomm_attention/transport/emulated.py, Note [Emulated links]): the transfer occupies a
side stream for bytes / bandwidth + latency and the rank's compute stream waits on it exactly where the real
code waits on NCCL, so the measured time includes whatever communication the rank's schedule does not hide.

    efficiency = T_single(S) / (W * max_r T_rank)      T_single: one flash-attn-4 fwd+bwd over the sequence

Per row and strategy: the time with the link, the time with an ideal link (no wait, same copies: compute
only), the exposed communication (their difference), the cost model's prediction for that link and its
error, the bytes the rank sends, the cost model's pick and the measured fastest. Strategies: "ring" (the
ring loop, hops posted before the compute they overlap; the sparse ring's direct sends of the rows each
block reads where the strategy takes it, Note [Sparse ring]), "allgather" (the all-gather of k, v, or the sparse
exchange of only the needed keys where the exchange plan makes it cheaper, Note [Sparse gather]; the
backward gathers again and reduces dK/dV in fp32), "ulysses" (the strategy's own autograd Function as it
runs: every all-to-all waited before the kernels that need it) and "ulysses_pipelined" (the same with its
all-to-alls pipelined by head groups, Note [Ulysses pipeline]).

    python scripts/bench_emulated.py --cases 65536x8,131072x8 --docs one,lognormal --links nvlink,internode \
        --out docs/bench/emulated.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_strategies as bs  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning import cost  # noqa: E402
from distcomm_attention.planning.exchange import compact_gathered_plan, gathered_exchange, sparse_ring  # noqa: E402
from distcomm_attention.strategies.sparse_ring import sparse_ring_backward, sparse_ring_forward  # noqa: E402
from distcomm_attention.planning.plans import gathered_plan, local_plan  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402
from distcomm_attention.strategies.allgather import AllGatherKV, local_backward  # noqa: E402
from distcomm_attention.strategies.ring import ring_backward, ring_forward  # noqa: E402
from distcomm.ring import RingComm  # noqa: E402
from distcomm_attention import transport  # noqa: E402
from distcomm_attention.transport import CountingTransport  # noqa: E402
from distcomm_attention.planning.plans import natural_order  # noqa: E402
from distcomm_attention.strategies.dispatch import _Ring  # noqa: E402
from distcomm_attention.strategies.ulysses import ulysses  # noqa: E402
from distcomm_attention.transport.emulated import INTER_NODE, NVLINK, EmulatedLink, Links  # noqa: E402

LINKS = {"nvlink": NVLINK, "internode": INTER_NODE, "ideal": Links(1e9, 1e9, 1e9, 1e9, latency_us=0.0)}


class _Sent(CountingTransport):
    """The link, its bytes counted, with RingComm's ``send_recv`` signature for the ring loop."""

    def send_recv(self, *tensors, shift: int = 1, recv_like=None):
        if len(tensors) == 3 and isinstance(tensors[0], (list, tuple)):  # the transport's own (tensors, shift, shapes)
            return super().send_recv(*tensors)
        shapes = None if recv_like is None else [tuple(getattr(r, "shape", r)) for r in recv_like]
        return super().send_recv(tensors, shift, shapes)


class _One:
    """A ring of one for the single-step loops (nothing moves)."""

    size, rank = 1, 0


def _ring_step(t, q, k, v, dout, plan, fwd, bwd, scale):
    def step():
        out, lse = ring_forward(q, k, v, None, t, plan, 0.0, scale, fwd)
        ring_backward(dout, q, k, v, out, lse, None, t, plan, 0.0, scale, bwd)

    return step


def _sparse_ring_step(t, q, k, v, dout, sp, fwd, bwd, scale):
    """The ring with direct sparse sends (Note [Sparse ring]) where the strategy takes it."""

    def step():
        out, lse, kept = sparse_ring_forward(q, k, v, None, t, sp, 0.0, scale, fwd)
        sparse_ring_backward(dout, q, k, v, out, lse, None, t, sp, kept, 0.0, scale, bwd)

    return step


def _allgather_step(t, q, k, v, dout, concrete, vis, world, rank, fwd, bwd, scale):
    n = q.shape[1]
    plan = gathered_plan(concrete, vis, world, rank, n)
    ex = gathered_exchange(concrete, vis, world, n)
    if ex is not None:  # the strategy's own computation (own keys first, buffers kept when small)
        with transport.using(lambda group: t):
            computation = AllGatherKV(None, concrete, n, compact_gathered_plan(concrete, vis, world, rank, n), 0.0,
                                      scale, fwd, bwd, ex)

        def step():
            out, lse = computation.forward(q, k, v, None)
            computation.backward(dout, q, k, v, out, lse, None)

        return step, True
    else:
        def gather():
            hk, hv = t.all_gather(k[0]), t.all_gather(v[0])
            return hk.wait()[0].unsqueeze(0), hv.wait()[0].unsqueeze(0)

        def reduce(dk, dv):
            hk, hv = t.reduce_scatter(dk[0]), t.reduce_scatter(dv[0])
            return hk.wait()[0], hv.wait()[0]

    def step():
        kg, vg = gather()
        out, lse = ring_forward(q, kg, vg, None, _One(), plan, 0.0, scale, fwd)
        kg, vg = gather()
        _, dk, dv = local_backward(dout, q, kg, vg, out, lse, None, plan, 0.0, scale, bwd)
        reduce(dk, dv)

    return step, ex is not None


def _ulysses_step(t, q, k, v, dout, concrete, vis, world, fwd, bwd, scale, pipelined: bool):
    """The strategy itself (its autograd Function, re-ordering included) with the link as its transport."""
    n = q.shape[1]
    inner = _Ring(RingComm(None), local_plan(vis, world * n), 0.0, scale, fwd, bwd, natural_order(concrete, world, n))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        with transport.using(lambda group: t):
            out = ulysses(q, k, v, None, None, world, inner, pipelined=pipelined)
            torch.autograd.backward(out, dout)

    return step


def bench_row(seq, world, heads, kv_heads, mix, layout, links, args, fwd, bwd):
    dev, dt, d = torch.device("cuda"), torch.bfloat16, args.head_dim
    scale = d ** -0.5
    docs = None if mix == "one" else bs.documents(mix, seq)
    vis = Visibility(True, cu_seqlens=None if docs is None else tuple(docs))
    n = seq // world
    concrete = bs.plan_layout(layout, seq, world, docs, True)["concrete"]
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    single = bs._timed(bs._fa4_single(rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d),
                                      True, docs), args.iters, args.warmup)
    row = {"seq": seq, "world": world, "heads": heads, "kv_heads": kv_heads, "documents": mix,
           "layout": bs.layout_name(concrete), "single_s": single, "links": {}}
    q, k, v, dout = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    for link_name in ["ideal"] + links:
        per = {}
        for strategy in args.strategies:
            if strategy.startswith("ulysses") and heads % world:
                continue
            if strategy.startswith("ulysses"):
                ranks = [0]  # every rank the same
            else:
                ranks = bs.pick_ranks(bs.planned_rank_s(strategy, concrete, vis, world, n, heads, kv_heads, d),
                                      args.ranks)
            times, sent, sparse = [], 0, None
            for r in ranks:
                t = _Sent(EmulatedLink(world, r, LINKS[link_name]))
                sp = sparse_ring(concrete, vis, world, r, n)
                if strategy == "ring" and sp is not None:
                    f = _sparse_ring_step(t, q, k, v, dout, sp, fwd, bwd, scale)
                elif strategy == "ring":
                    f = _ring_step(t, q, k, v, dout, ring_plan(concrete, vis, world, r, n), fwd, bwd, scale)
                elif strategy == "allgather":
                    f, sparse = _allgather_step(t, q, k, v, dout, concrete, vis, world, r, fwd, bwd, scale)
                else:
                    f = _ulysses_step(t, q, k, v, dout, concrete, vis, world, fwd, bwd, scale,
                                      pipelined=strategy == "ulysses_pipelined")
                times.append(bs._timed(f, args.iters, args.warmup))
                t.sent.clear()
                f()
                torch.cuda.synchronize()
                sent = max(sent, t.total)
            per[strategy] = {"ranks": ranks, "rank_s": times, "max_s": max(times), "bytes_sent": sent,
                             "efficiency": single / (world * max(times))}
            if sparse is not None:
                per[strategy]["sparse"] = sparse
        row["links"][link_name] = per
    for link_name in links:
        per, ideal = row["links"][link_name], row["links"]["ideal"]
        lk = LINKS[link_name]
        hw = cost.Hardware(p2p_gbps=lk.p2p_gbps, a2a_gbps=lk.a2a_gbps, allgather_gbps=lk.allgather_gbps,
                           reduce_scatter_gbps=lk.reduce_scatter_gbps)
        call = cost.Call(1, n, heads, kv_heads, d, 2, concrete, vis, world)
        for s, m in per.items():
            p = cost.predict(call, "ulysses" if s.startswith("ulysses") else s, hw)
            m["exposed_comm_s"] = m["max_s"] - ideal[s]["max_s"]
            m["predicted_s"] = p.seconds
            m["prediction_error"] = p.seconds / m["max_s"] - 1
        fastest = min(per, key=lambda s: per[s]["max_s"])
        pick = cost.choose(call, tuple(s for s in per if s != "ulysses_pipelined"), hw).strategy
        row[f"{link_name}_fastest"], row[f"{link_name}_pick"] = fastest, pick
        row[f"{link_name}_pick_vs_fastest"] = per[pick]["max_s"] / per[fastest]["max_s"]
    return row


def _line(row) -> str:
    parts = [f"S={row['seq']} W={row['world']} {row['documents']} {row['layout']}: single {row['single_s']*1e3:.2f} ms"]
    for link, per in row["links"].items():
        shown = ", ".join(f"{s} {m['efficiency']:.2f}" + (f" ({m['max_s']*1e3:.2f} ms, pred {m['prediction_error']:+.0%})"
                                                            if "prediction_error" in m else "")
                          for s, m in per.items())
        parts.append(f"  {link}: {shown}" + (f"; pick {row[link + '_pick']}, fastest {row[link + '_fastest']}"
                                              if link + "_pick" in row else ""))
    return "\n".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="65536x8", help="SxW,... (S tokens over W simulated ranks)")
    parser.add_argument("--docs", default="one", help=f"document mixes: one of {', '.join(bs.MIXES)}, comma-separated")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--dense-layout", default="zigzag", help="the layout of the rows without documents")
    parser.add_argument("--links", default="nvlink,internode")
    parser.add_argument("--strategies", default="ring,allgather,ulysses,ulysses_pipelined",
                        help="ulysses: as the strategy runs (one head group); ulysses_pipelined: by head groups")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2, help="time the k busiest ranks (by plan) and rank 0")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="fa4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.strategies = args.strategies.split(",")
    heads, kv_heads = map(int, args.heads.split("/"))
    probe = torch.empty(1, 1, heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    _, fwd, bwd = dispatch.select_kernels(args.backend, probe, Visibility(True), 0.0)
    rows = []
    for case in args.cases.split(","):
        seq, world = map(int, case.split("x"))
        for mix in args.docs.split(","):
            layout = args.dense_layout if mix == "one" else args.layout
            row = bench_row(seq, world, heads, kv_heads, mix, layout, args.links.split(","), args, fwd, bwd)
            print(_line(row), flush=True)
            rows.append(row)
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
