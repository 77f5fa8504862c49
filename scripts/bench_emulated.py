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
runs: every all-to-all waited before the kernels that need it), "ulysses_halves" (in two halves where no
query sees a later key, Note [Ulysses halves]; off in the strategy by default) and "ulysses_pipelined" (its
all-to-alls pipelined by head groups, Note [Ulysses pipeline]).

    python scripts/bench_emulated.py --cases 65536x8,131072x8 --docs one,lognormal --links nvlink,internode \
        --out docs/bench/emulated.json
    python scripts/bench_emulated.py --host-cost      # one JSON line: the link's host time per post and wait

``rank_step`` builds one simulated rank's forward + backward of a strategy over any transport; the GPU test
tests/test_gpu_emulated.py runs it on an emulated link and on ``InstantLink`` (the same data at once) and
requires the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.planning import cost, layouts  # noqa: E402
from distcomm_attention.planning.exchange import sparse_ring  # noqa: E402
from distcomm_attention.strategies.sparse_ring import sparse_ring_backward, sparse_ring_forward  # noqa: E402
from distcomm_attention.planning.visibility import Visibility, ring_plan  # noqa: E402
from distcomm_attention.strategies.allgather import AllGatherKV  # noqa: E402
from distcomm_attention.strategies.ring import ring_backward, ring_forward  # noqa: E402
from distcomm.ring import RingComm  # noqa: E402
from distcomm_attention import transport  # noqa: E402
from distcomm_attention.transport import CountingTransport  # noqa: E402
from distcomm_attention.strategies.dispatch import _gathered, _Ring, _SparseRing, ulysses_inner  # noqa: E402
from distcomm_attention.strategies.ulysses import ulysses  # noqa: E402
from distcomm_attention.transport.emulated import INTER_NODE, NVLINK, EmulatedLink, InstantLink, Links  # noqa: E402

LINKS = {"nvlink": NVLINK, "internode": INTER_NODE, "ideal": Links(1e9, 1e9, 1e9, 1e9, latency_us=0.0)}


class _Sent(CountingTransport):
    """The link, its bytes counted, with RingComm's ``send_recv`` signature for the ring loop."""

    def send_recv(self, *tensors, shift: int = 1, recv_like=None):
        if len(tensors) == 3 and isinstance(tensors[0], (list, tuple)):  # the transport's own (tensors, shift, shapes)
            return super().send_recv(*tensors)
        shapes = None if recv_like is None else [tuple(getattr(r, "shape", r)) for r in recv_like]
        return super().send_recv(tensors, shift, shapes)


def _ring_step(t, q, k, v, dout, plan, fwd, bwd, scale):
    def step():
        out, lse = ring_forward(q, k, v, None, t, plan, 0.0, scale, fwd)
        return (out,) + tuple(ring_backward(dout, q, k, v, out, lse, None, t, plan, 0.0, scale, bwd))

    return step


def _sparse_ring_step(t, q, k, v, dout, sp, fwd, bwd, scale):
    """The ring with direct sparse sends (Note [Sparse ring]) where the strategy takes it."""

    def step():
        out, lse, kept = sparse_ring_forward(q, k, v, None, t, sp, 0.0, scale, fwd)
        return (out,) + tuple(sparse_ring_backward(dout, q, k, v, out, lse, None, t, sp, kept, 0.0, scale, bwd))

    return step


class _Groups:
    """A simulated rank's process groups and the link each one's transfers take: the factory of
    ``transport.using`` (it keeps the groups alive: the strategies hold groups weakly)."""

    def __init__(self, *pairs):
        self.pairs = pairs  # (group, transport)

    def __call__(self, group):
        for g, t in self.pairs:
            if g is group:
                return t
        raise KeyError(f"no simulated link for group {group!r}")


def _group(size: int, rank: int) -> dist.ProcessGroup:
    """A simulated process group: its size and this rank, nothing behind it (a link stands in for it)."""
    return dist.ProcessGroup(dist.HashStore(), rank, size)


def _gathered_computation(t, concrete, vis, world: int, rank: int, n: int, fwd, bwd, scale):
    """(the all-gather strategy's own computation over a simulated group whose transfers take ``t``, the
    groups' factory, whether it gathers sparsely): dense or sparse as the strategy decides (Note [Sparse
    gather]), own keys first, reduction overlapped (Note [All-gather KV])."""
    group = _group(world, rank)
    groups = _Groups((group, t))
    plan, ex = _gathered(concrete, vis, world, rank, n)
    with transport.using(groups):
        computation = AllGatherKV(group, concrete, n, plan, 0.0, scale, fwd, bwd, ex)
    return computation, groups, ex is not None


