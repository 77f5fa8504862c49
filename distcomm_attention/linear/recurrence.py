"""Context-parallel linear attention: the gated delta rule and the scalar-decay form over a sharded sequence.

Note [Linear attention across ranks]
    Each step of both recurrences is affine in the state S (K x V per value head), so the end state of any
    piece of the sequence is A S_in + B: A (K x K) the product of the steps' transitions (for scalar decay
    exp(sum g) I, sent as one number per head) and B the end state from S_in = 0. A call runs in three
    phases (the pieces of Note [Runs and segments] in plan.py):

        1. local   every closed segment: outputs and end state, final (it depends on no other rank), in one
                   kernel call. Every open segment's map: the delta rule by its state pass alone from the
                   extended state [0 | I] (Note [Open segments in two passes] in kernels.py), in one call
                   for all of them; the scalar decay runs them with the closed ones from a zero state,
                   giving o0 and B (A = exp(sum g))
        2. gather  one all-gather of every rank's maps (per run, and per document end for final states),
                   then every rank folds the runs in global order, S_in(next) = A S_in + B, back to the
                   last run before each state it needs that starts a document (A = 0: its B alone)
        3. finish  each open segment's outputs from its S_in: the delta rule by the kernel's forward from S_in
                   (one call for all); the scalar decay by the correction o_t = o0_t + scale exp(cum g_t)
                   q_t^T S_in (with 16-bit inputs the product runs in their dtype, float32 accumulation, S_in
                   rounded to it as fla rounds its chunk states for the output product; one rounding of the sum)

        rank 0  [run a: closed ]------.                 .-> S_in(b) -> o(b) from S_in(b)
        rank 1  [run b: open   ]------+-- all-gather ---+-> S_in(c) = A_b S_in(b) + B_b -> o(c) ...
        rank 2  [run c: open   ]------'   (A, B) maps   '

    Traffic per rank: slots x heads x K x (K + V) numbers forward (scalar decay: K x V + 1), the same
    backward (the all-gather's adjoint, a reduce-scatter); independent of the sequence length. Gradients are
    exact: autograd differentiates phases 1-3 and the gather (the delta rule's open segments by the two
    passes' own backward). The kernel of phase 1 is pluggable
    (kernels.py): fla's Triton kernels on CUDA when installed, the chunked PyTorch path otherwise.

    Gradient convention (distcomm's): the total loss is the sum of the ranks' losses; q, k, v, g and beta
    receive their exact gradients on the rank that holds them. ``initial_state`` (the same on every rank)
    receives on each rank the part of its gradient flowing through that rank's runs: sum it over the ranks
    (like parameters' grads). ``final_state`` is returned on every rank; a loss on it counts once per rank
    that uses it.
"""

from __future__ import annotations

import torch

from distcomm_attention import _validation
from distcomm_attention.sharding import mesh_field
from distcomm_attention.linear import _checks, kernels
from distcomm_attention.linear.exchange import all_gather_rows
from distcomm_attention.linear.kernels import open_segments, passes_of, select_kernel

__all__ = ["chunk_gated_delta_rule_cp", "chunk_simple_gla_cp"]


