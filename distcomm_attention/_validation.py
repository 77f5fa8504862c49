r"""Input validation of the attention's entry points: every input error decided by all ranks together.

Every check of a call's inputs runs on each rank without raising (:func:`verdict`); the verdicts and a
small metadata vector (shapes, dtypes, options) then travel in one exchange (:func:`verify_across_ring`), and
every rank raises the same error: the input errors, naming each rank that found one and its message, else the
fields the ranks of a ring disagree on, with each rank's values in the caller's terms (shapes and dtypes,
layout names, floats, True/False, document boundaries). The texts travel in a second exchange that only an
error pays for.

Note [Collective verdicts]
    A check that raises on one rank while its peers go on into a collective leaves the peers waiting until the
    process group's timeout (30 minutes on gloo). So no input check of a communicating entry point raises
    where it runs: each rank computes its verdict, and the verdicts are decided together.

        rank 0:  checks -> ok       \                        / raise E (names rank 1) \
                                      > exchange(verdicts) -<                          > or all run
        rank 1:  checks -> error E  /                        \ raise E                /

    The exchange runs on every call (a cache of verified signatures would let a rank skip it while a peer,
    whose input changed, waits in it), over the whole group (so that ranks passing different ``ring_size``
    meet), on the host: CPU tensors on gloo or an in-process group, and for NCCL a gloo group over the same
    ranks made on first use, so verification never waits for the GPU's queue. Its cost is a small host
    all-gather per call (docs/testing.md gives the measured time).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import struct
import threading
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from distcomm import _check, _groups
from distcomm.ring import RingComm

__all__ = ["check_is_tensor", "check_qkv", "check_flag", "check_scale", "Shown", "render_ints", "verdict",
           "verify_across_ring"]


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


def _finite(value) -> bool:
    """Whether a real number is a finite float (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale to use: ``head_dim ** -0.5`` for None, else a finite real number."""
    if softmax_scale is None:
        return head_dim**-0.5
    is_real = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if not is_real or not _finite(softmax_scale):
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


def _all_ints(values) -> bool:
    """Whether every element of ``values`` is an int (not a bool)."""
    kinds = set(map(type, values))
    return kinds <= {int} or all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def _is_ints(value) -> bool:
    return isinstance(value, tuple) and _all_ints(value)


def _encode(value) -> int:
    """One int64 standing for a verified option: ints and bools as themselves (ints beyond +-2^62 by a digest),
    floats by their bits, int tuples (document boundaries) by a digest of their values, anything else by a
    digest of its repr."""
    if isinstance(value, Shown):
        return _encode(value.value)
    if isinstance(value, int) and -(2**62) <= value < 2**62:
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


def _tensor_code(t) -> list[int]:
    """A tensor's dims, dtype and shape as ints; ``-1`` in front for what is not a tensor of at most
    ``MAX_DIMS`` dims (this rank's verdict then says why)."""
    if not isinstance(t, torch.Tensor) or t.dim() > _check.MAX_DIMS:
        return [-1, -1] + [0] * _check.MAX_DIMS
    return [t.dim(), _check.dtype_code(t.dtype)] + list(t.shape) + [0] * (_check.MAX_DIMS - t.dim())


# The exception types a verdict may carry, by code (0: no error); anything else travels as RuntimeError.
_ERRORS = (None, TypeError, ValueError, ImportError, NotImplementedError, RuntimeError, OverflowError)


_PENDING = threading.local()  # an input error found before the call's own checks (``pending_error``)


@contextlib.contextmanager
def pending_error(error: BaseException):
    """Inside: the next :func:`verdict` on this thread returns ``error`` as its rank's verdict, without running
    its checks. For an entry point that checks its own input before calling a communicating one (a module's
    ``x``): the call it makes with stand-in tensors then raises ``error`` on every rank, after the exchange,
    instead of this rank raising alone while its peers wait in the call (Note [Collective verdicts])."""
    before = getattr(_PENDING, "error", None)
    _PENDING.error = error
    try:
        yield
    finally:
        _PENDING.error = before


def verdict(fn, *args, **kwargs):
    """``(fn(...), None)``, or ``(None, error)`` for an input error (TypeError, ValueError, ImportError,
    NotImplementedError): this rank's verdict, to be raised by every rank after the exchange
    (Note [Collective verdicts]). Inside :func:`pending_error`, that error, once."""
    pending = getattr(_PENDING, "error", None)
    if pending is not None:
        _PENDING.error = None
        return None, pending
    try:
        return fn(*args, **kwargs), None
    except (TypeError, ValueError, ImportError, NotImplementedError, OverflowError) as e:
        return None, e


def _error_code(error: BaseException | None) -> list[int]:
    if error is None:
        return [0, 0]
    kind = next((i for i, t in enumerate(_ERRORS) if t is not None and type(error) is t), None)
    if kind is None:
        kind = next(i for i, t in enumerate(_ERRORS) if t is not None and isinstance(error, t))
    return [kind, _digest(str(error).encode())]


_TEXT_BYTES = 256  # per field and rank in the second exchange of a disagreement
_ERROR_BYTES = 1024  # per rank: the text of an input error
_HINTS = {
    "layout": "pass the same `layout=` (or `sharding=`) on every rank",
    "balance_window": "shard the documents with the same balance_window (Sharding(..., balance_window=) or "
                      "shard_sequence(..., balance_window=)) on every rank",
    "requires_grad": "the inputs must need grad on every rank or on none (q, k and v for attention; a rank without "
                     "grads would skip the backward its peers wait in)",
    "ring_size": "pass the same `ring_size=` (or `sharding=`) on every rank of the group",
    "strategy": "pass the same `strategy=` on every rank; with strategy='auto', the same `hardware=`, `backend=` "
                "and inputs too (the ranks' picks differ)",
}


def _positions(ranks: list[int], what: str = "ring position") -> str:
    """``[0]`` -> "ring position 0"; ``[0, 2, 3, 4]`` -> "ring positions 0, 2-4"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"{what}{'s' if len(ranks) > 1 else ''} {text}"


def _describe(op: str, names: list[str], texts: list[list[str]], where: str = "the ring",
              what: str = "ring position", labels: list[int] | None = None) -> str:
    """The message of a disagreement: the differing fields, and each group of ring positions with the values
    it passed (``texts[r][i]``: ring position r's value of ``names[i]``; ``labels[r]``: the number it is named
    by, default r)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for pos, row in enumerate(texts):
        groups.setdefault(tuple(row), []).append(pos if labels is None else labels[pos])
    clauses = [
        f"{_positions(ranks, what)}: " + ", ".join(f"{name}={text}" for name, text in zip(names, row))
        for row, ranks in groups.items()
    ]
    hints = "".join(f"; {_HINTS[n]}" for n in names if n in _HINTS)
    fields = ", ".join(f"`{n}`" for n in names)
    return (
        f"{op}: the ranks of {where} disagree on {fields} ({'; '.join(clauses)}); every rank of "
        f"{'the ring' if where.startswith('the ring') else where} must pass the same shapes, dtypes and "
        f"options{hints}"
    )


def _exchange_texts(comm: RingComm, texts: list[str], device: torch.device,
                    size: int = _TEXT_BYTES) -> list[list[str]]:
    """Every ring member's ``texts`` (the same number everywhere), each cut to ``size`` bytes of UTF-8."""
    row: list[int] = []
    for text in texts:
        data = text.encode()
        if len(data) > size:
            data = data[: size - 3] + b"..."
        data = data.ljust(size, b"\0")
        row += [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, size, 8)]
    per = size // 8
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


def _errors_text(op: str, whole: RingComm, device, codes: list[list[int]], error: BaseException | None) -> str:
    """The input errors some ranks found (``codes[g]``: group rank g's error code), each rank named."""
    failed = [g for g, code in enumerate(codes) if code[0]]
    texts = [row[0] for row in _exchange_texts(whole, ["" if error is None else str(error)], device, _ERROR_BYTES)]
    by_text: dict[str, list[int]] = {}
    for g in failed:
        by_text.setdefault(texts[g], []).append(whole.ranks[g])
    clauses = "; ".join(f"{_positions(ranks, 'rank')}: {text}" for text, ranks in by_text.items())
    others = " (the other ranks' inputs passed; every rank raises this error)" if len(failed) < len(codes) else ""
    return f"{op}: invalid input on {clauses}{others}"


def verify_across_ring(
    op: str,
    comm: RingComm | None,
    tensors: dict[str, object],
    extra: dict[str, object] | None = None,
    *,
    error: BaseException | None = None,
    mesh: bool = False,
) -> None:
    """Raise the same error on every rank of ``comm``'s group unless no rank found an input error (``error``:
    this rank's, see :func:`verdict`) and the ranks of each ring agree on ``tensors``' shapes and dtypes and on
    the ``extra`` options (Note [Collective verdicts]). ``mesh``: ``comm`` is a 2-D mesh's ranks in a row, not
    a ring: where any rank says so, a disagreement names the ranks by their ranks in the default group.

    ``extra`` values are bools, ints, floats, strings, None, tuples of ints (compared by a digest) or
    :class:`Shown`. One exchange of one int per option (and 2 + MAX_DIMS per tensor, 2 for the verdict, 1 for ``mesh``), over
    the host; only when a rank failed or the ranks disagree, a second exchange of the errors and the differing
    fields as text, so that the message (the same on every rank, of the first failing rank's exception type,
    else ValueError) names each failing rank with its error, each differing field and every rank's value as
    the user wrote it.
    """
    if comm is None:
        if error is not None:
            raise error
        return
    whole, device = _exchange_comm(comm)
    if whole.size == 1:
        if error is not None:
            raise error
        return
    extra = {**(extra or {}), "ring_size": comm.size}
    names = list(tensors) + list(extra)
    values = list(tensors.values()) + list(extra.values())
    codes = [_tensor_code(t) for t in tensors.values()] + [[_encode(v)] for v in extra.values()]
    rows = whole.all_gather_ints([int(mesh)] + _error_code(error) + [x for code in codes for x in code], device)
    on_mesh = any(r[0] for r in rows)  # some rank's call is over a mesh: every rank names the ranks alike
    verdicts, rows = [r[1:3] for r in rows], [r[3:] for r in rows]
    # Every rank holds the same rows, so every rank finds the same fields and joins the second exchange.
    sizes = {r[-1] for r in rows}  # ring_size comes last
    rings = [list(range(len(rows)))] if len(sizes) > 1 else \
        [list(range(s, s + comm.size)) for s in range(0, len(rows), comm.size)]
    differing, spans, start = [], [], 0
    for i, code in enumerate(codes):
        end = start + len(code)
        if any(rows[g][start:end] != rows[ring[0]][start:end] for ring in rings for g in ring):
            differing.append(i)
            spans.append((start, end))
        start = end
    failed = [v[0] for v in verdicts if v[0]]
    if failed:  # a failing rank's options may be unread: only its tensors' shapes and dtypes are facts
        kept = [j for j, i in enumerate(differing)
                if i < len(tensors) and all(row[spans[j][0]] != -1 for row in rows)]
        differing, spans = [differing[j] for j in kept], [spans[j] for j in kept]
    if not failed and not differing:
        return
    parts = [_errors_text(op, whole, device, verdicts, error)] if failed else []
    if differing:
        parts.append(_disagreement(op, whole, device, comm.size, rings, len(sizes) > 1 or on_mesh, rows, spans,
                                   [names[i] for i in differing], [values[i] for i in differing],
                                   "the mesh" if on_mesh else "the group"))
    raise (_ERRORS[failed[0]] if failed else ValueError)("; and ".join(parts)) from error


def _disagreement(op, whole, device, ring_size, rings, by_rank, rows, spans, names, values, where) -> str:
    """The message naming the fields (``names``, this rank's ``values``) the ranks of some ring disagree on;
    ``by_rank``: every rank of ``where`` named by its rank in the default group."""
    texts = _exchange_texts(whole, [_render(v) for v in values], device)
    for j, (lo, hi) in enumerate(spans):  # long boundary lists that differ only where they are not shown
        seen: dict[str, set] = {}
        for g, row in enumerate(rows):
            seen.setdefault(texts[g][j], set()).add(tuple(row[lo:hi]))
        for g, row in enumerate(rows):
            if len(seen[texts[g][j]]) > 1:
                texts[g][j] += f" (digest {row[lo] & 0xFFFFFFFF:08x})"
    if by_rank:
        return _describe(op, names, texts, where, "rank", list(whole.ranks))
    if len(rows) == ring_size:
        return _describe(op, names, texts)
    parts = []
    for ring in rings:
        if all(rows[g][lo:hi] == rows[ring[0]][lo:hi] for g in ring for lo, hi in spans):
            continue
        where = f"the ring of global ranks {whole.ranks[ring[0]]}-{whole.ranks[ring[-1]]}"
        parts.append(_describe(op, names, [texts[g] for g in ring], where))
    return " | ".join(parts)


# global ranks -> a gloo group over them (NCCL groups' twins), registered with torch.distributed, which keeps
# it until destroy_process_group(); held weakly here so that it is not destroyed later, at the interpreter's
# exit (Note [Groups held weakly] in distcomm/_groups.py)
_HOST_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


# a process group -> the ring over the whole of it that verification exchanges over, on the host (``_exchange_comm``)
_EXCHANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _exchange_comm(comm: RingComm) -> tuple[RingComm, torch.device]:
    """The whole group of ``comm`` as a ring, and the device its small exchanges run on: the host (gloo or an
    in-process group: CPU tensors; NCCL: a gloo twin over the same ranks, made once), so that verification never
    waits for the GPU (Note [Collective verdicts]). Looked up once per group (on the host: a group's twin and
    backend do not change while it lives)."""
    group = comm.group
    hit = None if group is None else _EXCHANGES.get(group)
    if hit is not None:
        return hit, torch.device("cpu")
    whole, device = _exchange_comm_of(comm)
    if group is not None and device.type == "cpu":
        _EXCHANGES[group] = whole
    return whole, device


def _exchange_comm_of(comm: RingComm) -> tuple[RingComm, torch.device]:
    whole = comm if comm.size == _groups.group_size(comm.group) else RingComm(comm.group)
    if whole.size == 1:
        return whole, torch.device("cpu")
    try:
        backend = str(dist.get_backend(whole.group)).lower()
    except (RuntimeError, ValueError):
        backend = ""
    if "nccl" not in backend or "gloo" in backend:
        return whole, torch.device("cpu")
    if not dist.is_initialized():  # a group made without a default group: exchange on its own device
        return whole, torch.device("cuda", torch.cuda.current_device())
    key = tuple(whole.ranks)
    twin = _HOST_GROUPS.get(key)
    if twin is None:
        twin = _HOST_GROUPS[key] = dist.new_group(list(key), backend="gloo", use_local_synchronization=True)
    return RingComm(twin), torch.device("cpu")


def check_window(window_size) -> tuple[int, int]:
    """``window_size`` as a pair of ints >= -1 (-1: unbounded on that side)."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and -1 <= w < 2**62 for w in window_size
    )
    if not ok:
        raise ValueError(
            f"`window_size` must be a pair (left, right) of ints in [-1, 2^62) (-1: unbounded on that side), got "
            f"{window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    """``softcap`` as a finite float >= 0 (0: off)."""
    is_real = isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
    if not is_real or not _finite(softcap) or softcap < 0:
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


def boundaries_on_host(cu_seqlens):
    """``cu_seqlens`` on the host for a whole call: a 1-D tensor on a device is read back once here (one sync)
    instead of by every step that plans from it; anything else as given (``check_cu_seqlens`` judges it)."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu" and cu_seqlens.dim() == 1:
        return cu_seqlens.cpu()
    return cu_seqlens


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
    elif isinstance(cu_seqlens, (list, tuple)) and _all_ints(cu_seqlens):
        values = tuple(cu_seqlens)
    else:
        raise TypeError(f"`cu_seqlens` must be a 1-D integer tensor or a list of ints, got {cu_seqlens!r}")
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0 and hold at least one document, got {list(values)[:8]}")
    bad = None if all(map(operator.lt, values, values[1:])) else \
        next(i for i in range(1, len(values)) if values[i] <= values[i - 1])
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


