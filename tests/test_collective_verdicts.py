"""Input errors decided by all ranks together (Note [Collective verdicts] in distcomm_attention/_validation.py).

Layered, cheapest first:
1. pure functions: a verdict is computed without raising; a returned position tensor is the caller's own;
2. gloo worlds of 2 and 3 ranks through the public entry points: a mistake on one rank (or on every rank)
   ends in the same error on every rank, naming the rank and the argument, never in a hang; a mistake that
   appears on one rank after a call the ranks verified together (no cache lets a rank skip the exchange);
   ranks passing different ``ring_size``; the NCCL path's gloo twin group; the world stays usable after.
"""

import re

import pytest
import torch
import torch.distributed as dist

import distcomm_attention as da
from distcomm.losses import clip_loss
from distcomm_attention import _validation
from tests.dist_harness import run_world


# ------------------------------------------------------------------------------------------------------
# 1. pure functions
# ------------------------------------------------------------------------------------------------------


def test_verdict_returns_the_error_instead_of_raising():
    """A failing check hands back its error (to be raised by every rank after the exchange); a passing one
    its result; an error that is not an input error (a bug) is not swallowed."""
    assert _validation.verdict(lambda x: x + 1, 1) == (2, None)
    result, error = _validation.verdict(_validation.check_window, (3,))
    assert result is None and isinstance(error, ValueError) and "`window_size`" in str(error)

    def bug():
        raise KeyError("not an input error")

    with pytest.raises(KeyError):
        _validation.verdict(bug)


def test_balanced_position_ids_are_the_callers_own():
    """position_ids of a data-dependent layout comes from a cached table: changing the returned tensor in
    place must not change what later calls return."""
    docs = [0, 3, 10, 16]
    first = da.position_ids(8, "balanced", rank=1, ring_size=2, cu_seqlens=docs)
    expected = first.clone()
    first.fill_(-7)
    again = da.position_ids(8, "balanced", rank=1, ring_size=2, cu_seqlens=docs)
    assert torch.equal(again, expected)
    full = torch.cat([da.position_ids(8, "balanced", rank=r, ring_size=2, cu_seqlens=docs) for r in range(2)])
    assert sorted(full.tolist()) == list(range(16))  # still a permutation of the sequence


# ------------------------------------------------------------------------------------------------------
# 2. gloo worlds
# ------------------------------------------------------------------------------------------------------


