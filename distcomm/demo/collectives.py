"""Demo part 1: every collective forward and backward over the local ranks, checked against a
single-process float64 simulation of the same collective (values by the definition, gradients by autograd
on the simulation: the exact VJP under the convention total loss = sum of the per-rank losses)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import distcomm.functional as F
from distcomm._launch import run_world
from distcomm.demo import _common

# Each case: (name, make_input(rank, world) -> tensor, run(x, rank, world) -> tuple of outputs,
#             simulate(xs: list of float64 tensors, world) -> per-rank list of tuples of outputs)
SUM, MAX, PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT


def _x(rank: int, world: int = 0, n: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x[1] = 7.0  # a tie for MAX on every rank
    return x


def _uneven(rank: int, world: int = 0) -> torch.Tensor:
    return torch.arange(float(rank + 1) * 2, dtype=torch.float64).reshape(-1, 2) + 10 * rank


def _splits(world: int) -> list[list[int]]:
    # rank r sends (r + j) % 3 rows to rank j
    return [[(r + j) % 3 for j in range(world)] for r in range(world)]


def _a2a_input(rank, world):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(sum(_splits(world)[rank]), 2, generator=g, dtype=torch.float64)


CASES = {
    "all_reduce(SUM)": (
        _x, lambda x, r, w: (F.all_reduce(x, SUM),), lambda xs, w: [(sum(xs),)] * w),
    "all_reduce(MAX), with ties": (
        _x, lambda x, r, w: (F.all_reduce(x, MAX),),
        lambda xs, w: [(torch.stack(xs).amax(0),)] * w),
    "all_reduce(PRODUCT)": (
        _x, lambda x, r, w: (F.all_reduce(x, PRODUCT),), lambda xs, w: [(torch.stack(xs).prod(0),)] * w),
    "reduce(dst=last rank, SUM)": (
        _x, lambda x, r, w: (F.reduce(x, w - 1, SUM),),
        lambda xs, w: [((sum(xs) if r == w - 1 else None),) for r in range(w)]),
    "broadcast(src=last rank)": (
        _x, lambda x, r, w: (F.broadcast(x, w - 1),), lambda xs, w: [(xs[-1],)] * w),
    "all_gather": (
        _x, lambda x, r, w: F.all_gather(x), lambda xs, w: [tuple(xs)] * w),
    "all_gather_variable(dim=0)": (
        _uneven, lambda x, r, w: (F.all_gather_variable(x, dim=0)[0],),
        lambda xs, w: [(torch.cat(xs, 0),)] * w),
    "reduce_scatter_tensor": (
        _x, lambda x, r, w: (F.reduce_scatter_tensor(x),),
        lambda xs, w: [(sum(xs).chunk(w)[r],) for r in range(w)]),
    "all_to_all_single(uneven)": (
        _a2a_input,
        lambda x, r, w: (F.all_to_all_single(
            torch.empty(sum(s[r] for s in _splits(w)), 2, dtype=x.dtype, device=x.device), x,
            [s[r] for s in _splits(w)], _splits(w)[r]),),
        lambda xs, w: [(torch.cat([xs[s].split(_splits(w)[s])[r] for s in range(w)]),) for r in range(w)]),
    "gather(dst=0)": (
        _x, lambda x, r, w: F.gather(x, 0), lambda xs, w: [tuple(xs) if r == 0 else None for r in range(w)]),
    "scatter(src=0)": (
        _x, lambda x, r, w: (F.scatter([x * (j + 1) for j in range(w)], 0),),
        lambda xs, w: [(xs[0] * (r + 1),) for r in range(w)]),
    "ring_pass(shift=1)": (
        _x, lambda x, r, w: (F.ring_pass(x, 1),), lambda xs, w: [(xs[(r - 1) % w],) for r in range(w)]),
}


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _weights(rank: int, outs) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def run_rank(rank: int, world: int, device: str) -> dict:
    """Run every case on this rank; return outputs and input gradients."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    results = {}
    for name, (make, run, _) in CASES.items():
        x = make(rank, world).to(dev).requires_grad_()
        outs = run(x, rank, world)
        loss = sum((o * w.to(dev)).sum() for o, w in zip(outs, _weights(rank, outs)))
        loss.backward()
        results[name] = {"outs": [o.detach().cpu() for o in outs], "grad": x.grad.cpu()}
    return results


def check(results: list[dict], world: int) -> list[tuple[str, float, float]]:
    """Compare every rank's results with the float64 simulation; return (name, fwd err, bwd err) rows."""
    rows = []
    for name, (make, _, simulate) in CASES.items():
        xs = [make(r, world).requires_grad_() for r in range(world)]
        expected = simulate(xs, world)
        loss = 0
        fwd_err = 0.0
        for r in range(world):
            got = results[r][name]["outs"]
            if expected[r] is None:  # output not defined off the root: only its gradient path matters
                continue
            for e, o, w in zip(expected[r], got, _weights(r, got)):
                if e is None:
                    continue
                fwd_err = max(fwd_err, _max_abs(e.detach() - o))
                loss = loss + (e * w).sum()
        grads = torch.autograd.grad(loss, xs, allow_unused=True)
        bwd_err = max(
            _max_abs(results[r][name]["grad"] - (g if g is not None else torch.zeros_like(xs[r])))
            for r, g in enumerate(grads)
        )
        rows.append((name, fwd_err, bwd_err))
    return rows


def run(world: int, device: str, backend: str, number: int = 1) -> bool:
    """Run every collective on ``world`` local ranks, print the table; True if every check passes."""
    results = run_world(run_rank, world, device, backend=backend, timeout=120)
    return _common.table(check(results, world), f"{number}. collectives vs single-process float64 simulation")