# A call's segments of one length go as batch rows (``_Call._packed``) when they are at most this many (a
# zigzag or balanced rank's runs; fla compiles its kernels for each batch size, and a striped rank's
# one-token runs are better as one varlen call) and batch rows x value heads stay within CUDA's 65535 grid
# rows, which fla's kernels put them on.
_MAX_ROWS = 4
_MAX_GRID_Y = 65535


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``use_qk_l2norm_in_kernel``: x / sqrt(sum(x^2) + eps) over the head dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@torch.compiler.disable(reason=_checks.EAGER)
def chunk_gated_delta_rule_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel: bool = False,
    layout: str | None = None,
    group=None,
    sharding=None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (GDN, Qwen3-Next) over a sequence sharded across the ranks of ``group``.

    Each rank passes its shard, in the layout that ``shard_sequence`` / ``Sharding.shard`` gave it (the same
    layout as the softmax attention of a hybrid model). Arguments as fla's ``chunk_gated_delta_rule``:

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    Args:
        q, k: (B, T, H, K) this rank's T tokens. v: (B, T, HV, V), HV a multiple of H (GVA: value head i
            reads key head i // (HV // H)).
        g: (B, T, HV) log decay (<= 0 for a contracting state). beta: (B, T, HV), usually in (0, 1).
        scale: multiplies q; None: 1 / sqrt(K).
        initial_state: (N, HV, K, V) the state before the first token of each sequence: N = B, or with
            ``cu_seqlens`` N = number of documents (each document starts from its own). None: zeros.
        output_final_state: also return the state after each sequence's last token, (N, HV, K, V), float32
            (float64 for float64 inputs), on every rank.
        cu_seqlens: the documents' boundaries over the GLOBAL sequence (0, ..., B=1 x T x W), as for
            ``shard_sequence``; the state restarts at each document start, wherever the ranks' boundaries are.
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dim first (fla's option).
        layout, group, sharding: the layout and group of the shards ("contiguous", "zigzag", "striped",
            "balanced", "auto"; a :class:`~distcomm_attention.Sharding`); layout None: the one
            ``shard_sequence`` recorded for the group, else "contiguous".
        kernel: "auto" (fla on CUDA when installed, else PyTorch), "torch" or "fla".

    Returns:
        (o, final_state): o (B, T, HV, V) in q's dtype, this rank's tokens; final_state or None.

    Raises:
        ValueError / TypeError / ImportError: bad input (shapes, dtypes, heads, gates, states, documents,
            layout), raised before any communication by every rank alike (Note [Collective verdicts]).

    See Note [Linear attention across ranks] for the algorithm, traffic and gradient convention.
    """
    return _linear_cp("chunk_gated_delta_rule_cp", q, k, v, g, beta, scale, initial_state, output_final_state,
                      cu_seqlens, use_qk_l2norm_in_kernel, layout, group, sharding, kernel)


@torch.compiler.disable(reason=_checks.EAGER)
def chunk_simple_gla_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    layout: str | None = None,
    group=None,
    sharding=None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar-decay linear attention (simple GLA, Mamba-2 SSD, RetNet-style) over a sharded sequence.

        S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t

    Mamba-2's SSD maps onto it as q = C, k = B, v = x * dt, g = A * dt (its D skip term and gating stay
    outside). Arguments, returns and errors as :func:`chunk_gated_delta_rule_cp` without ``beta``; q and k
    may have fewer heads than v (HV a multiple of H: Mamba-2's groups).
    """
    return _linear_cp("chunk_simple_gla_cp", q, k, v, g, None, scale, initial_state, output_final_state,
                      cu_seqlens, False, layout, group, sharding, kernel)


def _linear_cp(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2norm, layout, group,
               sharding, kernel):
    delta = op == "chunk_gated_delta_rule_cp"
    comm, given_layout, grid, ring_error = _checks.ring_verdict(sharding, layout, group)
    facts = {"layout": None, "cu_seqlens": None, "mesh": mesh_field(grid)}

    def local_checks():
        scale_ = _checks.check_recurrence(q, k, v, g, beta, scale, initial_state, delta)
        _validation.check_flag("output_final_state", output_final_state)
        _validation.check_flag("use_qk_l2norm_in_kernel", l2norm)
        field, docs, concrete = _checks.check_layout_call(op, comm, given_layout, q.shape[1], cu_seqlens, grid)
        facts.update(layout=field, cu_seqlens=docs)
        b, _, _, dk = q.shape
        hv, dv = v.shape[2:]
        if docs is not None and b != 1:
            raise ValueError(f"with `cu_seqlens` the documents are packed in one row: B must be 1, got B={b}")
        count, per = (b, "one per batch row") if docs is None else (len(docs) - 1, "one per document of cu_seqlens")
        _checks.check_state("initial_state", initial_state, count, per, hv, dk, dv)
        run = select_kernel(kernel, q, backward=needs_grad, delta=delta)
        return scale_, _checks.cached_plan(concrete, q.shape[1] * comm.size, comm.size, docs, output_final_state), run

    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in tensors.values())
    checked, error = (None, ring_error) if ring_error is not None else _validation.verdict(local_checks)
    _validation.verify_across_ring(op, comm, tensors, extra={
        **facts, "output_final_state": output_final_state, "use_qk_l2norm_in_kernel": l2norm,
        # the scale in effect (1 and 1.0, None and 1 / sqrt(K) are the same); as written where it is not read
        "scale": float(checked[0]) if checked is not None else repr(scale), "kernel": kernel,
        "requires_grad": needs_grad}, error=error, mesh=grid is not None)
    scale, plan, run = checked
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return _Call(plan, comm, run, scale, q, k, v, g, beta, initial_state, needs_grad=needs_grad).forward(
        output_final_state)


