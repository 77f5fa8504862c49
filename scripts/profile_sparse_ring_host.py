"""Host (Python) time of one simulated rank's sparse-ring forward + backward on a packed mix of documents.

One rank of W runs the sparse ring's own loop (``sparse_ring_forward`` / ``sparse_ring_backward``, Note [Sparse
ring]) over ``InstantLink`` (its simulated peers' rows arrive at once; nothing waits), with either stub block
kernels that return zero tensors of the right shapes (``--backend stub``, the default: what is left is the
host work around the kernels: plans, index tensors, slices, merges, posts) or a real backend (``fa4`` on a
GPU). The rank is the one whose sparse plan has the most blocks (``--rank`` to pick another). Printed, one JSON
line:

- ``host_ms``: wall time per fwd+bwd (median of ``--iters``), time.perf_counter; on CUDA each call is timed
  behind its own queued ``torch.cuda._sleep`` so that the host never waits for the GPU;
- ``python_calls``: function calls (Python and builtin, cProfile's count) per fwd+bwd, and ``calls_by_file``
  (a builtin counted where it is called from);
- ``torch_ops``: operators dispatched per fwd+bwd (views included; a TorchDispatchMode count), the host's
  per-operator cost on a GPU, and ``ops_by_file`` (the innermost project file that issued each);
- ``sends`` / ``bytes_sent``: what the rank posts per fwd+bwd (unchanged by host-side work);
- the pack (documents, mean length), the plan (steps, blocks) and, with ``--top N``, cProfile's N functions by
  own time (to stderr).

    python scripts/profile_sparse_ring_host.py                                  # CPU, stub kernels, S=128k, W=8
    python scripts/profile_sparse_ring_host.py --device cuda --backend fa4 --top 25
    python scripts/profile_sparse_ring_host.py --docs pareto                    # bench_strategies' mixes too

Document mixes: bench_strategies.py's ("short": hundreds of documents of mean ~500 tokens at S = 128k;
"lognormal": median 2k; "pareto": heavy-tailed; "one_long").
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_strategies as bs  # noqa: E402

from distcomm_attention.kernels import dispatch  # noqa: E402
from distcomm_attention.kernels.contract import BlockBackward, BlockForward  # noqa: E402
from distcomm_attention.planning import balance  # noqa: E402
from distcomm_attention.planning.exchange import sparse_ring  # noqa: E402
from distcomm_attention.planning.visibility import Visibility  # noqa: E402
from distcomm_attention.strategies.sparse_ring import sparse_ring_backward, sparse_ring_forward  # noqa: E402
from distcomm_attention.transport import CountingTransport  # noqa: E402
from distcomm_attention.transport.emulated import InstantLink  # noqa: E402

class StubForward(BlockForward):
    """Packing block kernels (flash-attn-4's contract, Note [Packed steps]) that return zeros at once."""

    takes_windows = True
    packs = True

    def block(self, q, k, v, *, causal, scale, softcap, window=None, varlen=None, out=None, lse=None):
        lse_shape = (q.shape[1], q.shape[0]) if varlen is not None else (q.shape[0], q.shape[2], q.shape[1])
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), \
            torch.zeros(lse_shape, dtype=torch.float32, device=q.device)


class StubBackward(BlockBackward):
    takes_windows = True
    packs = True

    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap, window=None, varlen=None, dq=None,
              dk=None, dv=None):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class _CountOps(TorchDispatchMode):
    """Counts the operators dispatched inside it, by the innermost project file that issued each."""

    def __init__(self):
        super().__init__()
        self.by_file: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        here = "?"
        for frame in reversed(traceback.extract_stack(limit=16)[:-1]):  # (not this method's own frame)
            if "distcomm" in frame.filename or "scripts" in frame.filename:
                here = Path(frame.filename).name
                break
        self.by_file[here] += 1
        return func(*args, **(kwargs or {}))


def _calls_by_file(stats: pstats.Stats, runs: int) -> dict:
    """cProfile's calls per file (a builtin counted in the file that calls it), per run."""
    by_file: collections.Counter = collections.Counter()
    for (filename, _, _), (_, calls, _, _, callers) in stats.stats.items():
        if filename == "~":
            for (caller, _, _), counts in callers.items():
                by_file[Path(caller).name] += counts[1]
        else:
            by_file[Path(filename).name] += calls
    return {name: n / runs for name, n in by_file.most_common()}