def _allgather_step(t, q, k, v, dout, concrete, vis, world, rank, fwd, bwd, scale):
    computation, groups, sparse = _gathered_computation(t, concrete, vis, world, rank, q.shape[1], fwd, bwd, scale)

    def step():
        with transport.using(groups):
            out, lse = computation.forward(q, k, v, None)
            return (out,) + tuple(computation.backward(dout, q, k, v, out, lse, None))

    return step, sparse


def _hybrid_step(strategy, t_ulysses, t_ring, q, k, v, dout, concrete, vis, degree: int, rings: int,
                 ring_rank: int, fwd, bwd, scale):
    """(step, whether its ring dimension sends sparsely) of a hybrid's rank, Ulysses rank 0 of ``degree`` on ring rank
    ``ring_rank`` of ``rings``, as the strategy runs it: Ulysses' autograd Function over ``t_ulysses`` around
    the ring ("hybrid": the relaying ring loop) or the all-gather computation ("hybrid_allgather") over
    ``t_ring``; ``concrete``: the layout over the ring dimension, shards of ``degree`` x the local rows."""
    m = degree * q.shape[1]
    ulysses_group = _group(degree, 0)
    if strategy == "hybrid":  # the relay, or the sparse ring's direct sends where the strategy takes them
        sp = sparse_ring(concrete, vis, rings, ring_rank, m)
        inner = (_Ring(t_ring, ring_plan(concrete, vis, rings, ring_rank, m), 0.0, scale, fwd, bwd) if sp is None
                 else _SparseRing(t_ring, sp, 0.0, scale, fwd, bwd))
        groups, sparse = _Groups((ulysses_group, t_ulysses)), sp is not None
    else:
        inner, ring_groups, sparse = _gathered_computation(t_ring, concrete, vis, rings, ring_rank, m, fwd, bwd,
                                                           scale)
        groups = _Groups((ulysses_group, t_ulysses), *ring_groups.pairs)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        with transport.using(groups):
            out = ulysses(q, k, v, None, ulysses_group, degree, inner)
            return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)

    return step, sparse


def _ulysses_step(t, q, k, v, dout, concrete, vis, world, fwd, bwd, scale, pipelined: bool, split: bool = False):
    """The strategy itself (its autograd Function, re-ordering included) with the link as its transport;
    ``split``: in two halves where they apply (Note [Ulysses halves])."""
    n = q.shape[1]
    inner = ulysses_inner(RingComm(None), vis, concrete, world, n, 0.0, scale, fwd, bwd, split=split)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        with transport.using(lambda group: t):
            out = ulysses(q, k, v, None, None, world, inner, pipelined=pipelined)
            return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)

    return step


STRATEGIES = ("ring", "allgather", "ulysses", "ulysses_halves", "ulysses_pipelined", "hybrid", "hybrid_allgather",
              "ring_mesh", "allgather_mesh", "ulysses_mesh")
HYBRIDS = ("hybrid", "hybrid_allgather")
# the 1-D strategies over all the mesh's ranks on its sharding (``layouts.mesh_assignment``): what "auto" on a
# 2-D mesh also weighs
ON_MESH = ("ring_mesh", "allgather_mesh", "ulysses_mesh")


def plan_case(seq: int, world: int, mix: str, layout: str):
    """(cu_seqlens or None, visibility, the planner's layout) of a causal row: ``mix`` a document mix of
    scripts/bench_strategies.py ("one": a single sequence), ``layout`` resolved as bench_strategies does."""
    docs = None if mix == "one" else bs.documents(mix, seq)
    vis = Visibility(True, cu_seqlens=None if docs is None else tuple(docs))
    return docs, vis, bs.plan_layout(layout, seq, world, docs, True)["concrete"]


