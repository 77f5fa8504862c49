"""Input validation for ring attention: per-rank facts before any communication, cross-rank facts once.

Per-rank facts (types, ranks of tensors, dtypes, devices, head counts, lengths vs the layout) raise at once
on the rank that sees them. Cross-rank facts (shapes, dtypes, layout and mask that differ between the ring's
ranks) would make the ring hang or compute garbage: :func:`verify_across_ring` exchanges a small metadata
vector around the ring and every rank of the ring raises the same ValueError, naming the fields that differ
and each rank's values in the caller's terms (shapes and dtypes, layout names, floats, True/False, document
boundaries); those values travel in a second exchange that only a disagreement pays for. In distcomm's check mode the
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

import hashlib
import math
import struct
from typing import NamedTuple

import torch

from distcomm import _check
from distcomm.ring import RingComm

__all__ = ["check_is_tensor", "check_qkv", "check_flag", "check_scale", "Shown", "render_ints", "verify_across_ring"]

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


class Shown(NamedTuple):
    """A verified option compared by ``value`` alone and shown in a disagreement as ``text`` (e.g. a layout
    with where it came from: ``Shown("zigzag", "'zigzag' (recorded by shard_sequence)")``)."""

    value: object
    text: str


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _is_ints(value) -> bool:
    return isinstance(value, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _encode(value) -> int:
    """One int64 standing for a verified option: ints and bools as themselves, floats by their bits, int
    tuples (document boundaries) by a digest of their values, anything else by a digest of its repr."""
    if isinstance(value, Shown):
        return _encode(value.value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float_bits(value)
    if _is_ints(value):
        return _digest(struct.pack(f"<{len(value)}q", *value))
    return _digest(repr(value).encode())


def render_ints(values: tuple[int, ...], *, head: int = 4, tail: int = 2) -> str:
    """A list of ints as written, or its first and last entries and its length when it is long."""
    if len(values) <= head + tail + 1:
        return str(list(values))
    shown = ", ".join(map(str, values[:head])) + ", ..., " + ", ".join(map(str, values[-tail:]))
    return f"[{shown}] ({len(values)} entries)"


def _render(value) -> str:
    """A verified value in the user's terms: shape and dtype of a tensor, True/False, floats as floats,
    strings quoted, boundaries as a list."""
    if isinstance(value, Shown):
        return value.text
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    if _is_ints(value):
        return render_ints(value)
    return repr(value)


def _tensor_code(t: torch.Tensor, op: str) -> list[int]:
    if t.dim() > _check.MAX_DIMS:
        raise ValueError(f"{op}: tensors of more than {_check.MAX_DIMS} dims are not supported")
    return [t.dim(), _check.dtype_code(t.dtype)] + list(t.shape) + [0] * (_check.MAX_DIMS - t.dim())


_TEXT_BYTES = 256  # per field and rank in the second exchange of a disagreement
_HINTS = {
    "layout": "pass the same `layout=` (or `sharding=`) on every rank",
    "balance_window": "shard the documents with the same balance_window (Sharding(..., balance_window=) or "
                      "shard_sequence(..., balance_window=)) on every rank",
    "requires_grad": "q, k and v must need grad on every rank or on none (a rank without grads would skip the "
                     "backward its peers wait in)",
}


def _positions(ranks: list[int]) -> str:
    """``[0]`` -> "ring position 0"; ``[0, 2, 3, 4]`` -> "ring positions 0, 2-4"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"ring position{'s' if len(ranks) > 1 else ''} {text}"


