"""``Sharding`` and the layout record (Note [Layout record]): the layout named once, when sharding, cheapest first.

1. in-process: ``Sharding``'s argument errors, ``sharding=`` beside a conflicting ``layout``/``group``/
   ``ring_size``, ``position_ids(rank=...)`` without a layout, and a ring of one recording nothing;
2. gloo worlds of 2 and 3 ranks against the single-process float64 reference: shards of zigzag / striped
   attended with the layout left out (function, module, compiled), the ``Sharding`` handle, an explicit layout
   unchanged by a different record, ``gather_sequence`` / ``position_ids`` reading the record; an ambiguous
   record and a record that differs between ranks raise the same ValueError on every rank (never a hang).
"""

import re

import pytest
import torch
import torch.distributed as dist

import distcomm
import distcomm_attention as da
from distcomm_attention import sharding as _sharding
from distcomm_attention._reference import attention_reference
from distcomm_attention.planning import layouts
from tests.dist_harness import run_world

FP64 = dict(rtol=1e-10, atol=1e-12)


def _global(world: int, seed: int = 0):
    """Global (q, k, v) in float64, 4 tokens per rank (zigzag needs an even local length)."""
    g = torch.Generator().manual_seed(seed)
    seq = 4 * world
    return tuple(torch.randn(1, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))


def _want(world: int, layout: str, rank: int, seed: int = 0) -> torch.Tensor:
    q, k, v = _global(world, seed)
    return layouts.shard(attention_reference(q, k, v, causal=True), layout, world, rank)


def _catch(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------------
# 1. in-process
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: da.Sharding("spiral"), ValueError, r"Invalid layout 'spiral'. Must be one of: 'contiguous'"),
        (lambda: da.Sharding("zigzag", ring_size=0), ValueError, r"`ring_size` must be a positive int or None.*got 0"),
        (lambda: da.Sharding("zigzag", None), TypeError, r"positional argument"),  # group is keyword-only
    ],
)
def test_sharding_argument_errors(make, error, match):
    """A bad layout or ring size is refused when the handle is made, naming the value and what is allowed."""
    with pytest.raises(error, match=match):
        make()


def test_sharding_conflicts_name_both():
    """``sharding=`` beside a layout, group or ring size that says otherwise is refused, naming both."""
    q = torch.zeros(1, 4, 2, 8)
    s = da.Sharding("zigzag")
    with pytest.raises(ValueError, match=r"`layout`='striped' conflicts with `sharding`=Sharding\(layout='zigzag'.*"
                                         r"\(layout 'zigzag'\)"):
        da.ring_flash_attn(q, q, q, sharding=s, layout="striped")
    with pytest.raises(ValueError, match=r"`ring_size`=2 conflicts with `sharding`=.*\(ring_size None\)"):
        da.ring_flash_attn(q, q, q, sharding=s, ring_size=2)
    with pytest.raises(ValueError, match=r"`layout`='contiguous' conflicts with `sharding`"):
        da.RingAttention(16, heads=2, dim_head=8, layout="contiguous", sharding=s)
    with pytest.raises(TypeError, match=r"`sharding` must be a distcomm_attention.Sharding or None, got str"):
        da.ring_flash_attn(q, q, q, sharding="zigzag")
    # repeating the handle's own values is fine
    out = da.ring_flash_attn(q, q, q, sharding=s, layout="zigzag")
    assert out.shape == q.shape


def test_position_ids_with_rank_needs_a_layout():
    """``rank=`` consults no process group, so no record applies: the layout must be given."""
    with pytest.raises(ValueError, match=r"`rank`=1 needs an explicit `layout`.*'contiguous', 'zigzag', 'striped'"):
        da.position_ids(4, rank=1, ring_size=2)
    assert da.position_ids(4, "zigzag", rank=1, ring_size=2).tolist() == [2, 3, 4, 5]


def test_ring_of_one_records_nothing():
    """Without a process group every layout is the identity: nothing is recorded, nothing is ambiguous."""
    assert not dist.is_initialized()
    before = dict(_sharding._recorded)
    q, k, v = _global(1)
    for layout in da.planning.layouts.STATIC:
        da.shard_sequence(q, layout)
    assert _sharding._recorded == before
    torch.testing.assert_close(da.ring_flash_attn(q, k, v, causal=True), attention_reference(q, k, v, causal=True),
                               **FP64)
    s = da.Sharding("striped")
    torch.testing.assert_close(s.gather(s.shard(q)), q, rtol=0, atol=0)
    assert s.position_ids(4).tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------------
