"""Layer 2 at scale: a world of 8 gloo ranks on CPU (what an 8-GPU host runs), against float64 references.

Ring attention over one ring of 8 and over two rings of 4 (sequence parallel inside a ring, batch parallel
across rings), and the collectives whose gradients need the most care, at the largest world the suite runs.
"""

import torch
import torch.distributed as dist

import distcomm.functional as F
import distcomm_attention as da
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from tests.dist_harness import run_world

W = 8
CASES = [
    dict(layout="zigzag", causal=True, ring_size=None, h=4, hkv=2),
    dict(layout="striped", causal=True, ring_size=4, h=2, hkv=1),
    dict(layout="contiguous", causal=False, ring_size=4, h=2, hkv=2),
]
N, D = 4, 16  # tokens per rank, head dim


def _inputs(case, ring_index):
    """Global float64 (q, k, v, dout) of the sequence carried by ring ``ring_index``."""
    g = torch.Generator().manual_seed(100 * ring_index + CASES.index(case))
    ring = case["ring_size"] or W
    shapes = [(1, N * ring, case[h], D) for h in ("h", "hkv", "hkv", "h")]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _attention_rank(rank, world):
    results = []
    for case in CASES:
        ring = case["ring_size"] or world
        full = _inputs(case, rank // ring)
        q, k, v, dout = (da.shard_sequence(t, case["layout"], ring_size=case["ring_size"]) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = da.ring_flash_attn(q, k, v, causal=case["causal"], layout=case["layout"], ring_size=case["ring_size"])
        out.backward(dout)
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})
    return results


def test_ring_attention_world8():
    """Every rank of a world of 8 (one ring of 8, or two rings of 4) matches float64 attention on its ring's
    sequence: outputs and the gradients of q, k and v."""
    got = run_world(_attention_rank, W, timeout=120)
    for i, case in enumerate(CASES):
        ring = case["ring_size"] or W
        for rank in range(W):
            q, k, v, dout = (t.requires_grad_() for t in _inputs(case, rank // ring))
            out = attention_reference(q, k, v, causal=case["causal"])
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.detach())
            want = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
            for name, ref in want.items():
                torch.testing.assert_close(
                    got[rank][i][name], layouts.shard(ref, case["layout"], ring, rank % ring, 1),
                    rtol=1e-10, atol=1e-12, msg=lambda m: f"{case} rank {rank} {name}: {m}",
                )


def _x(rank):
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    x[0, 0] = 3.0  # a tie across all ranks for MAX
    return x


def _w(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank), dtype=torch.float64)


def _collectives_rank(rank, world):
    out = {}
    x = _x(rank).requires_grad_()
    y = F.all_reduce(x, dist.ReduceOp.MAX)
    (y * _w(rank, y.shape)).sum().backward()
    out["max"] = (y.detach(), x.grad)
    x = _x(rank)[: rank % 3].requires_grad_()  # sizes 0, 1, 2, 0, 1, 2, ...
    y, sizes = F.all_gather_variable(x, dim=0)
    (y * _w(rank, y.shape)).sum().backward()
    out["variable"] = (y.detach(), x.grad, sizes)
    return out


def test_collectives_world8():
    """all_reduce(MAX) with a tie on every rank and all_gather_variable with zero-size shards, at W = 8."""
    got = run_world(_collectives_rank, W, timeout=120)
    xs = [_x(r).requires_grad_() for r in range(W)]
    y = torch.stack(xs).amax(0)
    grads = torch.autograd.grad(sum((y * _w(r, y.shape)).sum() for r in range(W)), xs)
    for r in range(W):
        torch.testing.assert_close(got[r]["max"][0], y.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got[r]["max"][1], grads[r], rtol=1e-12, atol=1e-12)
    parts = [_x(r)[: r % 3].requires_grad_() for r in range(W)]
    cat = torch.cat(parts)
    grads = torch.autograd.grad(sum((cat * _w(r, cat.shape)).sum() for r in range(W)), parts)
    for r in range(W):
        assert got[r]["variable"][2] == [p.shape[0] for p in parts]
        torch.testing.assert_close(got[r]["variable"][0], cat.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got[r]["variable"][1], grads[r], rtol=1e-12, atol=1e-12)