def _describe(op: str, names: list[str], texts: list[list[str]]) -> str:
    """The message of a disagreement: the differing fields, and each group of ring positions with the values
    it passed (``texts[r][i]``: ring position r's value of ``names[i]``)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for pos, row in enumerate(texts):
        groups.setdefault(tuple(row), []).append(pos)
    clauses = [
        f"{_positions(ranks)}: " + ", ".join(f"{name}={text}" for name, text in zip(names, row))
        for row, ranks in groups.items()
    ]
    hints = "".join(f"; {_HINTS[n]}" for n in names if n in _HINTS)
    fields = ", ".join(f"`{n}`" for n in names)
    return (
        f"{op}: the ranks of the ring disagree on {fields} ({'; '.join(clauses)}); every rank of the ring must "
        f"pass the same shapes, dtypes and options{hints}"
    )


def _exchange_texts(comm: RingComm, texts: list[str], device: torch.device) -> list[list[str]]:
    """Every ring member's ``texts`` (the same number everywhere), each cut to ``_TEXT_BYTES`` bytes of UTF-8."""
    row: list[int] = []
    for text in texts:
        data = text.encode()
        if len(data) > _TEXT_BYTES:
            data = data[: _TEXT_BYTES - 3] + b"..."
        data = data.ljust(_TEXT_BYTES, b"\0")
        row += [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, _TEXT_BYTES, 8)]
    per = _TEXT_BYTES // 8
    out = []
    for ints in comm.all_gather_ints(row, device):
        raw = [b"".join(x.to_bytes(8, "little", signed=True) for x in ints[i * per : (i + 1) * per])
               for i in range(len(texts))]
        out.append([r.rstrip(b"\0").decode(errors="ignore") for r in raw])
    return out


def _group_key(group) -> str:
    """A key for the group that every rank derives alike (an object's address is not: a group created
    again may reuse it on one rank only)."""
    return getattr(group, "group_name", "") if group is not None else ""


def verify_across_ring(
    op: str,
    comm: RingComm | None,
    tensors: dict[str, torch.Tensor],
    extra: dict[str, object] | None = None,
) -> None:
    """Raise the same ValueError on every rank of the ring unless all ranks agree on ``tensors``' shapes and
    dtypes and on the ``extra`` options. Outside check mode, each signature is verified once (see
    Note [Verified signatures]).

    ``extra`` values are bools, ints, floats, strings, None, tuples of ints (compared by a digest) or
    :class:`Shown`. One exchange of one int per option (and 2 + MAX_DIMS per tensor); only when the ranks
    disagree, a second exchange of the differing fields as text, so that the message (the same on every
    rank) names each differing field and every rank's value as the user wrote it.
    """
    if comm is None or comm.size == 1:
        return
    extra = extra or {}
    names = list(tensors) + list(extra)
    values = list(tensors.values()) + list(extra.values())
    codes = [_tensor_code(t, op) for t in tensors.values()] + [[_encode(v)] for v in extra.values()]
    row = [x for code in codes for x in code]
    signature = (op, tuple(comm.ranks), _group_key(comm.group), tuple(names), tuple(row),
                 tuple(t.device.type for t in tensors.values()))
    if not _check.is_check_mode() and signature in _verified:
        return
    device = next(iter(tensors.values())).device
    rows = comm.all_gather_ints(row, device)
    if all(r == rows[0] for r in rows):
        _verified.add(signature)
        return
    # Every rank holds the same rows, so every rank finds the same fields and joins the second exchange.
    differing, spans, start = [], [], 0
    for i, code in enumerate(codes):
        end = start + len(code)
        if any(r[start:end] != rows[0][start:end] for r in rows):
            differing.append(i)
            spans.append((start, end))
        start = end
    texts = _exchange_texts(comm, [_render(values[i]) for i in differing], device)
    for j, (lo, hi) in enumerate(spans):  # long boundary lists that differ only where they are not shown
        seen: dict[str, set] = {}
        for r, row in enumerate(rows):
            seen.setdefault(texts[r][j], set()).add(tuple(row[lo:hi]))
        for r, row in enumerate(rows):
            if len(seen[texts[r][j]]) > 1:
                texts[r][j] += f" (digest {row[lo] & 0xFFFFFFFF:08x})"
    raise ValueError(_describe(op, [names[i] for i in differing], texts))


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


