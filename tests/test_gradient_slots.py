"""Packed backward calls writing their gradients straight into the sums (``RowSum.slot``, ``choose_slots``; the
all-gather's dQ and own keys' dK/dV, Note [Sparse gather]): the sums equal float64 sums of the terms however
the slots fall, a slot never overwrites an earlier term, and the all-gather strategy with a kernel that writes
its whole span (NaN outside its segments here) gives the float64 reference's gradients, in float64 and in
bf16, with the same bytes on the wire as without slots."""

import random

import pytest
import torch

from distcomm_attention.kernels.contract import MergeState, RowSum, Slots, choose_slots, slot_order
from tests.dist_harness import run_world


def _random_calls(rng: random.Random, n: int, count: int):
    """(span, runs) of ``count`` random calls over n rows: runs sorted, disjoint, inside the span; some spans None."""
    calls = []
    for _ in range(count):
        a = rng.randrange(n)
        b = rng.randint(a + 1, n)
        cuts = sorted(rng.sample(range(a, b + 1), min(b - a + 1, 2 * rng.randint(0, 3))))
        runs = tuple((x, y) for x, y in zip(cuts[::2], cuts[1::2]) if y > x)
        calls.append((None if rng.random() < 0.1 else (a, b), runs))
    return calls


def _meets(span, runs) -> bool:
    return any(x < span[1] and span[0] < y for x, y in runs)


def test_chosen_slots_never_overwrite_an_earlier_term():
    """Over random calls: no taken call's span holds a run of a taken call before it, every call left out (with
    a span and runs) conflicts with a taken one, and the largest runs go first: of a sparse call and a dense
    one that runs after it over its rows, the dense one gets the slot."""
    rng = random.Random(0)
    for _ in range(400):
        calls = _random_calls(rng, 48, rng.randint(1, 7))
        taken = choose_slots(calls)
        assert list(taken) == sorted(set(taken))
        for i in taken:
            assert calls[i][0] is not None and calls[i][1]
            for j in taken:
                if j < i:
                    assert not _meets(calls[i][0], calls[j][1]), (calls, taken)
        for i, (span, runs) in enumerate(calls):
            if i in taken or span is None or not runs:
                continue
            assert any(_meets(span, calls[j][1]) if j < i else _meets(calls[j][0], runs) for j in taken), (calls, i)
    sparse_first = [((10, 100), ((10, 12), (90, 100))), ((0, 90), ((0, 10), (12, 90)))]
    assert choose_slots(sparse_first) == (1,)


def test_slots_of_kernels_writing_only_their_segments():
    """With ``segments`` (``writes_segments_only``: a call writes its runs): no taken call writes a row a taken call
    before it wrote, every call left out conflicts with a taken one by the rows they write, and two calls whose
    spans overlap but whose runs do not are both taken (a whole-span kernel gets one of them)."""
    rng = random.Random(1)
    for _ in range(400):
        calls = _random_calls(rng, 48, rng.randint(1, 7))
        taken = choose_slots(calls, segments=True)
        for i in taken:
            for j in taken:
                if j < i:
                    assert not any(_meets(r, calls[j][1]) for r in calls[i][1]), (calls, taken)
        for i, (span, runs) in enumerate(calls):
            if i in taken or span is None or not runs:
                continue
            # a taken call before it holds a run in the rows it writes, or one after it writes a row of its runs
            assert any(any(_meets(r, calls[j][1]) for r in calls[i][1]) if j < i else
                       any(_meets(r, calls[i][1]) for r in calls[j][1]) for j in taken), (calls, i)
    apart = [((0, 100), ((0, 10), (90, 100))), ((5, 95), ((10, 90),))]
    assert choose_slots(apart, segments=True) == (0, 1)
    assert slot_order(apart, segments=True) == (((0, 100), True), ((5, 95), True))
    assert len(choose_slots(apart)) == 1


def _kernel_term(span, runs, shape, dtype, gen, into=None):
    """A call's term as a kernel makes it: its whole span written (NaN outside the runs), into ``into`` if given."""
    lo, hi = span
    term = into if into is not None else torch.empty((shape[0], hi - lo, *shape[2:]), dtype=dtype)
    term.fill_(float("nan"))
    for a, b in runs:
        term[:, a - lo:b - lo] = torch.randn((shape[0], b - a, *shape[2:]), dtype=torch.float64, generator=gen)
    return term


