"""The whole-sequence copies of Ulysses, and the NaN-row check of a block output, each as PyTorch's permuted
copies / index_select / isnan-any issue it and as the library now runs it (distcomm_attention/kernels/
triton_rows.py: ``take_rows`` with a computed index, ``nan_rows_``): time per call and GB/s (bytes read +
written), checked equal; then a sweep of the Triton gather's program shape. One GPU.

    python scripts/bench_row_copies.py --tokens 16384 --world 8 --heads 32 --kv-heads 8 --out row_copies.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from distcomm_attention.kernels import triton_rows
from distcomm_attention.strategies.ulysses import _pack_index, _place_index


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    n, w, d = a.tokens, a.world, a.head_dim
    rows = []

    def row(name, nbytes, torch_fn, new_fn):
        want, got = torch_fn(), new_fn()
        if want.shape != got.shape:
            raise SystemExit(f"{name}: shapes differ: {tuple(want.shape)} vs {tuple(got.shape)}")
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{name}: results differ")
        t0, t1 = _time(torch_fn, a.iters), _time(new_fn, a.iters)
        rows.append(dict(op=name, bytes=nbytes, torch_ms=t0 * 1e3, new_ms=t1 * 1e3,
                         torch_gbps=nbytes / t0 / 1e9, new_gbps=nbytes / t1 / 1e9, speedup=t0 / t1))
        print(json.dumps(rows[-1]), flush=True)

    for heads, label in ((a.heads, "q"), (a.kv_heads, "k")):
        h = heads // w
        x = torch.randn(1, n, heads, d, dtype=torch.bfloat16, device=dev)
        pack = _pack_index(0, n, w, 0, 1, dev)  # the indices Ulysses gathers its all-to-alls by
        nb = 2 * x.numel() * x.element_size()
        row(f"all-to-all pack {label} ({n} x {heads} heads -> {w} x {n} x {h})", nb,
            lambda: x.reshape(1, n, w, h, d).permute(2, 0, 1, 3, 4).contiguous(),
            lambda: triton_rows.take_rows(x.view(n * w, h * d), pack).view(w, 1, n, h, d))
        recv = torch.randn(w, 1, n, h, d, dtype=torch.bfloat16, device=dev)
        place = _place_index(n, w, dev)

        def placed():
            out = torch.empty(1, n, w, h, d, dtype=recv.dtype, device=dev)
            out[:, :, :] = recv.permute(1, 2, 0, 3, 4)
            return out.view(1, n, heads, d)

        row(f"all-to-all place {label} ({w} x {n} x {h} -> {n} x {heads} heads)", nb, placed,
            lambda: triton_rows.take_rows(recv.view(w * n, h * d), place).view(1, n, heads, d))
        whole = torch.randn(1, w * n, h, d, dtype=torch.bfloat16, device=dev)
        order = torch.randperm(w * n, device=dev)
        row(f"reorder {label} ({w * n} rows x {h} heads)", 2 * whole.numel() * 2,
            lambda: whole.index_select(1, order),
            lambda: triton_rows.take_rows(whole.view(w * n, h * d), order).view(1, w * n, h, d))

    h = a.heads // w
    out = torch.randn(1, w * n, h, d, dtype=torch.bfloat16, device=dev)
    out[0, 5, 1, 7] = float("nan")
    lse = torch.randn(1, h, w * n, device=dev)

    def nan_torch():
        return lse.clone().masked_fill_(out.isnan().any(-1).transpose(1, 2), float("nan"))

    row(f"NaN rows of out ({w * n} rows x {h} heads)", out.numel() * 2, nan_torch,
        lambda: triton_rows.nan_rows_(out, lse.clone()))
    # the gather's program shape, on the reorder of q and of k
    for heads in (a.heads, a.kv_heads):
        h = heads // w
        whole = torch.randn(w * n, h * d, dtype=torch.bfloat16, device=dev)
        order = torch.randperm(w * n, device=dev)
        base = _time(lambda: whole.index_select(0, order), a.iters)
        for block_r in (4, 8, 16, 32, 64):
            for block_c in sorted({min(h * d, 256), min(h * d, 512), h * d}):
                for warps in (2, 4, 8):
                    if block_r * block_c * 2 > 65536:
                        continue
                    cfg = (block_r, block_c, warps)
                    t = _time(lambda: triton_rows.gather_rows(whole, order, config=cfg), a.iters)
                    rows.append(dict(op=f"reorder sweep {h * d * 2} B rows", config=cfg, torch_ms=base * 1e3,
                                     triton_ms=t * 1e3, speedup=base / t))
        best = max((r for r in rows if r.get("config") and r["op"].startswith(f"reorder sweep {h * d * 2} ")),
                   key=lambda r: r["speedup"])
        print(json.dumps(best), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(a), rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
