"""Every tensor operation a simulated rank runs around its attention kernels, with the bytes it reads and
writes: where a strategy's time outside the kernels goes, on the CPU, without a GPU.

One simulated rank (scripts/bench_emulated.py's ``rank_step``) runs its forward + backward over an instant link
(``InstantLink``: the same data as a real exchange, at once) with stand-in kernels of flash-attn-4's contract
(packed varlen calls, windows: what the strategies issue on a Hopper GPU) that return zeros and are not traced.
Every other ATen operation is recorded (``TorchDispatchMode``): its name, the bytes of its tensor inputs and
outputs (what a GPU would move for it; views move nothing), and the innermost frame of the library that
issued it. The table sums them per (operation, frame), largest first; on a GPU each row is at least one kernel
launch (and one host launch cost) and its bytes over the memory bandwidth.

    python scripts/trace_rank_ops.py --seq 131072 --world 8 --docs lognormal --strategies allgather,ulysses
    python scripts/trace_rank_ops.py --seq 131072 --world 8 --docs pareto --json trace.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_emulated as be  # noqa: E402
import bench_strategies as bs  # noqa: E402

from distcomm_attention.kernels.contract import BlockBackward, BlockForward  # noqa: E402
from distcomm_attention.transport.emulated import InstantLink  # noqa: E402

_VIEWS = {"view", "_unsafe_view", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
          "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "reshape", "unflatten",
          "lift_fresh", "_reshape_alias", "diagonal", "view_as_real", "view_as_complex", "chunk"}


class _Quiet:
    """Whether the tracer is paused (the stand-in kernels' own allocations are not the strategy's)."""

    on = False


@contextlib.contextmanager
def _untraced():
    before, _Quiet.on = _Quiet.on, True
    try:
        yield
    finally:
        _Quiet.on = before


class StandInForward(BlockForward):
    """flash-attn-4's forward contract (packed varlen calls, windows, out= and lse=), returning zeros."""

    takes_windows = True
    packs = True

    def block(self, q, k, v, *, causal, scale, softcap, window=None, varlen=None, out=None, lse=None):
        with _untraced():
            if varlen is not None:  # q (total_q, H, D): lse (H, total_q)
                out = torch.zeros_like(q) if out is None else out
                lse = torch.zeros(q.shape[1], q.shape[0]) if lse is None else lse
                return out, lse
            return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


class StandInBackward(BlockBackward):
    """flash-attn-4's backward contract, returning zeros."""

    takes_windows = True
    packs = True
    dkv_in_input_dtype = True

    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap, window=None, varlen=None, dq=None, dk=None,
              dv=None):
        with _untraced():
            return (torch.zeros_like(q) if dq is None else dq, torch.zeros_like(k) if dk is None else dk,
                    torch.zeros_like(v) if dv is None else dv)


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
_WRITE_ONLY = {"zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full", "fill_", "zero_", "ones",
               "ones_like", "arange"}


def _read(name: str, args, kwargs) -> int:
    """Bytes an operation reads: its tensor arguments, but not what it only writes (a copy's destination, a
    fill's tensor, an ``out=`` tensor) and nothing for an allocation. An upper bound for operations that read
    part of a tensor argument (an index add reads its destination's indexed rows only)."""
    if name in _ALLOCATIONS or name in _WRITE_ONLY:
        return 0
    if name == "copy_":
        return _bytes(args[1])
    return _bytes(list(args)) + _bytes([v for key, v in kwargs.items() if key != "out"])


def _site() -> str:
    """The innermost frame of the library (or of the benchmark) that issued the operation."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/distcomm_attention/" in name or "/distcomm/" in name:
            return f"{name.split('/distcomm')[-1].removeprefix('_attention').lstrip('/')}:{frame.lineno} {frame.name}"
    return "(outside the library)"


class OpTrace(TorchDispatchMode):
    """Records (operation, site) -> [count, bytes read, bytes written] of every non-view ATen operation."""

    def __init__(self):
        super().__init__()
        self.rows: dict = collections.defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not _Quiet.on and name.rstrip("_") not in _VIEWS and name not in _VIEWS:
            row = self.rows[(name, _site())]
            row[0] += 1
            row[1] += _read(name, args, kwargs)
            row[2] += 0 if name in _ALLOCATIONS else _bytes(out)
        return out


def trace(strategy: str, seq: int, world: int, mix: str, layout: str, heads: int, kv_heads: int, dim: int,
          rank: int | None) -> dict:
    """One simulated rank's traced forward + backward: {"path", "rank", "rows": [(op, site, count, read, written)]}."""
    docs, vis, concrete = be.plan_case(seq, world, mix, layout)
    n = seq // world
    if rank is None:  # the busiest rank by plan, as the benchmarks time
        rank = 0 if strategy.startswith("ulysses") else bs.pick_ranks(
            bs.planned_rank_s(strategy, concrete, vis, world, n, heads, kv_heads, dim), 1)[-1]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, dim, generator=g).to(torch.bfloat16)
                     for h in (heads, kv_heads, kv_heads, heads))
    t = be._Sent(InstantLink(world, rank))
    path, step = be.rank_step(strategy, t, q, k, v, dout, concrete, vis, world, rank, StandInForward(),
                              StandInBackward(), dim ** -0.5)
    step()  # plans, caches
    recorder = OpTrace()
    with recorder:
        step()
    rows = sorted(((op, site, c, r, w) for (op, site), (c, r, w) in recorder.rows.items()), key=lambda x: -(x[3] + x[4]))
    return {"strategy": strategy, "path": path, "rank": rank, "seq": seq, "world": world, "documents": mix,
            "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--docs", default="lognormal", help="a document mix of scripts/bench_strategies.py, or one")
    p.add_argument("--layout", default="balanced")
    p.add_argument("--strategies", default="allgather,ulysses,ring")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=None, help="the simulated rank (default: the busiest by plan)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = []
    for strategy in args.strategies.split(","):
        res = trace(strategy, args.seq, args.world, args.docs, args.layout, args.heads, args.kv_heads,
                    args.head_dim, args.rank)
        out.append(res)
        total = sum(r[3] + r[4] for r in res["rows"])
        ops = sum(r[2] for r in res["rows"])
        print(f"== {strategy} ({res['path']}), rank {res['rank']}: {ops} operations, {total / 1e6:.1f} MB read + "
              f"written outside the kernels")
        for op, site, count, read, written in res["rows"][:args.top]:
            print(f"  {(read + written) / 1e6:9.1f} MB {count:4d} x {op:24s} {site}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
