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


def _group_key(group) -> str:
    """A key for the group that every rank derives alike (an object's address is not: a group created
    again may reuse it on one rank only)."""
    return getattr(group, "group_name", "") if group is not None else ""


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
    signature = (op, tuple(comm.ranks), _group_key(comm.group)) + tuple(
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


def check_window(window_size) -> tuple[int, int]:
    """``window_size`` as a pair of ints >= -1 (-1: unbounded on that side)."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size
    )
    if not ok:
        raise ValueError(
            f"`window_size` must be a pair (left, right) of ints >= -1 (-1: unbounded on that side), got "
            f"{window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    """``softcap`` as a finite float >= 0 (0: off)."""
    is_real = isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
    if not is_real or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"`softcap` must be a finite float >= 0 (0 disables it), got {softcap!r}")
    return float(softcap)


def check_attention_mask(attention_mask, q: torch.Tensor) -> None:
    """``attention_mask``: None or a bool (batch, local_seq) tensor on q's device (True = attend)."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dtype != torch.bool:
        raise TypeError(
            f"`attention_mask` must have dtype torch.bool (True = attend), got {attention_mask.dtype}; "
            "convert a 0/1 mask with `mask.bool()`"
        )
    expected = (q.shape[0], q.shape[1])
    if tuple(attention_mask.shape) != expected:
        raise ValueError(
            f"`attention_mask` must have shape (batch, local_seq) = {expected} (this rank's shard of the key "
            f"padding mask), got {tuple(attention_mask.shape)}"
        )
    if attention_mask.device != q.device:
        raise ValueError(f"`attention_mask` is on {attention_mask.device}, but q is on {q.device}")


def check_cu_seqlens(cu_seqlens, global_len: int) -> tuple[int, ...] | None:
    """``cu_seqlens`` as a tuple of ints: 0, strictly increasing, ending at ``global_len``.

    A CUDA tensor is read back to the host (one sync); pass a CPU tensor or a list to avoid it.
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(
                "`cu_seqlens` must be a 1-D integer tensor (num_docs + 1,), got "
                f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
            )
        values = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens
    ):
        values = tuple(cu_seqlens)
    else:
        raise TypeError(f"`cu_seqlens` must be a 1-D integer tensor or a list of ints, got {cu_seqlens!r}")
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0 and hold at least one document, got {list(values)[:8]}")
    bad = next((i for i in range(1, len(values)) if values[i] <= values[i - 1]), None)
    if bad is not None:
        raise ValueError(
            f"`cu_seqlens` must be strictly increasing (every document at least one token), got "
            f"{values[bad - 1]} then {values[bad]} at index {bad}"
        )
    if values[-1] != global_len:
        raise ValueError(
            f"`cu_seqlens` must end at the global sequence length {global_len} (local_seq x ring size), "
            f"got {values[-1]}"
        )
    return values


def cu_seqlens_digest(values: tuple[int, ...] | None) -> int:
    """A 63-bit digest of the document boundaries, so ranks can check they were given the same ones."""
    if values is None:
        return -1
    import hashlib

    data = struct.pack(f"<{len(values)}q", *values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
