"""Per-run kernels of the linear-attention recurrences: a chunked PyTorch implementation and fla's.

One contract, two backends (the only place that imports fla):

    kernel(q, k, v, g, beta, *, scale, initial_state, cu_seqlens) -> (o, final_state)

        q, k           (B, T, H, K)       v (B, T, HV, V), HV a multiple of H (value head i reads key head
        g              (B, T, HV)         i // (HV // H)); g: the log decay, the state is multiplied by exp(g_t)
        beta           (B, T, HV) or None None: the scalar-decay form (simple GLA / Mamba-2 SSD)
        initial_state  (N, HV, K, V)      N = B, or the number of sequences of ``cu_seqlens`` (then B = 1)
        cu_seqlens     LongTensor (N + 1,) independent sequences inside the T tokens, or None
        o              (B, T, HV, V)      final_state (N, HV, K, V), float32 (float64 for float64 inputs)

    gated delta rule    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t
    scalar decay        S_t = exp(g_t) S_{t-1} + k_t v_t^T,                                   o_t = scale S_t^T q_t

fla-core's ``chunk_gated_delta_rule`` and ``chunk_simple_gla`` keep this contract (fla's names and shapes).

Note [Chunked delta rule]
    Inside a chunk of C tokens with cumulative log decay gamma_t (Gamma_t = exp(gamma_t)), the delta rule's
    pseudo-values w_t (S_t = exp(g_t) S_{t-1} + k_t w_t^T) solve one unit lower-triangular system:

        (I + L) W = diag(beta) V - diag(beta Gamma) K S_0,   L_ti = beta_t (Gamma_t / Gamma_i) k_t.k_i  (i < t)
        O   = scale (diag(Gamma) Q S_0 + (Q K^T * D) W),     D_ti = Gamma_t / Gamma_i (i <= t), else 0
        S_C = Gamma_C S_0 + (K * Gamma_C / Gamma)^T W

    The scalar-decay form is the same with W = V. Everything is differentiable torch ops, so autograd gives
    the exact gradient; float64 inputs run in float64 (the tests' reference precision).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from distcomm_attention._device import on_device

__all__ = ["torch_chunk", "fla_chunk", "select_kernel", "KERNELS", "fla_available", "open_segments", "TorchPasses",
           "FlaPasses", "passes_of"]

KERNELS = ("auto", "torch", "fla")
CHUNK = 64


def _state_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _segment(q, k, v, g, beta, scale: float, h0, chunk: int):
    """One sequence, heads first: q, k (B, HV, T, K), v (B, HV, T, V), g, beta (B, HV, T) -> (o, S_T)."""
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:  # padded tokens carry k = v = 0 and g = 0: they leave the state as it is
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = torch.nn.functional.pad(g, (0, pad))
        beta = None if beta is None else torch.nn.functional.pad(beta, (0, pad))
    n = (t + pad) // chunk
    state = h0 if h0 is not None else q.new_zeros(b, h, dk, dv)
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    incl, strict = ones.tril(), ones.tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    outs = []
    for c in range(n):
        sl = slice(c * chunk, (c + 1) * chunk)
        qc, kc, vc, gc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl]
        gam = gc.cumsum(-1)
        decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")))
        if beta is None:
            w = vc
        else:
            bc = beta[:, :, sl]
            lower = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
            system = eye + lower
            rhs = torch.cat([bc[..., None] * vc, (bc * gam.exp())[..., None] * kc], dim=-1)
            sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            w = sol[..., :dv] - sol[..., dv:] @ state
        scores = (qc @ kc.transpose(-1, -2)) * decay
        outs.append(scale * (gam.exp()[..., None] * (qc @ state) + scores @ w))
        last = gam[..., -1:]
        state = last.exp()[..., None] * state + (kc * (last - gam).exp()[..., None]).transpose(-1, -2) @ w
    return torch.cat(outs, dim=2)[:, :, :t], state


def torch_chunk(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None, chunk: int = CHUNK):
    """The kernel contract in PyTorch (Note [Chunked delta rule]); any device, float32/float64 compute. Like
    fla's kernels, o comes back in q's dtype and the final states in float32 (float64 for float64 input)."""
    dtype, out_dtype = _state_dtype(q), q.dtype
    groups = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (q, k))
    heads_first = lambda x: x.transpose(1, 2).to(dtype)  # noqa: E731
    q, k, v, g = map(heads_first, (q, k, v, g))
    beta = None if beta is None else heads_first(beta)
    h0 = None if initial_state is None else initial_state.to(dtype)
    if cu_seqlens is None:
        o, state = _segment(q, k, v, g, beta, scale, h0, chunk)
        return o.transpose(1, 2).to(out_dtype), state
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, states = [], []
    for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = slice(a, e)
        o, state = _segment(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl],
                            None if beta is None else beta[:, :, sl], scale,
                            None if h0 is None else h0[i : i + 1], chunk)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype), torch.cat(states, dim=0)


def fla_available() -> bool:
    try:
        import fla.ops  # noqa: F401
    except ImportError:
        return False
    return True


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fla_backward_problem(device: torch.device, triton_version: str | None = None,
                         capability: tuple[int, int] | None = None, tilelang: bool | None = None,
                         delta: bool = True) -> str | None:
    """Why fla-core's gated chunk backward cannot run here, or None. fla refuses it on Hopper with Triton
    >= 3.4.0 and < 3.7.1 (wrong results in that Triton, fla issue #640); tilelang rescues the gated delta
    rule's (``delta``) but not the scalar decay's (``chunk_simple_gla``: fla's common ``chunk_bwd_dqkwg``
    has no tilelang path). Seen with fla-core 0.6.0 and Triton 3.6.0 on an H100 and an H200. The arguments
    after ``device`` default to this machine's."""
    if device.type != "cuda":
        return None
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tilelang is None:
        import importlib.util

        tilelang = importlib.util.find_spec("tilelang") is not None
    if capability[0] != 9 or not (3, 4, 0) <= _version(triton_version) < (3, 7, 1):
        return None
    if delta and not tilelang:
        return (f"fla-core's gated chunk backward refuses Triton {triton_version} on Hopper (fla issue #640: "
                f"wrong results in Triton >= 3.4.0, < 3.7.1): upgrade Triton to >= 3.7.1 or pip install tilelang")
    if not delta:
        return (f"fla-core's scalar-decay (chunk_simple_gla) backward refuses Triton {triton_version} on Hopper "
                f"(fla issue #640: wrong results in Triton >= 3.4.0, < 3.7.1; tilelang does not cover it): "
                f"upgrade Triton to >= 3.7.1")
    return None


_BOUNDS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_BOUNDS_LOCK = threading.Lock()


def _bounds(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, device) copies of the boundaries, the same tensor objects for the same boundaries: fla caches
    what it derives from them by identity (chunk indices, offsets), so a repeated call neither recomputes them
    nor copies between host and device."""
    return host_and_device(tuple(int(x) for x in cu_seqlens.tolist()), device)


def host_and_device(values: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, device) int64 copies of ``values``, the same tensor objects for the same values (a small LRU
    cache of the host tensors; the device copy is the host tensor's ``on_device`` copy: made from pinned
    memory without blocking the host, waited for by every stream that reads it, dropped with the host
    tensor)."""
    host = _cached(_BOUNDS, (values, str(device)), lambda: torch.tensor(values, dtype=torch.long))
    return host, on_device(host, device)


def _cached(cache: OrderedDict, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[key]``, made by ``make()`` on a miss; the 64 most recently used kept (threaded ranks share it)."""
    with _BOUNDS_LOCK:
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = make()
            while len(cache) > 64:
                cache.popitem(last=False)
        cache.move_to_end(key)
    return hit


_INDICES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def chunk_indices(host: torch.Tensor, device: torch.device, chunk: int = CHUNK) -> torch.Tensor:
    """fla's chunk indices of the boundaries ``host`` (a host tensor of ``_bounds``): one row (sequence, chunk
    of it) per chunk, as ``fla.ops.utils.index.prepare_chunk_indices`` makes them, but made here and put on
    ``device`` by ``on_device`` (pinned, no host wait), the same tensor for the same boundaries (fla's own is
    copied from pageable memory: the host would wait for the GPU on every new set of documents)."""
    def make() -> torch.Tensor:
        counts = (host[1:] - host[:-1] + chunk - 1).div(chunk, rounding_mode="floor")
        sequence = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        within = torch.arange(sequence.numel()) - (counts.cumsum(0) - counts)[sequence]
        return torch.stack([sequence, within], 1).to(host.dtype)

    return on_device(_cached(_INDICES, (tuple(host.tolist()), chunk), make), device)


def fla_chunk(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None):
    """The kernel contract by fla-core's Triton kernels (CUDA tensors). Scalar decay with HV > H expands the
    key heads first (fla's ``chunk_simple_gla`` takes as many key heads as value heads)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        raise ImportError("kernel='fla' needs flash-linear-attention: pip install fla-core") from e
    h0 = None if initial_state is None else initial_state.float()
    host, cu = (None, None) if cu_seqlens is None else _bounds(cu_seqlens, q.device)
    if beta is None:
        groups = v.shape[2] // q.shape[2]
        q, k = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (q, k))
        o, state = chunk_simple_gla(q, k, v, g=g, scale=scale, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu, cu_seqlens_cpu=host)
    else:
        indices = None if cu is None else chunk_indices(host, q.device)  # (fla's scalar-decay call takes none)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, cu_seqlens_cpu=host, chunk_indices=indices)
    return o, state


def select_kernel(kernel: str, q: torch.Tensor, backward: bool = False, delta: bool = True) -> Callable:
    """The kernel for a call: "torch", "fla" (ImportError / ValueError saying why it cannot run), or "auto":
    fla for CUDA tensors of 16/32 bits when it is installed and, for a call that will be differentiated
    (``backward``), its backward runs here (``fla_backward_problem``), else torch."""
    if kernel not in KERNELS:
        raise ValueError(f"Invalid kernel {kernel!r}. Must be one of: {', '.join(map(repr, KERNELS))}")
    if kernel == "torch":
        return torch_chunk
    usable = q.is_cuda and q.dtype != torch.float64
    if kernel == "fla":
        if not usable:
            raise ValueError(f"kernel='fla' runs on CUDA tensors of 16 or 32 bits, got {q.dtype} on {q.device}")
        if not fla_available():
            raise ImportError("kernel='fla' needs flash-linear-attention: pip install fla-core")
        problem = fla_backward_problem(q.device, delta=delta) if backward else None
        if problem is not None:
            raise ValueError(f"kernel='fla' with gradients: {problem}; or kernel='torch'")
        return fla_chunk
    if usable and fla_available() and not (backward and fla_backward_problem(q.device, delta=delta)):
        return fla_chunk
    return torch_chunk


# ---------------------------------------------------------------------------------------------------------
# The delta rule's open segments in two passes
# ---------------------------------------------------------------------------------------------------------

# Note [Open segments in two passes]
#     A segment that continues a document from an earlier rank needs the state entering it, S_in, known only
#     after the ranks' maps are gathered. The delta rule runs such segments in two passes:
#
#         summary  the map S_out = A S_in + B by the state pass alone, no outputs: B from a zero state with
#                  the chunks' pseudo-values u, A from I with zero values (the extended state [0 | I] with
#                  values [u | 0])
#         output   after the fold: the ordinary forward from S_in (state pass and outputs)
#
#     so the outputs are the kernel's own from the true incoming state, at the price of one wide state pass
#     instead of a wide output pass and a correction. Backward, in the order autograd reaches them:
#
#         output   dS_in = (d o / d S_in)^T do alone (the reverse state pass with no end-state gradient);
#                  no input gradients yet
#         summary  after the gathered maps' backward: every use of (A, B) on every rank is A S_in + B for the
#                  segment's own S_in (the fold and the final states), so dA = dB S_in^T and the gradient
#                  reaching q, k, v, g, beta through (A, B) is the kernel's backward with the end-state
#                  gradient dB; one backward with (do, dB) from S_in gives every input gradient
#
#     The pass objects below give these four operations over one call's sequences; ``TorchPasses`` by the
#     chunked PyTorch kernel (any device, float64: the reference the tests check the autograd wiring with),
#     ``FlaPasses`` by fla-core's chunk kernels, except for one state-only Triton pass of its own
#     (maps_kernel.py; K <= 128): the summary's A and B columns in one launch that stores the end state
#     alone (fla's state pass, run twice, also writes every chunk's state). dS_in is fla's reverse state pass
#     without an end-state gradient, on the values' local gradient (made first: the input gradients read it
#     again), while the chunk states' recompute runs beside it on a side stream. A fused state-only reverse
#     pass of its own measured no faster there (docs/hybrid.md, 2026-11-27).


class TorchPasses:
    """The four operations of Note [Open segments in two passes] by ``torch_chunk`` (and autograd for the
    backward ones). Tensors as the kernel contract; ``cu_seqlens`` the call's sequences."""

    def __init__(self, q, k, v, g, beta, scale: float, cu_seqlens=None):
        self.x = [t.detach() for t in (q, k, v, g, beta)]
        self.scale, self.cu = scale, cu_seqlens
        self.count = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1

    # the tensors the passes keep, handed to autograd's saved tensors between the forward and the backward
    def saved(self):
        return list(self.x)

    def restore(self, tensors):
        self.x = list(tensors)

    def release(self):
        self.x = None

    def summary(self):
        q, k, v, g, beta = self.x
        dk, dv = k.shape[-1], v.shape[-1]
        sdtype = _state_dtype(q)
        eye = torch.eye(dk, dtype=sdtype, device=q.device).expand(self.count, v.shape[2], dk, dk)
        h0 = torch.cat([eye.new_zeros(eye.shape[:-1] + (dv,)), eye], dim=-1)
        wide = torch.cat([v, v.new_zeros(v.shape[:3] + (dk,))], dim=-1)
        _, end = torch_chunk(q, k, wide, g, beta, scale=self.scale, initial_state=h0, cu_seqlens=self.cu)
        return end[..., dv:], end[..., :dv]

    def output(self, h_in):
        return torch_chunk(*self.x, scale=self.scale, initial_state=h_in, cu_seqlens=self.cu)[0]

    def state_grad(self, h_in, do, then_inputs: bool = True):
        with torch.enable_grad():
            h = h_in.detach().requires_grad_()
            o, _ = torch_chunk(*self.x, scale=self.scale, initial_state=h, cu_seqlens=self.cu)
            return torch.autograd.grad(o, h, do)[0]

    def input_grads(self, h_in, do, dht):
        with torch.enable_grad():
            x = [t.detach().requires_grad_() for t in self.x]
            o, end = torch_chunk(*x, scale=self.scale, initial_state=h_in, cu_seqlens=self.cu)
            return torch.autograd.grad((o, end), x, (do, dht))


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the open segments' backward (FlaPasses._before_dht)."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class FlaPasses:
    """The four operations of Note [Open segments in two passes] by fla-core's gated-delta-rule chunk kernels
    (its forward and backward, split where the passes need): CUDA tensors of 16/32 bits."""

    CHUNK = 64

    def __init__(self, q, k, v, g, beta, scale: float, cu_seqlens=None):
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        self.q, self.k, self.v, self.beta = (t.detach().contiguous() for t in (q, k, v, beta))
        self.scale = scale
        self.host, self.cu = (None, None) if cu_seqlens is None else _bounds(cu_seqlens, q.device)
        self.indices = None if self.cu is None else chunk_indices(self.host, q.device, self.CHUNK)
        self.count = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        common = dict(cu_seqlens=self.cu, chunk_indices=self.indices)
        self.device = torch.cuda.device(q.device)
        with self.device:
            # fla's own forward, in order: the gates' chunk-local cumulative sum (log2 units), then the WY
            # representation (w, u) and the solved intra-chunk matrix it keeps for the backward
            self.g = chunk_local_cumsum(g.detach().contiguous(), chunk_size=self.CHUNK, scale=RCP_LN2, **common)
            self.w, self.u, self.solved = chunk_gated_delta_rule_fwd_intra(
                k=self.k, v=self.v, g=self.g, beta=self.beta, chunk_size=self.CHUNK, **common)
        self.common = common
        self.pending = None  # the backward's parts that need no end-state gradient (state_grad, then input_grads)

    def saved(self):
        return [self.q, self.k, self.v, self.beta, self.g, self.solved]

    def restore(self, tensors):
        self.q, self.k, self.v, self.beta, self.g, self.solved = tensors
        self.w = self.u = None

    def release(self):
        self.q = self.k = self.v = self.beta = self.g = self.solved = self.w = self.u = None

    def _w_u(self):
        if self.w is None:  # dropped after the output pass; the backward recomputes them, as fla's does
            from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

            return recompute_w_u_fwd(k=self.k, v=self.v, beta=self.beta, A=self.solved, g=self.g, **self.common)
        return self.w, self.u

    def summary(self):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

        from distcomm_attention.linear import maps_kernel

        dk, heads = self.k.shape[-1], self.v.shape[2]
        if dk <= maps_kernel.MAX_K:  # both maps in one state-only pass (maps_kernel.py)
            with self.device:
                return maps_kernel.delta_maps(self.k, self.w, self.u, self.g, self.cu)
        eye = torch.eye(dk, dtype=torch.float32, device=self.k.device).expand(self.count, heads, dk, dk)
        # [A | B] in two state passes, B from a zero state, A from I with zero values: as fast as one pass of
        # width V + K, without the wide values' copy
        with self.device:
            ends = [chunk_gated_delta_rule_fwd_h(k=self.k, w=self.w, u=u, g=self.g, initial_state=h0,
                                                 output_final_state=True, save_new_value=False,
                                                 chunk_size=self.CHUNK, **self.common)[2]
                    for u, h0 in ((self.u.new_zeros(self.u.shape[:3] + (dk,)), eye.contiguous()), (self.u, None))]
        return ends[0], ends[1]

    def output(self, h_in):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o

        with self.device:
            h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=self.k, w=self.w, u=self.u, g=self.g,
                                                       initial_state=h_in.float().contiguous(),
                                                       output_final_state=False, chunk_size=self.CHUNK, **self.common)
            o = chunk_fwd_o(q=self.q, k=self.k, v=v_new, h=h, g=self.g, scale=self.scale, chunk_size=self.CHUNK,
                            **self.common)
        return o.to(self.q.dtype)

    def _before_dht(self, h_in, do, side: bool):
        """fla's backward up to its reverse state pass, the parts that need no end-state gradient: w and u
        recomputed, the values' local gradient (on the current stream: dS_in's pass reads it too), the chunk
        states from S_in and their new values. ``side``: that state pass on a side stream (it overlaps what the
        caller runs next, dS_in's reverse pass); the current stream waits for it when input_grads uses it.
        Returns (w, the local gradient)."""
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dv_local

        w, u = self._w_u()
        offsets = None
        if self.cu is not None:  # fla's cached chunk offsets made here, on the main stream, not on the side one
            from fla.ops.utils.index import prepare_chunk_offsets

            offsets = prepare_chunk_offsets(self.cu, self.CHUNK)
        dv = chunk_bwd_dv_local(q=self.q, k=self.k, do=do, g=self.g, scale=self.scale, chunk_size=self.CHUNK,
                                **self.common)
        main = torch.cuda.current_stream()
        stream = _side_stream(self.q.device) if side else main
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=self.k, w=w, u=u, g=self.g,
                                                       initial_state=h_in.float().contiguous(),
                                                       output_final_state=False, chunk_size=self.CHUNK, **self.common)
        if side:  # the allocator's stream bookkeeping: read on the side stream, or made there and read here
            for t in (w, u, h_in, self.k, self.g, self.cu, self.indices, offsets):
                if t is not None:
                    t.record_stream(stream)
            for t in (h, v_new):
                t.record_stream(main)
        self.pending = (w, h, v_new, dv, stream)
        return w, dv

    def state_grad(self, h_in, do, then_inputs: bool = True):
        """dS_in; ``then_inputs``: input_grads follows (its first parts run here, the chunk states' recompute
        beside the reverse pass), else only what the reverse pass reads."""
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.chunk_o import chunk_bwd_dv_local

        with self.device:
            do = do.contiguous()
            if then_inputs:
                w, dv = self._before_dht(h_in, do, side=True)
            else:
                w, dv = self._w_u()[0], chunk_bwd_dv_local(q=self.q, k=self.k, do=do, g=self.g, scale=self.scale,
                                                           chunk_size=self.CHUNK, **self.common)
            _, dh0, _ = chunk_gated_delta_rule_bwd_dhu(q=self.q, k=self.k, w=w, do=do, dv=dv, g=self.g,
                                                       h0=h_in.float().contiguous(), dht=None, scale=self.scale,
                                                       chunk_size=self.CHUNK, **self.common)
        return dh0

    def input_grads(self, h_in, do, dht):
        """fla's ``chunk_gated_delta_rule_bwd`` from its reverse state pass on, the parts before it taken from
        state_grad where it ran (fla-core 0.6.0's sequence of kernels)."""
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum

        with self.device:
            do = do.contiguous()
            if self.pending is None:
                self._before_dht(h_in, do, side=False)
            w, h, v_new, dv, stream = self.pending
            self.pending = None
            here = torch.cuda.current_stream()
            here.wait_stream(stream)
            if stream != here:
                for t in (h, v_new, dv):
                    t.record_stream(here)
            dh, _, dv = chunk_gated_delta_rule_bwd_dhu(q=self.q, k=self.k, w=w, do=do, dv=dv, g=self.g,
                                                       h0=h_in.float().contiguous(), dht=dht.float().contiguous(),
                                                       scale=self.scale, chunk_size=self.CHUNK, **self.common)
            dq, dk, dw, dg = chunk_bwd_dqkwg(q=self.q, k=self.k, v=v_new, w=w, g=self.g, h=h, dv=dv, do=do, dh=dh,
                                             scale=self.scale, chunk_size=self.CHUNK, **self.common)
            dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=self.k, v=self.v, beta=self.beta, g=self.g, A=self.solved,
                                                   dw=dw, du=dv, **self.common)
            dk.add_(dk2)
            dg.add_(dg2)
            dg = chunk_local_cumsum(dg, chunk_size=self.CHUNK, reverse=True, **self.common)
        return dq, dk, dv, dg, db