def busiest(concrete, vis: Visibility, world: int, n: int) -> int:
    """The rank whose sparse plan has the most blocks (the most host work), ties: the lower rank."""
    blocks = []
    for r in range(world):
        sp = sparse_ring(concrete, vis, world, r, n)
        blocks.append(-1 if sp is None else sum(len(s) for s in sp.plan.blocks))
    return max(range(world), key=lambda r: blocks[r])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--docs", default="short", help=f"one of {', '.join(bs.MIXES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="balanced",
                   help="balanced: docs/bench/profile.md's; auto takes contiguous for the short mix (2 steps)")
    p.add_argument("--rank", type=int, default=None, help="default: the rank with the most blocks")
    p.add_argument("--heads", default="32/8", help="query/kv heads (stub: the tensors' sizes only)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: host_ms includes the CPU operators' arithmetic (small with the stub's 1/1 heads of "
                        "dim 8); cuda: host time only")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="stub", help="stub (zeros at once) or a backend name (fa4 on a GPU)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-calls", type=int, default=3)
    p.add_argument("--top", type=int, default=0, help="print cProfile's N functions by own time to stderr")
    p.add_argument("--label", default="", help="recorded in the JSON line (e.g. before / after)")
    args = p.parse_args()

    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    seq, world, d = args.seq, args.world, args.head_dim
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    if args.device == "cpu" and args.heads == "32/8" and args.backend == "stub":
        heads, kv_heads, d = 1, 1, 8  # the host work does not depend on the sizes; small ones keep CPU arithmetic cheap
    docs = bs.documents(args.docs, seq, args.seed)
    vis = Visibility(True, cu_seqlens=tuple(docs))
    n = seq // world
    concrete = balance.resolve(args.layout, seq, world, vis.cu_seqlens)
    rank = busiest(concrete, vis, world, n) if args.rank is None else args.rank
    sp = sparse_ring(concrete, vis, world, rank, n)
    if sp is None:
        raise SystemExit(f"rank {rank}: the strategy runs the plain ring here (no sparse schedule)")
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g)  # noqa: E731
    if args.backend == "stub":
        fwd, bwd = StubForward(), StubBackward()
    else:
        _, fwd, bwd = dispatch.select_kernels(args.backend, rnd(1, 128, heads, d), vis, 0.0)
    q, k, v, dout = rnd(1, n, heads, d), rnd(1, n, kv_heads, d), rnd(1, n, kv_heads, d), rnd(1, n, heads, d)
    t = CountingTransport(InstantLink(world, rank))
    scale = d ** -0.5

    def step():
        out, lse, kept = sparse_ring_forward(q, k, v, None, t, sp, 0.0, scale, fwd)
        return out, sparse_ring_backward(dout, q, k, v, out, lse, None, t, sp, kept, 0.0, scale, bwd)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    t.sent.clear()
    t.calls.clear()
    step()
    sync()
    sends, sent = t.calls["send_recv"], t.sent["send_recv"]
    times = []
    for _ in range(args.iters):
        sync()
        if dev.type == "cuda":
            torch.cuda._sleep(int(2e8))  # ~0.1 s queued ahead: the host never waits for the GPU below
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_calls):
        step()
    prof.disable()
    sync()
    stats = pstats.Stats(prof)
    with _CountOps() as ops:
        step()
    sync()
    if args.top:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue(), file=sys.stderr)
    blocks = sum(len(s) for s in sp.plan.blocks)
    print(json.dumps({
        "label": args.label, "host_ms": statistics.median(times) * 1e3, "host_ms_min": min(times) * 1e3,
        "python_calls": stats.total_calls / args.profile_calls, "torch_ops": sum(ops.by_file.values()),
        "sends": sends, "bytes_sent": sent,
        "seq": seq, "world": world, "rank": rank, "documents": args.docs, "n_documents": len(docs) - 1,
        "mean_doc": seq / (len(docs) - 1), "layout": bs.layout_name(concrete), "steps": len(sp.plan.steps),
        "blocks": blocks, "keep": sp.keep, "backend": args.backend, "device": args.device,
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": args.dtype,
        "heads": f"{heads}/{kv_heads}", "head_dim": d, "torch": torch.__version__, "iters": args.iters,
        "calls_by_file": _calls_by_file(stats, args.profile_calls), "ops_by_file": dict(ops.by_file.most_common()),
    }), flush=True)


if __name__ == "__main__":
    main()