def rank_step(strategy: str, t, q, k, v, dout, concrete, vis, world: int, rank: int, fwd, bwd, scale: float, *,
              degree: int = 1, t_ring=None):
    """Simulated rank ``rank`` of ``world`` running ``strategy`` over transport ``t`` (a ``_Sent``) on its
    shards q, dout (1, n, H, D) and k, v (1, n, Hkv, D) -> (path, step): the path the strategy takes on this
    rank ("ring", "sparse_ring", "allgather", "sparse_allgather", "ulysses", "ulysses_halves",
    "ulysses_pipelined", "hybrid", "hybrid_sparse", "hybrid_allgather", "hybrid_sparse_allgather") and a
    function that runs its forward + backward once and returns (out, dq, dk, dv). The hybrids: Ulysses of ``degree`` over ``t``
    around ``world / degree`` rings over ``t_ring``; ``rank`` the ring rank, ``concrete`` the layout over the
    ring dimension."""
    n = q.shape[1]
    if strategy == "ring":
        sp = sparse_ring(concrete, vis, world, rank, n)
        if sp is not None:
            return "sparse_ring", _sparse_ring_step(t, q, k, v, dout, sp, fwd, bwd, scale)
        return "ring", _ring_step(t, q, k, v, dout, ring_plan(concrete, vis, world, rank, n), fwd, bwd, scale)
    if strategy == "allgather":
        step, sparse = _allgather_step(t, q, k, v, dout, concrete, vis, world, rank, fwd, bwd, scale)
        return ("sparse_allgather" if sparse else "allgather"), step
    if strategy in ("ulysses", "ulysses_halves", "ulysses_pipelined"):
        return strategy, _ulysses_step(t, q, k, v, dout, concrete, vis, world, fwd, bwd, scale,
                                       pipelined=strategy == "ulysses_pipelined", split=strategy == "ulysses_halves")
    if strategy in HYBRIDS:
        if degree < 2 or world % degree or t_ring is None:
            raise ValueError(f"strategy {strategy!r} needs a Ulysses degree >= 2 dividing the world ({world}) and a "
                             f"ring link, got degree={degree}, t_ring={t_ring!r}")
        step, sparse = _hybrid_step(strategy, t, t_ring, q, k, v, dout, concrete, vis, degree, world // degree,
                                    rank, fwd, bwd, scale)
        return (strategy.replace("hybrid", "hybrid_sparse", 1) if sparse else strategy), step
    raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def _hardware(links: Links, across: Links | None = None) -> cost.Hardware:
    """The cost model's hardware for emulated links (``across``: the hybrids' ring dimension's)."""
    hw = cost.Hardware(p2p_gbps=links.p2p_gbps, a2a_gbps=links.a2a_gbps, allgather_gbps=links.allgather_gbps,
                       reduce_scatter_gbps=links.reduce_scatter_gbps, latency_s=links.latency_us * 1e-6)
    return hw if across is None else dataclasses.replace(hw, across=_hardware(across))


def _inside(link_name: str) -> Links:
    """The hybrids' Ulysses dimension's links (inside a node): NVLink-class, or none for the ideal link."""
    return LINKS["ideal"] if link_name == "ideal" else NVLINK