class _Summary(torch.autograd.Function):
    """(q, k, v, g, beta) -> (A, B), its backward the whole segment's (Note [Open segments in two passes])."""

    @staticmethod
    def forward(ctx, passes, q, k, v, g, beta):
        ctx.passes, ctx.shapes = passes, [(t.shape, t.dtype) for t in (q, k, v, g, beta)]
        ctx.save_for_backward(*passes.saved())
        return passes.summary()

    @staticmethod
    @once_differentiable
    def backward(ctx, da, db):
        p = ctx.passes
        if p.h_in is None:
            raise RuntimeError("an open segment's maps were differentiated without its outputs' pass: call finish "
                               "(open_segments) before the backward")
        p.restore(ctx.saved_tensors)
        do = p.do if p.task == torch._C._current_graph_task_id() else None
        if do is None:  # this backward did not reach the outputs (or an earlier one left its gradient): none
            p.pending = None
            do = torch.zeros(p.o_shape, dtype=p.o_dtype, device=p.h_in.device)
        grads = p.input_grads(p.h_in, do, db)
        p.do = p.task = None  # this backward's; a later one (retain_graph) brings its own
        p.release()
        return (None, *(gr.to(dtype).reshape(shape) if gr is not None else None
                        for gr, (shape, dtype) in zip(grads, ctx.shapes)))


