"""Cross-rank metadata exchange and the opt-in check mode.

A shape or dtype that differs between ranks makes most collectives hang or silently corrupt memory. With
checking on (``distcomm.check_mode()`` as a context manager, ``distcomm.set_check_mode(True)``, or
``DISTCOMM_CHECK=1`` in the environment) every op first exchanges a small metadata vector and every rank
raises the same ``ValueError`` when the ranks disagree. Off by default: the exchange costs a host sync.

Note [Collective verdicts]
    A check that raises on one rank while its peers go on into a collective leaves the peers waiting until
    the process-group timeout (30 minutes on gloo). The rule:

    - Where an entry point exchanges metadata anyway (check mode; ``all_gather_variable`` without
      ``sizes``; ``ring_pass`` without ``recv_shape``; the losses), each rank computes its verdict without
      raising, the verdict travels in that exchange (:func:`encode_verdict`, :func:`decide`), and every rank
      raises the same error naming the failing rank(s), the argument, the value and what is allowed
      (:func:`raise_verdicts`).
    - Cross-rank facts (shapes, dtypes, split sizes, roots, ops, shifts, ``requires_grad``) are compared
      from the gathered rows, identical on every rank, so every rank reaches the same verdict.
    - Checks that stay local, raised on this rank before any communication: the types of the arguments
      (a tensor where a tensor is expected, an int ``dim``/``shift``/``src``), the ``group`` itself and
      values that every rank passes alike because the same code passes them (``dim``, ``ring_size``,
      ``impl``, ``op``), where a mistake is in the program, not in one rank's data.
    - Outside check mode a plain collective (``all_reduce``, ``all_to_all_single`` with ``*_split_sizes``,
      ``ring_pass`` with ``recv_shape``, ...) makes no exchange: what only another rank can see (its shape,
      its splits, its root) is not checked, and a per-rank error raises on that rank alone
      (docs/collectives.md, "What is checked").
"""

from __future__ import annotations

import contextlib
import os
import zlib

import torch
import torch.distributed as dist

from distcomm import _groups

__all__ = [
    "check_mode",
    "set_check_mode",
    "is_check_mode",
    "gather_meta",
    "TensorMeta",
    "encode_meta",
    "decode_meta",
    "meta_row",
    "refuse_wide",
    "dtype_code",
    "raise_mismatch",
    "require_agreement",
    "check_same",
    "decide",
    "collective_errors",
    "encode_verdict",
    "raise_verdicts",
    "VERDICT_WIDTH",
]

MAX_DIMS = 12
# The common dtypes, in a fixed order (other modules index into it for their own compact codes).
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]


def dtype_code(dtype: torch.dtype) -> int:
    """A code that differs for every dtype and is the same in every process and torch version.

    The CRC-32 of the dtype's name (``"torch.float8_e4m3fn"``): a non-negative int below 2**32.
    """
    return zlib.crc32(str(dtype).encode())


# Every dtype torch defines (aliases such as torch.half are the same object), by code; read from the module's
# namespace, which imports nothing lazily. The tests check that no two codes clash.
_DTYPE_BY_CODE = {dtype_code(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_override: bool | None = None
# torch 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.11 only has the old one.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_check_mode() -> bool:
    """Whether cross-rank shape/dtype checks run before each collective."""
    if _override is not None:
        return _override
    return os.environ.get("DISTCOMM_CHECK", "0").lower() not in ("", "0", "false", "no", "off")


def set_check_mode(enabled: bool | None) -> None:
    """Turn the check mode on or off for this process (``None`` defers to ``DISTCOMM_CHECK``)."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool or None, got {enabled!r}")
    _override = enabled


@contextlib.contextmanager
def check_mode(enabled: bool = True):
    """Context manager: verify shapes and dtypes across ranks before every distcomm collective inside it."""
    global _override
    previous = _override
    set_check_mode(enabled)
    try:
        yield
    finally:
        _override = previous


class TensorMeta(tuple):
    """(shape, dtype) of one rank's tensor, as learned by :func:`gather_meta`."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self[0]

    @property
    def dtype(self) -> torch.dtype | None:
        return self[1]


def encode_meta(tensor: torch.Tensor | None) -> list[int]:
    """``[ndim, dtype code, *shape, 0-padding]`` (2 + MAX_DIMS ints) of ``tensor``; ``[-1, -1, 0...]`` for None.
    Never raises: a tensor of more than MAX_DIMS dims is refused after the exchange, by every rank
    (:func:`refuse_wide`), not by its own rank while the others wait in the exchange."""
    if tensor is None:
        return [-1, -1] + [0] * MAX_DIMS
    return meta_row(tensor.shape, tensor.dtype)


def refuse_wide(ndims) -> None:
    """Raise the same ValueError on every rank if any rank's tensor has more than MAX_DIMS dims: ``ndims`` is
    (rank, number of dims) of every row gathered (a row's first entry), alike on every rank."""
    wide = [(r, n) for r, n in ndims if n > MAX_DIMS]
    if wide:
        ranks = ", ".join(f"rank {r}: {n} dims" for r, n in wide)
        raise ValueError(f"tensors of more than {MAX_DIMS} dims are not supported ({ranks}); reshape to at most "
                         f"{MAX_DIMS} dims (every rank raises this error)")


def meta_row(shape, dtype: torch.dtype) -> list[int]:
    """:func:`encode_meta`'s row for a shape and dtype, never raising: a shape of more than MAX_DIMS dims
    keeps its number of dims and its first MAX_DIMS sizes (enough to tell it from any other rank's)."""
    shape = [int(v) for v in shape]
    return [len(shape), dtype_code(dtype)] + shape[:MAX_DIMS] + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))