@pytest.mark.parametrize("batch", [1, 2])
def test_row_sum_with_slots_is_the_sum_of_its_terms(batch):
    """Random calls add to a RowSum with the chosen slots (each kernel writing its whole span, NaN outside its
    runs, into its slot where it gets one), then plain terms (as the all-gather's own keys get step 1's and the
    returned rows): the result is the float64 sum of every term's runs (rows no term reaches: 0), and slots
    were written in place (at batch 2 only whole-span slots are contiguous)."""
    rng, gen = random.Random(batch), torch.Generator().manual_seed(batch)
    n, used = 40, 0
    for _ in range(150):
        shape = (batch, n, 2, 3)
        calls = [(span or (0, n), runs) for span, runs in _random_calls(rng, n, rng.randint(1, 6))]
        if rng.random() < 0.3:
            calls.append(((0, n), ((0, n),)))
        order = slot_order(calls)
        sums = RowSum(torch.Size(shape), torch.float64, torch.device("cpu"))
        sums.slots = None if order is None else Slots(order)
        want = torch.zeros(shape, dtype=torch.float64)
        for span, runs in calls:
            slot = sums.slot(*span, torch.float64)
            term = _kernel_term(span, runs, shape, torch.float64, gen, into=slot)
            used += slot is not None
            for a, b in runs:
                want[:, a:b] += term[:, a - span[0]:b - span[0]]
            sums.add_runs(term, runs, span[0])
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(n)
            b = rng.randint(a + 1, n)
            extra = torch.randn((batch, b - a, 2, 3), dtype=torch.float64, generator=gen)
            want[:, a:b] += extra
            sums.add(a, b, extra)
        torch.testing.assert_close(sums.result(torch.float64), want, rtol=1e-13, atol=1e-13)
    assert used > (50 if batch == 1 else 20)


def _bf16_row_sum(seed: int, batch: int, fused: bool, monkeypatch):
    """A RowSum in fp32 of random bf16 kernel terms (slots as chosen) and fp32 extra terms (as the all-gather's
    returned rows), finished by ``triton_rows.sum_rows`` (``fused``, under the Triton interpreter) or by adding
    the kept terms one run at a time; -> (result in bf16, float64 sum of the terms)."""
    from distcomm_attention.kernels import triton_rows

    monkeypatch.setattr(triton_rows, "sum_available", lambda device: fused)
    ran = []
    monkeypatch.setattr(triton_rows, "sum_rows", lambda *a, real=triton_rows.sum_rows: ran.append(1) or real(*a))
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n, shape = 40, (batch, 40, 2, 3)
    calls = [(span or (0, n), runs) for span, runs in _random_calls(rng, n, rng.randint(1, 6))]
    order = slot_order(calls)
    sums = RowSum(torch.Size(shape), torch.float32, torch.device("cpu"))
    sums.slots = Slots(order or ())  # every term not written in place kept for the result
    want = torch.zeros(shape, dtype=torch.float64)
    for span, runs in calls:
        slot = sums.slot(*span, torch.bfloat16)
        term = _kernel_term(span, runs, shape, torch.bfloat16, gen, into=slot)
        for a, b in runs:
            want[:, a:b] += term[:, a - span[0]:b - span[0]].double()
        sums.add_runs(term, runs, span[0])
    for _ in range(rng.randint(0, 3)):
        a = rng.randrange(n)
        b = rng.randint(a + 1, n)
        extra = torch.randn((batch, b - a, 2, 3), generator=gen)
        want[:, a:b] += extra.double()
        sums.add(a, b, extra)
    kept = bool(sums.deferred)
    out = sums.result(torch.bfloat16)
    assert len(ran) == (fused and kept), "the kernel finishes every sum with kept terms, and only those"
    first = out.clone()
    again = sums.result(torch.bfloat16)  # the sum stays whole: a second result is the first, which it leaves
    assert torch.equal(again.view(torch.int16), first.view(torch.int16))
    assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    return first, want, kept


@pytest.mark.parametrize("batch", [1, 2])
def test_row_sum_finished_by_one_kernel_gives_the_same_bits(batch, monkeypatch):
    """A RowSum whose terms were kept aside (slots) finishes with ``triton_rows.sum_rows`` on CUDA: here under
    the Triton interpreter, against the same sums finished one run at a time, over random calls, slots and
    extra fp32 terms: the same bits (each row's terms added in fp32 in the same order and rounded once), and
    both within one bf16 rounding of the float64 sum of the terms (rows no term reaches: 0)."""
    kept = 0
    for seed in range(24):
        fused, want, k = _bf16_row_sum(seed, batch, True, monkeypatch)
        plain, _, _ = _bf16_row_sum(seed, batch, False, monkeypatch)
        kept += k
        assert fused.dtype == torch.bfloat16 and fused.shape == want.shape
        assert torch.equal(fused.view(torch.int16), plain.view(torch.int16)), seed
        torch.testing.assert_close(fused.double(), want, rtol=2 ** -8, atol=1e-6)
    assert kept > 12


