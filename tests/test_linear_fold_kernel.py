"""The fold over the gathered maps in one Triton launch each way (distcomm_attention/linear/fold_kernel.py),
under the Triton interpreter on CPU in float32, against float64:

1. the kernels alone: the state entering every step and the gradient after every folded step against a float64
   loop and its autograd, both recurrences, restarts, steps that fold nothing, K and V off the tile sizes, a
   table with a stride-0 world dimension (the simulated ranks' gather);
2. the linear layers with the fold on the kernels (as on CUDA), gloo worlds against the float64 recurrence:
   outputs, final states, every gradient; each rank that folds counts its launches.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_linear_attention import F64, _case, _check_world, _cp_rank, _gen

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32_TOL = dict(rtol=2e-5, atol=2e-5)

# (order, (rank, slot) or None, restart) as recurrence._Call._fold makes them
STEPS = [(0, (0, 0), True), (1, (0, 1), False), (2, None, False), (3, (1, 0), False), (4, (1, 1), True),
         (5, (2, 0), False), (6, (2, 1), False)]


def _table(delta: bool, rows: int, dk: int, dv: int, world: int = 3, slots: int = 2):
    gen = _gen("fold-kernel", delta, rows, dk, dv)
    na = rows * dk * dk if delta else rows
    a = 0.4 * torch.randn(world, slots, na, generator=gen, dtype=F64) if delta else \
        torch.rand(world, slots, na, generator=gen, dtype=F64)
    b = torch.randn(world, slots, rows * dk * dv, generator=gen, dtype=F64)
    return torch.cat([a, b], -1), na


def _index(table, steps):
    """The kernels' (2T,) step table: each step's map offset in ``table`` (-1: none), then its restart flag."""
    offsets = [-1 if at is None else at[0] * table.stride(0) + at[1] * table.stride(1) for _, at, _ in steps]
    return torch.tensor(offsets + [int(r) for _, _, r in steps], dtype=torch.long, device=table.device)


def _loop(table, steps, na, rows, dk, dv, delta):
    """The states entering every step in float64 on the values of ``table``, S_{t+1} = A_t S_t + B_t (B_t alone
    at a restart), with each step's A and B their own leaves: (states, {t: (A_t, B_t)})."""
    t64 = table.cpu().to(F64)
    leaves = {t: (t64[at[0], at[1], :na].clone().requires_grad_(),
                  t64[at[0], at[1], na:].view(rows, dk, dv).clone().requires_grad_())
              for t, (_, at, _) in enumerate(steps) if at is not None}
    h = t64.new_zeros(rows, dk, dv)
    states = []
    for t, (_, at, restart) in enumerate(steps):
        states.append(h)
        if at is None:
            continue
        a, b = leaves[t]
        if restart:
            h = b
        elif delta:
            h = a.view(rows, dk, dk) @ h + b
        else:
            h = a[:, None, None] * h + b
    return torch.stack(states), leaves


@pytest.mark.parametrize("delta, rows, dk, dv", [(True, 3, 8, 40), (True, 2, 24, 16), (True, 2, 128, 48),
                                                 (False, 3, 8, 40), (False, 2, 128, 20)])
@pytest.mark.parametrize("expanded", [False, True])
def test_fold_kernels_match_float64(delta, rows, dk, dv, expanded):
    from distcomm_attention.linear import fold_kernel

    table, na = _table(delta, rows, dk, dv)
    if expanded:  # every rank's slots one table row, as the simulated ranks' gather gives it
        table = table[:1].expand(3, *table.shape[1:])
    table = table.to(torch.float32).to(DEVICE)
    index = _index(table, STEPS)
    expected, leaves = _loop(table, STEPS, na, rows, dk, dv, delta)

    states = fold_kernel.fold_states(table, index, na, rows, dk, dv, delta)
    torch.testing.assert_close(states.cpu().to(F64), expected.detach(), **F32_TOL)

    d_states = torch.randn(expected.shape, generator=_gen("fold-kernel-d", delta, dk), dtype=F64)
    d_states[2] = 0  # an order nobody reads
    flat = [x for pair in leaves.values() for x in pair]
    grads = torch.autograd.grad(expected, flat, d_states, allow_unused=True)
    grads = {id(x): torch.zeros_like(x) if d is None else d for x, d in zip(flat, grads)}  # None: not read
    after = fold_kernel.fold_grads(table, index, na, rows, dk, dv, delta, d_states.to(torch.float32).to(DEVICE))
    after, states = after.cpu().to(F64), states.cpu().to(F64)
    for t, (a, b) in leaves.items():
        torch.testing.assert_close(after[t], grads[id(b)], **F32_TOL, msg=lambda m, t=t: f"dB at step {t}: {m}")
        if STEPS[t][2]:  # a restart reads no A
            continue
        got_a = (after[t] @ states[t].transpose(1, 2)).flatten() if delta else (after[t] * states[t]).sum((-1, -2))
        torch.testing.assert_close(got_a, grads[id(a)], **F32_TOL, msg=lambda m, t=t: f"dA at step {t}: {m}")