def _catch(fn):
    try:
        fn()
    except (TypeError, ValueError, ImportError, NotImplementedError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _in_sync(world):
    """A collective right after the errors: every rank still pairs up."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t) == world * (world + 1) / 2


def _qkv(n=4, heads=2, dtype=torch.float64):
    return tuple(torch.randn(1, n, heads, 8, dtype=dtype) for _ in range(3))


def _one_rank_rank(rank, world):
    """Each case: rank 1 alone passes something wrong, the others a valid call."""
    bad = rank == 1
    q, k, v = _qkv()
    cases = {
        "cu_seqlens not increasing": lambda: da.ring_flash_attn(
            q, k, v, cu_seqlens=[0, 3, 3, 4 * world] if bad else [0, 3, 4 * world]),
        "mask shape": lambda: da.ring_flash_attn(
            q, k, v, attention_mask=torch.ones(1, 3 if bad else 4, dtype=torch.bool)),
        "mask dtype": lambda: da.ring_flash_attn(
            q, k, v, attention_mask=torch.ones(1, 4, dtype=torch.int64 if bad else torch.bool)),
        "backend fa4 on CPU": lambda: da.ring_flash_attn(q, k, v, backend="fa4" if bad else "auto"),
        "backend unknown": lambda: da.ring_flash_attn(q, k, v, backend="fast" if bad else "auto"),
        "q not a tensor": lambda: da.ring_flash_attn(q.tolist() if bad else q, k, v),
        "causal not a bool": lambda: da.ring_flash_attn(q, k, v, causal="yes" if bad else True),
        "window": lambda: da.ring_flash_attn(q, k, v, window_size=(-2, 0) if bad else (-1, -1)),
        "layout name": lambda: da.ring_flash_attn(q, k, v, layout="zagzig" if bad else "zigzag"),
        "zigzag odd length": lambda: da.ring_flash_attn(*_qkv(3 if bad else 4), layout="zigzag"),
        "auto strategy, mask shape": lambda: da.context_parallel_attn(
            q, k, v, strategy="auto", causal=True, attention_mask=torch.ones(1, 5 if bad else 4, dtype=torch.bool)),
        "auto strategy, cu_seqlens": lambda: da.context_parallel_attn(
            q, k, v, strategy="auto", cu_seqlens=[0, 4 * world + 1] if bad else [0, 4 * world]),
        "auto strategy, causal not a bool": lambda: da.context_parallel_attn(
            q, k, v, strategy="auto", causal="yes" if bad else True),
        "auto strategy, hardware": lambda: da.context_parallel_attn(
            q, k, v, strategy="auto", causal=True, hardware={"a2a_gbps": 50} if bad else None),
        "ulysses, heads": lambda: da.context_parallel_attn(
            *_qkv(heads=3 if bad else 2), strategy="ulysses"),
        "allgather, softcap": lambda: da.context_parallel_attn(
            q, k, v, strategy="allgather", softcap=-1.0 if bad else 0.0),
        "gather dim": lambda: da.gather_sequence(torch.zeros(2, 4), dim=5 if bad else 1),
        # values beyond int64 or float: still this rank's verdict, never an error raised before the exchange
        "window beyond int64": lambda: da.ring_flash_attn(q, k, v, window_size=(2**63, -1) if bad else (-1, -1)),
        "softcap overflow": lambda: da.ring_flash_attn(q, k, v, softcap=10**400 if bad else 0.0),
        "scale overflow": lambda: da.ring_flash_attn(q, k, v, softmax_scale=10**400 if bad else None),
        "gather dim beyond int64": lambda: da.gather_sequence(torch.zeros(2, 4), dim=2**70 if bad else 1),
        "clip_loss scale overflow": lambda: clip_loss(torch.randn(2, 3), torch.randn(2, 3), 10**400 if bad else 2.0),
        "gather layout": lambda: da.gather_sequence(torch.zeros(2, 4), "zagzig" if bad else "zigzag"),
    }
    out = {name: _catch(fn) for name, fn in cases.items()}
    out["sync"] = _in_sync(world)
    return out


ONE_RANK = {
    "cu_seqlens not increasing": ("ValueError", r"`cu_seqlens` must be strictly increasing"),
    "mask shape": ("ValueError", r"`attention_mask` must have shape \(batch, local_seq\) = \(1, 4\).*got \(1, 3\)"),
    "mask dtype": ("TypeError", r"`attention_mask` must have dtype torch.bool"),
    "backend fa4 on CPU": (None, r"fa4"),
    "backend unknown": ("ValueError", r"backend 'fast'. Must be one of"),
    "q not a tensor": ("TypeError", r"`q` must be a torch.Tensor, got list"),
    "causal not a bool": ("TypeError", r"`causal` must be a bool, got str 'yes'"),
    "window": ("ValueError", r"`window_size` must be a pair .* got \(-2, 0\)"),
    "layout name": ("ValueError", r"zagzig"),
    "zigzag odd length": ("ValueError", r"zigzag"),
    "auto strategy, mask shape": ("ValueError", r"`attention_mask` must have shape"),
    "auto strategy, causal not a bool": ("TypeError", r"`causal` must be a bool, got str 'yes'"),
    "auto strategy, hardware": ("TypeError", r"`hardware` must be a distcomm_attention.Hardware or None, "
                                             r"got dict"),
    "auto strategy, cu_seqlens": ("ValueError", r"`cu_seqlens` must end at the global sequence length"),
    "ulysses, heads": ("ValueError", r"disagree on `q`, `k`, `v` .*ring position 1: q=\(1, 4, 3, 8\)"),
    "allgather, softcap": ("ValueError", r"`softcap` must be a finite float >= 0 .*got -1.0"),
    "gather dim": (None, r"dim"),
    "window beyond int64": ("ValueError", r"`window_size` must be a pair"),
    "softcap overflow": ("ValueError", r"`softcap` must be a finite float >= 0"),
    "scale overflow": ("ValueError", r"`softmax_scale` must be a finite float or None"),
    "gather dim beyond int64": (None, r"dim"),
    "clip_loss scale overflow": ("ValueError", r"the input of rank 1 was rejected.*`logit_scale` must be a real number"),
    "gather layout": ("ValueError", r"zagzig"),
}


@pytest.mark.parametrize("world", [2, 3])
def test_a_mistake_on_one_rank_raises_the_same_error_on_every_rank(world):
    """Rank 1's mistake (documents, mask, backend, types, options, layout, lengths, through ring_flash_attn,
    context_parallel_attn with every strategy and gather_sequence): every rank raises the same error, which
    names rank 1 and the argument; nobody waits for a peer that stopped, and the world stays usable."""
    got = run_world(_one_rank_rank, world, timeout=90)
    assert all(g["sync"] for g in got)
    for name, (kind, pattern) in ONE_RANK.items():
        msgs = [g[name] for g in got]
        assert msgs[0] is not None and all(m == msgs[0] for m in msgs), (name, msgs)
        assert kind is None or msgs[0].startswith(kind + ": "), (name, msgs[0])
        assert any(f in msgs[0] for f in ("invalid input on rank 1: ", "ring position 1: ", "the input of rank 1 ")), \
            (name, msgs[0])
        assert re.search(pattern, msgs[0]), (name, msgs[0])


def _after_verified_rank(rank, world):
    """A first call the ranks verify together, then rank 0 alone changes: the old cache let the others skip the
    exchange rank 0 waited in."""
    q, k, v = _qkv()
    good = da.ring_flash_attn(q, k, v, causal=True).shape[1]
    out = {"good": good}
    out["docs"] = _catch(lambda: da.ring_flash_attn(q, k, v, causal=True,
                                                    cu_seqlens=[0, 2, 2, 4 * world] if rank == 0 else None))
    out["shape"] = _catch(lambda: da.ring_flash_attn(*_qkv(6 if rank == 0 else 4), causal=True))
    out["requires_grad"] = _catch(lambda: da.ring_flash_attn(
        *(t.clone().requires_grad_(rank == 0) for t in (q, k, v)), causal=True))
    out["again"] = da.ring_flash_attn(q, k, v, causal=True).shape[1]
    out["sync"] = _in_sync(world)
    return out


def test_a_change_on_one_rank_after_a_verified_call_is_caught():
    """After a call every rank verified, a rank that alone passes invalid documents, another shape or grads:
    the same error on every rank (in default mode), then the same calls run again."""
    world = 3
    got = run_world(_after_verified_rank, world, timeout=60)
    for key, pattern in (("docs", r"invalid input on rank 0: `cu_seqlens` must be strictly increasing"),
                         ("shape", r"disagree on `q`, `k`, `v` \(ring position 0: q=\(1, 6, 2, 8\)"),
                         ("requires_grad", r"ring position 0: requires_grad=True; ring positions 1-2: "
                                           r"requires_grad=False")):
        assert got[0][key] is not None and all(g[key] == got[0][key] for g in got), (key, got)
        assert re.search(pattern, got[0][key]), (key, got[0][key])
    assert all(g["good"] == g["again"] == 4 and g["sync"] for g in got)


def _ring_size_rank(rank, world):
    q, k, v = _qkv()
    out = {}
    out["differ"] = _catch(lambda: da.ring_flash_attn(q, k, v, ring_size=1 if rank == 0 else None))
    out["invalid"] = _catch(lambda: da.ring_flash_attn(q, k, v, ring_size=3 if rank == 0 else 2))
    out["rings"] = da.ring_flash_attn(q, k, v, ring_size=2).shape[1]  # two rings of 2, verified together
    out["sync"] = _in_sync(world)
    return out


def test_ranks_passing_different_ring_sizes_all_raise():
    """ring_size 1 on rank 0 and the whole group elsewhere (rank 0 would run alone while its peers wait for it),
    or a ring_size the group cannot take on one rank: the same error on every rank of the group."""
    world = 4
    got = run_world(_ring_size_rank, world, timeout=60)
    for key, pattern in (("differ", r"ring_size"), ("invalid", r"invalid input on rank 0: `ring_size`=3 must divide")):
        assert got[0][key] is not None and all(g[key] == got[0][key] for g in got), (key, got)
        assert re.search(pattern, got[0][key]), (key, got[0][key])
    assert "(rank 0: ring_size=1; ranks 1-3: ring_size=4)" in got[0]["differ"], got[0]["differ"]
    assert all(g["rings"] == 4 and g["sync"] for g in got)


def _mesh_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    dtype = torch.float32 if rank == 1 else torch.float64
    q, k, v = (torch.randn(1, 8, 4, 8, dtype=dtype) for _ in range(3))
    return _catch(lambda: da.context_parallel_attn(q, k, v, strategy="hybrid", layout="contiguous", group=mesh,
                                                   causal=True))


def test_a_mismatch_on_a_mesh_names_the_ranks():
    """On a 2 x 2 mesh named ("ring", "ulysses") a dtype on rank 1 alone (mesh coordinate ring 0, ulysses 1):
    the same error on every rank, naming the ranks by their default-group ranks, not as ring positions (which
    the mesh's "ring" dimension would make read as the wrong coordinate)."""
    got = run_world(_mesh_rank, 4, timeout=90)
    assert got[0] is not None and all(g == got[0] for g in got), got
    assert "the ranks of the mesh disagree on `q`, `k`, `v`" in got[0], got[0]
    assert re.search(r"\(ranks 0, 2-3: q=\(1, 8, 4, 8\) torch\.float64.*; rank 1: q=\(1, 8, 4, 8\) torch\.float32"
                     r".*\); every rank of the mesh must pass", got[0]), got[0]
    assert "ring position" not in got[0], got[0]


def _twin_rank(rank, world):
    """The NCCL path: a group whose backend reports NCCL verifies over a gloo twin made on first use."""
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        q, k, v = _qkv()
        out = {"ok": da.ring_flash_attn(q, k, v, causal=True).shape[1]}
        out["error"] = _catch(lambda: da.ring_flash_attn(q, k, v, causal=rank == 0))
        out["twins"] = len(_validation._HOST_GROUPS)
        out["ok2"] = da.ring_flash_attn(q, k, v, causal=True).shape[1]
        out["twins2"] = len(_validation._HOST_GROUPS)
    finally:
        dist.get_backend = real
    return out


def test_nccl_groups_verify_over_a_gloo_twin():
    """The exchange of a GPU group runs on a gloo group over the same ranks (made once, reused), so that it
    never waits for the GPU: a disagreement is still raised on every rank."""
    got = run_world(_twin_rank, 2, timeout=60)
    assert all(g["ok"] == g["ok2"] == 4 for g in got)
    assert all(g["twins"] == g["twins2"] == 1 for g in got)
    assert got[0]["error"] == got[1]["error"] and "disagree on `causal`" in got[0]["error"]


def _compiled_rank(rank, world):
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = _qkv()
    out = {}

    def ring(q, k, v, window):
        return da.ring_flash_attn(q, k, v, causal=True, window_size=window)

    def ulysses(q, k, v, softcap):
        return da.context_parallel_attn(q, k, v, strategy="ulysses", softcap=softcap)

    compiled_ring = torch.compile(ring, backend="eager", fullgraph=True)
    compiled_ulysses = torch.compile(ulysses, backend="eager", fullgraph=True)
    out["ring"] = _catch(lambda: compiled_ring(q, k, v, (-2, 0) if rank == 1 else (-1, -1)))
    out["ulysses"] = _catch(lambda: compiled_ulysses(q, k, v, -1.0 if rank == 1 else 0.0))
    out["good"] = compiled_ring(q, k, v, (-1, -1)).shape[1]
    out["sync"] = _in_sync(world)
    return out


def test_compiled_calls_raise_one_ranks_mistake_on_every_rank():
    """Under torch.compile(fullgraph=True) an argument error found while tracing on one rank travels into the
    operator and is raised by every rank after the run-time exchange (raising it while tracing would leave
    the peers waiting in their operator's exchange)."""
    got = run_world(_compiled_rank, 2, timeout=120)
    for key, pattern in (("ring", r"invalid input on rank 1: `window_size` must be a pair"),
                         ("ulysses", r"invalid input on rank 1: `softcap` must be a finite float >= 0")):
        assert got[0][key] is not None and got[0][key] == got[1][key], (key, got)
        assert re.search(pattern, got[0][key]), (key, got[0][key])
    assert all(g["good"] == 4 and g["sync"] for g in got)
