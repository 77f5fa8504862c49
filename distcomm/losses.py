"""Contrastive losses over the global batch of all ranks: CLIP (InfoNCE) and SigLIP (sigmoid).

Each rank passes its own batch of paired features, ``image_features[i]`` with ``text_features[i]``. The
global batch is the concatenation of every rank's batch in rank order (N pairs in all); per-rank batch
sizes may differ, zero included. Features are used as given (normalise them first if you want cosine
similarities) and ``logit_scale`` is the multiplier itself (already exponentiated, as open_clip passes it):
``logits_ij = logit_scale * <x_i, y_j>``.

Gradient convention
    Let G be the loss of the whole global batch, computed as if on one process. With W ranks, rank r
    returns a loss L_r such that

        sum_r L_r = W * G            (identically, so for the values and for every gradient)

    which means:

    * the mean over ranks of the returned losses is G (log that, e.g. after an ``all_reduce(AVG)``);
    * rank r's gradient of its own features, divided by W, is G's gradient of them. DDP averages parameter
      gradients over ranks, so calling ``loss.backward()`` on every rank under DDP gives exactly G's
      gradient: do not multiply the loss by the world size;
    * the mean over ranks of ``logit_scale``'s (and ``logit_bias``'s) gradient is G's.

    With equal per-rank batches L_r is the familiar per-rank mean; with unequal ones each rank's share is
    weighted by its batch size. A rank with an empty batch returns a zero that is still in the autograd
    graph: call ``backward()`` on every rank, since the backward passes communicate. If every rank's batch
    is empty the loss is zero.

Available losses
    * :func:`clip_loss`: ``G = (1/2N) sum_i [CE(row i -> i) + CE(column i -> i)]`` of the N x N logit
      matrix. ``local_loss=True`` (default) computes only this rank's rows and columns.
    * :func:`siglip_loss`: ``G = -(1/N) sum_i sum_j log sigmoid(z_ij (logit_scale <x_i, y_j> + logit_bias))``
      with ``z_ij = 1`` if ``i == j`` else ``-1``. ``impl="ring"`` (default) keeps memory O(local batch).

Both are built only on distcomm's public ops (``all_gather_variable``, ``all_gather``, ``RingComm``) and
are meant to be read as examples of exact distributed losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distcomm import _check
from distcomm import functional as dfunc
from distcomm.ring import RingComm

__all__ = ["clip_loss", "siglip_loss"]

_SIGLIP_IMPLS = ("ring", "gather")


# ---------------------------------------------------------------------------------------------------------
# Validation (local only: runs before any communication)
# ---------------------------------------------------------------------------------------------------------


def _check_features(op: str, image_features, text_features) -> None:
    for name, t in (("image_features", image_features), ("text_features", text_features)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"{op}: `{name}` must be 2-d with shape (batch, dim), got shape {tuple(t.shape)} ({t.dim()} dims)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got dtype {t.dtype}")
    if image_features.dtype != text_features.dtype:
        raise TypeError(
            f"{op}: `image_features` and `text_features` must have the same dtype, got "
            f"{image_features.dtype} and {text_features.dtype}"
        )
    if image_features.device != text_features.device:
        raise ValueError(
            f"{op}: `image_features` and `text_features` must be on the same device, got "
            f"{image_features.device} and {text_features.device}"
        )
    if image_features.shape[1] != text_features.shape[1]:
        raise ValueError(
            f"{op}: feature dims differ: `image_features` has dim {image_features.shape[1]}, `text_features` has "
            f"dim {text_features.shape[1]}; both towers must embed into the same space"
        )
    if image_features.shape[0] != text_features.shape[0]:
        raise ValueError(
            f"{op}: batch sizes differ on this rank: `image_features` has {image_features.shape[0]} rows, "
            f"`text_features` has {text_features.shape[0]}; row i of each must be a matching pair"
        )


def _require_tensors(op: str, image_features, text_features) -> None:
    """The features' types: checked on this rank alone (Note [Collective verdicts] in :mod:`distcomm._check`)."""
    for name, t in (("image_features", image_features), ("text_features", text_features)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def _check_inputs(op: str, image_features, text_features, *scalars) -> tuple[torch.Tensor, ...]:
    """A loss's checks of this rank's inputs; returns the scalars (``logit_scale``[, ``logit_bias``]) as tensors."""
    _check_features(op, image_features, text_features)
    names = ("logit_scale", "logit_bias")
    return tuple(_check_scalar(op, name, v, image_features) for name, v in zip(names, scalars))


def _check_scalar(op: str, name: str, value, like: torch.Tensor) -> torch.Tensor:
    """Return ``value`` as a tensor with one element (a number becomes a constant in the compute dtype)."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: `{name}` must be a scalar tensor or a real number, got bool {value!r}")
    if isinstance(value, (int, float)):
        if isinstance(value, int) and abs(value) > 2**1023:
            raise ValueError(f"{op}: `{name}` must be a real number a float can hold, got an int of "
                             f"{value.bit_length()} bits")
        # Built in the compute dtype: a number rounded to half precision would change the loss.
        return torch.full((), float(value), dtype=_compute_dtype(like.dtype), device=like.device)  # no copy
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a scalar tensor or a real number, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(
            f"{op}: `{name}` must be a scalar tensor (0-d or one element), got shape {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got dtype {value.dtype}")
    return value


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits and losses of half-precision features are taken in float32."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# CLIP
# ---------------------------------------------------------------------------------------------------------


def clip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    local_loss: bool = True,
    group=None,
) -> torch.Tensor:
    """CLIP's symmetric InfoNCE loss over the global batch of all ranks.

    ``G = (1/2N) sum_i [CE(row i -> i) + CE(column i -> i)]`` where row i of the N x N matrix
    ``logit_scale * X @ Y.T`` scores image i against every text and column i scores text i against every
    image; X and Y are all ranks' features concatenated in rank order. See the module docstring for the
    gradient convention (``sum_r L_r = W * G``).

    Args:
        image_features: (n_r, D) this rank's image embeddings; n_r may differ across ranks, zero included.
        text_features: (n_r, D) this rank's text embeddings, row i paired with ``image_features[i]``.
        logit_scale: scalar tensor (0-d or one element) or number, the multiplier of the dot products
            (already exponentiated). Its own gradient is returned on every rank.
        local_loss: True: compute only this rank's n_r rows and n_r columns of the logit matrix (two
            (n_r, N) products; the scalable form) and return
            ``L_r = (W/2N) sum over own i of [CE(row i) + CE(column i)]``. False: compute the full (N, N)
            matrix on every rank and return ``L_r = G``.
        group: process group, DeviceMesh (1-D) or ``(mesh, dim)`` (``None``: the default group; no process
            group: a world of one).

    Returns:
        0-d tensor L_r, in float32 or wider (half-precision features are upcast before the logit products,
        so the logits are float32).

    Raises:
        TypeError, ValueError: features that are not tensors, or a bad ``local_loss``, ``group``: on this
            rank, before any communication. Any other bad input on any rank (shapes, dtypes, ``logit_scale``),
            feature dims / dtypes, ``logit_scale`` or ``local_loss`` that differ across ranks (each rank's
            share of W * G needs one form on every rank), or some ranks' losses needing a backward (grad
            mode on and an input requiring grad) while others' do not (the backward communicates): the same
            error on every rank, after one small exchange.
    """
    op = "clip_loss"
    _require_tensors(op, image_features, text_features)
    if not isinstance(local_loss, bool):
        raise TypeError(f"{op}: `local_loss` must be a bool, got {local_loss!r}")

    comm = RingComm(group)  # the group resolved once (a DeviceMesh becomes its ProcessGroup), with W and r
    group, world, rank = comm.group, comm.size, comm.rank
    sizes, (logit_scale,) = _agree_on_inputs(
        op, comm, image_features, _check_inputs, op, image_features, text_features, logit_scale,
        names=("logit_scale",), extra={"local_loss": torch.tensor(float(local_loss))},
    )
    all_images, _ = dfunc.all_gather_variable(image_features, sizes=sizes, group=group)
    all_texts, _ = dfunc.all_gather_variable(text_features, sizes=sizes, group=group)
    total = sum(sizes)
    # Half-precision operands are upcast before the products, so the logits are float32 throughout.
    dtype = _compute_dtype(image_features.dtype)
    scale = logit_scale.reshape(()).to(dtype)
    all_images, all_texts = all_images.to(dtype), all_texts.to(dtype)

    if local_loss:
        offset = sum(sizes[:rank])
        targets = torch.arange(offset, offset + sizes[rank], device=image_features.device)
        rows = scale * (image_features.to(dtype) @ all_texts.T)  # (n_r, N): own images vs all texts
        cols = scale * (text_features.to(dtype) @ all_images.T)  # (n_r, N): own texts vs all images
        summed = F.cross_entropy(rows, targets, reduction="sum") + F.cross_entropy(cols, targets, reduction="sum")
        weight = world / (2 * total) if total else 0.0
    else:
        targets = torch.arange(total, device=image_features.device)
        logits = scale * (all_images @ all_texts.T)  # (N, N)
        summed = F.cross_entropy(logits, targets, reduction="sum") + F.cross_entropy(
            logits.T, targets, reduction="sum"
        )
        weight = 1 / (2 * total) if total else 0.0
    return summed * weight


# ---------------------------------------------------------------------------------------------------------
# SigLIP
# ---------------------------------------------------------------------------------------------------------


def _siglip_logits(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor):
    """(logits, dots) of one block: ``scale * x @ y.T + bias`` and ``x @ y.T``, in the compute dtype.

    Half-precision operands are upcast before the product (one block at a time, so memory stays O(block)).
    """
    dtype = _compute_dtype(x.dtype)
    dots = x.to(dtype) @ y.to(dtype).T
    return dots * scale + bias, dots


def _siglip_signs(logits: torch.Tensor, diagonal: int | None) -> torch.Tensor:
    """z: -1 everywhere, +1 on ``logits.diagonal(diagonal)`` (the matching pairs), if given."""
    signs = torch.full_like(logits, -1.0)
    if diagonal is not None:
        signs.diagonal(diagonal).fill_(1.0)
    return signs


def _siglip_block_sum(x, y, scale, bias, diagonal: int | None) -> torch.Tensor:
    """``-sum log sigmoid(z * logits)`` of one block (differentiable)."""
    logits, _ = _siglip_logits(x, y, scale, bias)
    return -F.logsigmoid(_siglip_signs(logits, diagonal) * logits).sum()


def _siglip_block_grads(x, y, scale, bias, diagonal: int | None, weight: float):
    """Gradients of ``weight * _siglip_block_sum`` w.r.t. x, y (compute dtype), scale and bias (0-d)."""
    logits, dots = _siglip_logits(x, y, scale, bias)
    signs = _siglip_signs(logits, diagonal)
    # d/dl [-log sigmoid(z l)] = -z sigmoid(-z l)
    dlogits = -weight * signs * torch.sigmoid(-signs * logits)
    scaled = dlogits * scale
    dx = scaled @ y.to(logits.dtype)
    dy = scaled.T @ x.to(logits.dtype)
    return dx, dy, (dlogits * dots).sum(), dlogits.sum()


class _SigLipRing(torch.autograd.Function):
    """SigLIP loss with text blocks passed around the ring; saves only the local features.

    Note [SigLIP ring]
        Rank r needs every rank's text block against its own images. Blocks travel both ways at once,
        so the W - 1 foreign blocks arrive in K = floor(W/2) rounds (W = 5, rank 2 shown):

            round 0     own block y2 (the positives sit on its diagonal)
            round 1     y1 from the left (right-going stream), y3 from the right (left-going stream)
            round 2     y0 from the left,                    y4 from the right

        The left-going stream runs K' = floor((W-1)/2) rounds: with W even it sits out the last round,
        where both streams would bring the same block. The next round's transfer is posted before the
        current blocks are computed.

        Backward runs the same rounds again, recomputing each block from the local image features. Each
        travelling text block carries an accumulator of the gradient w.r.t. it: the rank holding the block
        adds its contribution and passes both on. After its stream's last round an accumulator holds the
        contributions of every rank the stream visited and goes straight back to the block's owner (one
        point-to-point send, K or K' ranks away), which adds both streams' accumulators to its own diagonal
        block's gradient. Nothing received is saved: memory stays O(local batch) however many ranks there
        are.
    """

    @staticmethod
    def forward(ctx, x, y, scale, bias, comm: RingComm, sizes: list[int]):
        ctx.save_for_backward(x, y, scale, bias)
        ctx.comm, ctx.sizes = comm, sizes
        total = sum(sizes)
        ctx.weight = comm.size / total if total else 0.0
        s, b = scale.reshape(()), bias.reshape(())
        rounds_right, rounds_left = _rounds(comm.size)

        pending = _post(comm, sizes, 1, y, y if rounds_left else None)
        loss = _siglip_block_sum(x, y, s, b, diagonal=0)
        for k in range(1, rounds_right + 1):
            right, left = _wait(pending)
            if k < rounds_right:
                pending = _post(comm, sizes, k + 1, right, left if k < rounds_left else None)
            for block in (right, left):
                if block is not None:
                    loss = loss + _siglip_block_sum(x, block, s, b, diagonal=None)
        return loss * ctx.weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        x, y, scale, bias = ctx.saved_tensors
        comm, sizes = ctx.comm, ctx.sizes
        rounds_right, rounds_left = _rounds(comm.size)
        weight = grad_loss * ctx.weight
        s, b = scale.reshape(()), bias.reshape(())

        pending = _post(comm, sizes, 1, y, y if rounds_left else None)
        dx, dy, dscale, dbias = _siglip_block_grads(x, y, s, b, diagonal=0, weight=weight)
        acc_right = acc_left = None
        for k in range(1, rounds_right + 1):
            right, left = _wait(pending)
            if k < rounds_right:
                pending = _post(comm, sizes, k + 1, right, left if k < rounds_left else None)
            if k == 1:  # the accumulators start on the first rank a block visits
                acc_right = torch.zeros(right.shape, dtype=dx.dtype, device=dx.device)
                if left is not None:
                    acc_left = torch.zeros(left.shape, dtype=dx.dtype, device=dx.device)
            else:
                acc_right, received_left = _wait(pending_acc)
                if left is not None:
                    acc_left = received_left
            for block, acc in ((right, acc_right), (left, acc_left)):
                if block is not None:
                    gx, gy, gs, gb = _siglip_block_grads(x, block, s, b, diagonal=None, weight=weight)
                    dx += gx
                    acc += gy
                    dscale += gs
                    dbias += gb
            if k < rounds_right:
                pending_acc = _post(comm, sizes, k + 1, acc_right, acc_left if k < rounds_left else None)

        # Each finished accumulator goes straight home (see Note [SigLIP ring]).
        home = [(sizes[comm.rank], y.shape[1])]
        handles = []
        if rounds_right:
            handles.append(comm.send_recv(acc_right, shift=-rounds_right, recv_like=home))
        if rounds_left:
            handles.append(comm.send_recv(acc_left, shift=rounds_left, recv_like=home))
        for handle in handles:
            dy += handle.wait()[0]
        return (
            dx.to(x.dtype),
            dy.to(y.dtype),
            dscale.reshape(scale.shape).to(device=scale.device, dtype=scale.dtype),
            dbias.reshape(bias.shape).to(device=bias.device, dtype=bias.dtype),
            None,
            None,
        )


def _rounds(world: int) -> tuple[int, int]:
    """Rounds K, K' of the right- and left-going streams: together they visit the W - 1 other ranks."""
    return world // 2, (world - 1) // 2


