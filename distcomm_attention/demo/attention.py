"""Demo: ring flash attention over the local ranks (causal, GQA, each layout) against single-process
float64 attention on the whole sequence."""

from __future__ import annotations

import torch

from distcomm._launch import run_world
from distcomm.demo import _common
from distcomm_attention import ring_flash_attn, shard_sequence
from distcomm_attention._reference import attention_reference
from distcomm_attention.planning.layouts import shard

B, S, H, HKV, D = 1, 48, 4, 2, 32


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, HKV, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def run_rank(rank: int, world: int, device: str, layout: str, dtype: str) -> dict:
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dt = getattr(torch, dtype)
    q, k, v, dout = (shard_sequence(t, layout).to(dev, dt) for t in _inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_flash_attn(q, k, v, causal=True, layout=layout)
    out.backward(dout)
    return {"out": out.detach().double(), "dq": q.grad.double(), "dk": k.grad.double(), "dv": v.grad.double()}


def check(results: list[dict], world: int, layout: str) -> list[tuple[str, float, float]]:
    q, k, v, dout = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    expected = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
    errs = {
        name: max((results[r][name] - shard(ref, layout, world, r)).abs().max().item()
                  for r in range(world))
        for name, ref in expected.items()
    }
    return [(f"ring_flash_attn({layout}, causal, GQA 4/2)", errs["out"], max(errs["dq"], errs["dk"], errs["dv"]))]


def run(world: int, device: str, backend: str, number: int = 2) -> bool:
    """Ring attention in every layout on ``world`` local ranks, printed as a table; True if every check passes."""
    rows = []
    for layout in ("contiguous", "zigzag", "striped"):
        res = run_world(run_rank, world, device, layout, "float64", backend=backend, timeout=120)
        rows += check(res, world, layout)
    return _common.table(rows, f"{number}. ring attention vs single-process attention on the whole sequence")
