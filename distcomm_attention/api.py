"""Public entry points of the attention: ``ring_flash_attn``, ``context_parallel_attn``, ``which_kernels`` and
``which_strategy``."""

from __future__ import annotations

import torch

from distcomm_attention import _validation
from distcomm_attention.kernels import dispatch
from distcomm_attention.planning import layouts
from distcomm_attention.planning.cost import Hardware, check_hardware
from distcomm_attention.kernels.dispatch import KernelChoice
from distcomm_attention.strategies import dispatch as strategies
from distcomm_attention.strategies.sparse_ring import ring_planner, run_ring
from distcomm_attention.strategies.prepare import prepare, ring_comm
from distcomm_attention.planning.visibility import Visibility
from distcomm_attention.sharding import Sharding, fallback_group, merge_sharding

__all__ = ["ring_flash_attn", "context_parallel_attn", "which_kernels", "which_strategy"]


def _check_arguments(q, k, v, *, causal, layout, group, ring_size, sharding, backend, window_size, softcap,
                     strategy="ring", hardware=None):
    """The entry points' argument checks: (layout, group, ring_size, window, softcap) or an input error."""
    if strategy != "ring":
        strategies.check_strategy(strategy)
    check_hardware(hardware)
    layout, group, ring_size = merge_sharding(sharding, layout, group, ring_size)
    if strategy != "ring" and ring_size is not None:
        raise ValueError(
            f"context_parallel_attn runs over the whole group: a `sharding` with ring_size={ring_size} is for "
            f"ring_flash_attn (independent rings inside the group)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validation.check_is_tensor(name, t)
    _validation.check_flag("causal", causal)
    if layout is not None:  # None: resolved for the ring in prepare (Note [Layout record])
        layouts.check_layout(layout)
    dispatch.check_backend(backend)
    return layout, group, ring_size, _validation.check_window(window_size), _validation.check_softcap(softcap)


def ring_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str | None = None,
    ring_size: int | None = None,
    group=None,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    sharding: Sharding | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across a ring of ranks (ring flash attention).

    Each rank passes its shard of the global sequence; key/value blocks travel around the ring while every
    rank attends its queries to the block it holds, so memory stays O(local sequence). The running max,
    sum and output accumulator stay in fp32 across all ring steps (no per-hop rounding), fully masked
    causal blocks are skipped, and the transfer of the next block is posted before the current block is
    computed, so communication overlaps compute.

    Args:
        q: (batch, local_seq, heads, head_dim), this rank's queries.
        k: (batch, local_seq, kv_heads, head_dim), heads % kv_heads == 0 (kv_heads < heads: GQA/MQA; query
            head h uses kv head h // (heads // kv_heads)). Communication stays at kv_heads size.
        v: like k.
        causal: mask over GLOBAL token positions: key j is visible to query i iff j <= i::

                global pos  0 1 2 3
                query 0     x . . .
                query 1     x x . .
                query 2     x x x .
                query 3     x x x x

        softmax_scale: multiplies q k^T; ``None`` means head_dim ** -0.5.
        layout: which global tokens this rank holds (W = ring size, r = position in the ring):
            "contiguous": tokens [r*n, (r+1)*n) (n = local_seq);
            "zigzag": the sequence cut into 2W equal chunks, rank r holds chunk r then chunk 2W-1-r
                (local_seq must be even; balanced causal work);
            "striped": token t on rank t mod W, in increasing t (balanced causal work).
            ``shard_sequence`` produces these shards. ``None`` (default): ``sharding``'s layout if given, else
            the layout ``shard_sequence`` recorded for this ring in this process, else "contiguous" (Note
            [Layout record] in sharding.py: several recorded layouts are an error on every rank, and the
            resolved layout is verified across the ring). A layout passed here is never overridden.
        ring_size: ranks per ring. ``None``: the whole group. Smaller (dividing the group size): independent
            rings of consecutive group ranks, each carrying its own sequence (sequence parallel inside a
            ring, batch parallel across rings).
        group: process group of the ring(s), or a 1-D DeviceMesh / ``(mesh, dim_name)`` (``None``: the
            default group; without an initialised process group, ordinary single-process attention).
        backend: "auto" (CPU and CUDA fp32/fp64 -> "torch"; CUDA fp16/bf16 -> the fastest backend that can
            do the call, see ``which_kernels``), "torch" (exact PyTorch math in fp32 / fp64, any device,
            every feature), "triton" (our Triton forward and backward, CUDA fp16/bf16, every feature; on CPU
            only under TRITON_INTERPRET=1), "fa4" (flash-attn-4 block kernels, Hopper/Blackwell, every
            feature but ``attention_mask``: windows and packed documents as FA4 window / varlen calls,
            softcap, GQA; ``pip install "distcomm[fa4]"``), "cudnn" (PyTorch's cuDNN attention
            ops, plain full/causal), "flash2" (Triton forward + PyTorch's FlashAttention-2 backward, plain
            full/causal) or "flash_attn" (like "flash2" with the flash-attn package's backward).
        attention_mask: optional bool (batch, local_seq), this rank's shard of the KEY padding mask, True =
            attend (the Hugging Face convention; shard it with ``shard_sequence`` like any tensor). It
            travels around the ring with its keys.
        window_size: (left, right): key j is visible to query i iff i - left <= j <= i + right (global
            positions; -1 = unbounded on that side; with ``causal`` the right side is 0). Blocks wholly
            outside the window are skipped, and ring steps that no rank needs are not communicated.
        softcap: if > 0, scores = softcap * tanh(scores / softcap) after scaling (Gemma 2); 0 = off.
        cu_seqlens: optional int (num_docs + 1,) GLOBAL document boundaries of the packed sequence
            (flash-attn's varlen convention: 0, ..., global length; the same on every rank; applies to every
            batch row). Attention never crosses a boundary; documents may have any lengths (one token, or
            spanning several ranks) with every layout. Pass a CPU tensor or a list: a CUDA tensor is read
            back to the host once per call (one sync: the GPU's queue drains and the call's host work is
            no longer hidden behind the GPU's; docs/bench/real.md measures it). ``cu_seqlens_from_position_ids``
            builds it from position ids that restart at 0 for each document.
        sharding: a :class:`Sharding` (layout, group and ring size in one handle: the explicit way to attend
            with the layout the inputs were sharded with, ``s.shard(x)``). ``layout``, ``group`` or
            ``ring_size`` passed beside it must repeat its values (ValueError otherwise).

    A query that sees no key at all (padding, a window or a document that leaves it nothing) outputs
    zeros and gets zero gradients.

    Returns:
        (batch, local_seq, heads, head_dim), like q: the attention output for this rank's queries.

    Gradients follow distcomm's convention (total loss = sum of the per-rank losses): the dK/dV a rank
    receives include the contributions of every rank's queries.

    Raises:
        TypeError / ValueError: bad input, raised before any communication (cross-rank disagreements: the
            same error on every rank of the ring).
        ImportError: an explicitly requested backend whose package is missing.
    """
    options, error = _validation.verdict(_check_arguments, q, k, v, causal=causal, layout=layout, group=group,
                                         ring_size=ring_size, sharding=sharding, backend=backend,
                                         window_size=window_size, softcap=softcap)
    layout, group, ring_size, window, softcap = options or (layout, fallback_group(sharding, group), None,
                                                            (-1, -1), 0.0)
    if torch.compiler.is_compiling():  # an input error travels into the operator, raised by every rank there
        from distcomm_attention._compiled import compiled_ring_flash_attn

        return compiled_ring_flash_attn(
            q, k, v, group=group, ring_size=ring_size, layout=layout, causal=causal, softmax_scale=softmax_scale,
            window=window, softcap=softcap, attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
            error=error,
        )
    comm, ring_error = ring_comm(group, ring_size)
    error = error or ring_error
    cu_seqlens = _validation.boundaries_on_host(cu_seqlens)
    requires_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    planned, scale, fwd, bwd, _ = prepare(
        q, k, v, comm, layout=layout, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
        attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend, requires_grad=requires_grad,
        error=error, planner=ring_planner(comm, q),
    )
    return run_ring(q, k, v, comm, planned, key_mask=attention_mask, softcap=softcap, scale=scale, fwd=fwd, bwd=bwd)


def which_kernels(
    q: torch.Tensor,
    *,
    causal: bool = False,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | list[int] | None = None,
) -> KernelChoice:
    """Which backend and block kernels ``ring_flash_attn`` would use for queries like ``q`` with these
    options, and why (no communication, nothing computed).

    Args:
        q: (batch, local_seq, heads, head_dim), or any tensor of that device, dtype and head_dim.
        causal, backend, attention_mask, window_size, softcap, cu_seqlens: as in ``ring_flash_attn``
            (``cu_seqlens`` is read for its presence only).

    Returns:
        ``KernelChoice(backend, forward, backward, reason)``, e.g. ``("triton", "TritonForward",
        "TritonBackward", ...)``.

    Raises:
        What ``ring_flash_attn`` would raise for the backend: e.g. ValueError for ``backend="flash2"`` with
        a window, ImportError when the backend's package is missing.
    """
    _validation.check_is_tensor("q", q)
    _validation.check_flag("causal", causal)
    dispatch.check_backend(backend)
    window = _validation.check_window(window_size)
    softcap = _validation.check_softcap(softcap)
    docs = None if cu_seqlens is None else (0,)
    vis = Visibility(causal, window, docs, attention_mask is not None)
    return dispatch.choose(backend, q, vis, softcap)


def context_parallel_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    strategy: str = "auto",
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str | None = None,
    group=None,
    backend: str = "auto",
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    sharding: Sharding | None = None,
    hardware: Hardware | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across ranks, by any context-parallel strategy.

    The same call, inputs and result as :func:`ring_flash_attn`; ``strategy`` decides who talks to whom:

        "ring"              k, v travel around the group, overlapped with compute (``ring_flash_attn``); with
                            documents or windows only the rows each step's block reads, straight to the
                            rank that reads them (Note [Sparse ring])
        "ulysses"           all-to-all to head sharding, whole-sequence attention per head group, and back;
                            heads must divide by the group size (kv heads are split, or replicated when
                            there are fewer kv heads than ranks)
        "allgather"         k, v (and the key mask) gathered once, dK / dV reduce-scattered in fp32; best
                            with GQA, where k, v are small
        "hybrid"            Ulysses over a mesh dimension "ulysses" x ring over a dimension "ring";
                            ``group`` is a 2-D DeviceMesh with those dimension names
        "hybrid_allgather"  Ulysses over "ulysses" x all-gather KV over "ring"
        "auto"              the fastest by the cost model (``which_strategy`` says what it picks and why)

    Every strategy takes every feature: causal, ``attention_mask`` (all-padding ranks too), windows,
    softcap, packed documents (``cu_seqlens``), GQA, every layout and backend.

    Args:
        q, k, v, causal, softmax_scale, backend, attention_mask, window_size, softcap, cu_seqlens: as in
            :func:`ring_flash_attn`.
        strategy: see above.
        layout: which global tokens this rank holds (see ``ring_flash_attn``): over the whole group, or for
            the hybrids over the "ring" dimension, each shard cut into equal contiguous pieces over the
            "ulysses" dimension (``shard_sequence(x, layout, group=mesh)`` produces these shards). ``None``:
            the ``sharding``'s, else the layout ``shard_sequence`` recorded for this group, else "contiguous"
            (as in ``ring_flash_attn``).
        group: a process group or 1-D DeviceMesh (``None``: the default group), or a 2-D DeviceMesh with
            dimensions "ulysses" and "ring" for the hybrids.
        sharding: a :class:`Sharding` giving layout and group at once (its ``ring_size`` must be ``None``).
        hardware: what ``strategy="auto"`` predicts with (see ``which_strategy``): ``None``, one node's
            NVLink-class links; e.g. ``Hardware(across=Hardware(p2p_gbps=50, a2a_gbps=50, allgather_gbps=50,
            reduce_scatter_gbps=50))`` for a mesh whose "ring" dimension crosses nodes. Every rank passes the
            same (the pick is verified across ranks). Ignored by the other strategies and in a compiled
            region, where "auto" runs the ring.

    Returns:
        (batch, local_seq, heads, head_dim), like q.

    Raises:
        TypeError / ValueError: bad input (e.g. heads not divisible by the Ulysses degree, naming both), raised
            before any communication; cross-rank disagreements (the strategy included): the same error on
            every rank.
    """
    options, error = _validation.verdict(_check_arguments, q, k, v, causal=causal, layout=layout, group=group,
                                         ring_size=None, sharding=sharding, backend=backend,
                                         window_size=window_size, softcap=softcap, strategy=strategy,
                                         hardware=hardware)
    layout, group, _, window, softcap = options or (layout, fallback_group(sharding, group), None, (-1, -1), 0.0)
    compiling = torch.compiler.is_compiling()
    if compiling and error is not None:  # into the operator, raised by every rank there
        from distcomm_attention._compiled import compiled_context_parallel_attn

        return compiled_context_parallel_attn(
            q, k, v, strategy="ring", group=group, layout=layout, causal=causal, softmax_scale=softmax_scale,
            window=window, softcap=softcap, attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
            error=error,
        )
    if compiling and strategy == "auto":
        strategy = "ring"  # the cost model runs on the host; a compiled region runs the ring (Note [Compiled strategies])
    if compiling:
        if strategy == "ring":
            return ring_flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, group=group,
                                   backend=backend, attention_mask=attention_mask, window_size=window_size,
                                   softcap=softcap, cu_seqlens=cu_seqlens)
        if strategy in ("hybrid", "hybrid_allgather"):
            raise NotImplementedError(
                f"strategy={strategy!r} takes a 2-D DeviceMesh, which cannot travel in a compiled graph; call it "
                f"outside the compiled region, or compile strategy 'ring', 'ulysses' or 'allgather'"
            )
        from distcomm_attention._compiled import compiled_context_parallel_attn

        return compiled_context_parallel_attn(
            q, k, v, strategy=strategy, group=group, layout=layout, causal=causal, softmax_scale=softmax_scale,
            window=window, softcap=softcap, attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
        )
    cu_seqlens = _validation.boundaries_on_host(cu_seqlens)
    requires_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    return strategies.run(q, k, v, strategy=strategy if error is None else "ring", group=group, layout=layout,
                          causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                          attention_mask=attention_mask, cu_seqlens=cu_seqlens, backend=backend,
                          requires_grad=requires_grad, error=error, hardware=hardware)


def which_strategy(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    group=None,
    layout: str | None = None,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: torch.Tensor | list[int] | None = None,
    hardware=None,
    backend: str = "auto",
    softcap: float = 0.0,
):
    """Which strategy ``context_parallel_attn(strategy="auto")`` would run for this call, and why (no
    communication, nothing computed).

    Args:
        q: (batch, local_seq, heads, head_dim); k: (batch, local_seq, kv_heads, head_dim) (shapes are read).
        group, layout, causal, attention_mask, window_size, cu_seqlens, softcap: as in ``context_parallel_attn``.
        backend: the block kernels the call would use, as in ``context_parallel_attn`` ("auto": the one it
            picks for ``q``'s device and dtype). Name one (e.g. ``"fa4"``) to ask about a GPU run from CPU
            tensors of the same shapes: flash-attn-4 runs a step's packed documents in a few varlen calls,
            which the model counts instead of one call per block.
        hardware: a ``distcomm_attention.planning.cost.Hardware`` (kernel throughput, link bandwidths);
            ``None``: the measured defaults (one H100 / H200 node with NVLink). Pass your own for other
            machines, e.g. ``Hardware(p2p_gbps=50, a2a_gbps=50, allgather_gbps=50, reduce_scatter_gbps=50)``
            for a group spanning nodes, or ``Hardware(across=that)`` for a 2-D mesh whose "ulysses" dimension
            stays inside a node and whose "ring" dimension crosses nodes.

    Returns:
        ``StrategyChoice(strategy, predictions, reason)``: the pick, and for every applicable strategy a
        ``Prediction(seconds, compute_s, comm_s, memory_bytes)`` of one forward + backward (Note [Cost model]
        in distcomm_attention/planning/cost.py). On a 2-D mesh the candidates are the hybrids and "ring",
        "ulysses" and "allgather" over all the mesh's ranks on the mesh's sharding; a 1-D pick there runs
        through ``strategy="auto"`` (naming it with the mesh as ``group`` is refused: a 1-D strategy takes
        a 1-D group).
    """
    _validation.check_flag("causal", causal)
    check_hardware(hardware)
    if layout is not None:
        layouts.check_layout(layout)
    window = _validation.check_window(window_size)
    return strategies.choose(q, k, group=group, layout=layout, causal=causal, window=window,
                             attention_mask=attention_mask, cu_seqlens=cu_seqlens, hardware=hardware,
                             backend=backend, softcap=softcap)