def _post(comm: RingComm, sizes: list[int], k: int, right: torch.Tensor, left: torch.Tensor | None):
    """Post round k: ``right`` moves one rank right (rank r - k's block arrives), ``left`` one rank left.

    Blocks keep their owner's batch size, so the incoming shapes are known from ``sizes``.
    """
    world, rank, dim = comm.size, comm.rank, right.shape[1]
    handle_right = comm.send_recv(right, shift=1, recv_like=[(sizes[(rank - k) % world], dim)])
    handle_left = None
    if left is not None:
        handle_left = comm.send_recv(left, shift=-1, recv_like=[(sizes[(rank + k) % world], dim)])
    return handle_right, handle_left


def _wait(pending) -> tuple[torch.Tensor, torch.Tensor | None]:
    handle_right, handle_left = pending
    return handle_right.wait()[0], None if handle_left is None else handle_left.wait()[0]


def _exchange_sizes(op: str, image_features: torch.Tensor, needs_grad: int, group, error=None,
                    agreed: dict[str, torch.Tensor] | None = None) -> list[int]:
    """Every rank's batch size (one small all_gather), checking that every rank's own inputs passed its
    checks (``error``: this rank's verdict, None if they did), and that feature dims, dtypes and
    ``needs_grad`` agree across ranks: bit 0 whether this rank's loss will be in the autograd graph, bits 1 and
    2 whether its image and its text features need grad.

    Both losses' backward passes communicate, so a rank without a graph would leave its peers waiting in
    theirs; every rank sees the same gathered rows and raises the same error (Note [Collective verdicts]
    in :mod:`distcomm._check`). ``agreed``: values every rank must pass alike (the scalars, ``impl``'s
    index), each a 0-d tensor compared by its float64 bits in the same exchange.
    """
    if error is None:
        row = [image_features.shape[0], image_features.shape[1], _check.dtype_code(image_features.dtype)]
    else:
        row = [0, 0, 0]
    row += [int(needs_grad), *_check.encode_verdict(error)]
    device = image_features.device if isinstance(image_features, torch.Tensor) else None
    names = list(agreed or {})
    meta = torch.tensor(row, dtype=torch.int64, device=device)
    if names:
        values = torch.stack([agreed[n].detach().reshape(()).to(device=device, dtype=torch.float64)
                              if error is None and agreed[n] is not None
                              else torch.zeros((), dtype=torch.float64, device=device) for n in names])
        meta = torch.cat([values.view(torch.int64), meta])
    gathered = [t.tolist() for t in dfunc.all_gather(meta, group=group)]
    rows = [r[len(names):] for r in gathered]
    _check.raise_verdicts(op, [r[4:] for r in rows])
    differing = [i for i in range(len(names)) if any(g[i] != gathered[0][i] for g in gathered)]
    if differing:
        as_float = [torch.tensor(g[: len(names)], dtype=torch.int64).view(torch.float64).tolist() for g in gathered]
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{names[i]}={as_float[r][i]!r}" for i in differing)
                           for r in range(len(gathered)))
        raise ValueError(f"{op}: the ranks disagree on {', '.join(f'`{names[i]}`' for i in differing)} ({detail}); "
                         "every rank must pass the same values")
    if any(r[1:3] != rows[0][1:3] for r in rows):
        detail = ", ".join(f"rank {i}: dim={r[1]} dtype={_check.decode_meta([0, r[2]]).dtype}" for i, r in enumerate(rows))
        raise ValueError(f"{op}: feature dims or dtypes differ across ranks ({detail}); they must agree")
    if any(r[3] & 1 != rows[0][3] & 1 for r in rows):
        detail = ", ".join(f"rank {i}: {bool(r[3] & 1)}" for i, r in enumerate(rows))
        raise ValueError(
            f"{op}: whether the loss needs a backward differs across ranks ({detail}); the backward "
            "communicates, so it must be all or none: grad mode enabled and the features or the scalars "
            "(`logit_scale`, `logit_bias`) requiring grad on every rank, or on none"
        )
    if any(r[3] != rows[0][3] for r in rows):
        def which(code: int) -> str:
            named = [n for bit, n in ((2, "image_features"), (4, "text_features")) if code & bit]
            return " and ".join(named) or "neither"

        detail = "; ".join(f"rank {i}: {which(r[3])}" for i, r in enumerate(rows))
        raise ValueError(
            f"{op}: which features need grad differs across ranks ({detail}); the features' gathers have a "
            "backward only on the ranks whose features need grad, and it communicates, so `image_features` and "
            "`text_features` must each need grad on every rank or on none"
        )
    return [r[0] for r in rows]


