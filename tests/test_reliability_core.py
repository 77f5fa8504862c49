"""Reliability of the distcomm core: one clear error on every rank, never a hang, crash or silent result.

Layered, cheapest first:
1. pure functions: the verdict encoding, the group helpers without a process group, the module caches;
2. gloo worlds of 2 and 3 ranks (tests/dist_harness.run_world, each under a timeout so a hang fails):
   - an explicit ProcessGroup without a default group, every collective against a float64 single-process
     reference;
   - a battery of inputs that are bad on one rank or disagree across ranks, in check mode and (for the
     entry points that exchange anyway) in default mode: every rank raises the same error, which names
     what is wrong, and the next collective still pairs up.
"""

from __future__ import annotations

import gc
import re
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as TF

import distcomm
import distcomm.functional as F
from distcomm import _check, _groups
from distcomm.losses import clip_loss, siglip_loss
from tests.dist_harness import run_world

WORLDS = [2, 3]


# ---------------------------------------------------------------------------------------------------------
# 1. Pure functions
# ---------------------------------------------------------------------------------------------------------


def test_verdict_round_trip_keeps_type_and_message():
    """A rank's error crosses the exchange intact (type, unicode text), so every rank can raise it."""
    rows = [_check.encode_verdict(None), _check.encode_verdict(TypeError("`dim` must be an int, got 'é'"))]
    assert all(len(r) == _check.VERDICT_WIDTH for r in rows)
    with pytest.raises(TypeError, match=r"^op: the input of rank 1 was rejected.*\(rank 1: `dim` must be an int, got 'é'\)"):
        _check.raise_verdicts("op", rows)
    _check.raise_verdicts("op", [_check.encode_verdict(None)] * 3)  # no error: returns


def test_verdict_names_every_failing_rank_and_cuts_long_messages():
    """Several failing ranks are all named; a long message is cut to a fixed width, never breaking the row."""
    rows = [_check.encode_verdict(ValueError("x" * 2000)), _check.encode_verdict(None),
            _check.encode_verdict(ValueError("`sizes`=[1] bad"))]
    assert len(rows[0]) == _check.VERDICT_WIDTH
    with pytest.raises(ValueError, match=r"ranks 0, 2 was rejected.*rank 2: `sizes`=\[1\] bad"):
        _check.raise_verdicts("op", rows)


def test_meta_row_never_raises_and_tells_dims_apart():
    """A shape of more dims than the row holds still encodes (a per-rank raise there would hang peers)."""
    big = _check.meta_row((1,) * 20, torch.float32)
    assert len(big) == 2 + _check.MAX_DIMS
    assert big != _check.meta_row((1,) * 12, torch.float32)


def test_bare_backend_object_raises_naming_group():
    """A bare ProcessGroupGloo lacks the flat collectives: a clear TypeError, not a failure half-way."""
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with pytest.raises(TypeError, match=r"`group` is a bare ProcessGroupGloo backend object, not a .*ProcessGroup"):
        F.all_reduce(torch.ones(2), group=backend)


def _module_containers():
    """Every dict, set, list and lru_cache at module level in distcomm (their sizes)."""
    sizes = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("distcomm.") and name != "distcomm" or name.startswith("distcomm_attention"):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, (dict, set, list)) and not attr.startswith("__"):
                sizes[f"{name}.{attr}"] = len(value)
            elif hasattr(value, "cache_info"):
                sizes[f"{name}.{attr}"] = value.cache_info().currsize
    return sizes


def test_no_module_cache_grows_with_call_signatures():
    """Calls of many shapes, dtypes and ops leave every module-level container of distcomm the same size:
    nothing is cached per call signature, so a long run with varying shapes does not leak."""
    F.all_reduce(torch.ones(1))
    before = _module_containers()
    assert before  # the scan sees distcomm's modules
    for n in range(1, 40):
        for dtype in (torch.float32, torch.float64):
            x = torch.ones(n, 2, dtype=dtype, requires_grad=True)
            F.all_reduce(x, op=F.ReduceOp.MAX).sum().backward()
            F.all_gather_variable(x, dim=0)
            F.ring_pass(x)
            with distcomm.check_mode():
                F.all_gather_tensor(x, dim=1)
            clip_loss(x, x, 2.0)
    gc.collect()
    assert _module_containers() == before


