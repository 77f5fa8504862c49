"""Block kernels on one GPU: our Triton forward and backward against flash-attn-4, PyTorch's
FlashAttention-2 and cuDNN.

    PYTHONPATH=. python scripts/bench_block_kernels.py --out docs/bench           # the full matrix (~3 min)
    PYTHONPATH=. python scripts/bench_block_kernels.py --quick                      # 8k only
    PYTHONPATH=. python scripts/bench_block_kernels.py --tune --seqs 8k --blocks ''  # backward config sweep first

Methods (bf16, batch 1, head_dim 128 unless flags say otherwise; q (B, S, H, D)):
- "triton": ``TritonForward`` / ``TritonBackward`` of distcomm_attention. "block" rows run them as a ring
  step does (forward: a non-final step that loads and stores the fp32 state; backward: dQ added into an
  fp32 accumulator, dK/dV returned in fp32); "sequence" rows as a ring of one does (forward: the fused
  final step writing out/lse; backward: dK/dV in bf16, dQ fp32). GQA native.
- "fa2": ``torch.ops.aten._scaled_dot_product_flash_attention`` and its ``_backward`` (PyTorch's copy of
  FlashAttention-2). No GQA: kv heads are expanded BEFORE timing (not counted).
- "cudnn": ``torch.ops.aten._scaled_dot_product_cudnn_attention`` (with logsumexp) and its ``_backward``;
  kv heads expanded before timing. Failures (no cuDNN attention for a shape) are recorded, not fatal.
- "fa4" (``--methods triton,fa4,fa2,cudnn`` where flash-attn-4 is installed): ``flash_attn.cute.interface``'s
  ``_flash_attn_fwd`` (returning lse) and ``_flash_attn_bwd`` (from that out and lse), the calls our "fa4"
  backend makes per block; GQA native.
Features (ours only; the aten ops have no windows or documents): a causal sliding window of 4k keys and
causal packed documents of random lengths 512..8k (seed 0), both "interval" blocks, at S = 16k; their
FLOPs count the visible (query, key) pairs only, and "vs causal" is their time per useful FLOP over that
of plain causal attention at the same S.

FLOPs: forward 4 * B * H * Sq * Sk * D, halved for causal; backward 2.5 x forward. Timing: CUDA events
around ``--iters`` back-to-back calls after ``--warmup`` calls (the first call of each kernel variant
compiles it and is not timed). Writes ``block_kernels.json`` under ``--out`` and prints markdown tables.

``--tune``: before the matrix, time the backward under each candidate dK/dV configuration (dQ config
fixed) and each dQ configuration (dK/dV fixed) at the first ``--seqs`` length, causal and full, 32/32
heads; the matrix then runs with the fastest pair (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_util as U  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Backward candidates (block_m, block_n, num_warps, num_stages) for --tune, per kernel.
DKDV_CANDIDATES = [(32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2)]
DQ_CANDIDATES = [(128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)]


def fwd_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    return 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)


def make_inputs(b, s, h, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hkv, d, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hkv, d, generator=gen, device="cuda", dtype=dtype)
    dout = torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=dtype)
    return q, k, v, dout


def expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, H, D) contiguous copy (query head h uses kv head h // (H // Hkv))."""
    b, s, hkv, d = x.shape
    return x.unsqueeze(3).expand(b, s, hkv, heads // hkv, d).reshape(b, s, heads, d).contiguous()


# ------------------------------------------------------------------------------------------------ methods
def triton_calls(q, k, v, dout, *, block, scale, ring_step: bool, bwd_config=None):
    """(forward fn, backward fn) of our kernels; ``ring_step`` selects the ring-step variants."""
    from distcomm_attention.kernels.triton_bwd import TritonBackward
    from distcomm_attention.kernels.triton_fwd import TritonForward

    fwd = TritonForward()
    bwd = TritonBackward(config=bwd_config)
    state = fwd.init_state(q)
    fwd.step(state, q, k, v, mask=block, scale=scale, final=True)
    out, lse = fwd.finalize(state, q.dtype)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    if ring_step:
        ring_state = fwd.init_state(q)
        fwd.step(ring_state, q, k, v, mask=block, scale=scale)  # the state now exists: later steps load it
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def forward():
            fwd.step(ring_state, q, k, v, mask=block, scale=scale)

        def backward():
            bwd.step(dout, q, k, v, None, lse, delta, mask=block, scale=scale, dq_acc=dq_acc,
                     dkv_dtype=torch.float32)
    else:
        def forward():
            st = fwd.init_state(q)
            fwd.step(st, q, k, v, mask=block, scale=scale, final=True)

        def backward():
            bwd.step(dout, q, k, v, None, lse, delta, mask=block, scale=scale, dkv_dtype=q.dtype)
    return forward, backward


def fa2_calls(q, k, v, dout, *, causal, scale):
    heads = q.shape[2]
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, expand(k, heads), expand(v, heads), dout))
    op = torch.ops.aten._scaled_dot_product_flash_attention
    res = op(qt, kt, vt, 0.0, causal, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]

    def forward():
        op(qt, kt, vt, 0.0, causal, False, scale=scale)

    def backward():
        torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return forward, backward