class _ScaledAdd(torch.autograd.Function):
    """o0 + w[..., None] * qh in o0's dtype (one rounding; w rounded to it, as the product's other factor
    is), with w's gradient summed over the value dim in float32: w carries the decay, whose gradient sums
    over every later token of the run."""

    @staticmethod
    def forward(ctx, o0, qh, w):
        ctx.save_for_backward(qh, w)
        return torch.addcmul(o0, qh, w.to(o0.dtype)[..., None])

    @staticmethod
    def backward(ctx, dout):
        qh, w = ctx.saved_tensors
        dqh = dout * w.to(dout.dtype)[..., None] if ctx.needs_input_grad[1] else None
        dw = None
        if ctx.needs_input_grad[2]:
            dw = (dout.to(w.dtype) * qh.to(w.dtype)).sum(-1)
        return dout, dqh, dw


def _open_ends(plan) -> frozenset[int]:
    """The documents whose last segment is open (the first segment of a run continuing a document): their
    final state needs the run's incoming state; every other document's is its last segment's B."""
    return frozenset(r.segments[0].doc for rank in plan.runs for r in rank if r.is_open and r.segments[0].ends)


class _Fold(torch.autograd.Function):
    """Phase 2's chain over the gathered maps as one autograd node: the incoming state of each run a rank reads.

    ``steps``: for every run order up to the last one read, (order, (rank, slot) of its map in ``gathered`` or
    None where the chain does not pass through it, whether it starts a document: its B alone). The state
    entering run j is S_j; S_{j+1} = A_j S_j + B_j (B_j alone for a restart, S_j for a run not folded). The
    forward is one product per folded run (``call._product``), the backward the mirror chain
    (dA_j = g_{j+1} S_j^T, dB_j = g_{j+1}, g_j = A_j^T g_{j+1} + dS_j): a few operations per step where
    autograd recorded ten. On float32 tables on CUDA both are one launch of fold_kernel.py each (a loop's host
    launch per step costs more on the GPU than its tiny product)."""

    @staticmethod
    def chain(call, gathered, steps, need):
        """The forward's loop: ({order: state entering it}, [state entering each step a product reads])."""
        maps_a, maps_b = call._tables(gathered)
        h = maps_b.new_zeros(maps_b.shape[2:])
        entering, out = [], {}
        for order, at, restart in steps:
            if order in need:
                out[order] = h
            entering.append(h if at is not None and not restart else None)
            if at is not None:
                h = maps_b[at] if restart else call._product(maps_a[at], maps_b[at], h)
        return out, entering

    @staticmethod
    def forward(ctx, call, gathered, steps, need):
        ctx.call, ctx.steps, ctx.need = call, steps, need
        ctx.index = call._fold_index(gathered, steps)
        if ctx.index is not None:  # one launch (fold_kernel.py)
            from distcomm_attention.linear import fold_kernel

            ctx.orders = sorted(need)
            index, t, _, _ = ctx.index
            states = fold_kernel.fold_states(gathered, index[: 2 * t], *call._fold_dims())
            ctx.save_for_backward(gathered, states)
            return tuple(states[o].view(call.b_shape).clone() for o in ctx.orders)
        out, entering = _Fold.chain(call, gathered, steps, need)
        ctx.orders = sorted(out)
        ctx.save_for_backward(gathered, *(e for e in entering if e is not None))
        # distinct tensors, none a view of the gathered table (autograd's rules for a function's outputs)
        return tuple(out[o].view(call.b_shape).clone() for o in ctx.orders)

    @staticmethod
    def kernel_backward(ctx, grads):
        """The backward by fold_kernel: the gradients of the states after every folded step in one launch, then
        B's gradients are those, A's one batched product with the states entering the steps."""
        from distcomm_attention.linear import fold_kernel

        call, (index, t, n_folded, n_products) = ctx.call, ctx.index
        gathered, states = ctx.saved_tensors
        d_states = torch.zeros_like(states)
        for o, d in zip(ctx.orders, grads):
            if d is not None:
                d_states[o] = d.flatten(0, 1)
        after = fold_kernel.fold_grads(gathered, index[: 2 * t], *call._fold_dims(), d_states)
        grad = torch.zeros(gathered.shape, dtype=gathered.dtype, device=gathered.device)
        flat, width = grad.view(-1, grad.shape[-1]), torch.Size(call.a_shape).numel()
        step_b, slot_b, step_a, slot_a = index[2 * t :].split([n_folded, n_folded, n_products, n_products])
        if n_folded:
            flat[:, width:].index_copy_(0, slot_b, after.index_select(0, step_b).flatten(1))
        if n_products:  # restarts alone read no A
            g, h = after.index_select(0, step_a), states.index_select(0, step_a)
            grad_a = call._map_grad(g.flatten(0, 1), h.flatten(0, 1)).view(n_products, -1)
            flat[:, :width].index_copy_(0, slot_a, grad_a)
        return None, grad, None, None

    @staticmethod
    def backward(ctx, *grads):
        call, steps = ctx.call, ctx.steps
        if torch.is_grad_enabled():  # a backward that is differentiated again (create_graph): the plain chain
            gathered = ctx.saved_tensors[0]
            out, _ = _Fold.chain(call, gathered, steps, ctx.need)
            states = [out[o].view(call.b_shape) for o in ctx.orders]
            pairs = [(s, d) for s, d in zip(states, grads) if s.requires_grad and d is not None]
            if not pairs:
                return None, torch.zeros_like(gathered), None, None
            outs, douts = zip(*pairs)
            (grad,) = torch.autograd.grad(outs, gathered, douts, create_graph=True, allow_unused=True)
            return None, grad if grad is not None else torch.zeros_like(gathered), None, None
        if ctx.index is not None:
            return _Fold.kernel_backward(ctx, grads)
        gathered, *saved = ctx.saved_tensors
        saved = list(saved)
        maps_a, _ = call._tables(gathered)
        grad = torch.zeros(gathered.shape, dtype=gathered.dtype, device=gathered.device)
        grad_a, grad_b = call._tables(grad)
        out_grad = dict(zip(ctx.orders, (None if d is None else d.flatten(0, 1) for d in grads)))
        g = None  # the gradient of the state after the current step
        for order, at, restart in reversed(steps):
            if at is not None:  # a run the chain passes through (else the state passes unchanged)
                h = None if restart else saved.pop()
                if g is not None:
                    grad_b[at] += g
                    if h is not None:
                        grad_a[at] += call._map_grad(g, h)
                g = None if restart or g is None else call._transpose_apply(maps_a[at], g)
            dh = out_grad.get(order)
            if dh is not None:
                g = dh if g is None else g + dh
        return None, grad, None, None


