"""Cross-rank metadata exchange and the opt-in check mode.

A shape or dtype that differs between ranks makes most collectives hang or silently corrupt memory. With
checking on (``distcomm.check_mode()`` as a context manager, ``distcomm.set_check_mode(True)``, or
``DISTCOMM_CHECK=1`` in the environment) every op first exchanges a small metadata vector and every rank
raises the same ``ValueError`` when the ranks disagree. Off by default: the exchange costs a host sync.
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
    "dtype_code",
    "raise_mismatch",
    "require_agreement",
    "check_same",
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
    """``[ndim, dtype code, *shape, 0-padding]`` (2 + MAX_DIMS ints) of ``tensor``; ``[-1, -1, 0...]`` for None."""
    if tensor is None:
        return [-1, -1] + [0] * MAX_DIMS
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensors of more than {MAX_DIMS} dims are not supported, got shape {tuple(tensor.shape)}")
    return [tensor.dim(), dtype_code(tensor.dtype)] + list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())


def decode_meta(row: list[int]) -> TensorMeta | None:
    """The inverse of :func:`encode_meta`: ``TensorMeta`` (dtype None if the code is unknown here) or None."""
    ndim, code = row[0], row[1]
    if ndim < 0:
        return None
    return TensorMeta((tuple(row[2 : 2 + ndim]), _DTYPE_BY_CODE.get(code)))


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
    op: str, tensor: torch.Tensor, group=None, *, free_dim: int | None = None, requires_grad: bool | None = None
) -> list:
    """Verify (in check mode) that every rank's tensor has the same dtype and shape, except along
    ``free_dim``, and, when ``requires_grad`` is given, that every rank passes the same flag (whether the
    input needs a backward, itself a collective).

    Returns the gathered metadata (empty when check mode is off).
    """
    if not is_check_mode() or _groups.group_size(group) == 1:
        return []
    if requires_grad is None:
        metas = gather_meta(tensor, group)
    else:
        metas, extras = gather_meta(tensor, group, extra=[int(requires_grad)])
    ref = metas[0]
    for m in metas:
        if m.dtype != ref.dtype:
            raise_mismatch(op, "dtypes", metas)
        if len(m.shape) != len(ref.shape):
            raise_mismatch(op, "shapes", metas)
        for d, (a, b) in enumerate(zip(m.shape, ref.shape)):
            if a != b and d != (free_dim % len(ref.shape) if free_dim is not None and ref.shape else None):
                raise_mismatch(op, "shapes", metas)
    if requires_grad is not None:
        require_agreement(op, "requires_grad", [e[0] for e in extras])
    return metas