def test_a_slot_is_refused_where_an_earlier_slot_wrote():
    """Slots go to the calls ``choose_slots`` picked, in the order they ask, even where two calls share a span; a
    span holding a row an earlier slot's term was written to gets none whatever it was granted, nor a slot of
    another dtype than the kept rows', nor any request after one out of step with the order."""
    shape = torch.Size((1, 10, 1, 1))
    calls = [((0, 10), ((0, 2),)), ((0, 10), ((2, 10),))]  # same span: the second, larger, gets the slot
    sums = RowSum(shape, torch.float32, torch.device("cpu"))
    sums.slots = Slots(slot_order(calls))
    assert sums.slot(0, 10, torch.bfloat16) is None
    assert sums.slot(0, 10, torch.bfloat16) is not None

    order = (((0, 6), True), ((4, 10), True), ((7, 10), True), ((7, 10), True), ((0, 3), True))
    sums = RowSum(shape, torch.float32, torch.device("cpu"))
    sums.slots = Slots(order)
    first = sums.slot(0, 6, torch.bfloat16)
    assert first is not None and first.shape == (1, 6, 1, 1)
    first.fill_(1.0)
    sums.add_runs(first, ((0, 5),), 0)
    assert sums.slot(4, 10, torch.bfloat16) is None  # row 4 holds the first term
    assert sums.slot(7, 10, torch.float32) is None  # another dtype than the kept rows'
    second = sums.slot(7, 10, torch.bfloat16)
    second.fill_(2.0)
    sums.add_runs(second, ((7, 10),), 7)
    assert sums.slot(1, 3, torch.bfloat16) is None  # out of step with the order: no more grants
    assert sums.slot(0, 3, torch.bfloat16) is None
    sums.add(3, 8, torch.full((1, 5, 1, 1), 0.5))
    got = sums.result(torch.float32).flatten().tolist()
    assert got == [1.0, 1.0, 1.0, 1.5, 1.5, 0.5, 0.5, 2.5, 2.0, 2.0]


def test_a_whole_term_is_adopted_only_when_it_owns_its_memory():
    """A term covering every row becomes the sum's buffer without a copy only when it is the whole of its memory
    (a kernel's own output); a view of a larger buffer is copied, so that the result neither keeps that buffer
    alive nor comes back strided."""
    own = torch.randn(2, 6, 1, 1)
    sums = RowSum(own.shape, torch.float32, torch.device("cpu"))
    sums.add(0, 6, own)
    assert sums.result(torch.float32).data_ptr() == own.data_ptr()
    big = torch.randn(2, 20, 1, 1)
    view = big[:, 3:9]
    sums = RowSum(view.shape, torch.float32, torch.device("cpu"))
    sums.add(0, 6, view)
    got = sums.result(torch.float32)
    assert got.is_contiguous() and got.untyped_storage().nbytes() == got.numel() * got.element_size()
    assert torch.equal(got, view)


def test_merge_state_slots_equal_merging_every_block():
    """Blocks of random calls (each writing its whole span, NaN outside its runs, into its slot where it gets
    one) merge into the same output and lse as the float64 softmax over all their keys: rows no call reached
    are 0 / -inf, and a span holding an earlier slot's row gets no slot."""
    from distcomm_attention.kernels.contract import BlockForward, merge_block

    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    n, used = 30, 0
    for _ in range(120):
        calls = [(span or (0, n), runs) for span, runs in _random_calls(rng, n, rng.randint(1, 5))]
        state = MergeState(torch.Size((1, n, 2, 3)), torch.device("cpu"))
        order = slot_order(calls)
        state.slots = None if order is None else Slots(order)
        weight = torch.full((1, 2, n), float("-inf"), dtype=torch.float64)  # logsumexp of every block's lse
        total = torch.zeros((1, n, 2, 3), dtype=torch.float64)  # sum of exp(lse) * out
        for span, runs in calls:
            lo, hi = span
            slot = state.slot(lo, hi, torch.float64, torch.float64)
            used += slot is not None
            out_b = _kernel_term(span, runs, (1, n, 2, 3), torch.float64, gen, into=slot)
            lse_b = torch.full((1, 2, hi - lo), float("nan"), dtype=torch.float64)
            for a, b in runs:
                lse_b[:, :, a - lo:b - lo] = torch.randn((1, 2, b - a), dtype=torch.float64, generator=gen)
                part = lse_b[:, :, a - lo:b - lo]
                weight[:, :, a:b] = torch.logaddexp(weight[:, :, a:b], part)
                total[:, a:b] += part.exp().transpose(1, 2).unsqueeze(-1) * out_b[:, a - lo:b - lo]
            for a, b in runs:
                merge_block(state, out_b[:, a - lo:b - lo], lse_b[:, :, a - lo:b - lo], slice(a, b))
        out, lse = BlockForward().finalize(state, torch.float64)
        seen = (weight > float("-inf")).transpose(1, 2).unsqueeze(-1)
        want = torch.where(seen, total / weight.exp().transpose(1, 2).unsqueeze(-1), 0.0)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse.double(), weight, rtol=1e-12, atol=1e-12)
    assert used > 40