def bench_row(seq, world, heads, kv_heads, mix, layout, links, args, fwd, bwd):
    """One row: every strategy's slowest timed rank per link, beside one flash-attn-4 call. The hybrids run
    Ulysses of degree ``args.ulysses`` inside a node (NVLink-class links) around rings of ``world /
    args.ulysses`` ranks over the row's link."""
    dev, dt, d = torch.device("cuda"), torch.bfloat16, args.head_dim
    scale = d ** -0.5
    docs, vis, concrete = plan_case(seq, world, mix, layout)
    degree = getattr(args, "ulysses", 0) or 0
    mesh = 2 <= degree < world and world % degree == 0 and heads % degree == 0
    rings = world // degree if mesh else 1
    concrete_mesh = plan_case(seq, rings, mix, layout)[2] if mesh else None
    flat = layouts.mesh_assignment(concrete_mesh, seq, tuple(tuple(r * degree + u for u in range(degree))
                                                             for r in range(rings))) if mesh else None
    n = seq // world
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    single = bs._timed(bs._fa4_single(rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d),
                                      True, docs), args.iters, args.warmup)
    row = {"seq": seq, "world": world, "heads": heads, "kv_heads": kv_heads, "documents": mix,
           "layout": bs.layout_name(concrete), "single_s": single, "links": {}}
    if mesh:
        row.update(ulysses=degree, rings=rings, mesh_layout=bs.layout_name(concrete_mesh))
    q, k, v, dout = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    kv_sent = cost._kv_sent(heads, kv_heads, degree) if mesh else kv_heads
    for link_name in ["ideal"] + links:
        per = {}
        for strategy in args.strategies:
            if strategy.startswith("ulysses") and heads % world or strategy in HYBRIDS + ON_MESH and not mesh:
                continue
            base, lay = (strategy[:-len("_mesh")], flat) if strategy in ON_MESH else (strategy, concrete)
            if base.startswith("ulysses"):
                ranks = [0]  # every rank the same
            elif strategy in HYBRIDS:  # ring ranks; every Ulysses rank of one ring rank the same
                ranks = bs.pick_ranks(bs.planned_rank_s("ring" if strategy == "hybrid" else "allgather", concrete_mesh,
                                                        vis, rings, degree * n, heads // degree, kv_sent // degree, d,
                                                        packs=getattr(fwd, "packs", False)),
                                      args.ranks)
            else:
                ranks = bs.pick_ranks(bs.planned_rank_s(base, lay, vis, world, n, heads, kv_heads, d,
                                                        packs=getattr(fwd, "packs", False)), args.ranks)
            times, gpu, host, sent, sparse = [], [], [], 0, None
            for r in ranks:
                if strategy in HYBRIDS:
                    t = _Sent(EmulatedLink(degree, 0, _inside(link_name)))
                    t_ring = _Sent(EmulatedLink(rings, r, LINKS[link_name]))
                    path, f = rank_step(strategy, t, q, k, v, dout, concrete_mesh, vis, world, r, fwd, bwd, scale,
                                        degree=degree, t_ring=t_ring)
                    counted = (t, t_ring)
                else:
                    t = _Sent(EmulatedLink(world, r, LINKS[link_name]))
                    path, f = rank_step(base, t, q, k, v, dout, lay, vis, world, r, fwd, bwd, scale)
                    counted = (t,)
                if base in ("allgather", "hybrid", "hybrid_allgather"):
                    sparse = "sparse" in path
                times.append(bs._timed(f, args.iters, args.warmup))
                if getattr(args, "host_time", False):  # the kernels alone (host kept ahead) and the host alone
                    gpu.append(U.gpu_seconds(f, args.iters, ahead_s=2 * times[-1] + 1e-3))
                    host.append(U.host_seconds(f, times[-1], args.iters, dev))
                for c in counted:
                    c.sent.clear()
                f()
                torch.cuda.synchronize()
                sent = max(sent, sum(c.total for c in counted))
            per[strategy] = {"ranks": ranks, "rank_s": times, "max_s": max(times), "bytes_sent": sent,
                             "efficiency": single / (world * max(times))}
            if host:
                per[strategy].update(gpu_s=gpu, host_s=host)
            if sparse is not None:
                per[strategy]["sparse"] = sparse
        row["links"][link_name] = per
    for link_name in links:
        per, ideal = row["links"][link_name], row["links"]["ideal"]
        hw = _hardware(LINKS[link_name])
        packs = getattr(args, "packs", False)
        call = cost.Call(1, n, heads, kv_heads, d, 2, concrete, vis, world, packs=packs)
        if mesh:
            hw_mesh = _hardware(_inside(link_name), across=LINKS[link_name])
            call_mesh = cost.Call(1, n, heads, kv_heads, d, 2, concrete_mesh, vis, world, degree, packs=packs)
            call_flat = dataclasses.replace(call_mesh, layout=flat, ulysses=1)
        for s, m in per.items():
            if s in HYBRIDS:
                p = cost.predict(call_mesh, s, hw_mesh)
            elif s in ON_MESH:
                p = cost.predict(call_flat, s[:-len("_mesh")], cost.links_across(hw_mesh))
            else:
                p = cost.predict(dataclasses.replace(call, ulysses_halves=s == "ulysses_halves"),
                                 "ulysses" if s.startswith("ulysses") else s, hw)
            m["exposed_comm_s"] = m["max_s"] - ideal[s]["max_s"]
            m["predicted_s"] = p.seconds
            m["prediction_error"] = p.seconds / m["max_s"] - 1
        fastest = min(per, key=lambda s: per[s]["max_s"])
        row[f"{link_name}_fastest"] = fastest
        one_d = tuple(s for s in per if s in ("ring", "allgather", "ulysses"))
        picks = {"": (one_d and cost.choose(call, one_d, hw).strategy)}
        if mesh:  # "auto" on the mesh: the hybrids and the 1-D strategies over its ranks that ran
            hybrids, on_mesh = (tuple(s for s in per if s in names) for names in (HYBRIDS, ON_MESH))
            asked = [(call_mesh, hybrids, hw_mesh)] if hybrids else []
            if on_mesh:
                asked.append((call_flat, tuple(s[:-len("_mesh")] for s in on_mesh), cost.links_across(hw_mesh)))
            if asked:
                picked = cost.choose_among(*asked).strategy
                picks["mesh_"] = picked if picked in HYBRIDS else picked + "_mesh"
        sets = {"": one_d, "mesh_": HYBRIDS + ON_MESH}
        for prefix, pick in picks.items():
            if not pick:
                continue
            best = min((s for s in per if s in sets[prefix]), key=lambda s: per[s]["max_s"])  # of its candidates
            row[f"{link_name}_{prefix}pick"] = pick
            row[f"{link_name}_{prefix}pick_vs_fastest"] = per[pick]["max_s"] / per[best]["max_s"]
            row[f"{link_name}_{prefix}pick_efficiency"] = per[pick]["efficiency"]
    return row