# 2. gloo worlds
# ------------------------------------------------------------------------------------------------------


def _ring(world):
    """A fresh group over every rank: a ring with nothing recorded yet (the record's key is the group's name)."""
    return dist.new_group(list(range(world)))


def _correct_rank(rank, world):
    out = {}
    q, k, v = _global(world)
    for layout in ("zigzag", "striped"):
        group = _ring(world)
        shards = [da.shard_sequence(t, layout, group=group) for t in (q, k, v)]
        out[("left out", layout)] = da.ring_flash_attn(*shards, causal=True, group=group)
        with distcomm.check_mode():
            out[("check mode", layout)] = da.ring_flash_attn(*shards, causal=True, group=group)
        out[("gather", layout)] = da.gather_sequence(shards[0], group=group)
        out[("positions", layout)] = da.position_ids(4, group=group)
        torch.manual_seed(0)
        module = da.RingAttention(16, heads=2, dim_head=8, causal=True, group=group).double()
        out[("module", layout)] = module(da.shard_sequence(q.reshape(1, -1, 32)[..., :16], layout, group=group))

        def attend(q, k, v, group=group):
            return da.ring_flash_attn(q, k, v, causal=True, group=group)

        out[("compiled", layout)] = torch.compile(attend, fullgraph=True, backend="aot_eager")(*shards)
    # The explicit handle.
    s = da.Sharding("zigzag", group=_ring(world))
    out["sharding"] = da.ring_flash_attn(*(s.shard(t) for t in (q, k, v)), causal=True, sharding=s)
    out["sharding gather"] = s.gather(s.shard(q))
    # An explicit layout is never overridden: striped recorded, zigzag shards (taken with rank=, which
    # records nothing) attended with layout="zigzag".
    group = _ring(world)
    da.shard_sequence(q, "striped", group=group)
    zig = [da.shard_sequence(t, "zigzag", ring_size=world, rank=rank) for t in (q, k, v)]
    out["explicit"] = da.ring_flash_attn(*zig, causal=True, layout="zigzag", group=group)
    # Nothing recorded: "contiguous", as before the record existed.
    group = _ring(world)
    out["default"] = da.ring_flash_attn(*(da.shard_sequence(t, "contiguous", ring_size=world, rank=rank)
                                          for t in (q, k, v)), causal=True, group=group)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_layout_left_out_uses_the_recorded_layout(world):
    """Shards of zigzag / striped attended with the layout left out equal the float64 reference (function, check
    mode, module, compiled), as do the ``Sharding`` handle, an explicit layout under a different record and the
    default with nothing recorded; gather_sequence and position_ids read the same record."""
    results = run_world(_correct_rank, world, timeout=180)
    q, k, v = _global(world)
    torch.manual_seed(0)
    module = da.RingAttention(16, heads=2, dim_head=8, causal=True).double()
    module_full = module(q.reshape(1, -1, 32)[..., :16]).detach()
    for rank, got in enumerate(results):
        for layout in ("zigzag", "striped"):
            for how in ("left out", "check mode", "compiled"):
                torch.testing.assert_close(got[(how, layout)], _want(world, layout, rank), **FP64,
                                           msg=f"{how} {layout} rank {rank}")
            torch.testing.assert_close(got[("gather", layout)], q, rtol=0, atol=0)
            assert got[("positions", layout)].tolist() == layouts.positions(layout, 4 * world, world, rank).tolist()
            torch.testing.assert_close(got[("module", layout)], layouts.shard(module_full, layout, world, rank), **FP64)
        torch.testing.assert_close(got["sharding"], _want(world, "zigzag", rank), **FP64)
        torch.testing.assert_close(got["sharding gather"], q, rtol=0, atol=0)
        torch.testing.assert_close(got["explicit"], _want(world, "zigzag", rank), **FP64)
        torch.testing.assert_close(got["default"], _want(world, "contiguous", rank), **FP64)