# ------------------------------------------------------------------------------------ the strategy, on gloo
def _whole_span_kernels(given, ignore=False, segments=False):
    """(forward, backward) FlashAttention stand-ins (exact, tests/test_backends.py) that fill every output buffer
    they are handed with NaN before writing their segments (a kernel may write its whole span), and record
    which of out (forward) and dq, dk, dv (backward) they were handed; with ``ignore``, kernels that then
    write into buffers of their own instead (the contract allows it); with ``segments``, kernels that say they
    write only their segments' rows (``writes_segments_only``, as flash-attn-4 does) and do: rows of a buffer
    outside the segments keep what they held."""
    from tests.test_backends import WindowedExactBackward, WindowedExactForward

    class WholeSpanForward(WindowedExactForward):
        writes_segments_only = segments

        def block(self, *args, out=None, lse=None, **kwargs):
            given.append(("forward", out is not None))
            for t in (out, lse):  # (lse: the state's rows of the span, handed beside out for one batch element)
                if t is not None and not segments:
                    t.fill_(float("nan"))
            return super().block(*args, out=None if ignore else out, lse=lse, **kwargs)

    class WholeSpan(WindowedExactBackward):
        writes_segments_only = segments

        def block(self, *args, dq=None, dk=None, dv=None, **kwargs):
            given.append(("backward", *(t is not None for t in (dq, dk, dv))))
            for t in (dq, dk, dv):
                if t is not None and not segments:
                    t.fill_(float("nan"))
            if ignore:
                dq = dk = dv = None
            return super().block(*args, dq=dq, dk=dk, dv=dv, **kwargs)

    return WholeSpanForward(), WholeSpan()


def _owns(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _plan_inputs(rank, world, layout, docs, seed, batch=1, dtype=torch.float64):
    """Random inputs of one plan over ``world`` ranks of 24 tokens (batch, heads 4 / kv heads 2, head_dim 8):
    (q, k, v, dout) of the whole sequence and this rank's positions under ``layout``."""
    from distcomm_attention.planning import balance, layouts

    seq_len = world * 24
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, h, 8, dtype=dtype, generator=g) for h in (4, 2, 2))
    dout = torch.randn(batch, seq_len, 4, 8, dtype=dtype, generator=g)
    concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
    return q, k, v, dout, layouts.positions(concrete, seq_len, world, rank)