def _host_us(post, posts: int, warmup: int = 20) -> dict:
    """Host microseconds of ``post()`` (it posts one operation and returns its handle) and of the handle's
    ``wait()``, each timed on its own (time.perf_counter) with the device idle before the post: median and
    mean over ``posts`` calls after ``warmup``."""
    for _ in range(warmup):
        post().wait()
    posting, waiting = [], []
    for _ in range(posts):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = post()
        t1 = time.perf_counter()
        handle.wait()
        t2 = time.perf_counter()
        posting.append(t1 - t0)
        waiting.append(t2 - t1)
        del handle
    torch.cuda.synchronize()
    return {"post_us": statistics.median(posting) * 1e6, "post_mean_us": statistics.mean(posting) * 1e6,
            "wait_us": statistics.median(waiting) * 1e6}


HOST_COST_ROWS = 1024  # rows per rank of --host-cost's tensors (a post's host work does not depend on them)


def host_cost(args) -> dict:
    """The emulated link's host time per operation (``--host-cost``): each operation of Note [Transport] as
    the strategies post it, for simulated rank 0 of W (the first ``--cases`` entry's), on n = HOST_COST_ROWS
    rows of ``--heads`` / ``--head-dim`` in bf16; on an ``EmulatedLink`` ("emulated", the "ideal" link: a
    post's host work is the same on every link) and on ``InstantLink`` ("instant": the same data made at
    once, the host cost of the copies alone).

        send_recv         a ring hop: k, v (1, n, Hkv, D), received as sent
        send_recv_shaped  a sparse-ring hop: k, v and key-mask bytes (1, n), received as n / 2 rows
        all_gather        (n, Hkv, D) -> (W n, Hkv, D)
        all_to_all_v      Ulysses' all-to-all of q: (W, 1, n, H / W, D), one row per rank
    """
    world = int(args.cases.split(",")[0].split("x")[1])
    heads, kv_heads = map(int, args.heads.split("/"))
    n, d = HOST_COST_ROWS, args.head_dim
    dev = torch.device("cuda")
    k = torch.randn(1, n, kv_heads, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(1, n, device=dev, dtype=torch.uint8)
    q_a2a = torch.randn(world, 1, n, max(heads // world, 1), d, device=dev, dtype=torch.bfloat16)
    half = [(1, n // 2, kv_heads, d), (1, n // 2, kv_heads, d), (1, n // 2)]
    ops = {
        "send_recv": lambda t: t.send_recv((k, v), 1),
        "send_recv_shaped": lambda t: t.send_recv((k, v, mask), 1, half),
        "all_gather": lambda t: t.all_gather(k[0]),
        "all_to_all_v": lambda t: t.all_to_all_v(q_a2a, [1] * world, [1] * world),
    }
    links = {"emulated": EmulatedLink(world, 0, LINKS["ideal"]), "instant": InstantLink(world, 0)}
    cost_us = {name: {link: _host_us(lambda: op(t), args.posts) for link, t in links.items()}
               for name, op in ops.items()}
    return {"host_cost": cost_us, "world": world, "rows": n, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
            "posts": args.posts, "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def host_probe_us(launches: int = 500) -> float:
    """This machine's host microseconds per launch of a one-element CUDA op (median of 5 runs of
    ``launches``, the GPU kept ahead; fewer than CUDA's queue of pending launches holds): a reference for the
    host terms of the rows, which move with the CPU."""
    x = torch.zeros(1, device="cuda")

    def run():
        for _ in range(launches):
            x.add_(1)

    run()
    return 1e6 * U.host_seconds(run, 1e-6 * 20 * launches, 5, x.device) / launches


def _line(row) -> str:
    parts = [f"S={row['seq']} W={row['world']} {row['documents']} {row['layout']}: single {row['single_s']*1e3:.2f} ms"]
    for link, per in row["links"].items():
        shown = ", ".join(f"{s} {m['efficiency']:.2f}" + (f" ({m['max_s']*1e3:.2f} ms, pred {m['prediction_error']:+.0%})"
                                                            if "prediction_error" in m else "")
                          + (f" [gpu {max(m['gpu_s'])*1e3:.2f}, host {max(m['host_s'])*1e3:.2f} ms]" if "host_s" in m
                             else "")
                          for s, m in per.items())
        parts.append(f"  {link}: {shown}" + (f"; pick {row[link + '_pick']}, fastest {row[link + '_fastest']}"
                                              if link + "_pick" in row else "")
                     + (f"; mesh pick {row[link + '_mesh_pick']}" if link + "_mesh_pick" in row else ""))
    return "\n".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="65536x8", help="SxW,... (S tokens over W simulated ranks)")
    parser.add_argument("--docs", default="one", help=f"document mixes: one of {', '.join(bs.MIXES)}, comma-separated")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--dense-layout", default="zigzag", help="the layout of the rows without documents")
    parser.add_argument("--links", default="nvlink,internode")
    parser.add_argument("--strategies", default="ring,allgather,ulysses,ulysses_pipelined",
                        help="ulysses: as the strategy runs (one head group); ulysses_pipelined: by head groups; "
                             "ulysses_halves: in two halves; with --ulysses U: hybrid, hybrid_allgather and "
                             "ring_mesh, allgather_mesh, ulysses_mesh (the 1-D strategies on the mesh's sharding)")
    parser.add_argument("--ulysses", type=int, default=0,
                        help="the hybrids' Ulysses degree (inside a node, NVLink-class links; the rings over "
                             "--links); a row whose world or heads it does not divide runs no mesh strategy")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ranks", type=bs.parse_ranks, default=2,
                        help="time the k busiest ranks (by the cost model's compute, packed calls counted) and rank 0; "
                             "'all': every rank")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="fa4")
    parser.add_argument("--out", default=None)
    parser.add_argument("--host-cost", action="store_true",
                        help="print one JSON line: the link's host microseconds per post and wait, per operation")
    parser.add_argument("--posts", type=int, default=500, help="timed posts per operation for --host-cost")
    parser.add_argument("--host-time", action="store_true",
                        help="per timed rank also gpu_s (CUDA time with the host kept ahead by a GPU sleep: the "
                             "kernels and the link alone) and host_s (host seconds per call: Python and launches), "
                             "and the machine's host_probe_us_per_launch in the JSON")
    args = parser.parse_args()
    if args.host_cost:
        print(json.dumps(host_cost(args)), flush=True)
        return
    args.strategies = args.strategies.split(",")
    heads, kv_heads = map(int, args.heads.split("/"))
    probe = torch.empty(1, 1, heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    name, fwd, bwd = dispatch.select_kernels(args.backend, probe, Visibility(True), 0.0)
    args.packs = dispatch.packs(name)  # the cost model counts the calls this backend issues
    rows, meta = [], {"device": torch.cuda.get_device_name()}
    if args.host_time:
        meta["host_probe_us_per_launch"] = host_probe_us()
    for case in args.cases.split(","):
        seq, world = map(int, case.split("x"))
        for mix in args.docs.split(","):
            layout = args.dense_layout if mix == "one" else args.layout
            row = bench_row(seq, world, heads, kv_heads, mix, layout, args.links.split(","), args, fwd, bwd)
            print(_line(row), flush=True)
            rows.append(row)
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows, **meta}, indent=1))


if __name__ == "__main__":
    main()
