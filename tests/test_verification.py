"""Cross-rank disagreements in the caller's terms (``_validation.verify_across_ring``), cheapest first.

1. pure functions: the rendering of ring positions and long document boundaries, and the message's grouping
   of ranks by the values they passed;
2. gloo world of 2 ranks: every verified field of ``ring_flash_attn`` and ``gather_sequence`` made to differ
   between the ranks gives one message, the same on every rank, naming the field and each rank's value as
   the caller wrote it (layout names, floats, True/False, shapes and dtypes, document boundaries), after
   one exchange when the ranks agree and a second, small one only when they do not.
"""

import re

import pytest
import torch

import distcomm
import distcomm_attention as da
from distcomm_attention import _validation
from tests.dist_harness import run_world


# ------------------------------------------------------------------------------------------------------
# 1. pure functions
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ranks, text",
    [([0], "ring position 0"), ([1, 2, 3], "ring positions 1-3"), ([0, 2, 3, 4, 7], "ring positions 0, 2-4, 7")],
)
def test_ring_positions_are_compressed(ranks, text):
    """Large rings stay readable: consecutive positions are written as a range."""
    assert _validation._positions(ranks) == text


def test_long_boundaries_show_their_ends_and_length():
    """Short boundary lists are shown whole; long ones by their first and last entries and their length."""
    assert _validation.render_ints((0, 3, 8)) == "[0, 3, 8]"
    assert _validation.render_ints(tuple(range(0, 200, 2))) == "[0, 2, 4, 6, ..., 196, 198] (100 entries)"


def test_message_groups_ranks_by_their_values():
    """Ranks that passed the same values share one clause; only the differing fields are listed."""
    msg = _validation._describe("op", ["causal", "softcap"], [["True", "0.0"], ["False", "0.0"], ["False", "0.0"]])
    assert msg == ("op: the ranks of the ring disagree on `causal`, `softcap` (ring position 0: causal=True, "
                   "softcap=0.0; ring positions 1-2: causal=False, softcap=0.0); every rank of the ring must pass "
                   "the same shapes, dtypes and options")


# ------------------------------------------------------------------------------------------------------
# 2. gloo world of 2 ranks
# ------------------------------------------------------------------------------------------------------