def test_group_helpers_without_process_group():
    """Without any group, None is a world of one and global ranks are the identity."""
    assert _groups.resolve(None) == (None, 1, 0)
    assert _groups.global_ranks(None) is None
    with pytest.raises(ValueError, match=r"`dst`=1 is not a rank of this single-process run; the only rank is 0"):
        _groups.check_rank_in_group("dst", 1, None)


# ---------------------------------------------------------------------------------------------------------
# 2a. An explicit ProcessGroup without a default group, against a float64 reference
# ---------------------------------------------------------------------------------------------------------


def _x(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1) + rank


def _var(rank: int) -> torch.Tensor:
    return torch.arange(2 * (rank + 1), dtype=torch.float64).reshape(rank + 1, 2) + 100 * rank


def _a2a_piece(src: int, dst: int) -> torch.Tensor:
    """The dst + 1 rows rank ``src`` sends to rank ``dst`` in the uneven all_to_all_single."""
    return torch.arange(2 * (dst + 1), dtype=torch.float64).reshape(dst + 1, 2) + 1000 * src + 10 * dst


def _features(rank: int):
    g = torch.Generator().manual_seed(rank)
    n = rank + 1
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64)


def _bare_group(store, rank: int, world: int) -> dist.ProcessGroup:
    """A ProcessGroup built by hand on a gloo backend, unknown to torch.distributed's registry."""
    backend = dist.ProcessGroupGloo(store, rank, world)
    pg = dist.ProcessGroup(store, rank, world)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _no_default_group_rank(rank: int, world: int, port: int) -> dict:
    dist.destroy_process_group()  # the harness made a default group: this rank runs without one
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=30))
    try:
        assert not dist.is_initialized()
        pg = _bare_group(dist.PrefixStore("bare", store), rank, world)
        out = {"size_rank": torch.tensor(_groups.resolve(pg)[1:])}
        x = _x(rank).requires_grad_()
        y = F.all_reduce(x, group=pg)
        y.backward(torch.full_like(y, rank + 1.0))
        out["all_reduce"], out["all_reduce_grad"] = y.detach(), x.grad
        x = _x(rank)
        out["all_reduce_max"] = F.all_reduce(x, op=F.ReduceOp.MAX, group=pg)
        out["broadcast"] = F.broadcast(x, src=world - 1, group=pg)
        out["reduce"] = F.reduce(x, dst=world - 1, group=pg)
        out["all_gather"] = torch.stack(F.all_gather(x, group=pg))
        out["all_gather_tensor"] = F.all_gather_tensor(x, dim=1, group=pg)
        out["all_gather_variable"] = F.all_gather_variable(_var(rank), group=pg)[0]
        out["reduce_scatter_tensor"] = F.reduce_scatter_tensor(torch.cat([x] * world), group=pg)
        out["reduce_scatter"] = F.reduce_scatter(torch.empty(2, 3, dtype=x.dtype), [x * (j + 1) for j in range(world)],
                                                 group=pg)
        out["gather"] = torch.stack(F.gather(x, dst=world - 1, group=pg))
        out["scatter"] = F.scatter([_x(r) for r in range(world)] if rank == 0 else None, src=0, group=pg)
        send = torch.cat([_a2a_piece(rank, j) for j in range(world)])
        recv = torch.empty(world * (rank + 1), 2, dtype=torch.float64)
        out["all_to_all_single"] = F.all_to_all_single(
            recv, send, [rank + 1] * world, [j + 1 for j in range(world)], group=pg
        )
        out["ring_pass"] = F.ring_pass(x, group=pg)
        img, txt = _features(rank)
        out["siglip"] = siglip_loss(img, txt, 2.0, -1.0, group=pg)
        out["clip"] = clip_loss(img, txt, 2.0, group=pg)
        return out
    finally:  # a default group again, which the harness destroys
        dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world)


