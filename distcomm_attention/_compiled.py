"""``ring_flash_attn`` and ``context_parallel_attn`` under ``torch.compile``: each call as two custom ops.

Note [Compiled ring attention]
    Dynamo cannot trace the ring itself: its plan is computed on the host from the call's options (and
    from ``cu_seqlens``' values), and its point-to-point transfers have no functional form. So inside a
    compiled region ``ring_flash_attn`` checks what can be checked while tracing (types, shapes, options)
    and then calls one opaque operator:

        distcomm_attention::ring_attn(q, k, v, key_mask?, cu_seqlens?, group, ...) -> (out, lse)
        distcomm_attention::ring_attn_backward(dout, q, k, v, out, lse, ...)      -> (dq, dk, dv)

    joined by ``torch.library.register_autograd``, each with a fake (meta) implementation, so a model
    compiles whole (``fullgraph=True``) and compiled autograd sees an ordinary custom op. At run time the
    operators do exactly what the eager path does (``prepare.prepare``: per-rank checks, cross-rank
    verification, plan and sparse schedule, kernel choice; then ``ring.ring_forward`` / ``ring_backward``, or
    the sparse ring's loops where the eager path runs it: ``sparse_ring.run_ring``'s rule, Note [Sparse ring]).
    The sparse ring's backward sends the rows again (eager may keep the forward's: the same values). The process group
    travels as its name (``ProcessGroup.group_name``, "" for the default group), resolved at run time the
    way PyTorch's functional collectives resolve theirs. A layout left out travels as "" and is resolved from
    the layout record when the operators run (Note [Layout record] in sharding.py), in the forward and again
    in the backward: shard the inputs before the forward, as the eager path needs too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distcomm_attention import _validation
from distcomm_attention.planning import layouts
from distcomm_attention.strategies.prepare import prepare, ring_comm
from distcomm_attention.strategies.ring import _no_autocast, ring_backward, ring_forward
from distcomm_attention.strategies.sparse_ring import (_transport, ring_planner, sparse_ring_backward,
                                                       sparse_ring_forward)

__all__ = ["compiled_ring_flash_attn", "compiled_context_parallel_attn"]


def _group_name(group) -> str:
    """The name of the group (or of a 1-D DeviceMesh / (mesh, dim)'s group) that travels in the graph."""
    if group is None:
        return ""
    if isinstance(group, tuple):
        if len(group) != 2 or not hasattr(group[0], "get_group"):
            raise TypeError(f"`group` as a tuple must be (DeviceMesh, dim_name or index), got {group!r}")
        mesh, dim = group
        return mesh.get_group(dim).group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh with {group.ndim} dims needs a dim: pass group=(mesh, dim_name) with dim_name one "
                f"of {group.mesh_dim_names}"
            )
        return group.get_group().group_name
    raise TypeError(f"`group` must be a ProcessGroup, a DeviceMesh or (mesh, dim_name), got {type(group).__name__}")


def _resolve_group(name: str):
    if not name:
        return None
    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    if resolve is None:  # pragma: no cover - every supported torch has it (functional collectives use it)
        raise RuntimeError("this torch cannot resolve process groups by name inside compiled graphs")
    return resolve(name)


def _error_of(text: str) -> BaseException | None:
    """The input error a traced call found (``"TypeName: message"``, "" for none), to be raised by every rank
    after the run-time exchange (Note [Collective verdicts] in _validation.py)."""
    if not text:
        return None
    name, _, message = text.partition(": ")
    kinds = {t.__name__: t for t in _validation._ERRORS if t is not None}
    return kinds.get(name, RuntimeError)(message)


def _error_text(error: BaseException | None) -> str:
    """``"TypeName: message"`` (built from the error's arguments: a constant while tracing)."""
    if error is None:
        return ""
    message = error.args[0] if error.args and isinstance(error.args[0], str) else repr(error.args)
    return type(error).__name__ + ": " + message


def _prepared(q, k, v, key_mask, cu_seqlens, group_name, ring_size, layout, causal, window_left, window_right,
              softcap, scale, backend, error, requires_grad):
    comm, ring_error = ring_comm(_resolve_group(group_name), ring_size or None)
    prepared = prepare(  # layout "": left out, resolved for the ring here at run time (Note [Layout record])
        q, k, v, comm, layout=layout or None, causal=causal, softmax_scale=scale, window=(window_left, window_right),
        softcap=softcap, attention_mask=key_mask, cu_seqlens=cu_seqlens, backend=backend,
        requires_grad=requires_grad, error=_error_of(error) or ring_error, planner=ring_planner(comm, q),
    )
    return comm, prepared  # prepared.plan: (ring plan, sparse schedule or None), as the eager ring's