def _agree_on_inputs(op: str, comm: RingComm, image_features, validate, *args, names=(), extra=None):
    """Run this rank's checks ``validate(*args)`` (returning the loss's scalars, called ``names``) and agree
    across the ring on them, on ``extra`` (more 0-d values), on the batch sizes and on the backward
    (:func:`_exchange_sizes`): (sizes, scalars)."""
    if comm.size == 1:
        return [image_features.shape[0]], validate(*args)
    try:
        scalars, error = validate(*args), None
    except (TypeError, ValueError, OverflowError) as e:
        scalars, error = None, e
    tensors = [t for t in (*args, *(scalars or ())) if isinstance(t, torch.Tensor)]
    grad = torch.is_grad_enabled()
    # bit 0: the loss needs a backward; bits 1, 2: the image and the text features need grad (their gathers
    # have a backward, a collective, only where they do)
    needs_grad = int(grad and any(t.requires_grad for t in tensors)) | sum(
        bit for bit, t in ((2, args[1]), (4, args[2])) if grad and isinstance(t, torch.Tensor) and t.requires_grad)
    # the same names on every rank (the rows' lengths must match), values or None where unread
    agreed = {**dict(zip(names, scalars or (None,) * len(names))), **(extra or {})}
    return _exchange_sizes(op, image_features, needs_grad, comm.group, error, agreed), scalars


