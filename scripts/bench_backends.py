"""Block-kernel backends on ONE GPU: direct kernels against ``ring_flash_attn`` at world 1 per backend.

Three tables, every TFLOP/s taken in the same run and every efficiency against the fastest single-GPU
kernel measured here (flash-attn-4 where installed):

1. full sequences (S x S, batch 1): a direct flash-attn-4 call (``flash_attn_func``), PyTorch SDPA with the
   cuDNN backend, SDPA with the FlashAttention-2 backend, and ``ring_flash_attn`` (no process group: a
   ring of one) with backend fa4, cudnn, triton, flash2 and auto; forward and forward+backward;
2. the block pair of a ring step (forward returning lse, backward from that lse) at ring block shapes:
   raw FA4 (``_flash_attn_fwd`` + ``_flash_attn_bwd``) against the same pair through our backend interface
   (FA4Forward init_state/step/finalize + FA4Backward.step), both without accumulators and as the ring calls
   it (fp32 dQ accumulator, fp32 dK/dV);
3. features at S = 16k causal: a 4k sliding window, softcap, and packed documents (16 of 1k; and 3 of
   random lengths), FA4 direct (its window / varlen calls) against the ring's backends.

FLOPs: forward 4 * b * h * s_q * s_k * d (the visible pairs only: halved for causal, the band for a window);
forward+backward 3.5 x forward. CUDA events around ``iters`` back-to-back calls after ``warmup`` calls.

    PYTHONPATH=. python scripts/bench_backends.py --out docs/bench
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as bu  # noqa: E402

import distcomm_attention as da  # noqa: E402
from distcomm_attention.kernels import fa4 as _fa4
from distcomm_attention.kernels import dispatch as _kernels  # noqa: E402
from distcomm_attention.planning.visibility import CAUSAL, FULL  # noqa: E402

RING_BACKENDS = ("fa4", "cudnn", "triton", "flash2", "auto")
DIRECT = ("fa4 direct", "cudnn direct", "sdpa fa2")


def pairs(s: int, causal: bool, window: int | None = None) -> int:
    """Visible (query, key) pairs of an s x s attention (causal: j <= i; window w: i - w <= j <= i)."""
    if window is not None:
        w = min(window, s - 1)
        return s * (w + 1) - w * (w + 1) // 2
    return s * (s + 1) // 2 if causal else s * s


def tflops(flops: float, seconds: float | None) -> float | None:
    return None if seconds is None else flops / seconds / 1e12


# ---------------------------------------------------------------------------------------- the callables
def _sdpa(backend, q, k, v, causal):
    from torch.nn.attention import sdpa_kernel

    gqa = q.shape[2] != k.shape[2]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def direct_fn(method: str, causal: bool, window: int | None = None, softcap: float = 0.0,
              docs: list[int] | None = None):
    """f(q, k, v) -> out for a direct single-GPU kernel (documents: FA4's varlen call, batch 1)."""
    from torch.nn.attention import SDPBackend

    if method == "fa4 direct" and docs is not None:
        func = _fa4._interface().flash_attn_varlen_func
        longest = max(b - a for a, b in zip(docs, docs[1:]))
        cu = torch.tensor(docs, dtype=torch.int32, device="cuda")

        def run(q, k, v):
            if q.shape[0] != 1:  # q[0] alone would be timed against the FLOPs of the whole batch
                raise ValueError(f"fa4 direct with documents runs batch 1, got --batch {q.shape[0]}")
            return func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                        max_seqlen_k=longest, causal=causal)[0][None]
        return run
    if method == "fa4 direct":
        func = _fa4._interface().flash_attn_func
        win = (window, 0) if window is not None else (None, None)
        return lambda q, k, v: func(q, k, v, causal=causal, window_size=win, softcap=softcap)[0]
    if window is not None or softcap or docs is not None:
        raise ValueError(f"{method}: no window, softcap or documents")
    backend = SDPBackend.CUDNN_ATTENTION if method == "cudnn direct" else SDPBackend.FLASH_ATTENTION
    return lambda q, k, v: _sdpa(backend, q, k, v, causal)


def ring_fn(backend: str, causal: bool, window: int | None = None, softcap: float = 0.0,
            docs: list[int] | None = None):
    win = (window, 0) if window is not None else (-1, -1)
    return lambda q, k, v: da.ring_flash_attn(q, k, v, causal=causal, backend=backend, window_size=win,
                                              softcap=softcap, cu_seqlens=docs)


def doc_pairs(docs: list[int]) -> int:
    """Visible pairs of causal attention within packed documents."""
    return sum(pairs(b - a, True) for a, b in zip(docs, docs[1:]))