def _slots_rank(rank, world, plans, dtype_name, batch=1, ignore=False, segments=False):
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch
    from distcomm_attention.strategies import allgather
    from tests.counting import counted, max_diff, reference_errors

    given: list = []
    fwd, bwd = _whole_span_kernels(given, ignore, segments)
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    dtype = getattr(torch, dtype_name)
    out = []
    for i, (layout, (causal, window, docs)) in enumerate(plans):
        q, k, v, dout, pos = _plan_inputs(rank, world, layout, docs, 100 + i, batch)
        kwargs = dict(causal=causal, window_size=window, cu_seqlens=docs, layout=layout, strategy="allgather")
        runs = {}
        for name, in_place in (("slots", True), ("plain", False)):
            before = len(given)
            cls = allgather.AllGatherKV
            attrs = ("own_keys_in_shard", "_row_slots", "_own_slots", "_home_slots")
            saved = tuple(vars(cls)[attr] for attr in attrs)
            if not in_place:  # step 0 over the buffer's rows, no slot
                cls.own_keys_in_shard = cls._home_slots = lambda *a: None
                cls._row_slots = cls._own_slots = staticmethod(lambda *a: None)
            else:  # step 1's dK/dV written into the buffers that go home: recorded
                home_slots = saved[3]

                def recording(self, *args):
                    home = home_slots(self, *args)
                    given.append(("home", home is not None))
                    return home

                cls._home_slots = recording
            try:
                local = [t[:, pos].to(dtype).requires_grad_() for t in (q, k, v)]
                with counted() as made:
                    o = da.context_parallel_attn(*local, **kwargs)
                    o.backward(dout[:, pos].to(dtype))
            finally:
                for attr, method in zip(attrs, saved):
                    setattr(cls, attr, method)
            runs[name] = {"grads": [o.detach()] + [t.grad for t in local], "sent": sum(c.total for c in made),
                          "given": given[before:], "owned": all(_owns(t.grad) for t in local)}
        errors = reference_errors(q, k, v, dout, pos, runs["slots"]["grads"][0].double(),
                                  [_Grad(t) for t in runs["slots"]["grads"][1:]], causal=causal, window=window,
                                  docs=docs, mask=None)
        apart = [max_diff(a.double(), b.double()) for a, b in zip(runs["slots"]["grads"],
                                                                               runs["plain"]["grads"])]
        out.append({"errors": errors, "apart": apart, "sent": (runs["slots"]["sent"], runs["plain"]["sent"]),
                    "given": runs["slots"]["given"], "given_plain": runs["plain"]["given"],
                    "owned": runs["slots"]["owned"]})
    return out


def test_allgather_slots_for_kernels_writing_only_their_segments():
    """Kernels that write only their segments' rows (flash-attn-4's varlen calls, ``writes_segments_only``) are
    granted slots whose spans overlap where their runs do not (a rank's two steps, the own keys' calls and the
    calls across its boundaries, each spanning most of its rows): over random plans on 4 ranks out, dq, dk, dv
    equal the float64 reference and the plain path's, the bytes are the same, and more buffers are handed
    than to kernels that write their whole span."""
    from tests.test_exchange import _random_plans

    world = 4
    plans = _random_plans(world, 24, 10, seed=11)
    handed = {}
    for segments in (False, True):
        got = run_world(_slots_rank, world, plans, "float64", 1, False, segments, timeout=240)
        handed[segments] = 0
        for r in range(world):
            for i, res in enumerate(got[r]):
                where = f"segments {segments}, rank {r}, plan {plans[i]}"
                assert max(res["errors"]) < 1e-10, (where, res["errors"])
                assert max(res["apart"]) < 1e-12, (where, res["apart"])
                assert res["sent"][0] == res["sent"][1] and res["owned"], where
                handed[segments] += sum(any(h[1:]) for h in res["given"])
    assert handed[True] > handed[False] > 0, handed


class _Grad:
    """A stand-in leaf for ``reference_errors``: ``.grad`` in float64."""

    def __init__(self, grad):
        self.grad = grad.double()


@pytest.mark.parametrize("world, batch, ignore", [(3, 1, False), (4, 1, False), (3, 2, False), (4, 1, True)])
def test_allgather_with_slots_matches_float64(world, batch, ignore):
    """The all-gather strategy over random plans (documents crossing ranks, one-token documents, windows, every
    layout) with a kernel that writes its whole span: out, dq, dk, dv equal the float64 reference and the
    plain path's (step 0 over the buffer's rows, no slot), the bytes sent are the same, every gradient is
    contiguous and the whole of its memory, and kernels were handed output, dq and dk/dv slots (none on the
    plain path), step 1's calls the buffers that go home; at batch 2 (whole spans only) and with a kernel that
    ignores the buffers it is handed, too."""
    from tests.test_exchange import _random_plans

    plans = _random_plans(world, 24, 10, seed=world)
    got = run_world(_slots_rank, world, plans, "float64", batch, ignore, timeout=240)
    handed = [0, 0, 0, 0]  # outputs, dq, dk and dv written into slots, step 1's dK/dV into the buffers going home
    for r in range(world):
        for i, res in enumerate(got[r]):
            where = f"rank {r}, plan {plans[i]}"
            assert max(res["errors"]) < 1e-10, (where, res["errors"])
            assert max(res["apart"]) < 1e-12, (where, res["apart"])
            assert res["sent"][0] == res["sent"][1], where
            assert res["owned"], where
            assert not any(any(h[1:]) for h in res["given_plain"]), where
            handed[0] += sum(h[1] for h in res["given"] if h[0] == "forward")
            handed[1] += sum(h[1] for h in res["given"] if h[0] == "backward")
            handed[2] += sum(h[2] and h[3] for h in res["given"] if h[0] == "backward")
            handed[3] += sum(h[1] for h in res["given"] if h[0] == "home")
    assert min(handed) > 0, handed