def test_fold_kernel_refuses_what_it_cannot_hold():
    from distcomm_attention.linear import fold_kernel

    table = torch.zeros(1, 1, 8, dtype=F64, device=DEVICE)
    index = torch.tensor([0, 0], dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="float32 table"):
        fold_kernel.fold_states(table, index, 4, 1, 2, 2, False)
    with pytest.raises(ValueError, match=r"key dim 256 > 128"):
        fold_kernel.fold_states(table.float(), index, 4, 1, 256, 2, True)


def _kernel_rank(rank: int, world: int, cases: list[dict]):
    """_cp_rank with the fold on fold_kernel (as on CUDA), counting the launches."""
    from distcomm_attention.linear import fold_kernel, recurrence

    launches = []
    for name in ("fold_states", "fold_grads"):
        original = getattr(fold_kernel, name)
        setattr(fold_kernel, name, lambda *a, _f=original, _n=name: launches.append(_n) or _f(*a))
    recurrence._Call._fold_on_kernel = lambda self, gathered: gathered.dtype == torch.float32
    return _cp_rank(rank, world, cases), launches


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU ranks run the kernels interpreted")
def test_linear_layers_with_the_fold_kernels():
    """float32 inputs on the PyTorch chunk kernel with the fold on fold_kernel, against the float64 recurrence:
    zigzag with documents crossing boundaries (both recurrences), balanced documents, with final states; and
    contiguous without them, where rank 1 folds run 0 alone, a restart (no product)."""
    from tests.test_linear_attention import run_world

    docs = [0, 3, 4, 15, 16]
    f32 = torch.float32
    cases = [_case("gdn", "zigzag", 16, docs, dtype=f32), _case("scalar", "zigzag", 16, docs, dtype=f32),
             _case("gdn", "balanced", 32, [0, 3, 4, 15, 16, 32], dtype=f32)]
    no_finals = [dict(_case(kind, "contiguous", 32, dtype=f32), finals=False) for kind in ("gdn", "scalar")]
    results = run_world(_kernel_rank, 4, cases + no_finals)
    for r, (_, launches) in enumerate(results):
        # every rank folds in each case with final states; without them each rank but the first (which reads
        # no incoming state) in each; every fold is differentiated
        folds = len(cases) + (len(no_finals) if r else 0)
        assert launches.count("fold_states") == launches.count("fold_grads") == folds, (r, launches)
    _check_world(4, cases + no_finals, results=[res for res, _ in results], tol=F32_TOL)


@pytest.mark.gpu2
def test_fold_kernels_on_a_table_off_the_current_device():
    """A table on cuda:1 while cuda:0 is current: the kernels launch on the table's GPU (as the loop did)."""
    from distcomm_attention.linear import fold_kernel

    table, na = _table(True, 2, 16, 24)
    table = table.to(torch.float32).to("cuda:1")
    index = _index(table, STEPS)
    expected, _ = _loop(table, STEPS, na, 2, 16, 24, True)
    with torch.cuda.device(0):
        states = fold_kernel.fold_states(table, index, na, 2, 16, 24, True)
        after = fold_kernel.fold_grads(table, index, na, 2, 16, 24, True, torch.ones_like(states))
    assert states.device == after.device == table.device
    torch.testing.assert_close(states.cpu().to(F64), expected.detach(), **F32_TOL)


@pytest.mark.gpu
def test_fold_kernel_error_on_a_long_chain():
    """64 steps of near-isometric maps at K = V = 128 (W = 32 zigzag reads that many): the TF32x3 products'
    error against float64 stays within a few T x 2^-22 relative (T = 64 steps; the module's docstring), states
    and gradients (exact float32 products would give about 1e-6, a wrong product about 1)."""
    from distcomm_attention.linear import fold_kernel

    gen = torch.Generator().manual_seed(7)
    rows, dk, dv, t = 4, 128, 128, 64
    q, _ = torch.linalg.qr(torch.randn(t, rows, dk, dk, generator=gen, dtype=F64))
    a, b = 0.999 * q, 0.1 * torch.randn(t, rows, dk, dv, generator=gen, dtype=F64)
    table = torch.cat([a.flatten(1), b.flatten(1)], 1)[:, None].to(torch.float32).cuda()  # (W = t, slots 1, ...)
    steps = [(i, (i, 0), i == 0) for i in range(t)]
    expected, leaves = _loop(table, steps, rows * dk * dk, rows, dk, dv, True)
    states = fold_kernel.fold_states(table, _index(table, steps), rows * dk * dk, rows, dk, dv, True)
    bound = 4 * t * 2.0**-22
    assert (states.cpu().to(F64) - expected).abs().max() <= bound * expected.abs().max()
    d = torch.randn(expected.shape, generator=gen, dtype=F64)
    after = fold_kernel.fold_grads(table, _index(table, steps), rows * dk * dk, rows, dk, dv, True,
                                   d.to(torch.float32).cuda()).cpu().to(F64)
    grads = torch.autograd.grad(expected, [leaves[i][1] for i in range(t - 1)], d)
    want = torch.stack(grads)
    assert (after[: t - 1] - want).abs().max() <= bound * want.abs().max()