class _Output(torch.autograd.Function):
    """(A, S_in) -> o from S_in; backward: dS_in alone, the input gradients follow in _Summary's. ``A`` is an
    input only so that o requires grad whenever the segment's inputs do, and autograd reaches this backward
    before the summary's."""

    @staticmethod
    def forward(ctx, passes, a, h_in):
        if passes.h_in is not None:
            raise RuntimeError("an open segment's outputs are computed once per open_segments call (finish)")
        ctx.passes = passes
        # whether the maps' node is in the graph (its inputs take gradients, the maps were not made under
        # no_grad): only then does its backward follow this one's
        passes.inputs_need_grad = ctx.needs_input_grad[1]
        passes.h_in = h_in.detach()
        o = passes.output(passes.h_in)
        if o._base is not None:  # a tensor of its own: a view made here could not be changed in place later
            o = o.clone()
        passes.o_shape, passes.o_dtype = o.shape, o.dtype
        ctx.save_for_backward(*passes.saved(), h_in)
        passes.release()  # the tensors live on in the two nodes' saved tensors (checkpointing, offloading)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        p = ctx.passes
        # what an earlier backward that reached the outputs but not the maps left (autograd.grad or
        # backward(inputs=...) leaving q, k, v, g, beta out) is dropped: each backward reads its own
        p.do = p.task = p.pending = None
        *tensors, h_in = ctx.saved_tensors
        p.restore(tensors)
        # contiguous once for both backward passes (autograd's gradient of a sum is an expanded tensor)
        h_in, do = h_in.detach(), do.contiguous()
        if p.inputs_need_grad:  # the summary's backward may follow in this backward and read them
            p.h_in, p.do, p.task = h_in, do, torch._C._current_graph_task_id()
        dh_in = p.state_grad(h_in, do, then_inputs=p.inputs_need_grad) if ctx.needs_input_grad[2] else None
        p.release()
        return None, None, dh_in


def passes_of(run: Callable) -> type | None:
    """The two-pass operations that go with a kernel (Note [Open segments in two passes])."""
    return {torch_chunk: TorchPasses, fla_chunk: FlaPasses}.get(run)


def open_segments(passes: type, q, k, v, g, beta, *, scale: float, cu_seqlens=None):
    """The delta rule's open segments of one call: (A, B, finish), A (N, HV, K, K) and B (N, HV, K, V) the
    maps (float32; float64 for float64 inputs), ``finish(h_in)`` the outputs (B, T, HV, V) from the incoming
    states h_in (N, HV, K, V), to be called once, after the fold. Differentiable end to end."""
    p = passes(q, k, v, g, beta, scale, cu_seqlens)
    p.h_in = p.do = p.task = None
    a, b = _Summary.apply(p, q, k, v, g, beta)
    return a, b, lambda h_in: _Output.apply(p, a, h_in)