def test_allgather_with_slots_in_bf16():
    """In bf16 (the kernels' dtype apart from the fp32 sums): gradients within bf16 tolerance of float64, the
    plain path's up to the order of the fp32 sums, the same bytes, slots handed."""
    world = 3
    plans = [("contiguous", (True, (-1, -1), (0, 5, 13, 30, 31, 50, 72))),
             ("balanced", (True, (-1, -1), (0, 2, 9, 10, 40, 72)))]
    got = run_world(_slots_rank, world, plans, "bfloat16", timeout=240)
    for i in range(len(plans)):
        for r in range(world):
            res = got[r][i]
            assert max(res["errors"]) < 5e-2, (r, plans[i], res["errors"])
            assert max(res["apart"]) < 1.6e-2, (r, plans[i], res["apart"])
            assert res["sent"][0] == res["sent"][1]
            assert res["owned"], (r, plans[i])
    assert any(h[0] == "backward" and h[1] for r in range(world) for res in got[r] for h in res["given"])


def _return_rank(rank, world, plans, flagged=True, max_runs=None):
    """Each plan's bf16 fwd+bwd with the all-gather, its dK/dV going home as shipped (``allgather.return_dtype``)
    and in fp32 (``return_dtype`` replaced), with whole-span kernels that say their dK/dV come in the inputs'
    dtype (``flagged``) or not, and own rows by runs at most ``max_runs`` (0: never, the buffer's own rows then
    summing in fp32): out, dq, dk, dv of both, the bytes each sent, the rows this rank received, the depth of
    its step-1 terms on the rows that go home (None where that path did not run), and the float64 reference's
    errors."""
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch
    from distcomm_attention.planning import balance
    from distcomm_attention.planning.exchange import gathered_exchange
    from distcomm_attention.planning.visibility import Visibility
    from distcomm_attention.strategies import allgather, sparse_gather
    from tests.counting import counted, reference_errors

    fwd, bwd = _whole_span_kernels([])
    bwd.dkv_in_input_dtype = flagged
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    if max_runs is not None:
        sparse_gather.MAX_RUNS = max_runs
    shipped, depth = allgather.return_dtype, allgather._depth
    depths = []

    def recording(spans):  # how many step-1 terms reach a row of the other ranks' at most
        spans = list(spans)
        depths.append(depth(spans))
        return depth(spans)

    allgather._depth = recording
    out = []
    for i, (layout, (causal, window, docs)) in enumerate(plans):
        q, k, v, dout, pos = _plan_inputs(rank, world, layout, docs, 300 + i)
        runs = {}
        for name, wire in (("shipped", shipped), ("fp32", lambda dtype, acc_dtype, bwd: torch.float32)):
            allgather.return_dtype, depths[:] = wire, []
            try:
                local = [t[:, pos].bfloat16().requires_grad_() for t in (q, k, v)]
                with counted() as made:
                    o = da.context_parallel_attn(*local, causal=causal, window_size=window, cu_seqlens=docs,
                                                 layout=layout, strategy="allgather")
                    o.backward(dout[:, pos].bfloat16())
            finally:
                allgather.return_dtype = shipped
            runs[name] = {"grads": [o.detach()] + [t.grad for t in local], "sent": sum(c.total for c in made),
                          "depth": max(depths) if depths else None}
        concrete = balance.resolve(layout, world * 24, world, docs) if layout == "balanced" else layout
        ex = gathered_exchange(concrete, Visibility(causal, window, docs), world, 24)
        errors = reference_errors(q, k, v, dout, pos, runs["shipped"]["grads"][0].double(),
                                  [_Grad(t) for t in runs["shipped"]["grads"][1:]], causal=causal, window=window,
                                  docs=docs, mask=None)
        out.append({"grads": {n: r["grads"] for n, r in runs.items()}, "sent": {n: r["sent"] for n, r in runs.items()},
                    "received": None if ex is None else ex.remote_rows(rank)[1], "depth": runs["shipped"]["depth"],
                    "errors": errors})
    return out