def cudnn_calls(q, k, v, dout, *, causal, scale):
    heads = q.shape[2]
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, expand(k, heads), expand(v, heads), dout))
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    res = op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]

    def forward():
        op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)

    def backward():
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)
    return forward, backward


def fa4_calls(q, k, v, dout, *, causal, scale):
    from distcomm_attention.kernels import fa4 as _fa4

    fa4 = _fa4._interface()
    out, lse = fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)[:2]

    def forward():
        fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)

    def backward():
        fa4._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)
    return forward, backward


def timed(fn, args) -> float:
    fn()  # compile / first-call work outside the timing
    torch.cuda.synchronize()
    return U.time_loop(fn, iters=args.iters, warmup=args.warmup, device=torch.device("cuda"), barrier=False)


# ----------------------------------------------------------------------------------------------- features
def window_block(s: int, left: int):
    i = torch.arange(s)
    lo, hi = (i - left).clamp(min=0), i + 1
    return interval_block(lo, hi, s), int((hi - lo).sum())


def documents_block(s: int, lo_len: int, hi_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < s:
        bounds.append(min(s, bounds[-1] + int(torch.randint(lo_len, hi_len + 1, (1,), generator=gen))))
    cu = torch.tensor(bounds)
    i = torch.arange(s)
    doc = torch.searchsorted(cu, i, right=True) - 1
    lo, hi = cu[doc], i + 1
    return interval_block(lo, hi, s), int((hi - lo).sum()), len(bounds) - 1


def interval_block(lo: torch.Tensor, hi: torch.Tensor, s: int):
    from distcomm_attention.planning.visibility import BlockMask

    j = torch.arange(s)
    col_lo = torch.searchsorted(hi, j, right=True)
    col_hi = torch.maximum(torch.searchsorted(lo, j, right=True), col_lo)
    return BlockMask("interval", *(a.to(device="cuda", dtype=torch.int32) for a in (lo, hi, col_lo, col_hi)))


# ------------------------------------------------------------------------------------------------- runner
def run_case(args, rows, *, kind, s, h, hkv, causal, bwd_config):
    from distcomm_attention.planning.visibility import CAUSAL, FULL

    b, d, dtype = args.batch, args.head_dim, DTYPES[args.dtype]
    q, k, v, dout = make_inputs(b, s, h, hkv, d, dtype)
    scale = d**-0.5
    flops = fwd_flops(b, h, s, s, d, causal)
    row = {"kind": kind, "s": s, "heads": f"{h}/{hkv}", "mask": "causal" if causal else "full", "fwd_flops": flops}
    makers = {
        "triton": lambda: triton_calls(q, k, v, dout, block=CAUSAL if causal else FULL, scale=scale,
                                       ring_step=kind == "block", bwd_config=bwd_config),
        "fa2": lambda: fa2_calls(q, k, v, dout, causal=causal, scale=scale),
        "cudnn": lambda: cudnn_calls(q, k, v, dout, causal=causal, scale=scale),
        "fa4": lambda: fa4_calls(q, k, v, dout, causal=causal, scale=scale),
    }
    for method in args.methods:
        try:
            forward, backward = makers[method]()
            t_f = timed(forward, args)
            t_b = timed(backward, args)
            row[method] = {"fwd_ms": t_f * 1e3, "bwd_ms": t_b * 1e3, "fwd_tflops": flops / t_f / 1e12,
                           "bwd_tflops": 2.5 * flops / t_b / 1e12}
        except Exception as exc:  # one failing method must not end the benchmark
            row[method] = {"error": U.error_text(exc)}
        finally:
            U.release_memory(torch.device("cuda"))
    rows.append(row)
    print(fmt_row(row, args.methods), flush=True)


def run_feature(args, rows, *, name, s, h, hkv, bwd_config):
    b, d, dtype = args.batch, args.head_dim, DTYPES[args.dtype]
    q, k, v, dout = make_inputs(b, s, h, hkv, d, dtype)
    scale = d**-0.5
    extra = {}
    if name == "window":
        block, pairs = window_block(s, args.window)
        extra["window_left"] = args.window
    else:
        block, pairs, ndocs = documents_block(s, 512, 8192)
        extra["documents"] = ndocs
    flops = 4.0 * b * h * pairs * d
    row = {"kind": "feature", "feature": name, "s": s, "heads": f"{h}/{hkv}", "mask": "causal",
           "fwd_flops": flops, **extra}
    try:
        forward, backward = triton_calls(q, k, v, dout, block=block, scale=scale, ring_step=False,
                                         bwd_config=bwd_config)
        t_f, t_b = timed(forward, args), timed(backward, args)
        row["triton"] = {"fwd_ms": t_f * 1e3, "bwd_ms": t_b * 1e3, "fwd_tflops": flops / t_f / 1e12,
                         "bwd_tflops": 2.5 * flops / t_b / 1e12}
    except Exception as exc:
        row["triton"] = {"error": U.error_text(exc)}
    U.release_memory(torch.device("cuda"))
    rows.append(row)
    print(fmt_row(row, ["triton"]), flush=True)


def tune(args, s: int) -> tuple:
    """Sweep the backward candidates; returns the fastest BackwardConfig tuple and the measurements."""
    from distcomm_attention.kernels.triton_bwd import default_backward_config

    base = default_backward_config(args.head_dim).astuple()
    results = {"dkdv": [], "dq": []}
    best = {}
    for which, cands in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
        for cand in cands:
            cfg = (*cand, *base[4:]) if which == "dkdv" else (*base[:4], *cand)
            total = 0.0
            entry = {"config": cand}
            for causal in (True, False):
                try:
                    from distcomm_attention.kernels.triton_bwd import BackwardConfig
                    from distcomm_attention.planning.visibility import CAUSAL, FULL

                    q, k, v, dout = make_inputs(args.batch, s, 32, 32, args.head_dim, DTYPES[args.dtype])
                    _, backward = triton_calls(q, k, v, dout, block=CAUSAL if causal else FULL,
                                               scale=args.head_dim**-0.5, ring_step=False,
                                               bwd_config=BackwardConfig(*cfg))
                    t = timed(backward, args)
                    entry["causal_ms" if causal else "full_ms"] = t * 1e3
                    total += t
                except Exception as exc:
                    entry["error"] = U.error_text(exc)
                    total = math.inf
                U.release_memory(torch.device("cuda"))
            entry["total_ms"] = total * 1e3
            results[which].append(entry)
            print(f"tune {which} {cand}: " + ", ".join(f"{k_}={v_:.2f}" if isinstance(v_, float) else f"{k_}={v_}"
                                                         for k_, v_ in entry.items() if k_ != "config"), flush=True)
        best[which] = min(results[which], key=lambda e: e["total_ms"])["config"]
    return (*best["dkdv"], *best["dq"]), results


# ------------------------------------------------------------------------------------------------ output
def _cell(entry, key):
    if entry is None:
        return "-"
    if "error" in entry:
        return "err"
    return f"{entry[key]:.0f}"


def fmt_row(row, methods) -> str:
    name = row.get("feature") or row["kind"]
    cells = [name, U.fmt_count(row["s"]), row["mask"], row["heads"]]
    for m in methods:
        e = row.get(m)
        cells.append(f"{_cell(e, 'fwd_tflops')} / {_cell(e, 'bwd_tflops')}")
    return "| " + " | ".join(cells) + " |"


def markdown(rows, methods) -> str:
    lines = ["| kind | S | mask | heads | " + " | ".join(f"{m} fwd / bwd" for m in methods)
             + " | triton bwd / fa2 bwd | triton bwd / cudnn bwd | triton fwd / best fwd | triton bwd / best bwd |",
             "| :--- | :--- | :--- | :--- | " + " | ".join("---:" for _ in methods) + " | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if row["kind"] == "feature":
            continue
        ratio = []
        for other in ("fa2", "cudnn"):
            a, b = row.get("triton"), row.get(other)
            ok = a and b and "error" not in a and "error" not in b
            ratio.append(f"{a['bwd_tflops'] / b['bwd_tflops']:.2f}" if ok else "-")
        for key in ("fwd_tflops", "bwd_tflops"):  # against the fastest kernel of the row, ours included
            ok = [row[m][key] for m in methods if row.get(m) and "error" not in row[m]]
            mine = row.get("triton")
            ratio.append(f"{mine[key] / max(ok):.2f}" if ok and mine and "error" not in mine else "-")
        lines.append(fmt_row(row, methods) + " " + " | ".join(ratio) + " |")
    feats = [r for r in rows if r["kind"] == "feature"]
    if feats:
        causal = {(r["s"], r["heads"]): r for r in rows if r["kind"] == "sequence" and r["mask"] == "causal"}
        lines += ["", "| feature | S | heads | fwd ms | bwd ms | fwd / bwd TFLOP/s (visible pairs) | "
                  "time per useful FLOP vs plain causal (fwd+bwd) |", "| :--- | :--- | :--- | ---: | ---: | ---: | ---: |"]
        for r in feats:
            e = r.get("triton", {})
            if "error" in e:
                lines.append(f"| {r['feature']} | {U.fmt_count(r['s'])} | {r['heads']} | err | err | err | - |")
                continue
            what = f"window {r['window_left']}" if r["feature"] == "window" else f"{r['documents']} documents"
            ref = causal.get((r["s"], r["heads"]), {}).get("triton")
            vs = "-"
            if ref and "error" not in ref:
                per_ours = (e["fwd_ms"] + e["bwd_ms"]) / r["fwd_flops"]
                per_ref = (ref["fwd_ms"] + ref["bwd_ms"]) / causal[(r["s"], r["heads"])]["fwd_flops"]
                vs = f"{per_ours / per_ref:.2f}"
            lines.append(f"| {what} | {U.fmt_count(r['s'])} | {r['heads']} | {e['fwd_ms']:.2f} | {e['bwd_ms']:.2f} | "
                         f"{e['fwd_tflops']:.0f} / {e['bwd_tflops']:.0f} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="folder for block_kernels.json (default: print only)")
    p.add_argument("--seqs", default="8k,16k,32k", help="full-sequence lengths (comma-separated)")
    p.add_argument("--blocks", default="4k,8k", help="ring block sizes Sq = Sk (comma-separated, may be empty)")
    p.add_argument("--heads", default="32/32,32/8", help="query/kv head pairs")
    p.add_argument("--masks", default="causal,full")
    p.add_argument("--methods", default="triton,fa2,cudnn")
    p.add_argument("--features", default="window,documents", help="ours only, at --feature-seq (may be empty)")
    p.add_argument("--feature-seq", default="16k")
    p.add_argument("--window", type=int, default=4096, help="left window of the window feature")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tune", action="store_true", help="sweep backward configs first and use the fastest")
    p.add_argument("--quick", action="store_true", help="8k sequences and 8k blocks only, no features")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_kernels.py needs a CUDA GPU")
    if args.quick:
        args.seqs, args.blocks, args.features = "8k", "8k", ""
    args.methods = U.parse_list(args.methods)
    seqs, blocks = U.parse_list(args.seqs, U.parse_count), U.parse_list(args.blocks, U.parse_count)
    heads = [tuple(int(x) for x in hp.split("/")) for hp in U.parse_list(args.heads)]
    masks = U.parse_list(args.masks)
    started = time.monotonic()

    bwd_config, tuning = None, None
    if args.tune:
        best, tuning = tune(args, seqs[0] if seqs else blocks[0])
        from distcomm_attention.kernels.triton_bwd import BackwardConfig

        bwd_config = BackwardConfig(*best)
        print(f"tuned backward config: {best}", flush=True)

    rows: list[dict] = []
    print("| kind | S | mask | heads | " + " | ".join(f"{m} fwd / bwd TFLOP/s" for m in args.methods) + " |", flush=True)
    for h, hkv in heads:
        for causal in (m == "causal" for m in masks):
            for s in blocks:
                run_case(args, rows, kind="block", s=s, h=h, hkv=hkv, causal=causal, bwd_config=bwd_config)
            for s in seqs:
                run_case(args, rows, kind="sequence", s=s, h=h, hkv=hkv, causal=causal, bwd_config=bwd_config)
    for name in U.parse_list(args.features):
        for h, hkv in heads:
            run_feature(args, rows, name=name, s=U.parse_count(args.feature_seq), h=h, hkv=hkv,
                        bwd_config=bwd_config)

    from distcomm_attention.kernels.triton_bwd import default_backward_config
    from distcomm_attention.kernels.triton_fwd import default_config

    table = markdown(rows, args.methods)
    print("\n" + table, flush=True)
    result = {
        "env": U.env_info("none (one GPU)", 1),
        "command": U.command_line(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "forward_config": vars(default_config(args.head_dim)),
        "backward_config": (bwd_config or default_backward_config(args.head_dim)).astuple(),
        "tuning": tuning,
        "rows": rows,
        "markdown": table,
        "seconds": time.monotonic() - started,
    }
    if args.out is not None:
        U.write_json(args.out / "block_kernels.json", result)
        print(f"wrote {args.out / 'block_kernels.json'} ({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