@torch.library.custom_op("distcomm_attention::ring_attn", mutates_args=())
def _ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, group_name: str, ring_size: int, layout: str, causal: bool,
    window_left: int, window_right: int, softcap: float, scale: float, backend: str, error: str,
    requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring; returns out (B, n, H, D) and lse (B, H, n)."""
    with _no_autocast(q.device):
        comm, p = _prepared(q, k, v, key_mask, cu_seqlens, group_name, ring_size, layout, causal, window_left,
                            window_right, softcap, scale, backend, error, requires_grad)
        plan, sparse = p.plan
        if sparse is None:
            out, lse = ring_forward(q, k, v, key_mask, comm, plan, softcap, p.scale, p.fwd)
        else:
            out, lse, _ = sparse_ring_forward(q, k.contiguous(), v.contiguous(), key_mask, _transport(comm), sparse,
                                              softcap, p.scale, p.fwd)
    # the fake implementation promises contiguous outputs
    return out.contiguous(), lse.to(_lse_dtype(q)).contiguous()


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@_ring_attn.register_fake
def _ring_attn_fake(q, k, v, key_mask, cu_seqlens, group_name, ring_size, layout, causal, window_left,
                    window_right, softcap, scale, backend, error, requires_grad):
    b, n, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=_lse_dtype(q))


@torch.library.custom_op("distcomm_attention::ring_attn_backward", mutates_args=())
def _ring_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    key_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, group_name: str, ring_size: int,
    layout: str, causal: bool, window_left: int, window_right: int, softcap: float, scale: float, backend: str,
    error: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward ring; returns dq, dk, dv."""
    with _no_autocast(q.device):
        comm, p = _prepared(q, k, v, key_mask, cu_seqlens, group_name, ring_size, layout, causal, window_left,
                            window_right, softcap, scale, backend, error, True)
        plan, sparse = p.plan
        if sparse is None:
            grads = ring_backward(dout, q, k, v, out, lse, key_mask, comm, plan, softcap, p.scale, p.bwd)
        else:
            grads = sparse_ring_backward(dout, q, k.contiguous(), v.contiguous(), out, lse, key_mask, _transport(comm),
                                         sparse, None, softcap, p.scale, p.bwd)
    return _apart(tuple(g.contiguous() for g in grads))  # as the fake implementation promises