def decode_meta(row: list[int]) -> TensorMeta | None:
    """The inverse of :func:`encode_meta`: ``TensorMeta`` (dtype None if the code is unknown here) or None."""
    ndim, code = row[0], row[1]
    if ndim < 0:
        return None
    return TensorMeta((tuple(row[2 : 2 + min(ndim, MAX_DIMS)]), _DTYPE_BY_CODE.get(code)))


def gather_meta(tensor: torch.Tensor | None, group=None, *, extra: list[int] | None = None):
    """All-gather (shape, dtype) of ``tensor`` (and optional extra ints) from every member of ``group``.

    Returns a list, in group-rank order, of ``TensorMeta`` (or ``None`` where a rank passed ``None``), and
    when ``extra`` is given also the list of every rank's extra ints. One small collective; every rank
    receives identical data, so decisions taken from it agree on every rank.
    """
    extra = list(extra or [])
    row = encode_meta(tensor) + extra
    group = _groups.resolve_group(group)
    if group is None:
        rows = [row]
    else:
        device = _groups.comm_device(tensor, group)
        local = torch.tensor(row, dtype=torch.int64, device=device)
        out = torch.empty(_groups.group_size(group) * len(row), dtype=torch.int64, device=device)
        all_gather_flat(out, local, group=group)
        rows = out.view(-1, len(row)).tolist()
    refuse_wide((i, r[0]) for i, r in enumerate(rows))
    metas = [decode_meta(r[: 2 + MAX_DIMS]) for r in rows]
    if extra:
        return metas, [r[2 + MAX_DIMS :] for r in rows]
    return metas


def raise_mismatch(op: str, what: str, metas) -> None:
    """Raise the same ValueError on every rank describing a cross-rank disagreement."""
    detail = ", ".join(
        f"rank {i}: " + ("None" if m is None else f"shape={tuple(m.shape)} dtype={m.dtype}") for i, m in enumerate(metas)
    )
    raise ValueError(f"{op}: {what} differ across ranks ({detail})")


_HINTS = {"requires_grad": " (the ranks that require grad would wait forever in the backward)"}


def require_agreement(op: str, name: str, values: list[int], *, show=None) -> None:
    """Raise the same ValueError on every rank when the ranks' ``values`` of the argument ``name`` differ.

    ``values`` are every rank's ints as gathered (identical on every rank); ``show`` formats one for the
    message (default: ``bool`` for ``requires_grad``, else ``int``).
    """
    if all(v == values[0] for v in values):
        return
    if show is None:
        show = bool if name == "requires_grad" else int
    detail = ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
    hint = _HINTS.get(name, "")
    raise ValueError(f"{op}: `{name}` differs across ranks ({detail}); every rank must pass the same{hint}")


