"""Real links: every context-parallel strategy on W GPUs over NCCL, beside its emulated and predicted time.

One process per GPU runs the public call, ``context_parallel_attn(strategy=...)`` forward + backward, on its
shard of one sequence (the same random q, k, v on every rank, sharded by ``shard_sequence``):

    efficiency = T_single(S) / (W * T_W)     T_single: one flash-attn-4 fwd+bwd over the whole sequence
                                             on one of the same GPUs (varlen for packed documents), same run
                                             T_W: the slowest rank's mean fwd+bwd (CUDA events, ranks lined up)

Per row and strategy: T_W, per-GPU TFLOP/s, efficiency, peak memory (``max_memory_allocated`` during the
timed loop, this rank's shards included, the whole sequence freed before), the bytes the busiest rank sent
in one fwd+bwd (the strategies' transport counted; the ring's hops counted at ``RingComm.send_recv``; the
cross-rank verification on the host not counted) beside the exchange plan's minimum, the cost model's
prediction (``which_strategy``, default NVLink hardware) and its error, and, with ``--emulated``, the
emulated-link time of scripts/bench_emulated.py for the same row (its "nvlink" link) and its error. Dense
rows also run PyTorch's ``context_parallel`` (ring, SDPA under cuDNN and FlashAttention-2) for time and
peak memory.

    python scripts/bench_real.py --world 2 --seqs 8k,16k,32k,64k --docs one,lognormal,pareto \
        --emulated docs/bench/real_emulated_w2.json --out docs/bench/real_w2.json

``--device cpu`` runs the same loop on gloo with the PyTorch kernels (a smoke run; no baseline kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm.ring import RingComm  # noqa: E402
from distcomm_attention import context_parallel_attn, shard_sequence, which_strategy  # noqa: E402
from distcomm_attention import transport  # noqa: E402
from distcomm_attention.planning import balance  # noqa: E402
from distcomm_attention.planning.exchange import exchange_plan  # noqa: E402
from distcomm_attention.planning.visibility import Visibility  # noqa: E402
from distcomm_attention.transport import CountingTransport  # noqa: E402
from distcomm_attention.transport.torch_dist import TorchTransport  # noqa: E402

STRATEGIES = ("ring", "allgather", "ulysses", "auto")


class _Wire:
    """Bytes this rank puts on the wire: the transports' (counted) plus the ring's hops (tensors on the data's device:
    on NCCL the verification exchange runs on the host)."""

    def __init__(self):
        self.transports: list[CountingTransport] = []
        self.ring = 0

    def factory(self, group):
        t = CountingTransport(TorchTransport(group))
        self.transports.append(t)
        return t

    @property
    def total(self) -> int:
        return self.ring + sum(t.total for t in self.transports)


def _counting_ring(wire: _Wire, device: torch.device):
    original = RingComm.send_recv

    def send_recv(self, *tensors, shift: int = 1, **kwargs):
        inside = any(self is getattr(t.inner, "_ring", None) for t in wire.transports)  # counted there already
        if shift % self.size and not inside:
            wire.ring += sum(t.numel() * t.element_size() for t in tensors if t.device == device)
        return original(self, *tensors, shift=shift, **kwargs)

    return original, send_recv


def plan_minimum(concrete, vis, world, n, rank, kv_heads, d, itemsize) -> int:
    """The exchange plan's bytes for ``rank``: its rows that others need (k, v in the input dtype) out, and
    the dK, dV of the rows it received (fp32, as the strategies reduce them) back."""
    ex = exchange_plan(concrete, vis, world, n)
    sent, received = ex.remote_rows(rank)
    row = 2 * kv_heads * d
    return sent * row * itemsize + received * row * 4


def _flops(seq, heads, d, docs, causal) -> float:
    """Attention fwd+bwd FLOPs over the visible pairs (4 matmuls forward-equivalent x 3.5)."""
    lengths = [seq] if docs is None else [b - a for a, b in zip(docs, docs[1:])]
    pairs = sum(L * (L + 1) / 2 if causal else L * L for L in lengths)
    return 3.5 * 4 * pairs * heads * d


def _single(q, k, v, causal, docs, device, args):
    if device.type != "cuda":
        return None
    return U.time_loop(bs._fa4_single(q, k, v, causal, docs), iters=args["iters"], warmup=args["warmup"],
                       device=device, barrier=False)


def bench_case(seq, mix, causal, world, rank, device, args) -> dict:
    heads, kv_heads, d = args["heads"], args["kv_heads"], args["head_dim"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    docs = None if mix == "one" else bs.documents(mix, seq)
    layout = ("zigzag" if causal else "contiguous") if docs is None else args["layout"]
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dt, generator=g)  # noqa: E731
    q, k, v, dout = rnd(1, seq, heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, kv_heads, d), rnd(1, seq, heads, d)
    single = _single(q, k, v, causal, docs, device, args)
    cu = None if docs is None else torch.tensor(docs, dtype=torch.int32, device=device)
    local = [shard_sequence(x, layout, cu_seqlens=cu).contiguous() for x in (q, k, v, dout)]
    del q, k, v, dout
    U.release_memory(device)
    n = seq // world
    vis = Visibility(causal, cu_seqlens=None if docs is None else tuple(docs))
    concrete = balance.resolve(layout, seq, world, None if docs is None else tuple(docs))
    choice = which_strategy(local[0], local[1], layout=layout, causal=causal, cu_seqlens=cu)
    row = {"seq": seq, "world": world, "documents": mix, "causal": causal, "layout": bs.layout_name(concrete),
           "single_s": single, "flops": _flops(seq, heads, d, docs, causal), "pick": choice.strategy,
           "plan_min_bytes": max(plan_minimum(concrete, vis, world, n, r, kv_heads, d, local[1].element_size())
                                 for r in range(world)),
           "strategies": {}}
    ql, kl, vl = (x.detach().requires_grad_() for x in local[:3])
    dl = local[3]
    for strategy in args["strategies"]:
        if strategy == "ulysses" and heads % world:
            continue

        def step():
            out = context_parallel_attn(ql, kl, vl, strategy=strategy, causal=causal, layout=layout, cu_seqlens=cu)
            out.backward(dl)
            ql.grad = kl.grad = vl.grad = None

        U.release_memory(device)
        with U.PeakMemory(device) as pm:
            t = U.time_loop(step, iters=args["iters"], warmup=args["warmup"], device=device)
        wire = _Wire()
        original, counted = _counting_ring(wire, device)
        RingComm.send_recv = counted
        try:
            with transport.using(wire.factory):
                step()
            U.synchronize(device)
        finally:
            RingComm.send_recv = original
        t_max, peak, sent = U.all_max([t, pm.bytes or 0, wire.total], device)
        m = {"max_s": t_max, "peak_bytes": int(peak), "bytes_sent": int(sent),
             "tflops_per_gpu": row["flops"] / world / t_max / 1e12}
        if single:
            m["efficiency"] = single / (world * t_max)
        predicted = choice.predictions.get(choice.strategy if strategy == "auto" else strategy)
        if predicted is not None:
            m["predicted_s"] = predicted.seconds
            m["prediction_error"] = predicted.seconds / t_max - 1
        row["strategies"][strategy] = m
    if docs is None and device.type == "cuda" and args["context_parallel"]:
        row["context_parallel"] = _torch_cp(seq, causal, world, device, args)
    return row


def _torch_cp(seq, causal, world, device, args) -> dict:
    import bench_ring_attention as bra

    out = {}
    for backend in ("cudnn", "flash"):
        c = {"batch": 1, "S": seq, "H": args["heads"], "Hkv": args["kv_heads"], "D": args["head_dim"],
             "causal": causal, "sdpa_backend": backend, "iters": args["iters"], "warmup": args["warmup"]}
        res, err = U.guarded(lambda: bra.bench_cp(c, device, torch.bfloat16), device)
        if err:
            out[backend] = {"error": err}
            continue
        t, peak = U.all_max([res["fwdbwd_s"], res["peak"] or 0], device)
        out[backend] = {"max_s": t, "peak_bytes": int(peak), "note": res.get("note", "")}
    return out


def run_rank(rank: int, world: int, cfg: dict) -> list:
    device = U.rank_device(cfg["backend_dist"])
    rows = []
    for seq, mix, causal in cfg["cases"]:
        row, err = U.guarded(lambda: bench_case(seq, mix, causal, world, rank, device, cfg), device)
        if err:
            row = {"seq": seq, "documents": mix, "causal": causal, "error": err}
        if rank == 0:
            print(_line(row), flush=True)
        rows.append(row)
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _line(row) -> str:
    head = f"S={row['seq']} {row['documents']} {'causal' if row['causal'] else 'full'}"
    if "error" in row:
        return f"{head}: {row['error']}"
    parts = [f"{head} {row['layout']}: single {_ms(row['single_s'])} ms, pick {row['pick']}, "
             f"plan min {row['plan_min_bytes'] / 2**20:.1f} MiB"]
    for s, m in row["strategies"].items():
        parts.append(f"  {s:9s} {_ms(m['max_s'])} ms  eff {m.get('efficiency', float('nan')):.3f}  "
                     f"{m['tflops_per_gpu']:.0f} TF/GPU  peak {m['peak_bytes'] / 2**30:.2f} GiB  "
                     f"sent {m['bytes_sent'] / 2**20:.1f} MiB  pred {m.get('prediction_error', float('nan')):+.0%}"
                     + (f"  emul {m['emulated_error']:+.0%}" if "emulated_error" in m else ""))
    for b, m in row.get("context_parallel", {}).items():
        parts.append(f"  torch_cp/{b} " + (m["error"] if "error" in m else
                                           f"{_ms(m['max_s'])} ms  peak {m['peak_bytes'] / 2**30:.2f} GiB"))
    return "\n".join(parts)


def _join_emulated(rows, path):
    """Add each strategy's emulated-link (NVLink-class) time and the real time's error against it."""
    emulated = json.loads(Path(path).read_text())["rows"]
    for row in rows:
        for e in emulated:
            if (e["seq"], e["world"], e["documents"]) != (row.get("seq"), row.get("world"), row.get("documents")):
                continue
            if not row.get("causal"):
                continue
            for s, m in row["strategies"].items():
                em = e["links"].get("nvlink", {}).get(s)
                if em:
                    m["emulated_s"] = em["max_s"]
                    m["emulated_error"] = em["max_s"] / m["max_s"] - 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqs", default="8k,16k,32k,64k", help="total tokens of the dense rows")
    p.add_argument("--packed-seq", default="128k", help="total tokens of the packed rows")
    p.add_argument("--docs", default="one,lognormal,pareto", help=f"mixes ({', '.join(bs.MIXES)}); one: dense")
    p.add_argument("--full", action="store_true", help="dense rows also without the causal mask")
    p.add_argument("--layout", default="auto", help="layout of the packed rows")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-context-parallel", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--emulated", default=None, help="scripts/bench_emulated.py JSON(s) of the same rows, comma-separated")
    p.add_argument("--from-json", default=None, help="join --emulated into this earlier run's JSON (nothing runs)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.from_json:
        report = json.loads(Path(a.from_json).read_text())
        for path in a.emulated.split(","):
            _join_emulated(report["rows"], path)
        print("\n".join(map(_line, report["rows"])))
        U.write_json(Path(a.out or a.from_json), report)
        return
    heads, kv_heads = map(int, a.heads.split("/"))
    cases = []
    for mix in a.docs.split(","):
        if mix == "one":
            for seq in a.seqs.split(","):
                cases += [(U.parse_count(seq), "one", True)] + ([(U.parse_count(seq), "one", False)] if a.full else [])
        else:
            cases.append((U.parse_count(a.packed_seq), mix, True))
    cfg = {"cases": cases, "heads": heads, "kv_heads": kv_heads, "head_dim": a.head_dim, "iters": a.iters,
           "warmup": a.warmup, "strategies": a.strategies.split(","), "layout": a.layout,
           "context_parallel": not a.no_context_parallel,
           "backend_dist": "nccl" if a.device == "cuda" else "gloo"}
    results = U.launch(run_rank, a.world, cfg, backend=cfg["backend_dist"], timeout=900)
    if not results:
        return
    rows = results[0]
    if a.emulated:
        for path in a.emulated.split(","):
            _join_emulated(rows, path)
        print("with the emulated times:\n" + "\n".join(map(_line, rows)))
    report = {"rows": rows, "command": U.command_line(), "commit": U.git_commit(),
              "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "world": a.world}
    if a.out:
        U.write_json(Path(a.out), report)


if __name__ == "__main__":
    main()
