"""Check a multi-node setup: a collective and ring attention across and within nodes, against float64
references computed on each rank.

    # on every machine (N of them, G GPUs each), with HOST the address of one of them:
    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id my-job examples/multinode_check.py

torchrun numbers the ranks node by node (node n holds global ranks n*G .. n*G+G-1), so ``ring_size=G``
makes one ring per node, whose traffic stays on the node's NVLink, while a ring over the whole world
crosses the network. Checked here:

1. ``all_reduce`` (SUM) over the world, forward and backward;
2. ``ring_flash_attn`` (causal, zigzag, GQA, float64) with one ring over the whole world;
3. the same with ``ring_size`` = ranks per node, and that every such ring's members are on one node.

Exits with status 1 (every rank) if any check fails; rank 0 prints one line per check.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import distcomm
import distcomm.functional as F
from distcomm_attention import ring_flash_attn, shard_sequence
from distcomm_attention._reference import attention_reference

TOL = 1e-10


def _attention_error(ring_size: int | None, seed: int, device: torch.device) -> float:
    """Max error of this rank's ring attention output and input gradients vs float64 attention."""
    ring = distcomm.RingComm(ring_size=ring_size)
    g = torch.Generator().manual_seed(seed)
    seq = 4 * ring.size
    q = torch.randn(1, seq, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, seq, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, seq, 4, 16, generator=g, dtype=torch.float64)
    shards = [shard_sequence(t, "zigzag", ring_size=ring_size).to(device) for t in (q, k, v, dout)]
    ql, kl, vl = (t.requires_grad_() for t in shards[:3])
    out = ring_flash_attn(ql, kl, vl, causal=True, layout="zigzag", ring_size=ring_size)
    out.backward(shards[3])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = attention_reference(q, k, v, causal=True)
    ref.backward(dout)
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    return max(
        (got.detach().cpu() - shard_sequence(want.detach(), "zigzag", ring_size=ring_size)).abs().max().item()
        for got, want in pairs
    )


def run(device: torch.device) -> dict[str, float]:
    """Every check's error on this rank (0.0 = exact); the process group is initialised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    errors = {}

    x = torch.arange(3, dtype=torch.float64, device=device).add(rank + 1).requires_grad_()
    y = F.all_reduce(x)
    (y * (rank + 1)).sum().backward()
    want_y = torch.arange(3, dtype=torch.float64) * world + world * (world + 1) / 2
    want_grad = torch.full((3,), world * (world + 1) / 2, dtype=torch.float64)
    errors["all_reduce forward+backward, world"] = max(
        (y.detach().cpu() - want_y).abs().max().item(), (x.grad.cpu() - want_grad).abs().max().item()
    )

    errors["ring attention, one ring over all nodes"] = _attention_error(None, seed=0, device=device)
    ring = distcomm.RingComm(ring_size=local_world)
    errors["ring attention, one ring per node"] = _attention_error(local_world, seed=1 + rank // local_world, device=device)
    nodes = [None] * world
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)))
    errors["rings of ring_size=ranks per node stay on one node"] = float(len({nodes[r] for r in ring.ranks}) != 1)
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: gloo even with GPUs")
    args = parser.parse_args(argv)
    if args.device == "auto" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        errors = run(device)
        worst = [None] * dist.get_world_size()
        dist.all_gather_object(worst, errors)
        ok = all(err <= TOL for per_rank in worst for err in per_rank.values())
        if dist.get_rank() == 0:
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
            for name in errors:
                err = max(per_rank[name] for per_rank in worst)
                print(f"  {name:<55} max error {err:.1e}  {'ok' if err <= TOL else 'FAILED'}")
            print(f"multi-node check on {dist.get_world_size()} ranks over {nodes} node(s): "
                  f"{'all checks passed' if ok else 'SOME CHECKS FAILED'}", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