def siglip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    impl: str = "ring",
    group=None,
) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss over the global batch of all ranks.

    ``G = -(1/N) sum_i sum_j log sigmoid(z_ij (logit_scale <x_i, y_j> + logit_bias))``, ``z_ij = +1`` for the
    matching pair (i == j in the rank-order concatenation) and ``-1`` otherwise. Rank r returns
    ``L_r = (W/N) sum over its own i of sum_j (...)``, so ``sum_r L_r = W * G`` (see the module docstring).

    Args:
        image_features: (n_r, D) this rank's image embeddings; n_r may differ across ranks, zero included.
        text_features: (n_r, D) this rank's text embeddings, row i paired with ``image_features[i]``.
        logit_scale: scalar tensor (0-d or one element) or number: the multiplier (already exponentiated).
        logit_bias: scalar tensor (0-d or one element) or number: the additive bias.
        impl: ``"ring"`` (default): text blocks travel around the ring in both directions; a custom
            autograd Function saves only the local features and recomputes every block in backward, so
            memory stays O(n_r * max_r n_r), flat in W. ``"gather"``: one ``all_gather_variable`` of the
            text features and an (n_r, N) logit block, saved by autograd (memory grows with N).
        group: process group, DeviceMesh (1-D) or ``(mesh, dim)`` (``None``: the default group; no process
            group: a world of one).

    Returns:
        0-d tensor L_r, in float32 or wider (half-precision features are upcast before the logit products).

    Raises:
        TypeError, ValueError: features that are not tensors, or a bad ``group``: on this rank, before any
            communication. Any other bad input on any rank (shapes, dtypes, the scalars, ``impl``), feature
            dims / dtypes, ``impl``, ``logit_scale`` or ``logit_bias`` that differ across ranks, or some ranks'
            losses needing a backward (grad mode on and an input requiring grad) while others' do not (the
            backward communicates, for both ``impl`` values): the same error on every rank, after one small
            exchange.
    """
    op = "siglip_loss"
    _require_tensors(op, image_features, text_features)

    def validate(*args):
        if not isinstance(impl, str) or impl not in _SIGLIP_IMPLS:
            raise ValueError(f"{op}: invalid `impl` {impl!r}; must be one of {list(_SIGLIP_IMPLS)}")
        return _check_inputs(*args)

    comm = RingComm(group)  # the group resolved once (a DeviceMesh becomes its ProcessGroup), with W and r
    code = torch.tensor(float(_SIGLIP_IMPLS.index(impl)) if impl in _SIGLIP_IMPLS else -1.0)
    sizes, (logit_scale, logit_bias) = _agree_on_inputs(
        op, comm, image_features, validate, op, image_features, text_features, logit_scale, logit_bias,
        names=("logit_scale", "logit_bias"), extra={"impl (index in ['ring', 'gather'])": code},
    )
    if impl == "ring":
        return _SigLipRing.apply(image_features, text_features, logit_scale, logit_bias, comm, sizes)

    group, world, rank = comm.group, comm.size, comm.rank
    all_texts, _ = dfunc.all_gather_variable(text_features, sizes=sizes, group=group)
    total = sum(sizes)
    offset = sum(sizes[:rank])
    summed = _siglip_block_sum(
        image_features, all_texts, logit_scale.reshape(()), logit_bias.reshape(()), diagonal=offset
    )
    return summed * (world / total if total else 0.0)