def _siglip_reference(world: int) -> torch.Tensor:
    xs, ys = zip(*(_features(r) for r in range(world)))
    x, y = torch.cat(xs), torch.cat(ys)
    logits = 2.0 * x @ y.T - 1.0
    z = 2 * torch.eye(len(x), dtype=x.dtype) - 1
    return -TF.logsigmoid(z * logits).sum() / len(x)


def _clip_reference(world: int) -> torch.Tensor:
    xs, ys = zip(*(_features(r) for r in range(world)))
    x, y = torch.cat(xs), torch.cat(ys)
    logits = 2.0 * x @ y.T
    t = torch.arange(len(x))
    return (TF.cross_entropy(logits, t) + TF.cross_entropy(logits.T, t)) / 2


@pytest.mark.parametrize("world", WORLDS)
def test_explicit_group_without_default_group(world):
    """A ProcessGroup passed as `group` without init_process_group is used (its own rank and size, src/dst
    its own ranks), never ignored: every collective matches the float64 single-process reference."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    res = run_world(_no_default_group_rank, world, store.port, timeout=90)
    xs = [_x(r) for r in range(world)]
    total = sum(xs)
    for r, out in enumerate(res):
        assert out["size_rank"].tolist() == [world, r]
        torch.testing.assert_close(out["all_reduce"], total)
        torch.testing.assert_close(out["all_reduce_grad"], torch.full((2, 3), world * (world + 1) / 2, dtype=torch.float64))
        torch.testing.assert_close(out["all_reduce_max"], torch.stack(xs).amax(0))
        torch.testing.assert_close(out["broadcast"], xs[-1])
        torch.testing.assert_close(out["reduce"], total if r == world - 1 else torch.zeros_like(total))
        torch.testing.assert_close(out["all_gather"], torch.stack(xs))
        torch.testing.assert_close(out["all_gather_tensor"], torch.cat(xs, dim=1))
        torch.testing.assert_close(out["all_gather_variable"], torch.cat([_var(i) for i in range(world)]))
        torch.testing.assert_close(out["reduce_scatter_tensor"], total)
        torch.testing.assert_close(out["reduce_scatter"], total * (r + 1))
        gathered = torch.stack(xs) if r == world - 1 else torch.zeros(world, 2, 3, dtype=torch.float64)
        torch.testing.assert_close(out["gather"], gathered)
        torch.testing.assert_close(out["scatter"], xs[r])
        torch.testing.assert_close(out["all_to_all_single"], torch.cat([_a2a_piece(i, r) for i in range(world)]))
        torch.testing.assert_close(out["ring_pass"], xs[(r - 1) % world])
    torch.testing.assert_close(sum(out["siglip"] for out in res), world * _siglip_reference(world))
    torch.testing.assert_close(sum(out["clip"] for out in res), world * _clip_reference(world))


# ---------------------------------------------------------------------------------------------------------
# 2b. Bad inputs on one rank, or disagreeing across ranks: the same error on every rank
# ---------------------------------------------------------------------------------------------------------


def _cases(rank: int, world: int) -> dict:
    """name -> (check mode on?, the call this rank makes). Rank 0 (or 1) differs from the others."""
    x = torch.randn(2, 3)
    first, second = rank == 0, rank == 1
    ones = [1] * world
    skewed = [1, 2] + [1] * (world - 2)  # rank 0 expects 2 rows from rank 1, which sends 1
    grad = torch.randn(2, 3, requires_grad=not first)
    img, txt = _features(rank)
    img, txt = img.float(), txt.float()
    return {
        # check mode: what only another rank can see
        "a2as_splits_disagree": (True, lambda: F.all_to_all_single(
            torch.empty(world + int(first), 3), torch.randn(world, 3), skewed if first else ones, ones)),
        "a2as_sum_one_rank": (True, lambda: F.all_to_all_single(
            torch.empty(world, 3), torch.randn(world, 3), None, [5] + [0] * (world - 1) if first else None)),
        "ring_recv_shape": (True, lambda: F.ring_pass(x, recv_shape=(3, 3) if first else (2, 3))),
        "ring_shift": (True, lambda: F.ring_pass(x, shift=2 if first else 1, recv_shape=(2, 3))),
        "ring_requires_grad": (True, lambda: F.ring_pass(grad, recv_shape=(2, 3))),
        "all_reduce_shape": (True, lambda: F.all_reduce(torch.randn(3 if first else 2))),
        "all_reduce_op": (True, lambda: F.all_reduce(x, op=F.ReduceOp.MAX if first else F.ReduceOp.SUM)),
        "all_reduce_dtype_op": (True, lambda: F.all_reduce(
            torch.ones(2, dtype=torch.complex64 if first else torch.float32), op=F.ReduceOp.MAX)),
        "all_reduce_requires_grad": (True, lambda: F.all_reduce(grad)),
        "reduce_dst_range": (True, lambda: F.reduce(x, dst=7 if first else 0)),
        "reduce_dst_differs": (True, lambda: F.reduce(x, dst=1 if first else 0)),
        "broadcast_src_differs": (True, lambda: F.broadcast(x, src=1 if first else 0)),
        "gather_dst_differs": (True, lambda: F.gather(x, dst=1 if first else 0)),
        "scatter_src_differs": (True, lambda: F.scatter([x] * world, src=1 if first else 0)),
        "all_gather_dtype": (True, lambda: F.all_gather(x.double() if first else x)),
        "agt_dim_one_rank": (True, lambda: F.all_gather_tensor(torch.randn(3) if first else x, dim=1)),
        "agb_output_one_rank": (True, lambda: F._all_gather_base(torch.empty(world * 2 + int(first), 3), x)),
        "rst_divisible_one_rank": (True, lambda: F.reduce_scatter_tensor(torch.randn(world * 2 + int(first), 3))),
        "rs_shapes_differ": (True, lambda: F.reduce_scatter(
            torch.empty(2, 3), [torch.randn(2, 3 + int(first and j != rank)) for j in range(world)])),
        "a2a_shapes_differ": (True, lambda: F.all_to_all(
            [torch.empty(2, 3) for _ in range(world)], [torch.randn(2 + int(second), 3) for _ in range(world)])),
        "var_sizes_differ": (True, lambda: F.all_gather_variable(x, sizes=[2] * world if first else [3] * world)),
        # default mode: the entry points that exchange anyway
        "var_dim_one_rank": (False, lambda: F.all_gather_variable(torch.randn(3) if first else x, dim=1)),
        "var_sizes_given_or_not": (True, lambda: F.all_gather_variable(x, sizes=[2] * world if first else None)),
        "ring_learn_shift": (False, lambda: F.ring_pass(x, shift=2 if first else 1)),
        "scatter_src_range_one_rank": (False, lambda: F.scatter([x] * world, src=9 if first else 0)),
        "scatter_none_on_src": (False, lambda: F.scatter(None if first else [x] * world, src=0)),
        "clip_skips_backward": (False, lambda: clip_loss(img.requires_grad_(not first), txt, 2.0)),
        "clip_bad_batch_one_rank": (False, lambda: clip_loss(img, txt[:0] if first else txt, 2.0)),
        "siglip_bad_scale_one_rank": (False, lambda: siglip_loss(img, txt, torch.ones(2) if first else 2.0, 0.0)),
        "siglip_gather_dtype": (False, lambda: siglip_loss(img.double() if second else img, txt.double() if second else txt,
                                                          2.0, 0.0, impl="gather")),
        "siglip_skips_backward": (False, lambda: siglip_loss(img.requires_grad_(not first), txt, 2.0, 0.0)),
        # every loss needs a backward (its scale does), but the features' gathers would have one on rank 0 only
        "clip_feature_grad_one_rank": (False, lambda: clip_loss(img.detach().requires_grad_(first), txt.detach(),
                                                                torch.tensor(2.0, requires_grad=True))),
        "siglip_text_grad_one_rank": (False, lambda: siglip_loss(img.detach(), txt.detach().requires_grad_(first),
                                                                 torch.tensor(2.0, requires_grad=True), 0.0,
                                                                 impl="gather")),
        # more than MAX_DIMS (12) dims on one rank: refused by every rank after the exchange, not by its own
        "var_wide_one_rank": (False, lambda: F.all_gather_variable(
            torch.zeros([1] * 12 + [2]) if second else torch.zeros([1] * 11 + [2]), dim=-1)),
        "all_reduce_wide_one_rank": (True, lambda: F.all_reduce(torch.zeros([1] * (13 if second else 12)))),
        "ring_learn_wide_one_rank": (False, lambda: F.ring_pass(torch.zeros([2] + [1] * (12 if second else 11)))),
        # scan: one rank's bad positions, and a combine that does not keep the shapes (log depth: rank 0
        # combines nothing in the first round)
        "scan_positions_repeated": (False, lambda: F.scan(torch.ones(2, 3), positions=[2, 2] if second else
                                                          [2 * rank, 2 * rank + 1])),
        "scan_positions_count": (False, lambda: F.scan(torch.ones(2, 3), positions=[2] if second else
                                                       [2 * rank, 2 * rank + 1])),
        "scan_combine_shape": (False, lambda: F.scan(torch.ones(2), combine=lambda a, b: torch.cat([a, b]),
                                                     algorithm="log")),
    }


EXPECTED = {
    "a2as_splits_disagree": r"ValueError: all_to_all_single: rank 1 sends 1 rows to rank 0 \(its input_split_sizes\), "
                            r"but rank 0 expects 2 rows",
    "a2as_sum_one_rank": r"ValueError: all_to_all_single: the input of rank 0 was rejected.*`input_split_sizes`=\[5, 0",
    "ring_recv_shape": r"ValueError: ring_pass: rank \d sends tensor 0 with shape \(2, 3\) and dtype torch.float32 to "
                       r"rank 0, which expects shape \(3, 3\).*`recv_shape`",
    "ring_shift": r"ValueError: ring_pass: `shift` differs across ranks \(rank 0: [02] \(mod \d\), rank 1: 1",
    "ring_requires_grad": r"ValueError: ring_pass: `requires_grad` differs across ranks \(rank 0: False, rank 1: True",
    "all_reduce_shape": r"ValueError: all_reduce: shapes differ across ranks \(rank 0: shape=\(3,\)",
    "all_reduce_op": r"ValueError: all_reduce: `op` differs across ranks \(rank 0: MAX, rank 1: SUM",
    "all_reduce_dtype_op": r"TypeError: all_reduce: the input of rank 0 was rejected.*`op`=MAX is not defined for complex",
    "all_reduce_requires_grad": r"ValueError: all_reduce: `requires_grad` differs across ranks \(rank 0: False",
    "reduce_dst_range": r"ValueError: reduce: the input of rank 0 was rejected.*`dst`=7 is not a member of the group",
    "reduce_dst_differs": r"ValueError: reduce: `dst` differs across ranks \(rank 0: 1, rank 1: 0",
    "broadcast_src_differs": r"ValueError: broadcast: `src` differs across ranks \(rank 0: 1, rank 1: 0",
    "gather_dst_differs": r"ValueError: gather: `dst` differs across ranks \(rank 0: 1, rank 1: 0",
    "scatter_src_differs": r"ValueError: scatter: `src` differs across ranks \(rank 0: 1, rank 1: 0",
    "all_gather_dtype": r"ValueError: all_gather: dtypes differ across ranks \(rank 0: shape=\(2, 3\) dtype=torch.float64",
    "agt_dim_one_rank": r"ValueError: all_gather_tensor: the input of rank 0 was rejected.*`dim`=1 is out of range",
    "agb_output_one_rank": r"ValueError: _all_gather_base: the input of rank 0 was rejected.*`output_tensor` has shape",
    "rst_divisible_one_rank": r"ValueError: reduce_scatter_tensor: the input of rank 0 was rejected.*does not divide",
    "rs_shapes_differ": r"ValueError: reduce_scatter: shapes of `input_list\[1\]` differ across ranks \(rank 0: \(2, 4\), "
                        r"rank 1: \(2, 3\)",
    "a2a_shapes_differ": r"ValueError: all_to_all: rank 1's input for rank 0 has shape \(3, 3\).*but rank 0's output",
    "var_sizes_differ": r"ValueError: all_gather_variable: the `sizes` passed differ across ranks \(rank 0: \[2, 2",
    "var_dim_one_rank": r"ValueError: all_gather_variable: the input of rank 0 was rejected.*`dim`=1 is out of range",
    "var_sizes_given_or_not": r"ValueError: all_gather_variable: `sizes given` differs across ranks \(rank 0: a list, "
                              r"rank 1: None",
    "ring_learn_shift": r"ValueError: ring_pass: `shift` differs across ranks \(rank 0: [02] \(mod \d\), rank 1: 1",
    "scatter_src_range_one_rank": r"ValueError: scatter: the input of rank 0 was rejected.*`src`=9 is not a member",
    "scatter_none_on_src": r"ValueError: scatter: the input of rank 0 was rejected.*`tensors` must hold \d tensors on "
                           r"the source rank",
    "clip_skips_backward": r"ValueError: clip_loss: whether the loss needs a backward differs across ranks "
                           r"\(rank 0: False, rank 1: True",
    "clip_bad_batch_one_rank": r"ValueError: clip_loss: the input of rank 0 was rejected.*batch sizes differ on this rank",
    "siglip_bad_scale_one_rank": r"ValueError: siglip_loss: the input of rank 0 was rejected.*`logit_scale` must be a "
                                 r"scalar tensor",
    "siglip_gather_dtype": r"ValueError: siglip_loss: feature dims or dtypes differ across ranks \(rank 0: dim=4 "
                           r"dtype=torch.float32, rank 1: dim=4 dtype=torch.float64",
    "siglip_skips_backward": r"ValueError: siglip_loss: whether the loss needs a backward differs across ranks",
    "clip_feature_grad_one_rank": r"ValueError: clip_loss: which features need grad differs across ranks \(rank 0: "
                                  r"image_features; rank 1: neither",
    "siglip_text_grad_one_rank": r"ValueError: siglip_loss: which features need grad differs across ranks \(rank 0: "
                                 r"text_features; rank 1: neither",
    "var_wide_one_rank": r"ValueError: tensors of more than 12 dims are not supported \(rank 1: 13 dims\)",
    "all_reduce_wide_one_rank": r"ValueError: tensors of more than 12 dims are not supported \(rank 1: 13 dims\)",
    "ring_learn_wide_one_rank": r"ValueError: tensors of more than 12 dims are not supported \(rank 1: 13 dims\)",
    "scan_positions_repeated": r"ValueError: scan: the input of rank 1 was rejected.*`positions` must be distinct, "
                               r"got \[2, 2\]",
    "scan_positions_count": r"ValueError: scan: the input of rank 1 was rejected.*`positions` holds 1 places; `x` has "
                            r"2 pieces",
    "scan_combine_shape": r"ValueError: `combine` returned shapes \[\(4,\)\]; it must keep the shapes of `x`, "
                          r"\[\(2,\)\]",
}


def _battery_rank(rank: int, world: int) -> dict:
    out = {}
    for name, (checking, call) in _cases(rank, world).items():
        distcomm.set_check_mode(checking)
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            distcomm.set_check_mode(None)
    # every exchange paired up: the next collective still sees every rank's own value
    out["after"] = torch.cat(F.all_gather(torch.tensor([float(rank)])))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_raise_the_same_error_on_every_rank(world):
    """Each bad input, on one rank or disagreeing across ranks, ends in the same clear error on every rank:
    no hang (timeout), no crash (a dead rank fails the run), no silent result."""
    res = run_world(_battery_rank, world, timeout=120)
    assert set(EXPECTED) == set(_cases(0, world))
    for name, pattern in EXPECTED.items():
        messages = [out[name] for out in res]
        assert all(m is not None for m in messages), f"{name} returned on ranks {[i for i, m in enumerate(messages) if m is None]}"
        assert len(set(messages)) == 1, f"{name}: the ranks raised different errors: {messages}"
        assert re.search(pattern, messages[0]), f"{name}: {messages[0]!r}"
    for out in res:
        torch.testing.assert_close(out["after"], torch.arange(world, dtype=torch.float32))


def _good_after_check_rank(rank: int, world: int) -> dict:
    """The verified paths still compute: uneven splits that agree, a recv_shape that is right."""
    with distcomm.check_mode():
        send = torch.cat([_a2a_piece(rank, j) for j in range(world)])
        recv = torch.empty(world * (rank + 1), 2, dtype=torch.float64)
        a2a = F.all_to_all_single(recv, send, [rank + 1] * world, [j + 1 for j in range(world)])
        ring = F.ring_pass(_var(rank), recv_shape=_var((rank - 1) % world).shape)
        img, txt = _features(rank)
        clip = clip_loss(img, txt, 2.0)
    return {"a2a": a2a, "ring": ring, "clip": clip}


@pytest.mark.parametrize("world", WORLDS)
def test_check_mode_keeps_agreeing_calls_exact(world):
    """Check mode verifies and then computes the same values as the float64 reference."""
    res = run_world(_good_after_check_rank, world, timeout=60)
    for r, out in enumerate(res):
        torch.testing.assert_close(out["a2a"], torch.cat([_a2a_piece(i, r) for i in range(world)]))
        torch.testing.assert_close(out["ring"], _var((r - 1) % world))
    torch.testing.assert_close(sum(out["clip"] for out in res), world * _clip_reference(world))


# ---------------------------------------------------------------------------------------------------------
# Graphs do not keep process groups alive (Note [Groups held weakly])
# ---------------------------------------------------------------------------------------------------------


def _graphs_release_group_rank(rank, world):
    """Outputs of every differentiable collective, loss, attention strategy (dense and sparse exchanges) and
    the linear-attention exchange over a subgroup, left in cyclic garbage (no collection) while the subgroup
    is destroyed: the subgroup must be freed then, not at the interpreter's exit; each backward afterwards
    says the group is gone."""
    import weakref

    import distcomm_attention as da
    from distcomm.losses import clip_loss
    from distcomm_attention.linear.exchange import all_gather_rows

    pg = dist.new_group([0, 1])
    ref = weakref.ref(pg)
    x = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 8, 4, 8, dtype=torch.float64, requires_grad=True)
    outs = [
        F.all_gather_tensor(x, 1, group=pg), F.all_reduce(x, group=pg), F.broadcast(x, 0, group=pg),
        F.reduce_scatter_tensor(x, 0, group=pg), F.all_to_all_single(torch.empty_like(x), x, group=pg),
        F.ring_pass(x, group=pg), F.reduce(x, 0, group=pg), *F.gather(x, 0, group=pg),
        F.scatter(list(x.unbind(0)), 0, group=pg), *F.all_gather(x, group=pg), all_gather_rows(x[0], pg, 2),
        clip_loss(x[0], x[1], torch.tensor(1.0, dtype=torch.float64), group=pg),
    ]
    docs = [0, 3, 9, 10, 16]  # documents across the ranks' boundaries: the sparse exchanges run
    for strategy in ("ring", "allgather", "ulysses"):
        for cu in (None, docs):
            outs.append(da.context_parallel_attn(q, q, q, strategy=strategy, group=pg, causal=True, layout="zigzag",
                                                 cu_seqlens=cu))
    cycle = [outs]
    cycle.append(cycle)
    del x, q, outs
    gc.collect()
    gc.disable()  # the cycle stays uncollected: only the group table can keep the group alive
    try:
        dist.destroy_process_group(pg)
        del pg
        alive = ref() is not None
    finally:
        gc.enable()
    errors = []
    for out in cycle[0]:
        if not out.requires_grad or out.grad_fn is None:
            continue
        try:
            out.sum().backward(retain_graph=True)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return alive, errors


def test_graphs_do_not_keep_process_groups_alive():
    """An autograd graph that kept its collective's ProcessGroup strongly kept the group past
    ``destroy_process_group()``; a graph in cyclic garbage then freed it during the interpreter's exit, which
    aborted the process ("terminate called without an active exception", 2-6 of 16 two-rank gloo runs). Every
    collective's and strategy's graph now holds its group weakly."""
    for alive, errors in run_world(_graphs_release_group_rank, 2):
        assert not alive
        assert len(errors) >= 19 and all(e is not None and "was destroyed, or no longer referenced" in e
                                         for e in errors), errors
