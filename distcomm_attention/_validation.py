"""Input validation for ring attention: per-rank facts before any communication, cross-rank facts once.

Per-rank facts (types, ranks of tensors, dtypes, devices, head counts, lengths vs the layout) raise at once
on the rank that sees them. Cross-rank facts (shapes, dtypes, layout and mask that differ between the ring's
ranks) would make the ring hang or compute garbage: :func:`verify_across_ring` exchanges a small metadata
vector around the ring and every rank of the ring raises the same ValueError. In distcomm's check mode the
exchange comes first and the per-rank shape checks after it, so that a rank whose shapes differ from its
peers' (e.g. a local length the layout cannot split on one rank only) fails together with them instead of
raising alone while they wait in the exchange.

Note [Verified signatures]
    Exchanging metadata costs a host sync, so outside distcomm's check mode it happens once per new
    signature (ring members, shapes, dtypes, options) and the verified signatures are remembered. A
    signature is new on every rank at the same call as long as the ranks call with the same shapes, and
    a disagreement is caught the first time it appears together with a new signature. A rank that
    changes its shapes alone, after the ring verified the old ones, is caught only in check mode
    (``distcomm.check_mode()`` or DISTCOMM_CHECK=1), which verifies every call. The exchange runs inside
    the ring only (a ring all-gather), so rings of one group never wait for each other.
"""

from __future__ import annotations

import math
import struct

import torch

from distcomm import _check
from distcomm.ring import RingComm

__all__ = ["check_is_tensor", "check_qkv", "check_flag", "check_scale", "verify_across_ring"]

_DTYPE_CODES = {dt: i for i, dt in enumerate(_check._DTYPES)}
_verified: set[tuple] = set()


def check_is_tensor(name: str, value) -> None:
    """Raise TypeError unless ``value`` is a torch.Tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")


def check_qkv(q, k, v) -> None:
    """Per-rank checks of the attention inputs (shapes (B, n, H, D) and (B, n, Hkv, D))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"`{name}` must have 4 dims (batch, local_seq, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have the same dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    b, n, heads, head_dim = q.shape
    if k.shape[0] != b or k.shape[1] != n:
        raise ValueError(
            "k and v must have q's batch size and local sequence length (batch, local_seq, kv_heads, head_dim), "
            f"got q={tuple(q.shape)}, k={tuple(k.shape)}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"q, k, v must have the same head_dim, got q: {head_dim}, k/v: {k.shape[3]}")
    kv_heads = k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) (grouped-query attention: query head "
            "h uses kv head h // (heads // kv_heads))"
        )
    if head_dim == 0:
        raise ValueError(f"head_dim must be >= 1, got shape {tuple(q.shape)}")


def check_flag(name: str, value) -> None:
    """Raise TypeError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__} {value!r}")


def check_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale to use: ``head_dim ** -0.5`` for None, else a finite real number."""
    if softmax_scale is None:
        return head_dim**-0.5
    is_real = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if not is_real or not math.isfinite(softmax_scale):
        raise ValueError(f"`softmax_scale` must be a finite float or None, got {softmax_scale!r}")
    return float(softmax_scale)


def float_bits(value: float) -> int:
    """The bit pattern of a float64 as an int, so a float can travel in an int metadata vector."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _describe(op: str, names: list[str], rows: list[list[int]], extra_names: list[str]) -> str:
    per_rank = []
    for pos, row in enumerate(rows):
        parts, i = [], 0
        for name in names:
            ndim, code = row[i], row[i + 1]
            dtype = _check._DTYPES[code] if 0 <= code < len(_check._DTYPES) else "?"
            parts.append(f"{name}={tuple(row[i + 2 : i + 2 + ndim])} {dtype}")
            i += 2 + _check.MAX_DIMS
        parts += [f"{n}={val}" for n, val in zip(extra_names, row[i:])]
        per_rank.append(f"ring position {pos}: " + ", ".join(parts))
    return f"{op}: the ranks of the ring disagree on shapes, dtypes or options ({'; '.join(per_rank)})"


def verify_across_ring(
    op: str,
    comm: RingComm | None,
    tensors: dict[str, torch.Tensor],
    extra: dict[str, int] | None = None,
) -> None:
    """Raise the same ValueError on every rank of the ring unless all ranks agree on ``tensors``' shapes and
    dtypes and on the ``extra`` ints. Outside check mode, each signature is verified once (see
    Note [Verified signatures])."""
    if comm is None or comm.size == 1:
        return
    extra = extra or {}
    signature = (op, tuple(comm.ranks), id(comm.group)) + tuple(
        (name, tuple(t.shape), t.dtype, t.device.type) for name, t in tensors.items()
    ) + tuple(extra.items())
    if not _check.is_check_mode() and signature in _verified:
        return
    row: list[int] = []
    for t in tensors.values():
        if t.dim() > _check.MAX_DIMS:
            raise ValueError(f"{op}: tensors of more than {_check.MAX_DIMS} dims are not supported")
        row += [t.dim(), _DTYPE_CODES.get(t.dtype, len(_check._DTYPES))] + list(t.shape)
        row += [0] * (_check.MAX_DIMS - t.dim())
    row += list(extra.values())
    rows = comm.all_gather_ints(row, next(iter(tensors.values())).device)
    if any(r != rows[0] for r in rows):
        raise ValueError(_describe(op, list(tensors), rows, list(extra)))
    _verified.add(signature)