@pytest.mark.parametrize("flagged, max_runs", [(True, None), (True, 0), (False, None)])
def test_sparse_gradients_go_home_in_the_kernels_dtype(flagged, max_runs):
    """bf16 inputs, the all-gather's sparse exchange (Note [Sparse gather], "What goes home"). With a backward
    kernel whose dK/dV come in the inputs' dtype (flash-attn-4's contract), the rows that go home cost 2 bytes an
    element, not fp32's 4 (the bytes differ by exactly the received rows' k and v at 2 bytes); where each of
    those rows is one kernel call's output on every rank, the results are the same bits as sending them in fp32;
    where a rank summed two or more calls' terms first (or, with own rows never by runs, summed its rows in fp32
    before sending), the sum is rounded once more: within a bf16 rounding of the largest gradient. With a kernel
    whose dK/dV are fp32 sums (Triton, cuDNN or flash-attn-2 with GQA), fp32 travels: the same bytes and bits.
    Every result within bf16 tolerance of float64."""
    from tests.test_exchange import _random_plans

    world = 3
    plans = _random_plans(world, 24, 12, seed=5)
    got = run_world(_return_rank, world, plans, flagged, max_runs, timeout=240)
    same = rounded = 0
    grad_row = 2 * 2 * 8  # k and v, kv heads 2 x head_dim 8, elements per token
    for i, plan in enumerate(plans):
        results = [got[r][i] for r in range(world)]
        if results[0]["received"] is None:  # the dense all-gather: nothing sparse to send home
            continue
        by_runs = all(res["depth"] is not None for res in results if res["received"])
        assert by_runs == (max_runs is None) or not any(res["received"] for res in results), plan
        exact = not flagged or (by_runs and all(res["depth"] is None or res["depth"] <= 1 for res in results))
        for r, res in enumerate(results):
            where = (r, plan)
            saved = res["received"] * grad_row * (4 - 2) if flagged else 0
            assert res["sent"]["fp32"] - res["sent"]["shipped"] == saved, where
            assert max(res["errors"]) < 5e-2, (where, res["errors"])
            for a, b in zip(res["grads"]["shipped"], res["grads"]["fp32"]):
                if exact:
                    assert torch.equal(a, b), where
                else:
                    assert float((a.double() - b.double()).abs().max()) <= 2 ** -7 * float(b.double().abs().max())
        moved = any(res["received"] for res in results)
        same += exact and moved
        rounded += not exact and moved
    if not flagged:  # fp32 on the wire: every plan the same bits
        assert same >= 3 and rounded == 0, (same, rounded)
    elif max_runs is None:  # both kinds of row met
        assert same >= 3 and rounded >= 1, (same, rounded)
    else:  # every plan through the fp32 buffer, rounded before it left
        assert same == 0 and rounded >= 3, (same, rounded)


def _poisoned_rank(rank, world, plans):
    """Each plan's float64 fwd+bwd with the all-gather and the whole-span kernels while every new tensor of a
    floating dtype made by ``torch.empty``, ``torch.empty_like`` or ``Tensor.new_empty`` starts as NaN (memory
    the code leaves unset, such as the buffer rows of own keys the forward does not place, Note [Sparse
    gather]): the float64 reference's errors, and how many rows the forward left unplaced."""
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch
    from distcomm_attention.strategies import allgather
    from tests.counting import reference_errors

    fwd, bwd = _whole_span_kernels([])
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    unplaced, forward_plan = [], allgather.AllGatherKV._forward_plan

    def counting(self):
        plan, place = forward_plan(self)
        if place is not None:
            unplaced.append(sum(n for _, _, n in self.sparse.own_runs) - sum(n for _, _, n in place))
        return plan, place

    allgather.AllGatherKV._forward_plan = counting
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    out = []
    for i, (layout, (causal, window, docs)) in enumerate(plans):
        q, k, v, dout, pos = _plan_inputs(rank, world, layout, docs, 400 + i)
        local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
        torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
        torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
        torch.Tensor.new_empty = lambda self, *a, **kw: poison(new_empty(self, *a, **kw))
        try:
            o = da.context_parallel_attn(*local, causal=causal, window_size=window, cu_seqlens=docs, layout=layout,
                                         strategy="allgather")
            o.backward(dout[:, pos])
        finally:
            torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty
        out.append(reference_errors(q, k, v, dout, pos, o, local, causal=causal, window=window, docs=docs,
                                    mask=None))
    return {"errors": out, "unplaced": sum(unplaced)}