def _apart(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` with any that shares storage with an earlier one copied: a custom op's outputs may not alias
    one another (the sparse ring's dK and dV may be views of one buffer)."""
    out, seen = [], set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return tuple(out)


@_ring_attn_backward.register_fake
def _ring_attn_backward_fake(dout, q, k, v, out, lse, key_mask, cu_seqlens, group_name, ring_size, layout, causal,
                             window_left, window_right, softcap, scale, backend, error):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask, cu_seqlens, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask, cu_seqlens)
    ctx.options = options[:-1]  # everything but requires_grad


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_mask, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _ring_attn_backward(dout.contiguous(), q, k, v, out, lse, key_mask, cu_seqlens, *ctx.options)
    return (dq, dk, dv) + (None,) * 13


_ring_attn.register_autograd(_backward, setup_context=_setup_context)


def _traced_checks(q, k, v, attention_mask, softmax_scale, cu_seqlens):
    """What can be checked while tracing; -> (scale, cu_seqlens as a tensor or None, requires_grad)."""
    _validation.check_qkv(q, k, v)
    _validation.check_attention_mask(attention_mask, q)
    scale = _validation.check_scale(softmax_scale, q.shape[3])
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    return scale, cu_seqlens, torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def _checked(q, k, v, attention_mask, softmax_scale, cu_seqlens, error, ring_size=None):
    """The traced checks' results, with stand-ins after an input error (this rank's, or the caller's), whose
    text then travels into the operator: every rank raises it after the run-time exchange, so that no rank
    stops while tracing while its peers wait in their operator's exchange."""
    def checks():
        if ring_size is not None:
            layouts.check_position(ring_size, 0)
        return _traced_checks(q, k, v, attention_mask, softmax_scale, cu_seqlens)

    checked, traced = _validation.verdict(checks)
    error = error or traced
    if error is None:
        return checked + (attention_mask, cu_seqlens, "")
    for name, t in (("q", q), ("k", k), ("v", v)):  # a graph needs tensors: this one is raised here, alone
        _validation.check_is_tensor(name, t)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    return 1.0, None, False, mask, None, _error_text(error)


def compiled_ring_flash_attn(q, k, v, *, group, ring_size, layout, causal, softmax_scale, window, softcap,
                             attention_mask, cu_seqlens, backend, error=None) -> torch.Tensor:
    """``ring_flash_attn`` inside a compiled region (options already type-checked by the caller; ``error``:
    what that check found)."""
    scale, docs, requires_grad, mask, _, text = _checked(q, k, v, attention_mask, softmax_scale, cu_seqlens, error,
                                                         ring_size)
    docs = docs if not text else None
    out, _lse = _ring_attn(
        q, k, v, mask, docs, _group_name(group), ring_size or 0, layout or "", causal, window[0], window[1],
        softcap, scale, backend, text, requires_grad,
    )
    return out


# ---------------------------------------------------------------------------------------------------------
# The other strategies (Note [Compiled strategies])
# ---------------------------------------------------------------------------------------------------------
#
# Note [Compiled strategies]
#     "ulysses" and "allgather" compile as one opaque operator each way, like the ring:
#
#         distcomm_attention::cp_attn(q, k, v, key_mask?, cu_seqlens?, group, strategy, ...) -> out
#         distcomm_attention::cp_attn_backward(dout, q, k, v, ...)                           -> (dq, dk, dv)
#
#     At run time the forward runs the eager strategy (validation, cross-rank verification, plan, kernels)
#     without autograd; the backward runs it again with autograd and differentiates it, so only q, k, v are
#     saved. That recomputes one forward (about 1 / 3.5 of a forward + backward) where the eager path and
#     the compiled ring do not. The hybrids take a 2-D mesh, which cannot travel in a graph: they run eagerly.


def _run_strategy(q, k, v, key_mask, cu_seqlens, group_name, strategy, layout, causal, window_left, window_right,
                  softcap, scale, backend, error, requires_grad):
    from distcomm_attention.strategies import dispatch as strategies

    return strategies.run(q, k, v, strategy=strategy, group=_resolve_group(group_name), layout=layout or None,
                          causal=causal, softmax_scale=scale, window=(window_left, window_right), softcap=softcap,
                          attention_mask=key_mask, cu_seqlens=cu_seqlens, backend=backend,
                          requires_grad=requires_grad, error=_error_of(error))


@torch.library.custom_op("distcomm_attention::cp_attn", mutates_args=())
def _cp_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, group_name: str, strategy: str, layout: str, causal: bool,
    window_left: int, window_right: int, softcap: float, scale: float, backend: str, error: str,
    requires_grad: bool,
) -> torch.Tensor:
    """The forward of ``strategy`` (Note [Compiled strategies]); returns out (B, n, H, D)."""
    with torch.no_grad():
        out = _run_strategy(q, k, v, key_mask, cu_seqlens, group_name, strategy, layout, causal, window_left,
                            window_right, softcap, scale, backend, error, requires_grad)
    return out.contiguous()


@_cp_attn.register_fake
def _cp_attn_fake(q, k, v, key_mask, cu_seqlens, group_name, strategy, layout, causal, window_left, window_right,
                  softcap, scale, backend, error, requires_grad):
    return torch.empty_like(q)


@torch.library.custom_op("distcomm_attention::cp_attn_backward", mutates_args=())
def _cp_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, group_name: str, strategy: str, layout: str, causal: bool,
    window_left: int, window_right: int, softcap: float, scale: float, backend: str, error: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``strategy``: its forward recomputed with autograd, then differentiated."""
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = _run_strategy(qg, kg, vg, key_mask, cu_seqlens, group_name, strategy, layout, causal, window_left,
                            window_right, softcap, scale, backend, error, True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    return tuple(g.contiguous() for g in grads)


@_cp_attn_backward.register_fake
def _cp_attn_backward_fake(dout, q, k, v, key_mask, cu_seqlens, group_name, strategy, layout, causal, window_left,
                           window_right, softcap, scale, backend, error):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _cp_setup_context(ctx, inputs, output):
    q, k, v, key_mask, cu_seqlens, *options = inputs
    ctx.save_for_backward(q, k, v, key_mask, cu_seqlens)
    ctx.options = options[:-1]  # everything but requires_grad


def _cp_backward(ctx, dout):
    q, k, v, key_mask, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _cp_attn_backward(dout.contiguous(), q, k, v, key_mask, cu_seqlens, *ctx.options)
    return (dq, dk, dv) + (None,) * 13


_cp_attn.register_autograd(_cp_backward, setup_context=_cp_setup_context)


def compiled_context_parallel_attn(q, k, v, *, strategy, group, layout, causal, softmax_scale, window, softcap,
                                   attention_mask, cu_seqlens, backend, error=None) -> torch.Tensor:
    """``context_parallel_attn`` with strategy "ulysses" or "allgather" inside a compiled region (``error``: what
    the caller's argument check found; raised by every rank at run time)."""
    scale, docs, requires_grad, mask, _, text = _checked(q, k, v, attention_mask, softmax_scale, cu_seqlens, error)
    return _cp_attn(q, k, v, mask, docs, _group_name(group), strategy if not text else "ring", layout or "", causal,
                    window[0], window[1], softcap, scale, backend, text, requires_grad)
