"""Context-parallel linear attention: the gated delta rule and the scalar-decay form over a sharded sequence.

Note [Linear attention across ranks]
    Each step of both recurrences is affine in the state S (K x V per value head), so the end state of any
    piece of the sequence is A S_in + B: A (K x K) the product of the steps' transitions (for scalar decay
    exp(sum g) I, sent as one number per head) and B the end state from S_in = 0. A call runs in three
    phases (the pieces of Note [Runs and segments] in plan.py):

        1. local   every closed segment: outputs and end state, final (it depends on no other rank);
                   every open segment: one kernel call from the extended state [0 | I] with values [v | 0],
                   giving its outputs from a zero state o0, its map's B and A, and q_t^T P_t (P_t: the
                   transition from the run's start to token t) as the extra output columns
        2. gather  one all-gather of every rank's maps (per run, and per document end for final states),
                   then every rank folds all runs in global order: S_in(next) = A S_in + B
        3. correct each open segment: o_t = o0_t + (q_t^T P_t) S_in (scalar decay: scale exp(cum g_t) q_t^T S_in)

        rank 0  [run a: closed ]------.                 .-> S_in(b) -> o(b) = o0 + qP S_in(b)
        rank 1  [run b: open   ]------+-- all-gather ---+-> S_in(c) = A_b S_in(b) + B_b -> o(c) ...
        rank 2  [run c: open   ]------'   (A, B) maps   '

    Traffic per rank: slots x heads x K x (K + V) numbers forward (scalar decay: K x V + 1), the same
    backward (the all-gather's adjoint, a reduce-scatter); independent of the sequence length. Gradients are
    exact: autograd differentiates phases 1-3 and the gather. The kernel of phase 1 is pluggable
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
from distcomm_attention.linear import _checks
from distcomm_attention.linear.exchange import all_gather_rows
from distcomm_attention.linear.kernels import select_kernel

__all__ = ["chunk_gated_delta_rule_cp", "chunk_simple_gla_cp"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``use_qk_l2norm_in_kernel``: x / sqrt(sum(x^2) + eps) over the head dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


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
    comm, given_layout = _checks.resolve_ring(sharding, layout, group)  # the same verdict on every rank
    facts = {"layout": None, "cu_seqlens": None}

    def local_checks():
        scale_ = _checks.check_recurrence(q, k, v, g, beta, scale, initial_state, delta)
        _validation.check_flag("output_final_state", output_final_state)
        _validation.check_flag("use_qk_l2norm_in_kernel", l2norm)
        field, docs, concrete = _checks.check_layout_call(op, comm, given_layout, q.shape[1], cu_seqlens)
        facts.update(layout=field, cu_seqlens=docs)
        b, _, _, dk = q.shape
        hv, dv = v.shape[2:]
        if docs is not None and b != 1:
            raise ValueError(f"with `cu_seqlens` the documents are packed in one row: B must be 1, got B={b}")
        count, per = (b, "one per batch row") if docs is None else (len(docs) - 1, "one per document of cu_seqlens")
        _checks.check_state("initial_state", initial_state, count, per, hv, dk, dv)
        run = select_kernel(kernel, q, backward=needs_grad)
        return scale_, _checks.cached_plan(concrete, q.shape[1] * comm.size, comm.size, docs, output_final_state), run

    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in tensors.values())
    checked, error = _validation.verdict(local_checks)
    _validation.verify_across_ring(op, comm, tensors, extra={
        **facts, "output_final_state": output_final_state, "use_qk_l2norm_in_kernel": l2norm,
        "scale": scale if isinstance(scale, (float, int, type(None))) else repr(scale), "kernel": kernel,
        "requires_grad": needs_grad}, error=error)
    scale, plan, run = checked
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return _Call(plan, comm, run, scale, q, k, v, g, beta, initial_state).forward(output_final_state)


class _Call:
    """One call's three phases (Note [Linear attention across ranks]) on this rank's runs."""

    def __init__(self, plan, comm, run, scale, q, k, v, g, beta, initial_state, gather=None):
        self.plan, self.comm, self.run, self.scale = plan, comm, run, scale
        # (slots, n) -> (W, slots, n); scripts/bench_linear.py passes one for simulated ranks
        self.gather = gather or (lambda table: all_gather_rows(table, comm.group, comm.size))
        self.q, self.k, self.v, self.g, self.beta, self.h0 = q, k, v, g, beta, initial_state
        self.delta = beta is not None
        self.sdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, _, _, self.dk = q.shape
        _, _, self.hv, self.dv = v.shape
        self.rows = b if len(plan.docs) == 2 else 1  # states per map: the batch rows, or the one packed row
        self.a_shape = (self.rows, self.hv, self.dk, self.dk) if self.delta else (self.rows, self.hv)
        self.b_shape = (self.rows, self.hv, self.dk, self.dv)

    def _slice(self, x, seg):
        return None if x is None else x[:, seg.local : seg.local + seg.length]

    def _doc_state(self, doc: int):
        if self.h0 is None:
            return None
        return self.h0 if len(self.plan.docs) == 2 else self.h0[doc : doc + 1]

    def _closed(self, segs):
        """Outputs and end states of the closed segments (one kernel call, the segments as its sequences)."""
        if not segs:
            return [], []
        idx = torch.cat([torch.arange(s.local, s.local + s.length) for s in segs]).to(self.q.device)
        pick = lambda x: None if x is None else x.index_select(1, idx)  # noqa: E731
        cu = None
        if len(segs) > 1:
            cu = torch.tensor([0] + [s.length for s in segs]).cumsum(0)
        h0 = None
        if self.h0 is not None:
            h0 = torch.cat([self._doc_state(s.doc) for s in segs]) if cu is not None else self._doc_state(segs[0].doc)
        o, ends = self.run(pick(self.q), pick(self.k), pick(self.v), pick(self.g), pick(self.beta), scale=self.scale,
                           initial_state=h0, cu_seqlens=cu)
        outs = list(o.split([s.length for s in segs], dim=1))
        return outs, [e.unsqueeze(0) for e in ends.unbind(0)] if cu is not None else [ends]

    def _open(self, seg):
        """(o0, the correction's factor, A, B) of an open segment (phase 1)."""
        q, k, v, g, beta = (self._slice(x, seg) for x in (self.q, self.k, self.v, self.g, self.beta))
        if self.delta:
            zeros = v.new_zeros(v.shape[:3] + (self.dk,))
            eye = torch.eye(self.dk, dtype=self.sdtype, device=v.device).expand(self.rows, self.hv, -1, -1)
            h0 = torch.cat([eye.new_zeros(self.b_shape), eye], dim=-1)
            o, state = self.run(q, k, torch.cat([v, zeros], dim=-1), g, beta, scale=self.scale, initial_state=h0)
            return o[..., : self.dv], o[..., self.dv :].to(self.sdtype), state[..., self.dv :], state[..., : self.dv]
        o, state = self.run(q, k, v, g, None, scale=self.scale, initial_state=None)
        cum = g.to(self.sdtype).cumsum(1)
        # scalar decay: o_t += scale * exp(cum_t) * q_t H_in, kept factored (q per key head, one weight per
        # token and value head) rather than expanded to every value head's K-wide factor
        return o, (q.to(self.sdtype), self.scale * cum.exp()), cum[:, -1].exp(), state

    def _corrected(self, o0, factor, h):
        """o0 plus the incoming state's contribution (phase 3): factor . H_in per token and value head."""
        if self.delta:
            correction = torch.einsum("bthk,bhkv->bthv", factor, h)
        else:
            q, weight = factor
            b, t, heads, _ = q.shape
            qh = torch.einsum("bthk,bhgkv->bthgv", q, h.reshape(h.shape[0], heads, -1, *h.shape[2:]))
            correction = qh.reshape(b, t, self.hv, self.dv) * weight[..., None]
        return (o0.to(correction.dtype) + correction).to(o0.dtype)  # one rounding of the sum

    def forward(self, finals: bool):
        plan, rank = self.plan, self.comm.rank
        mine = plan.runs[rank]
        pieces: dict[int, torch.Tensor] = {}  # local start -> outputs
        zero_a = torch.zeros(self.a_shape, dtype=self.sdtype, device=self.q.device)
        closed = [s for r in mine for s in r.segments if s.opens]
        outs, ends = self._closed(closed)
        end_of = {}
        for s, o, e in zip(closed, outs, ends):
            pieces[s.local] = o
            end_of[s.local] = (zero_a, e)
        opened = {}
        for r in mine:
            if r.is_open:
                s = r.segments[0]
                o0, factor, a, b = self._open(s)
                opened[r.order] = (s, o0, factor)
                end_of[s.local] = (a, b)
        slots = [end_of[r.segments[-1].local] for r in mine]
        if finals:
            slots += [end_of[s.local] for r in mine for s in r.segments if s.ends]
        table = torch.stack([torch.cat([a.reshape(-1), b.reshape(-1)]) for a, b in slots]) if slots else \
            zero_a.new_zeros(0, zero_a.numel() + self.rows * self.hv * self.dk * self.dv)
        table = torch.nn.functional.pad(table, (0, 0, 0, plan.slots - table.shape[0]))
        gathered = self.gather(table)
        states = self._fold(gathered, finals)
        for order, (s, o0, factor) in opened.items():
            pieces[s.local] = self._corrected(o0, factor, states[order])
        out = torch.cat([pieces[key] for key in sorted(pieces)], dim=1).to(self.q.dtype)
        if gathered.requires_grad:  # every rank joins the gather's backward (Note [Scan by gathered summaries])
            out = out + gathered.reshape(-1)[:0].sum().to(out.dtype)
        final = None
        if finals:
            final = torch.cat([self._apply(self._unpack(gathered[r, slot]), states[order])
                               for r, slot, order in plan.doc_end])
        return out, final

    def _unpack(self, row):
        na = torch.Size(self.a_shape).numel()
        return row[:na].reshape(self.a_shape), row[na:].reshape(self.b_shape)

    def _apply(self, ab, h):
        a, b = ab
        if self.delta:
            return torch.einsum("bhij,bhjv->bhiv", a, h) + b
        return a[..., None, None] * h + b

    def _fold(self, gathered, finals: bool) -> dict[int, torch.Tensor]:
        """The state entering each run (phase 2), up to the last run this rank needs."""
        plan = self.plan
        need = [r.order for r in plan.runs[self.comm.rank]] + ([o for _, _, o in plan.doc_end] if finals else [])
        last = max(need, default=-1)
        slot_of = {r.order: (r.rank, i) for rank in plan.runs for i, r in enumerate(rank)}
        h = torch.zeros(self.b_shape, dtype=self.sdtype, device=gathered.device)
        states = {}
        for order in range(last + 1):
            states[order] = h
            rank, slot = slot_of[order]
            h = self._apply(self._unpack(gathered[rank, slot]), h)
        return states