def _catch(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _fields_rank(rank, world):
    first = rank == 0

    def qkv(n=4, dtype=torch.float64, grad=False):
        return tuple(torch.randn(1, n, 2, 16, dtype=dtype, requires_grad=grad) for _ in range(3))

    def attn(*args, **kw):
        return lambda: da.ring_flash_attn(*(args or qkv()), **kw)

    calls = {
        "length": attn(*qkv(4 if first else 6)),
        "dtype": attn(*qkv(dtype=torch.float64 if first else torch.float32)),
        "layout": attn(layout="zigzag" if first else "striped"),
        "causal": attn(causal=first),
        "softmax_scale": attn(softmax_scale=0.5 if first else None),
        "window": attn(window_size=(3, 0) if first else (-1, -1)),
        "softcap": attn(softcap=2.5 if first else 0.0),
        "attention_mask": attn(attention_mask=torch.ones(1, 4, dtype=torch.bool) if first else None),
        "cu_seqlens": attn(cu_seqlens=[0, 3, 8] if first else [0, 5, 8]),
        "cu_seqlens none": attn(cu_seqlens=[0, 3, 8] if first else None),
        "cu_seqlens long": attn(*qkv(16), cu_seqlens=list(range(33)) if first else [0] + list(range(2, 33))),
        # the same length and shown entries, different in the middle: told apart by a digest
        "cu_seqlens middle": attn(*qkv(16), cu_seqlens=[b + (b == 16 and not first) for b in range(0, 33, 2)]),
        "requires_grad": attn(*qkv(grad=first)),
        "two fields": attn(causal=first, softcap=1.0 if first else 0.0),
        "gather dim": lambda: da.gather_sequence(torch.zeros(4, 4), dim=0 if first else 1),
        "gather shape": lambda: da.gather_sequence(torch.zeros(2, 4 if first else 6)),
    }
    msgs = {name: _catch(fn) for name, fn in calls.items()}
    # this rank's boundaries are invalid: its error, raised on every rank (in default mode too)
    msgs["cu_seqlens invalid"] = _catch(attn(cu_seqlens=[0, 3, 8] if first else [0, 3, 9]))

    # One exchange when the ranks agree (as before), a second only for the message of a disagreement.
    calls_made = []
    original = distcomm.RingComm.all_gather_ints

    def counting(*args):
        calls_made.append(1)
        return original(*args)

    distcomm.RingComm.all_gather_ints = counting
    try:
        da.ring_flash_attn(*qkv(8), causal=True)
        agree = len(calls_made)
        _catch(attn(*qkv(8), softcap=1.0 if first else 2.0))  # a new signature on both ranks
        msgs["exchanges"] = (agree, len(calls_made) - agree)
    finally:
        distcomm.RingComm.all_gather_ints = original
    return msgs


def _disagree(op, fields, rank0, rank1):
    names = ", ".join(f"`{f}`" for f in fields)
    return (rf"^{op}: the ranks of the ring disagree on {re.escape(names)} \(ring position 0: {rank0}; ring position 1: "
            rf"{rank1}\); every rank of the ring must pass the same shapes, dtypes and options")


EXPECTED = {
    "length": _disagree("ring_flash_attn", ["q", "k", "v"], r"q=\(1, 4, 2, 16\) torch.float64, k=\(1, 4, 2, 16\) "
                        r"torch.float64, v=\(1, 4, 2, 16\) torch.float64", r"q=\(1, 6, 2, 16\) torch.float64, .*"),
    "dtype": _disagree("ring_flash_attn", ["q", "k", "v"], r"q=\(1, 4, 2, 16\) torch.float64, .*",
                       r"q=\(1, 4, 2, 16\) torch.float32, k=\(1, 4, 2, 16\) torch.float32, .*"),
    "layout": _disagree("ring_flash_attn", ["layout"], "layout='zigzag'", "layout='striped'")
    + r"; pass the same `layout=` \(or `sharding=`\) on every rank$",
    "causal": _disagree("ring_flash_attn", ["causal"], "causal=True", "causal=False") + "$",
    "softmax_scale": _disagree("ring_flash_attn", ["softmax_scale"], "softmax_scale=0.5", "softmax_scale=0.25"),
    "window": _disagree("ring_flash_attn", ["window_left", "window_right"], "window_left=3, window_right=0",
                        "window_left=-1, window_right=-1"),
    "softcap": _disagree("ring_flash_attn", ["softcap"], "softcap=2.5", "softcap=0.0"),
    "attention_mask": _disagree("ring_flash_attn", ["attention_mask"], "attention_mask=True", "attention_mask=False"),
    "cu_seqlens": _disagree("ring_flash_attn", ["cu_seqlens"], r"cu_seqlens=\[0, 3, 8\]", r"cu_seqlens=\[0, 5, 8\]"),
    "cu_seqlens none": _disagree("ring_flash_attn", ["cu_seqlens"], r"cu_seqlens=\[0, 3, 8\]", "cu_seqlens=None"),
    "cu_seqlens long": _disagree("ring_flash_attn", ["cu_seqlens"],
                                 r"cu_seqlens=\[0, 1, 2, 3, \.\.\., 31, 32\] \(33 entries\)",
                                 r"cu_seqlens=\[0, 2, 3, 4, \.\.\., 31, 32\] \(32 entries\)"),
    "cu_seqlens middle": _disagree("ring_flash_attn", ["cu_seqlens"],
                                   r"cu_seqlens=\[0, 2, 4, 6, \.\.\., 30, 32\] \(17 entries\) \(digest [0-9a-f]{8}\)",
                                   r"cu_seqlens=\[0, 2, 4, 6, \.\.\., 30, 32\] \(17 entries\) \(digest [0-9a-f]{8}\)"),
    "requires_grad": _disagree("ring_flash_attn", ["requires_grad"], "requires_grad=True", "requires_grad=False")
    + r"; the inputs must need grad on every rank or on none \(q, k and v for attention",
    "two fields": _disagree("ring_flash_attn", ["causal", "softcap"], "causal=True, softcap=1.0",
                            "causal=False, softcap=0.0"),
    "gather dim": _disagree("gather_sequence", ["dim"], "dim=0", "dim=1"),
    "gather shape": _disagree("gather_sequence", ["x_local"], r"x_local=\(2, 4\) torch.float32",
                              r"x_local=\(2, 6\) torch.float32"),
    "cu_seqlens invalid": r"^ring_flash_attn: invalid input on rank 1: `cu_seqlens` must end at the global sequence "
                          r"length 8 \(local_seq x ring size\), got 9 \(the other ranks' inputs passed; every rank "
                          r"raises this error\)$",
}


def test_each_field_disagreement_names_the_field_and_both_values():
    """Every verified field that differs between two ranks is named with both ranks' values in the caller's terms
    (no encoded floats, layout codes or digests), in one message that is the same on both ranks."""
    msgs = run_world(_fields_rank, 2, timeout=120)
    for key, expect in EXPECTED.items():
        assert msgs[0][key] == msgs[1][key], (key, msgs[0][key], msgs[1][key])
        assert msgs[0][key] is not None and re.search(expect, msgs[0][key]), (key, msgs[0][key])
    assert all(m["exchanges"] == (1, 2) for m in msgs)


def _exchange_rank(rank, world):
    import gc

    import torch.distributed as dist

    from distcomm.ring import RingComm

    before = len(_validation._EXCHANGES)
    whole, device = _validation._exchange_comm(RingComm(None))
    out = {"device": str(device), "size": whole.size}
    out["again"] = _validation._exchange_comm(RingComm(None))[0] is whole  # looked up once per group
    out["sub-ring"] = _validation._exchange_comm(RingComm(None, 1))[0] is whole  # a ring of part of it: the whole
    group = dist.new_group([0, 1])
    other = _validation._exchange_comm(RingComm(group))[0]
    out["other group"] = other is not whole and other.size == 2 and len(_validation._EXCHANGES) == before + 2
    dist.destroy_process_group(group)
    del group, other
    gc.collect()
    out["gone with its group"] = len(_validation._EXCHANGES) == before + 1
    return out


def test_verification_ring_is_looked_up_once_per_group():
    """``_exchange_comm`` (the ring a call verifies over, on the host) is found once per process group and kept
    while the group lives: the same ring for every call and sub-ring of the group, another for another group,
    and the entry gone once that group is destroyed."""
    for out in run_world(_exchange_rank, 2, timeout=120):
        assert out == {"device": "cpu", "size": 2, "again": True, "sub-ring": True, "other group": True,
                       "gone with its group": True}, out