def random_docs(s: int, count: int, seed: int = 0) -> list[int]:
    """``count`` documents of random lengths (multiples of 64) packed into s tokens, deterministic."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set((torch.randint(1, s // 64, (count - 1,), generator=g) * 64).tolist()))
    return [0, *cuts, s]


def measure(fn, q, k, v, dout, *, iters, warmup, device) -> dict:
    """{"fwd_s", "fwdbwd_s"}: seconds per forward (no grad) and per forward + backward."""
    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwdbwd():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    fwdbwd()  # first call: compile / autotune / graph build, then the checked warm-up
    t_fb = bu.time_loop(fwdbwd, iters=iters, warmup=warmup, device=device, barrier=False)
    t_f = bu.time_loop(fwd, iters=iters, warmup=warmup, device=device, barrier=False)
    return {"fwd_s": t_f, "fwdbwd_s": t_fb}


def inputs(b, s, h, hkv, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda heads: torch.randn(b, s, heads, d, device=device, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = (make(n).requires_grad_() for n in (h, hkv, hkv))
    return q, k, v, make(h)


# --------------------------------------------------------------------------------------------- sections
def run_sequences(args, device, report):
    rows = []
    for hkv in args.kv_heads:
        for s in args.seqs:
            for mask in args.masks:
                causal = mask == "causal"
                q, k, v, dout = inputs(args.batch, s, args.heads, hkv, args.head_dim, args.dtype, device)
                flops = 4 * args.batch * args.heads * args.head_dim * pairs(s, causal)
                row = {"seq": s, "mask": mask, "heads": args.heads, "kv_heads": hkv, "fwd_flops": flops,
                       "methods": {}}
                try:
                    row["auto"] = da.which_kernels(q, causal=causal).backend
                except Exception as exc:
                    row["auto"] = bu.error_text(exc)
                methods = [(m, lambda m=m: direct_fn(m, causal)) for m in DIRECT]
                methods += [(f"ring {b}", lambda b=b: ring_fn(b, causal)) for b in RING_BACKENDS]
                methods = [(n, f) for n, f in methods if args.methods is None or n in args.methods]
                for name, make in methods:
                    res, err = bu.guarded(lambda: measure(make(), q, k, v, dout, iters=args.iters,
                                                          warmup=args.warmup, device=device), device)
                    entry = {"error": err} if err else {
                        **res, "fwd_tflops": tflops(flops, res["fwd_s"]),
                        "fwdbwd_tflops": tflops(3.5 * flops, res["fwdbwd_s"])}
                    row["methods"][name] = entry
                    shown = "ERROR " + err[:150] if err else \
                        f"{entry['fwd_tflops']:7.1f} / {entry['fwdbwd_tflops']:7.1f} TFLOP/s"
                    print(f"  S={s:6d} {mask:6s} {args.heads}/{hkv:<2d} {name:14s} {shown}", flush=True)
                rows.append(row)
                del q, k, v, dout
                bu.release_memory(device)
                report["sequences"] = rows
                bu.write_json(Path(args.out) / f"{args.name}.json", report)
    return rows


def run_blocks(args, device, report):
    """The block pair: raw FA4 against FA4 through our backend interface."""
    rows = []
    try:
        iface = _fa4._interface()
    except ImportError as exc:
        report["blocks_error"] = bu.error_text(exc)
        return rows
    scale = args.head_dim ** -0.5
    for s in args.block_seqs:
        for mask in args.masks:
            causal = mask == "causal"
            q, k, v, dout = (x.detach() for x in inputs(args.batch, s, args.heads, args.heads, args.head_dim,
                                                        args.dtype, device, seed=1))
            flops = 4 * args.batch * args.heads * args.head_dim * pairs(s, causal)

            def raw():
                out, lse = iface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)[:2]
                iface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)

            def ours(ring_like: bool):
                fwd, bwd = _fa4.FA4Forward(), _fa4.FA4Backward()
                block_mask = CAUSAL if causal else FULL

                def run():
                    state = fwd.init_state(q)
                    fwd.step(state, q, k, v, mask=block_mask, scale=scale, final=True)
                    out, lse = fwd.finalize(state, q.dtype)
                    acc = torch.zeros(q.shape, dtype=torch.float32, device=device) if ring_like else None
                    bwd.step(dout, q, k, v, out, lse, None, mask=block_mask, scale=scale, dq_acc=acc,
                             dkv_dtype=torch.float32 if ring_like else None)
                return run

            row = {"seq": s, "mask": mask, "heads": args.heads, "fwd_flops": flops, "methods": {}}
            for name, fn in (("raw fa4", raw), ("interface", ours(False)), ("interface, ring accumulators",
                                                                              ours(True))):
                def timed(fn=fn):
                    fn()
                    return bu.time_loop(fn, iters=args.iters, warmup=args.warmup, device=device, barrier=False)

                t, err = bu.guarded(timed, device)
                row["methods"][name] = {"error": err} if err else {"s": t, "tflops": tflops(3.5 * flops, t)}
                print(f"  block {s}x{s} {mask:6s} {name:30s} "
                      + (f"ERROR {err[:150]}" if err else f"{tflops(3.5 * flops, t):7.1f} TFLOP/s"), flush=True)
            rows.append(row)
            report["blocks"] = rows
            bu.write_json(Path(args.out) / f"{args.name}.json", report)
    return rows


def run_features(args, device, report):
    rows = []
    s = args.feature_seq
    q, k, v, dout = inputs(args.batch, s, args.heads, args.heads, args.head_dim, args.dtype, device, seed=2)
    equal = [i * s // args.docs for i in range(args.docs + 1)]
    mixed = random_docs(s, 3)
    features = [("window", args.window, 0.0, None), ("softcap", None, args.softcap, None),
                (f"{args.docs} documents of {s / args.docs / 1024:g}k", None, 0.0, equal),
                (f"{len(mixed) - 1} documents {mixed}", None, 0.0, mixed)]
    for feature, window, softcap, docs in features:
        visible = doc_pairs(docs) if docs is not None else pairs(s, True, window)
        flops = 4 * args.batch * args.heads * args.head_dim * visible
        label = (f"window {window}" if window is not None else f"softcap {softcap}" if softcap else feature)
        row = {"seq": s, "mask": "causal", "feature": label, "fwd_flops": flops, "methods": {}}
        methods = [("fa4 direct", lambda: direct_fn("fa4 direct", True, window, softcap, docs))]
        methods += [(f"ring {b}", lambda b=b: ring_fn(b, True, window, softcap, docs))
                    for b in ("fa4", "triton", "auto")]
        for name, make in methods:
            res, err = bu.guarded(lambda: measure(make(), q, k, v, dout, iters=args.iters, warmup=args.warmup,
                                                  device=device), device)
            row["methods"][name] = {"error": err} if err else {
                **res, "fwd_tflops": tflops(flops, res["fwd_s"]), "fwdbwd_tflops": tflops(3.5 * flops, res["fwdbwd_s"])}
            print(f"  S={s} causal {label:12s} {name:12s} "
                  + (f"ERROR {err[:150]}" if err else f"{res['fwdbwd_s'] * 1e3:8.2f} ms fwd+bwd"), flush=True)
        rows.append(row)
        report["features"] = rows
        bu.write_json(Path(args.out) / f"{args.name}.json", report)
    return rows


# ------------------------------------------------------------------------------------------------ report
def _cell(entry: dict | None, key: str, spec: str = ".0f") -> str:
    if not entry:
        return "-"
    if entry.get("error"):
        return "err"
    return bu.fmt(entry.get(key), spec)


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a.get("error") or b.get("error") or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}"


def markdown(report: dict) -> str:
    parts = [bu.markdown_header("Block-kernel backends on one GPU", report)]
    versions = report.get("versions", {})
    parts.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".\n")
    seq = report.get("sequences", [])
    if seq:
        names = [*DIRECT, *(f"ring {b}" for b in RING_BACKENDS)]
        parts.append("### Full sequences: TFLOP/s forward / forward+backward (bf16, batch 1, head_dim "
                     f"{report['config']['head_dim']})\n")
        headers = ["S", "mask", "heads", *names, "ring fa4 / fa4 (f+b)", "auto ran"]
        rows = []
        for r in seq:
            m = r["methods"]
            cells = [f"{_cell(m.get(n), 'fwd_tflops')} / {_cell(m.get(n), 'fwdbwd_tflops')}" for n in names]
            rows.append([f"{r['seq'] // 1024}k", r["mask"], f"{r['heads']}/{r['kv_heads']}", *cells,
                         _ratio(m.get("ring fa4"), m.get("fa4 direct"), "fwdbwd_tflops"), r.get("auto", "-")])
        parts.append(bu.markdown_table(headers, rows, "lll" + "r" * (len(headers) - 3)) + "\n")
    blocks = report.get("blocks", [])
    if blocks:
        parts.append("### Block pair (forward with lse + backward from that lse), fwd+bwd TFLOP/s\n")
        names = ["raw fa4", "interface", "interface, ring accumulators"]
        rows = [[f"{r['seq'] // 1024}k x {r['seq'] // 1024}k", r["mask"],
                 *(_cell(r["methods"].get(n), "tflops") for n in names),
                 _ratio(r["methods"].get("interface"), r["methods"].get("raw fa4"), "tflops"),
                 _ratio(r["methods"].get("interface, ring accumulators"), r["methods"].get("raw fa4"), "tflops")]
                for r in blocks]
        parts.append(bu.markdown_table(["block", "mask", *names, "interface / raw", "ring-like / raw"], rows,
                                       "ll" + "r" * 5) + "\n")
    feats = report.get("features", [])
    if feats:
        parts.append("### Features at S = 16k causal: forward+backward milliseconds\n")
        names = ["fa4 direct", "ring fa4", "ring triton", "ring auto"]
        rows = []
        for r in feats:
            m = r["methods"]
            cells = ["err" if (m.get(n) or {}).get("error") else bu.fmt((m.get(n) or {}).get("fwdbwd_s", None)
                                                                          and m[n]["fwdbwd_s"] * 1e3, ".2f")
                     for n in names]
            best = m.get("ring auto") or {}
            ratio = ("-" if best.get("error") or (m.get("fa4 direct") or {}).get("error") else
                     f"{best['fwdbwd_s'] / m['fa4 direct']['fwdbwd_s']:.2f}")
            rows.append([r["feature"], *cells, ratio])
        parts.append(bu.markdown_table(["feature", *names, "auto / fa4 time"], rows, "l" + "r" * 5) + "\n")
    errors = sorted({f"{name}: {e['error']}" for section in (seq, blocks, feats) for r in section
                     for name, e in r["methods"].items() if e.get("error")})
    if errors:
        parts.append("Errors (`err` cells):\n\n" + "\n".join(f"- {e}" for e in errors) + "\n")
    return "\n".join(parts)


def plot(report: dict, path: Path) -> None:
    seq = report.get("sequences", [])
    panels = []
    for hkv in sorted({r["kv_heads"] for r in seq}, reverse=True):
        for mask in ("causal", "full"):
            rows = [r for r in seq if r["kv_heads"] == hkv and r["mask"] == mask]
            if not rows:
                continue
            series = []
            for name in (*DIRECT, *(f"ring {b}" for b in RING_BACKENDS)):
                ys = [(r["methods"].get(name) or {}).get("fwdbwd_tflops") for r in rows]
                series.append({"label": name, "x": [r["seq"] for r in rows], "y": ys,
                               "style": "o--" if name in DIRECT else "o-"})
            panels.append({"title": f"{mask}, heads {rows[0]['heads']}/{hkv}", "xlabel": "sequence length",
                           "ylabel": "fwd+bwd TFLOP/s", "xscale": "log", "series": series,
                           "xticks": [(r["seq"], f"{r['seq'] // 1024}k") for r in rows]})
    if panels:
        bu.plot_panels(path, panels, title="Block-kernel backends on one GPU (bf16)")


def versions() -> dict:
    out = {}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=lambda t: bu.parse_list(t, int), default=[8192, 16384, 32768])
    p.add_argument("--masks", type=lambda t: bu.parse_list(t), default=["causal", "full"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=lambda t: bu.parse_list(t, int), default=[32, 8])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--block-seqs", type=lambda t: bu.parse_list(t, int), default=[4096, 8192])
    p.add_argument("--feature-seq", type=int, default=16384)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--docs", type=int, default=16, help="equal packed documents in the features section")
    p.add_argument("--sections", type=lambda t: bu.parse_list(t), default=["sequences", "blocks", "features"])
    p.add_argument("--methods", type=lambda t: bu.parse_list(t), default=None,
                   help="full-sequence methods to run, e.g. 'fa4 direct,ring fa4' (default: all)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--name", default="backends")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_backends.py needs a CUDA GPU")
    args.dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    report = {"command": bu.command_line(), "env": bu.env_info("none (one GPU)", 1), "versions": versions(),
              "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()},
              "auto_preference": list(_kernels.AUTO_PREFERENCE)}
    out = Path(args.out)
    if "sequences" in args.sections:
        run_sequences(args, device, report)
    if "blocks" in args.sections:
        run_blocks(args, device, report)
    if "features" in args.sections:
        run_features(args, device, report)
    bu.write_json(out / f"{args.name}.json", report)
    (out / f"{args.name}.md").write_text(markdown(report))
    if not args.no_plot:
        plot(report, out / f"{args.name}.png")
    print(markdown(report), flush=True)


if __name__ == "__main__":
    main()