def _errors_rank(rank, world):
    msgs = {}
    q, k, v = _global(world)
    local = [da.shard_sequence(t, "zigzag", ring_size=world, rank=rank) for t in (q, k, v)]

    # Ambiguous on every rank: zigzag, then striped, recorded for the same ring.
    group = _ring(world)
    for layout in ("zigzag", "striped"):
        da.shard_sequence(q, layout, group=group)
    for check in (False, True):
        with distcomm.check_mode(check):
            msgs[("ambiguous", check)] = _catch(lambda: da.ring_flash_attn(*local, causal=True, group=group))
    msgs["ambiguous again"] = _catch(lambda: da.ring_flash_attn(*local, causal=True, group=group))  # verified before
    msgs["ambiguous gather"] = _catch(lambda: da.gather_sequence(local[0], group=group))
    msgs["ambiguous positions"] = _catch(lambda: da.position_ids(4, group=group))
    msgs["ambiguous explicit"] = da.ring_flash_attn(*local, causal=True, group=group, layout="zigzag").shape[1]

    # A record that differs between ranks: rank 0 recorded zigzag, the others striped.
    group = _ring(world)
    da.shard_sequence(q, "zigzag" if rank == 0 else "striped", group=group)
    msgs["differs"] = _catch(lambda: da.ring_flash_attn(*local, causal=True, group=group))
    msgs["differs gather"] = _catch(lambda: da.gather_sequence(local[0], group=group))

    # Rank 0 recorded zigzag, the others nothing (the default, contiguous).
    group = _ring(world)
    if rank == 0:
        da.shard_sequence(q, "zigzag", group=group)
    msgs["default"] = _catch(lambda: da.ring_flash_attn(*local, causal=True, group=group))

    # Ambiguous on rank 0 only: the ambiguity is not raised by rank 0 alone before the exchange.
    group = _ring(world)
    for layout in ("zigzag", "striped") if rank == 0 else ("zigzag",):
        da.shard_sequence(q, layout, group=group)
    msgs["ambiguous on one"] = _catch(lambda: da.ring_flash_attn(*local, causal=True, group=group))

    # The world still works afterwards.
    msgs["after"] = da.ring_flash_attn(*local, causal=True, layout="zigzag").shape[1]
    return msgs


@pytest.mark.parametrize("world", [2, 3])
def test_ambiguous_or_differing_records_raise_on_every_rank(world):
    """An ambiguous record, a record that differs between ranks, and an ambiguity on one rank only: the same
    ValueError on every rank of the ring, naming the layouts and saying to pass layout= or sharding=."""
    msgs = run_world(_errors_rank, world, timeout=120)
    rest = f"ring positions 1-{world - 1}" if world > 2 else "ring position 1"
    ambiguous = (r"ring_flash_attn: `layout` was left out, and shard_sequence recorded several layouts for this ring "
                 r"in this process \('zigzag' and 'striped'\).*pass layout= \(or sharding=Sharding\(layout, \.\.\.\)\)")
    for key, expect in [
        (("ambiguous", False), ambiguous),
        (("ambiguous", True), ambiguous),
        ("ambiguous again", ambiguous),
        ("ambiguous gather", r"gather_sequence: `layout` was left out, and shard_sequence recorded several layouts "
                             r"for this ring in this process \('zigzag' and 'striped'\)"),
        ("ambiguous positions", r"position_ids: `layout` was left out.*\('zigzag' and 'striped'\)"),
        ("differs", r"ring_flash_attn: the ranks of the ring disagree on `layout` \(ring position 0: layout='zigzag' "
                    rf"\(left out; recorded by shard_sequence\); {rest}: layout='striped' \(left out; recorded by "
                    r"shard_sequence\)\).*pass the same `layout=` \(or `sharding=`\) on every rank"),
        ("differs gather", r"gather_sequence: the ranks of the ring disagree on `layout` \(ring position 0: "
                           r"layout='zigzag'"),
        ("default", rf"disagree on `layout` \(ring position 0: layout='zigzag' \(left out; recorded by "
                    rf"shard_sequence\); {rest}: layout='contiguous' \(left out; the default\)\)"),
        ("ambiguous on one", rf"disagree on `layout` \(ring position 0: layout=ambiguous \(left out; shard_sequence "
                             rf"recorded 'zigzag' and 'striped'\); {rest}: layout='zigzag' \(left out; recorded"),
    ]:
        assert msgs[0][key] is not None and re.search(expect, msgs[0][key]), (key, msgs[0][key])
        assert all(m[key] == msgs[0][key] for m in msgs), (key, [m[key] for m in msgs])
    assert all(m["ambiguous explicit"] == 4 and m["after"] == 4 for m in msgs)
