"""Time the gated delta rule's state passes alone at one rank's shapes (one GPU, fla-core, no tilelang needed):
fla's forward state pass, its values' local gradient and reverse pass (dS_in, without an end-state gradient, as the
open segments' backward runs it), and this library's state-only pass (distcomm_attention/linear/maps_kernel.py:
the maps), each the median of
CUDA-event timings; and each pass again with the tokens cut into pieces run as batch rows, which shows whether a
pass's time follows its work or its chain of chunks (a pass bound by the chain would take 1/P of the time in P
pieces, and an open segment could then run its passes in pieces).

    python scripts/bench_linear_passes.py --tokens 16384 --heads 16/32 --dim 128

Each time is CUDA events around one call with the host ahead (a GPU sleep queued first), so fla's Python does
not count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_util as U  # noqa: E402


def timed(fn, iters: int = 20) -> float:
    """Median milliseconds of one call, the host ahead by 1 ms of queued GPU sleep (``_bench_util``)."""
    for _ in range(3):
        fn()
    return 1e3 * U.gpu_seconds(fn, iters, ahead_s=1e-3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--heads", default="16/32", help="key heads / value heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--splits", default="1,2,4,8",
                   help="the tokens also cut into this many equal pieces, run as batch rows (chunk-local inputs "
                        "stay valid): whether a pass's time follows its work or its chain of chunks")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from distcomm_attention.linear.maps_kernel import delta_maps

    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    h, hv = (int(x) for x in args.heads.split("/"))
    t, d = args.tokens, args.dim
    q = torch.randn(1, t, h, d, device=dev, dtype=bf)
    k = torch.nn.functional.normalize(torch.randn(1, t, h, d, device=dev), dim=-1).to(bf)
    v = torch.randn(1, t, hv, d, device=dev, dtype=bf)
    g = chunk_local_cumsum(torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device=dev) + 4), chunk_size=64,
                           scale=RCP_LN2)
    beta = torch.rand(1, t, hv, device=dev).to(bf)
    do = torch.randn(1, t, hv, d, device=dev, dtype=bf)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
    h0, dht = torch.randn(1, hv, d, d, device=dev), torch.randn(1, hv, d, d, device=dev)
    scale = d**-0.5
    dv_local = chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=scale)
    dhu = lambda end: chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv_local, g=g, h0=h0,  # noqa: E731
                                                     dht=end, scale=scale)
    rows = {
        "fla forward state pass (fwd_h)": timed(lambda: chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g,
                                                                                     initial_state=h0)),
        "fla reverse pass, no end-state gradient": timed(lambda: dhu(None)),
        "fla reverse pass with it": timed(lambda: dhu(dht)),
        "fla local values' gradient (dv_local)": timed(lambda: chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=scale)),
        "maps (A, B), one pass": timed(lambda: delta_maps(k, w, u, g)),
    }
    by_split = {}
    for pieces in (int(x) for x in args.splits.split(",")):
        if t % (64 * pieces):
            continue
        cut = lambda x: x.reshape((pieces, t // pieces) + x.shape[2:])  # noqa: E731
        kc, wc, uc, gc, qc, doc, dvc = map(cut, (k, w, u, g, q, do, dv_local))
        h0c, dhtc = (x.expand(pieces, *x.shape[1:]).contiguous() for x in (h0, dht))
        by_split[pieces] = {
            "fwd_h": timed(lambda: chunk_gated_delta_rule_fwd_h(k=kc, w=wc, u=uc, g=gc, initial_state=h0c)),
            "reverse pass": timed(lambda: chunk_gated_delta_rule_bwd_dhu(q=qc, k=kc, w=wc, do=doc, dv=dvc, g=gc,
                                                                         h0=h0c, dht=dhtc, scale=scale)),
            "maps": timed(lambda: delta_maps(kc, wc, uc, gc)),
        }
    out = {"device": torch.cuda.get_device_name(), "tokens": t, "heads": args.heads, "dim": d, "ms": rows,
           "ms, tokens cut into pieces run as batch rows": by_split}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
