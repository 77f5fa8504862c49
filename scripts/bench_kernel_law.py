"""How one flash-attn-4 varlen forward + backward's time grows with document length: the kernel law the cost
model's compute term stands for.

Each row is one call over S tokens packed as documents of one length L (causal, bf16, d = 128), S / L
documents, at the heads given (32/8: a rank of the ring or the all-gather; 4/1: Ulysses' rank at W = 8), timed
on CUDA events with the host kept ahead (median of ``--iters`` after ``--warmup``). Beside the time, the work
counts a cost law can use: the visible pairs, the pairs of the 128 x 128 tiles they touch, the query tiles (one
per 128 rows of a document), all per head. ``--suffixes Lk/Lq,...`` adds rows whose documents hand the kernel
only their last Lq queries over all Lk keys (a later rank's share of a document): there the key tiles (the
backward's work items) outnumber the query tiles.

    PYTHONPATH=. python scripts/bench_kernel_law.py --out docs/bench/kernel_law.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_strategies as bs  # noqa: E402

TILE = 128


def work(lengths: list[int]) -> dict:
    """Per-head work counts of causal documents of ``lengths``."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    q_tiles = sum(math.ceil(n / TILE) for n in lengths)
    tiles = sum(math.ceil(min(n, (i + 1) * TILE) / TILE) for n in lengths for i in range(math.ceil(n / TILE)))
    return dict(pairs=pairs, tile_pairs=tiles * TILE * TILE, q_tiles=q_tiles, documents=len(lengths))


def suffix_work(key_len: int, query_len: int, documents: int) -> dict:
    """Per-head work counts of ``documents`` documents of ``key_len`` tokens whose last ``query_len`` tokens are
    the queries (causal, bottom-right): what a later rank's share of a document, or a rank reading a document's
    keys from others, hands the kernel. Key tiles: the 128-key tiles each document's keys span."""
    first = key_len - query_len
    q_tiles = math.ceil(query_len / TILE)
    tiles = sum(math.ceil(min(key_len, first + (i + 1) * TILE) / TILE) for i in range(q_tiles))
    pairs = sum(first + i + 1 for i in range(query_len))
    return dict(pairs=pairs * documents, tile_pairs=tiles * TILE * TILE * documents, q_tiles=q_tiles * documents,
                k_tiles=math.ceil(key_len / TILE) * documents, documents=documents)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="16384,131072", help="tokens per call, comma-separated")
    p.add_argument("--lengths", default="64,128,256,512,1024,2048,4096,8192,16384,32768,131072")
    p.add_argument("--heads", default="32/8,4/1", help="query/kv heads, comma-separated")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--suffixes", default="", help="key_len/query_len pairs, comma-separated: documents of "
                   "key_len keys whose last query_len tokens are the queries, --seqs keys a call")
    p.add_argument("--out", type=Path, default=Path("kernel_law.json"))
    args = p.parse_args()
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")) if args.suffixes else ():
        for key_len, query_len in (tuple(int(x) for x in pair.split("/")) for pair in args.suffixes.split(",")):
            if key_len > seq or query_len > key_len:
                continue
            docs = seq // key_len
            for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
                g = torch.Generator(device=dev).manual_seed(0)
                q = torch.randn(1, docs * query_len, hq, d, device=dev, dtype=dt, generator=g)
                k, v = (torch.randn(1, docs * key_len, hkv, d, device=dev, dtype=dt, generator=g) for _ in range(2))
                step = bs._fa4_single(q, k, v, True, list(range(0, docs * query_len + 1, query_len)),
                                      key_docs=list(range(0, docs * key_len + 1, key_len)))
                ms = bs._timed(step, args.iters, args.warmup, host_ahead=True) * 1e3
                row = dict(seq=docs * key_len, length=key_len, query_length=query_len, heads=hq, kv_heads=hkv, ms=ms,
                           **suffix_work(key_len, query_len, docs))
                rows.append(row)
                print(json.dumps(row), flush=True)
    for seq in (int(s) for s in args.seqs.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            if length > seq:
                continue
            docs = list(range(0, seq + 1, length))
            docs[-1] = seq
            lengths = [b - a for a, b in zip(docs, docs[1:])]
            for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v = (torch.randn(1, seq, h, d, device=dev, dtype=dt, generator=g) for h in (hq, hkv, hkv))
                ms = bs._timed(bs._fa4_single(q, k, v, True, docs), args.iters, args.warmup, host_ahead=True) * 1e3
                row = dict(seq=seq, length=length, heads=hq, kv_heads=hkv, ms=ms, **work(lengths),
                           k_tiles=sum(math.ceil(n / TILE) for n in lengths))
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
