"""Memory traffic outside the kernels, on the CPU: scripts/trace_rank_ops.py records every tensor operation a
simulated rank runs around its attention kernels (stand-ins of flash-attn-4's contract) with the bytes it reads
and writes. Plain Ulysses (batch 1) moves each of q, k, v, dout into the all-to-all and into natural order, and
each of out, dq, dk, dv back, once each way: at most two passes (read + write) per tensor, and one where the
shards are in natural order (the bound allows 1% for small operations around them). The emulated link's own copies (what NCCL would move) and the NaN-row check (one fused
kernel on a GPU) are not counted."""

import pytest

from tests.scripts import import_script


def _outside_kernels(strategy: str, seq: int, world: int, layout: str, heads: int, kv_heads: int, dim: int):
    trace = import_script("trace_rank_ops")
    res = trace.trace(strategy, seq, world, "lognormal", layout, heads, kv_heads, dim, None)
    rows = [r for r in res["rows"] if "emulated.py" not in r[1] and "_nan_rows" not in r[1]]
    return res["path"], rows


@pytest.mark.parametrize("layout, passes", [("balanced", 2), ("contiguous", 1)])
def test_ulysses_moves_each_tensor_at_most_twice(layout, passes):
    seq, world, heads, kv_heads, dim = 4096, 4, 8, 4, 64
    path, rows = _outside_kernels("ulysses", seq, world, layout, heads, kv_heads, dim)
    assert path == "ulysses"
    n = seq // world  # a rank's heads over the whole sequence hold as many elements as its shard
    tensors = 4 * n * heads * dim + 4 * n * kv_heads * dim  # q, out, dout, dq; k, v, dk, dv (bf16: 2 bytes)
    indices = 8 * (passes - 1) * seq * 8  # the reorders' int64 indices over the sequence, read once each
    moved = sum(read + written for _, _, _, read, written in rows)
    assert moved <= 1.01 * (passes * 2 * tensors * 2 + indices), "\n".join(
        f"{(r + w) / 1e6:8.2f} MB {c:3d} x {op} {site}" for op, site, c, r, w in rows)
    assert moved >= passes * 2 * tensors * 2 * 0.9  # the tracer sees the copies it bounds


def test_the_tracer_counts_what_moves():
    """Views move nothing, a copy reads its source and writes its destination, an allocation is free, a fill
    writes, an out= tensor is not read; the stand-in kernels' own work is not traced."""
    import torch

    trace = import_script("trace_rank_ops")
    x = torch.ones(1000, dtype=torch.float32)  # 4000 bytes
    y = torch.empty(1000)
    recorder = trace.OpTrace()
    with recorder:
        x.view(10, 100).transpose(0, 1)
        y.copy_(x)
        torch.empty(500)
        torch.zeros(250)
        torch.add(x, x, out=y)
        with trace._untraced():
            x.clone()
    moved = {op: (count, read, written) for (op, _), (count, read, written) in recorder.rows.items()}
    assert moved == {"copy_": (1, 4000, 4000), "empty": (1, 0, 0), "zeros": (1, 0, 1000), "add": (1, 8000, 4000)}