class _Call:
    """One call's three phases (Note [Linear attention across ranks]) on this rank's runs."""

    def __init__(self, plan, comm, run, scale, q, k, v, g, beta, initial_state, gather=None, needs_grad=False):
        self.plan, self.comm, self.run, self.scale = plan, comm, run, scale
        # (slots, n) -> (W, slots, n); scripts/bench_linear.py passes one for simulated ranks. ``needs_grad``:
        # the call's grad flag, alike on every rank, so that every rank joins the gather's backward
        # (exchange.all_gather_rows)
        self.gather = gather or (lambda table: all_gather_rows(table, comm.group, comm.size, grad=needs_grad))
        self.q, self.k, self.v, self.g, self.beta, self.h0 = q, k, v, g, beta, initial_state
        self.delta = beta is not None
        self.passes = passes_of(run) if self.delta else None
        if self.delta and self.passes is None:
            raise ValueError(f"no two-pass operations for the kernel {run!r} (kernels.passes_of)")
        self.sdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, _, _, self.dk = q.shape
        _, _, self.hv, self.dv = v.shape
        self.rows = b if len(plan.docs) == 2 else 1  # states per map: the batch rows, or the one packed row
        self.a_shape = (self.rows, self.hv, self.dk, self.dk) if self.delta else (self.rows, self.hv)
        self.b_shape = (self.rows, self.hv, self.dk, self.dv)
        self._split_cache: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}  # _pieces
        # this rank's segments' local starts in order, and the outputs whole where one call gives them (_finished)
        self.locals = sorted(s.local for r in plan.runs[comm.rank] for s in r.segments)
        self.whole = None

    def _pieces(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """x (q, k, v, g or beta) split along the tokens into this rank's segments: {local start: view}. One
        split, whose backward writes x's gradient once (a slice's backward fills a zero tensor of x's size)."""
        cache = self._split_cache
        if id(x) not in cache:
            segs = sorted((s for r in self.plan.runs[self.comm.rank] for s in r.segments), key=lambda s: s.local)
            cache[id(x)] = (x, dict(zip((s.local for s in segs), x.split([s.length for s in segs], dim=1))))
        return cache[id(x)][1]

    def _pick(self, segs):
        """A function taking q, k, v, g or beta to the tokens of ``segs`` in order: the tensor itself where they
        are all of the rank's tokens, the segment's piece for one, else the pieces joined."""
        def pick(x):
            if x is None:
                return None
            pieces = self._pieces(x)
            if len(segs) == len(pieces) and all(a.local < b.local for a, b in zip(segs[:-1], segs[1:])):
                return x
            return pieces[segs[0].local] if len(segs) == 1 else torch.cat([pieces[s.local] for s in segs], dim=1)
        return pick

    def _doc_state(self, doc: int):
        if self.h0 is None:
            return None
        return self.h0 if len(self.plan.docs) == 2 else self.h0[doc : doc + 1]

    def _states_of(self, segs):
        """(N, HV, K, V) initial states of one kernel call over ``segs``: each closed segment's document's,
        zeros for an open one (its incoming state enters in phase 3); None when every one would be zero."""
        if self.h0 is None:
            return None
        zero = self.h0.new_zeros(self.b_shape)
        states = [self._doc_state(s.doc) if s.opens else zero for s in segs]
        return states[0] if len(segs) == 1 else torch.cat(states)

    def _packed(self, segs):
        """One kernel call's arguments over ``segs``: (q, k, v, g, beta), cu_seqlens (None for one segment, or
        for a few segments of one length, a zigzag or balanced rank's two runs without documents: then each is
        a batch row of the call, and the kernel reads no boundaries; fla's scalar decay reads them back from the
        GPU on every call) and the batch rows B; each row's segments are the call's sequences, row-major."""
        pick = self._pick(segs)
        x = [pick(t) for t in (self.q, self.k, self.v, self.g, self.beta)]
        b = x[0].shape[0]
        if len(segs) == 1:
            return x, None, b
        if self._as_rows(segs):
            shape = (b * len(segs), segs[0].length)  # (B, S L, ...) -> (B S, L, ...): the same order of sequences
            return [None if t is None else t.reshape(shape + t.shape[2:]) for t in x], None, b
        x = [None if t is None else t.reshape((1, -1) + t.shape[2:]) for t in x]
        return x, torch.tensor([0] + [s.length for _ in range(b) for s in segs]).cumsum(0), b

    def _as_rows(self, segs) -> bool:
        """Whether one kernel call takes ``segs`` as batch rows (``_packed``): a few segments of one length."""
        return (len({s.length for s in segs}) == 1 and len(segs) <= _MAX_ROWS
                and self.q.shape[0] * len(segs) * self.hv <= _MAX_GRID_Y)

    @staticmethod
    def _per_segment(t, segs, b):
        """A call's per-sequence tensor (B x segments, ...) row-major -> one (B, ...) per segment."""
        return list(t.reshape((b, len(segs)) + t.shape[1:]).unbind(1))

    @staticmethod
    def _split(o, segs, b):
        """A call's outputs -> one (B, length, ...) per segment (one segment: the outputs themselves, not a split
        of one piece, whose backward copies the gradient)."""
        o = o.reshape((b, -1) + o.shape[2:])
        return (o,) if len(segs) == 1 else o.split([s.length for s in segs], dim=1)

    def _finished(self, o, segs, b):
        """The two passes' outputs over ``segs`` -> {local start: outputs}; where ``segs`` are every segment of
        this rank in local order (a zigzag rank's two open runs), also the outputs whole (``self.whole``), which
        the call returns without a split and a join (whose backward copies the output gradient)."""
        if [s.local for s in segs] == self.locals:
            self.whole = o.reshape((b, -1) + o.shape[2:])
        return dict(zip((s.local for s in segs), self._split(o, segs, b)))

    def _call(self, segs, h0=None):
        """One kernel call over ``segs``: per segment outputs (B, length, ...) and end states (B, ...).
        ``h0``: (segments x B, ...) segment-major."""
        x, cu, b = self._packed(segs)
        if h0 is not None and b > 1:
            h0 = h0.reshape((len(segs), b) + h0.shape[1:]).transpose(0, 1).reshape(h0.shape)
        o, ends = self.run(*x, scale=self.scale, initial_state=h0, cu_seqlens=cu)
        return self._split(o, segs, b), self._per_segment(ends, segs, b)

    def _phase1(self, closed, opening):
        """Phase 1: (o, end state) per closed segment, o None where phase 3 gives it; (A, B) per open one; and
        ``finish``, taking the open segments' incoming states to {local start: outputs} of the segments whose
        outputs phase 3 gives. The scalar decay runs every segment in one kernel call (an open one from a zero
        state, corrected in phase 3); the delta rule runs the closed ones in one call and the open ones in two
        passes, their maps now and their outputs from the incoming states (Note [Open segments in two passes]
        in kernels.py), or, where they would all be batch rows of one call (a zigzag rank 0's two runs), the
        closed ones in the two passes too, from their documents' initial states: one call's host work saved."""
        if not self.delta:
            segs = sorted(closed + opening, key=lambda s: s.local)
            results = dict(zip((s.local for s in segs), zip(*self._call(segs, h0=self._states_of(segs))))) \
                if segs else {}
            started = [self._scalar_open(s, *results[s.local]) for s in opening]
            return ([results[s.local] for s in closed], [(a, b) for _, _, a, b in started],
                    lambda hs: {s.local: self._corrected(o0, factor, h)
                                for s, (o0, factor, _, _), h in zip(opening, started, hs)})
        if closed and opening and self._as_rows(closed + opening):
            return self._two_passes(closed, opening)
        done = list(zip(*self._call(closed, h0=self._states_of(closed)))) if closed else []
        if not opening:
            return done, [], lambda hs: {}
        _, maps, finish = self._two_passes([], opening)
        return done, maps, finish

    def _two_passes(self, closed, opening):
        """``_phase1`` of the delta rule for ``opening`` and ``closed`` (possibly none) in one call of the two
        passes: a closed segment's end state is its map applied to its document's initial state (B alone from
        zeros), its outputs come from that state in phase 3 with the open segments'."""
        segs = sorted(closed + opening, key=lambda s: s.local)
        x, cu, b = self._packed(segs)
        a, bmap, finish = open_segments(self.passes, *x, scale=self.scale, cu_seqlens=cu)
        maps = dict(zip((s.local for s in segs), zip(self._per_segment(a, segs, b), self._per_segment(bmap, segs, b))))
        entering = {s.local: self._entering(s) for s in closed}
        done = [(None, maps[s.local][1] if entering[s.local] is None else
                 self._product(maps[s.local][0].flatten(0, 1), maps[s.local][1].flatten(0, 1),
                               entering[s.local].flatten(0, 1)).view(self.b_shape)) for s in closed]

        def finish_all(hs):
            given = dict(zip((s.local for s in opening), hs))
            states = [given[s.local] if s.local in given else entering[s.local] for s in segs]
            if any(h is None for h in states):  # closed segments from zero states
                zero = hs[0].new_zeros(self.b_shape)
                states = [zero if h is None else h for h in states]
            return self._finished(finish(torch.stack(states, 1).flatten(0, 1)), segs, b)

        return done, [maps[s.local] for s in opening], finish_all

    def _entering(self, seg):
        """The state entering closed segment ``seg`` in the map's dtype (its document's initial state), or None
        for zeros."""
        h = self._doc_state(seg.doc)
        return None if h is None else h.to(self.sdtype).view(self.b_shape)

    def _scalar_open(self, seg, o, end):
        # the sum along the tokens as the last dim: along the strided middle dim it took 5.9 ms on an H100
        # for 16k tokens x 80 heads, more than the kernel call
        cum = self._pieces(self.g)[seg.local].to(self.sdtype).transpose(1, 2).cumsum(-1).transpose(1, 2)
        q = self._pieces(self.q)[seg.local]
        # scalar decay: o_t += scale * exp(cum_t) * q_t H_in, kept factored (q per key head, one weight per
        # token and value head) rather than expanded to every value head's K-wide factor
        return o, (q, self.scale * cum.exp()), cum[:, -1].exp(), end

    def _corrected(self, o0, factor, h):
        """Scalar decay: o0 plus the incoming state's contribution (phase 3), scale exp(cum g_t) q_t^T H_in.

        For 16-bit inputs the product runs in their dtype with float32 accumulation, H_in rounded to it, as
        fla's kernels round their chunk states before the output product; one rounding of the sum."""
        low = o0.dtype in (torch.float16, torch.bfloat16)
        dtype = o0.dtype if low else h.dtype  # of the product
        q, weight = factor
        if low and o0.is_cuda and max(self.dk, self.dv) <= 128:  # the same in one pass (correction_kernel.py)
            from distcomm_attention.linear.correction_kernel import ScalarCorrection

            return ScalarCorrection.apply(o0, q, weight, h)
        b, t, heads, _ = q.shape
        groups = self.hv // heads
        hk = h.reshape(b, heads, groups, self.dk, self.dv).transpose(2, 3).reshape(b, heads, self.dk, groups * self.dv)
        qh = torch.matmul(q.transpose(1, 2).to(dtype), hk.to(dtype))
        qh = qh.reshape(b, heads, t, groups, self.dv).permute(0, 2, 1, 3, 4).reshape(b, t, self.hv, self.dv)
        return _ScaledAdd.apply(o0 if low else o0.to(dtype), qh, weight).to(o0.dtype)

    def forward(self, finals: bool):
        plan, rank = self.plan, self.comm.rank
        mine = plan.runs[rank]
        pieces: dict[int, torch.Tensor] = {}  # local start -> outputs
        zero_a = torch.zeros(self.a_shape, dtype=self.sdtype, device=self.q.device)
        closed = [s for r in mine for s in r.segments if s.opens]
        runs = [r for r in mine if r.is_open]
        done, maps, finish = self._phase1(closed, [r.segments[0] for r in runs])
        end_of = {}
        for s, (o, e) in zip(closed, done):
            if o is not None:
                pieces[s.local] = o
            end_of[s.local] = (zero_a, e)
        for r, ab in zip(runs, maps):
            end_of[r.segments[0].local] = ab
        slots = [end_of[r.segments[-1].local] for r in mine]
        if finals:
            slots += [end_of[s.local] for r in mine for s in r.segments if s.ends]
        table = torch.stack([torch.cat([a.reshape(-1), b.reshape(-1)]) for a, b in slots]) if slots else \
            zero_a.new_zeros(0, zero_a.numel() + self.rows * self.hv * self.dk * self.dv)
        table = torch.nn.functional.pad(table, (0, 0, 0, plan.slots - table.shape[0]))
        gathered = self.gather(table)
        open_ends = _open_ends(plan) if finals else frozenset()
        states = self._fold(gathered, open_ends)
        pieces.update(finish([states[r.order] for r in runs]))
        ordered = [pieces[key] for key in sorted(pieces)]
        out = self.whole if self.whole is not None else ordered[0] if len(ordered) == 1 else torch.cat(ordered, dim=1)
        out = out.to(self.q.dtype)
        if gathered.requires_grad and not runs:
            # every rank joins the gather's backward (Note [Scan by gathered summaries]); a rank with an open run
            # reads the gather in its outputs, one without adds nothing from it (a copy of its outputs: a
            # tensor of their own, which the caller may change in place)
            out = out + gathered.reshape(-1)[:0].sum().to(out.dtype)
        final = None
        if finals:
            # a document ending in an open segment: its map from the run's incoming state; else its B alone
            maps_a, maps_b = self._tables(gathered)
            final = torch.cat([(self._product(maps_a[r, slot], maps_b[r, slot], states[order].flatten(0, 1))
                                if d in open_ends else maps_b[r, slot]).view(self.b_shape)
                               for d, (r, slot, order) in enumerate(plan.doc_end)])
        return out, final

    # the fold's maps flat over (rows, value heads): A (R, K, K) (scalar decay: (R,)), B and states (R, K, V)

    def _tables(self, gathered):
        """(A, B) of every gathered slot as flat views (W, slots, R, ...) of the (W, slots, numbers) table."""
        na = torch.Size(self.a_shape).numel()
        lead, r = gathered.shape[:2], self.rows * self.hv
        return (gathered[..., :na].view(*lead, r, *self.a_shape[2:]),
                gathered[..., na:].view(*lead, r, self.dk, self.dv))

    def _product(self, a, b, h):
        """A h + B on flat maps: one batched product-and-add (the fold is a chain of these)."""
        if self.delta:
            return torch.baddbmm(b, a, h)
        return torch.addcmul(b, a[:, None, None], h)

    def _fold_on_kernel(self, gathered) -> bool:
        """Whether the fold runs as fold_kernel's launches: float32 tables on NVIDIA GPUs (its TF32 products),
        K within its tile."""
        if not (gathered.is_cuda and torch.version.hip is None and gathered.dtype == torch.float32
                and gathered.stride(-1) == 1):
            return False
        try:
            from distcomm_attention.linear import fold_kernel
        except ImportError:  # no triton
            return False
        return not self.delta or self.dk <= fold_kernel.MAX_K

    def _fold_dims(self):
        """fold_kernel's (na, rows, dk, dv, delta) for this call's maps."""
        return torch.Size(self.a_shape).numel(), self.rows * self.hv, self.dk, self.dv, self.delta

    def _fold_index(self, gathered, steps):
        """(index, T, folded steps, steps with a product) for fold_kernel, or None where the fold runs as a loop
        of products: ``index`` on the table's device holds each step's map offset in ``gathered`` (-1: none)
        and restart flag, then the folded steps and their slots (row of the flat (W * slots) table), then those
        of the steps with a product (not restarts)."""
        if not self._fold_on_kernel(gathered):
            return None
        per = gathered.shape[1]
        offsets = [-1 if at is None else at[0] * gathered.stride(0) + at[1] * gathered.stride(1) for _, at, _ in steps]
        restarts = [int(bool(restart)) for _, _, restart in steps]
        folded = [(t, at[0] * per + at[1]) for t, (_, at, _) in enumerate(steps) if at is not None]
        products = [(t, slot) for (t, slot) in folded if not steps[t][2]]
        values = (*offsets, *restarts, *(t for t, _ in folded), *(s for _, s in folded),
                  *(t for t, _ in products), *(s for _, s in products))
        _, index = kernels.host_and_device(values, gathered.device)
        return index, len(steps), len(folded), len(products)

    def _map_grad(self, g, h):
        """d(A h + B)/dA contracted with g: g h^T (delta), sum(g * h) per head (scalar decay)."""
        if self.delta:
            return torch.bmm(g, h.transpose(1, 2))
        return (g * h).sum((-1, -2))

    def _transpose_apply(self, a, g):
        """A^T g, the state's gradient through one map."""
        if self.delta:
            return torch.bmm(a.transpose(1, 2), g)
        return a[:, None, None] * g

    def _fold(self, gathered, open_ends) -> dict[int, torch.Tensor]:
        """The state entering each run this rank reads (phase 2): its open runs', and those of the runs holding
        an open segment that ends a document of ``open_ends`` (final states)."""
        plan = self.plan
        need = [r.order for r in plan.runs[self.comm.rank] if r.is_open]
        need += [order for d, (_, _, order) in enumerate(plan.doc_end) if d in open_ends]
        last = max(need, default=-1)
        slot_of = {r.order: (r.rank, i) for rank in plan.runs for i, r in enumerate(rank)}
        # a run whose last segment starts a document passes on its B alone (A = 0): the chain behind a needed
        # state starts at the last such run before it (run 0 is one), and no other run is folded
        restarts = {r.order for rank in plan.runs for r in rank if r.segments[-1].opens}
        folded: set[int] = set()
        for order in need:
            j = order - 1
            while j >= 0 and j not in folded:
                folded.add(j)
                if j in restarts:
                    break
                j -= 1
        steps = [(order, slot_of[order] if order in folded else None, order in restarts) for order in range(last + 1)]
        need = set(need)
        return dict(zip(sorted(need), _Fold.apply(self, gathered, steps, need))) if need else {}