def test_allgather_reads_no_unset_memory():
    """The all-gather over random plans (documents crossing ranks, one-token documents, windows; contiguous, zigzag
    and balanced layouts) with every new floating tensor starting as NaN: out, dq, dk, dv still equal the float64
    reference, so no row the code leaves unset (buffer rows of own keys the forward does not place, sums' rows no
    term reaches) is read; and the forward did leave own rows unplaced."""
    from tests.test_exchange import _random_plans

    world = 4
    plans = _random_plans(world, 24, 12, seed=9)
    got = run_world(_poisoned_rank, world, plans, timeout=240)
    for r in range(world):
        for plan, errors in zip(plans, got[r]["errors"]):
            assert max(errors) < 1e-10, (r, plan, errors)
    assert sum(g["unplaced"] for g in got) > 0


def _fused_sums_rank(rank, world, plans):
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch, triton_rows

    fwd, bwd = _whole_span_kernels([], False)
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    real, ran = triton_rows.sum_rows, []
    triton_rows.sum_rows = lambda *a: ran.append(1) or real(*a)
    out = []
    for i, (layout, (causal, window, docs)) in enumerate(plans):
        q, k, v, dout, pos = _plan_inputs(rank, world, layout, docs, 200 + i, dtype=torch.float32)
        kwargs = dict(causal=causal, window_size=window, cu_seqlens=docs, layout=layout, strategy="allgather")
        grads, counts = {}, {}
        for fused in (True, False):
            triton_rows.sum_available = lambda device, fused=fused: fused
            before = len(ran)
            local = [t[:, pos].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            o = da.context_parallel_attn(*local, **kwargs)
            o.backward(dout[:, pos].to(torch.bfloat16))
            grads[fused] = [t.grad.view(torch.int16).clone() for t in local]
            counts[fused] = len(ran) - before
        out.append({"same": [torch.equal(a, b) for a, b in zip(grads[True], grads[False])], "ran": counts})
    return out


def test_allgather_sums_finished_by_one_kernel_give_the_same_bits():
    """The all-gather in bf16 with packed whole-span kernels, documents crossing ranks (the own keys' dK/dV sums
    and dQ kept for the result): finished by ``triton_rows.sum_rows`` (the Triton interpreter here) or a run at
    a time, dq, dk and dv have the same bits on every rank, and the kernel ran on some rank."""
    world = 3
    plans = [("contiguous", (True, (-1, -1), (0, 5, 13, 30, 31, 50, 72))),
             ("balanced", (True, (-1, -1), (0, 2, 9, 10, 40, 72)))]
    got = run_world(_fused_sums_rank, world, plans, timeout=240)
    for r in range(world):
        for i, res in enumerate(got[r]):
            assert all(res["same"]), (r, plans[i], res["same"])
            assert res["ran"][False] == 0, (r, plans[i])
    assert sum(res["ran"][True] for r in range(world) for res in got[r]) > 0


def _mixed_return_rank(rank, world, strategy):
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch

    fwd, bwd = _whole_span_kernels([])
    bwd.dkv_in_input_dtype = rank == 0  # one rank's backward would send bf16 home, the others' fp32
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    docs = (0, 5, 40, 24 * world)
    q, k, v, dout, pos = _plan_inputs(rank, world, "contiguous", docs, 1)
    local = [t[:, pos].bfloat16().requires_grad_() for t in (q, k, v)]
    try:
        o = da.context_parallel_attn(*local, causal=True, cu_seqlens=docs, layout="contiguous", strategy=strategy)
        o.backward(dout[:, pos].bfloat16())
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("strategy", ["allgather", "ring", "ulysses"])
def test_ranks_disagreeing_on_what_goes_home_get_one_error(strategy):
    """Ranks whose backward kernels differ in the dtype the sparse exchanges send dK/dV home in (the all-gather's
    and the sparse ring's: Note [Sparse gather], "What goes home"; Note [Sparse ring]) get the same error on every
    rank, naming the field, before any exchange (no hang, no crash); a strategy without that exchange (Ulysses)
    does not care (2 ranks: its degree divides the 4 heads)."""
    got = run_world(_mixed_return_rank, 2 if strategy == "ulysses" else 3, strategy, timeout=120)
    if strategy == "ulysses":
        assert got == [None] * 2, got
        return
    assert got[0] is not None and "sparse dK/dV home in" in got[0], got
    assert "the inputs' dtype (backend 'fa4')" in got[0] and "fp32 (backend 'fa4')" in got[0], got[0]
    assert got[0] == got[1] == got[2]