def check_same(
    op: str,
    tensor: torch.Tensor,
    group=None,
    *,
    free_dim: int | None = None,
    requires_grad: bool | None = None,
    **ints: int,
) -> list:
    """Verify (in check mode) that every rank's tensor has the same dtype and shape, except along
    ``free_dim``, that every rank passes the same ``ints`` (e.g. ``dst=0``), and, when ``requires_grad``
    is given, the same flag (whether the input needs a backward, itself a collective).

    Returns the gathered metadata (empty when check mode is off).
    """
    if not is_check_mode() or _groups.group_size(group) == 1:
        return []
    names = list(ints)
    extra = [int(v) for v in ints.values()] + ([] if requires_grad is None else [int(requires_grad)])
    metas, extras = gather_meta(tensor, group, extra=extra) if extra else (gather_meta(tensor, group), None)
    ref = metas[0]
    for m in metas:
        if m.dtype != ref.dtype:
            raise_mismatch(op, "dtypes", metas)
        if len(m.shape) != len(ref.shape):
            raise_mismatch(op, "shapes", metas)
        for d, (a, b) in enumerate(zip(m.shape, ref.shape)):
            if a != b and d != (free_dim % len(ref.shape) if free_dim is not None and ref.shape else None):
                raise_mismatch(op, "shapes", metas)
    for i, name in enumerate(names):
        require_agreement(op, name, [e[i] for e in extras])
    if requires_grad is not None:
        require_agreement(op, "requires_grad", [e[len(names)] for e in extras])
    return metas


# ---------------------------------------------------------------------------------------------------------
# Collective verdicts (Note [Collective verdicts])
# ---------------------------------------------------------------------------------------------------------

_VERDICT_BYTES = 512
VERDICT_WIDTH = 2 + _VERDICT_BYTES // 8  # ints per encoded verdict: [type code, length, packed utf-8 bytes]
_ERROR_TYPES = {1: ValueError, 2: TypeError}


def encode_verdict(error: Exception | None) -> list[int]:
    """A fixed-width int row carrying this rank's error (its type and message, cut to 512 bytes) or none."""
    if error is None:
        return [0] * VERDICT_WIDTH
    code = 2 if isinstance(error, TypeError) else 1
    data = str(error).encode()[:_VERDICT_BYTES]
    padded = data.ljust(_VERDICT_BYTES, b"\0")
    packed = [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, _VERDICT_BYTES, 8)]
    return [code, len(data), *packed]


def _decode_verdict(row: list[int]) -> tuple[type, str] | None:
    if not row[0]:
        return None
    data = b"".join(int(v).to_bytes(8, "little", signed=True) for v in row[2:VERDICT_WIDTH])
    return _ERROR_TYPES.get(row[0], ValueError), data[: row[1]].decode(errors="replace")


def raise_verdicts(op: str, rows: list[list[int]], ranks: list[int] | None = None) -> None:
    """Raise the same error on every rank if any rank's verdict row (:func:`encode_verdict`) holds one.

    ``rows`` are every rank's verdict rows in group-rank order, identical on every rank; ``ranks`` names
    them (default: their group ranks). The error has the first failing rank's type and every failing
    rank's message.
    """
    failing = [(r if ranks is None else ranks[r], v) for r, v in enumerate(map(_decode_verdict, rows)) if v]
    if not failing:
        return
    detail = "; ".join(f"rank {r}: {message}" for r, (_, message) in failing)
    which = "rank" if len(failing) == 1 else "ranks"
    raise failing[0][1][0](
        f"{op}: the input of {which} {', '.join(str(r) for r, _ in failing)} was rejected, so every rank stops "
        f"here ({detail})"
    )


def collective_errors() -> tuple[type, ...]:
    """The errors an exchanging entry point sends as its verdict: ValueError, and in check mode TypeError
    too (outside it a wrong argument type stays local, Note [Collective verdicts])."""
    return (ValueError, TypeError) if is_check_mode() else (ValueError,)


def decide(op: str, group, size: int, validate, *args):
    """Run this rank's argument checks ``validate(*args)`` and return its result, collectively in check mode.

    Outside check mode (or with one rank, or while compiling) the checks raise here, on this rank. In check
    mode every rank's verdict, error or none, travels in one small all-gather and every rank raises the
    same error naming the failing ranks and their messages, so no rank is left waiting in a collective.
    """
    if size == 1 or not is_check_mode() or torch.compiler.is_compiling():
        return validate(*args)
    try:
        result, error = validate(*args), None
    except (TypeError, ValueError) as e:
        result, error = None, e
    _, rows = gather_meta(None, group, extra=encode_verdict(error))
    raise_verdicts(op, rows)
    return result
