"""The sparse all-gather of keys and the sparse reduce-scatter of their gradients (Note [Exchange plan]).

Note [Sparse gather]
    With an exchange plan ``ex`` the all-gather KV strategy gathers, on rank r, only the keys its queries can
    see: rank s sends rank r its rows need[s][r] (one all-to-all-v per tensor), and rank r places them at
    the compacted buffer rows of those keys' global positions (the union U_r in natural order):

        rank r:  post all_to_all_v(k_r[need[r][d]] for d != r)    (the others' rows in flight, posted first)
                 buffer[own]  = its own needed rows              (placed meanwhile, nothing on the wire)
                 ... blocks that read own rows only run here (``plans.split_local``) ...
                 buffer[remote] = what arrived                    (wait)

    Where those blocks read the shard itself (own rows by runs: ``AllGatherKV.own_keys_in_shard``, forward and
    backward), only the own rows the other blocks read (documents crossing into the shard) are placed; the
    buffer's other own rows stay unset, read by nothing.

    The backward is the adjoint: the buffer's dK/dV rows go back to their owners (all-to-all-v with the
    splits exchanged), and each owner adds every rank's contribution to its rows (``index_add_``, in fp32).
    It is posted and waited apart (``post_scatter_add``): the remote rows leave at the post, the own rows are
    read at the wait, so the blocks reading own rows only run in between (Note [All-gather KV]).
    A rank's own rows keep their order in the buffer, between the few remote rows of documents that cross
    its boundaries: when they form at most ``MAX_RUNS`` runs (both in the shard and in the buffer) they are
    placed and read back by one slice copy per run instead of an index gather and scatter, and when they are
    every row of the shard the gradient's rows are all written by those copies (no zero fill, no index_add).
    The rows that travel form runs too (the keys of documents crossing a boundary): up to 4 x MAX_RUNS runs,
    what is sent is taken by one concatenation of slices (one kernel) and what arrives is placed by one slice
    copy per run up to MAX_RUNS runs, else by one row scatter (``index_copy_``; never an index put, which reads
    every element through its index).
    An exchange in which no rank sends another anything (every document on one rank) is skipped by every
    rank: rank r's buffer is then its own rows.

    Direct pieces. The rows s sends r split into pieces, maximal runs of consecutive rows of s at consecutive
    positions: each lands on consecutive rows of r's buffer (the buffer is in position order, and no other
    needed key lies between two consecutive positions). Both ends derive the same pieces from the plan, so
    when every rank has at least one and at most MAX_PIECES of them (sent and received; decided from the
    plan, alike on every rank) the exchange goes as one group of point-to-point transfers
    (``Transport.exchange``): each piece leaves as a view of the shard and arrives in its buffer slice, with
    no pack before the wire and no place after it; the gradients go back the same way, each piece added to
    its owner's rows. Otherwise it is the all-to-all-v above: where some rank has more (a striped layout:
    pieces of one row), and where some rank has none, since every rank then takes part in every group of
    transfers (NCCL's batched point-to-point transfers need every rank of the group in its first one; a
    group may meet the exchange first). A transport without ``exchange`` also gets the all-to-all-v.
    The gradients several ranks return for the same piece (a document's keys that every later rank of it
    reads) land in one tensor and are summed by one reduction (in fp32) before they meet the owner's sums.

    What goes home. A rank's gradient for another rank's key row is one partial, sent once and summed by the
    owner in fp32 with the others' and its own (no chain of hops adds to it, as in the ring's or a
    reduce-scatter's). Where the backward kernel returns its dK/dV in the inputs' dtype (``dkv_in_input_dtype``:
    flash-attn-4, which sums a GQA group's query heads inside, in fp32) the partial travels in that dtype
    (``allgather.return_dtype``), half the bytes of fp32 for bf16 and fp16: a row one kernel call wrote crosses
    unchanged, the same values as in fp32; a row two calls reached is one addition in that dtype (computed in
    fp32, rounded once), three or more are summed in fp32 and rounded once (windows, a rank's two runs of one
    document). With the other kernels it travels in fp32, as before (Triton and torch return fp32 dK/dV; cuDNN
    and flash-attn-2 sum a GQA group's heads in fp32 outside the kernel). The ranks verify that their kernels
    agree on it (``prepare``'s field "sparse dK/dV home in"), so every rank sends and receives in one dtype. The
    dense all-gather's reduce-scatter keeps fp32 (Note [All-gather KV]).
"""

from __future__ import annotations

import functools

import torch

from distcomm_attention.planning import layouts
from distcomm_attention.planning.exchange import Exchange
from distcomm_attention._device import on_device
from distcomm_attention.kernels.contract import copy_all

__all__ = ["SparseGather"]


MAX_RUNS = 16  # own rows forming at most this many runs are moved by slice copies (Note [Sparse gather])
MAX_PIECES = 64  # direct transfers per rank and tensor (sent and received), else an all-to-all-v (same Note)


def _runs(src: torch.Tensor, dst: torch.Tensor, limit: int | None = None) -> tuple[tuple[int, int, int], ...] | None:
    """(src start, dst start, length) of the runs where both row indices step by one, or None when there are
    more than ``limit`` (default ``MAX_RUNS``; host tensors)."""
    if src.numel() == 0:
        return ()
    breaks = ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero().flatten() + 1
    if breaks.numel() >= (MAX_RUNS if limit is None else limit):
        return None
    starts = [0] + breaks.tolist()
    stops = starts[1:] + [src.numel()]
    return tuple((int(src[a]), int(dst[a]), b - a) for a, b in zip(starts, stops))


def _take(rows: torch.Tensor, runs, index) -> torch.Tensor:
    """Rows of ``rows`` (dim 0) in order, as one new contiguous tensor: by ``runs`` ((source row, destination
    row, length), the destinations consecutive from 0) in one concatenation of slices, else by ``index()``."""
    if runs is None:
        return rows.index_select(0, index())
    if not runs:
        return rows[:0].contiguous()
    return torch.cat([rows[a:a + length] for a, _, length in runs])


def _index(ranges) -> torch.Tensor:
    """The row indices of ranges [start, stop), as one int64 tensor."""
    if not ranges:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, b) for a, b in ranges])


class _Arrival:
    """Buffers with this rank's own rows placed; ``wait()`` places the rest and returns them (B, m, ...) (a
    bool tensor as uint8: the ring loop's convention for a key mask in flight)."""

    def __init__(self, buffers, handles, place, bools):
        self._buffers, self._handles, self._place, self._bools = buffers, handles, place, bools

    def local(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(None if b is None else b.transpose(0, 1) for b in self._buffers)

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        for i, handle in enumerate(self._handles):
            if handle is None:
                continue
            if self._place is None:  # direct pieces: already in their buffer slices
                handle.wait()
            else:
                (recv,) = handle.wait()
                if isinstance(self._place, tuple):  # runs: (arrived row, buffer row, length)
                    copy_all([self._buffers[i][at:at + length] for _, at, length in self._place],
                             [recv[a:a + length] for a, _, length in self._place])
                else:  # one row scatter (an index put would read every element through the index)
                    self._buffers[i].index_copy_(0, self._place, recv)
        self._handles = []
        return tuple(None if b is None else (b.view(torch.uint8) if bool_ else b).transpose(0, 1)
                     for b, bool_ in zip(self._buffers, self._bools))


class SparseGather:
    """Rank ``transport.rank``'s side of a call's sparse exchange (see Note [Sparse gather])."""

    def __init__(self, transport, ex: Exchange, layout):
        self.transport, self.ex = transport, ex
        (self.send_splits, self.recv_splits, self.send_index, self.own_index, self.place_own, self.place,
         self.buffer_len) = _indices(ex, layout, transport.rank)
        # (a transport without ``exchange``, one made before it was part of Note [Transport], gets the
        # all-to-all-v: the same on every rank, as every rank's transport is of one kind)
        pieces = MAX_PIECES if hasattr(transport, "exchange") else -1
        (self.skip, self.own_runs, self.own_all, self.back_runs, self.place_runs, self.pieces,
         self.returns_by_runs) = _tables(ex, layout, transport.rank, MAX_RUNS, pieces)
        # the pieces sent, grouped by the rows they cover: what comes back for them is summed per group
        self.back_groups = () if self.pieces is None else _same_rows(self.pieces[0])

    def _index(self, name: str, device: torch.device) -> torch.Tensor:
        return on_device(getattr(self, name), device)  # ``_indices``' cached tensors

    def own_ranges(self, k0: int, k1: int) -> list[tuple[int, int, int]]:
        """The own rows among buffer rows [k0, k1) as (shard row start, stop, offset from k0), by ``own_runs``."""
        out = []
        for a, at, length in self.own_runs:
            lo, hi = max(k0, at), min(k1, at + length)
            if lo < hi:
                out.append((a + lo - at, a + hi - at, lo - k0))
        return out

    def is_own(self) -> torch.Tensor:
        """(m,) bool: which buffer rows hold this rank's own keys."""
        own = torch.zeros(self.buffer_len, dtype=torch.bool)
        own[self.place_own] = True
        return own

    def post(self, *tensors: torch.Tensor | None, own: tuple | None = None) -> _Arrival:
        """Start gathering (B, n, ...) local tensors into (B, m, ...) buffers of the needed keys. ``own``: the own
        rows to place, (shard row, buffer row, length) runs inside ``own_runs`` (the other own rows of the
        buffers left unset, for a caller that reads none of them); default every own row."""
        present = [t for t in tensors if t is not None]
        device = present[0].device
        buffers, bools, shards = [], [], []
        for t in tensors:
            if t is None:
                buffers.append(None), bools.append(False), shards.append(None)
                continue
            rows = t.view(torch.uint8) if t.dtype == torch.bool else t
            rows = rows.transpose(0, 1)
            buffers.append(rows.new_empty((self.buffer_len,) + tuple(rows.shape[1:])))
            bools.append(t.dtype == torch.bool), shards.append(rows)
        handles = self._send(shards, buffers)  # every transfer posted first, the own rows placed while they travel
        runs = self.own_runs if own is None else own
        if runs is not None:  # one launch for every run of the tensors of each dtype (k and v together)
            for which in _by_dtype(shards):
                pairs = [(buffers[i][at:at + length], shards[i][a:a + length]) for i in which for a, at, length in runs]
                copy_all([dst for dst, _ in pairs], [src for _, src in pairs])
        else:
            for rows, buffer in zip(shards, buffers):
                if rows is not None:
                    buffer[self._index("place_own", device)] = rows.index_select(0, self._index("own_index", device))
        if self.pieces is not None:  # arrived in their slices: nothing to place
            place = None
        elif self.place_runs is not None and len(self.place_runs) <= MAX_RUNS:
            place = self.place_runs
        else:
            place = self._index("place", device)
        return _Arrival(buffers, handles, place, bools)

    def _send(self, shards, buffers) -> list:
        """Post the transfers of the (n, ...) ``shards`` (None: absent) into their (m, ...) ``buffers``: with
        direct pieces one exchange for the tensors of each dtype (k and v travel as one group of transfers, one
        launch and one latency), else an all-to-all-v each; the handle of each tensor (shared; None where
        nothing moves)."""
        handles = [None] * len(shards)
        if self.pieces is not None:
            sent, received = self.pieces
            for which in _by_dtype(shards):
                handle = self.transport.exchange(
                    [(peer, shards[i][a:a + length]) for i in which for peer, a, length in sent],
                    [(peer, buffers[i][at:at + length]) for i in which for peer, at, length in received])
                for i in which:
                    handles[i] = handle
        elif not self.skip:
            for i, rows in enumerate(shards):
                if rows is not None:
                    send = _take(rows, self.back_runs, lambda: self._index("send_index", rows.device))
                    handles[i] = self.transport.all_to_all_v(send, self.send_splits, self.recv_splits)
        return handles

    def gather(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """(B, n, ...) local tensors -> (B, m, ...) buffers of the needed keys (None stays None)."""
        got = self.post(*tensors).wait()
        return tuple(None if g is None else (g.view(torch.bool) if t.dtype == torch.bool else g).contiguous()
                     for g, t in zip(got, tensors))

    def post_scatter_add(self, grads, local_len: int, wire: torch.dtype | None = None) -> list[_Returning]:
        """Start sending the other ranks' rows of (B, m, ...) buffer gradients (``grads``, a sequence: dK and dV
        travel together, as one group of transfers with direct pieces) home (not to change before the wait: with
        direct pieces in a gradient's dtype they leave as views), in ``wire``'s dtype (default each gradient's;
        every rank of the exchange must pass the same); each result's ``wait()`` gives (B, n, ...) this rank's
        rows, every rank's contributions summed in the gradient's dtype (the adjoint of :meth:`gather`). The
        gradients' own rows are read at the wait: the caller may add to them meanwhile (Note [All-gather KV])."""
        shards = []
        for grad in grads:
            rows = grad.transpose(0, 1)
            if wire is not None and wire != grad.dtype:  # one conversion of the whole buffer (own rows unread)
                rows = rows.to(wire)
            shards.append(rows)
        handles = [None] * len(shards)
        if self.pieces is not None:  # each received piece's rows back to its owner, each sent piece's home
            sent, received = self.pieces
            for which in _by_dtype(shards):
                sends, recvs, groups = [], [], []
                for i in which:
                    rows = shards[i]
                    # the pieces that come back for the same rows (from several ranks) land in one tensor, summed
                    # at once
                    mine, back = [], [None] * len(sent)
                    for _, length, which_pieces in self.back_groups:
                        mine.append(rows.new_empty((len(which_pieces), length) + tuple(rows.shape[1:])))
                        for j, piece in enumerate(which_pieces):
                            back[piece] = mine[-1][j]
                    sends += [(peer, rows[at:at + length]) for peer, at, length in received]
                    recvs += list(zip((peer for peer, _, _ in sent), back))
                    groups.append(mine)
                handle = self.transport.exchange(sends, recvs)
                for j, i in enumerate(which):
                    handles[i] = _Grouped(handle, groups[j], j * len(sent), (j + 1) * len(sent))
        elif not self.skip:
            runs = None if self.place_runs is None else tuple((at, a, n) for a, at, n in self.place_runs)
            for i, rows in enumerate(shards):
                remote = _take(rows, runs, lambda: self._index("place", rows.device))
                handles[i] = self.transport.all_to_all_v(remote, self.recv_splits, self.send_splits)
        return [_Returning(self, grad.transpose(0, 1), handle, local_len) for grad, handle in zip(grads, handles)]

    def scatter_add(self, grad: torch.Tensor, local_len: int) -> torch.Tensor:
        """``post_scatter_add([grad], local_len)[0].wait()``."""
        return self.post_scatter_add([grad], local_len)[0].wait()


def _by_dtype(tensors) -> list[list[int]]:
    """The indices of the present ``tensors`` (None: absent) grouped by dtype, in order of first appearance: the
    tensors one exchange can carry together (a simulated link's stand-in data is copied element by element)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


class _Returning:
    """Buffer gradients whose remote rows are on their way to their owners (``SparseGather.post_scatter_add``)."""

    def __init__(self, sparse: SparseGather, rows: torch.Tensor, handle, local_len: int):
        self._sparse, self._rows, self._handle, self._local_len = sparse, rows, handle, local_len

    def wait(self) -> torch.Tensor:
        """(B, n, ...): the buffer's own rows now, plus what the other ranks sent back for this rank's keys."""
        sparse, rows = self._sparse, self._rows
        device = rows.device
        shape = (self._local_len,) + tuple(rows.shape[1:])
        if sparse.own_all:  # every row of the shard is an own row, in runs: copied, nothing left to zero
            out = torch.empty(shape, dtype=rows.dtype, device=device)
            copy_all([out[a:a + length] for a, _, length in sparse.own_runs],
                     [rows[at:at + length] for _, at, length in sparse.own_runs])
        else:
            out = torch.zeros(shape, dtype=rows.dtype, device=device)
            out.index_add_(0, sparse._index("own_index", device),
                           rows.index_select(0, sparse._index("place_own", device)))
        if self._handle is not None and sparse.pieces is not None:
            for (_, a, length), piece in zip(sparse.pieces[0], self._handle.wait()):
                out[a:a + length] += piece
        elif self._handle is not None:
            (back,) = self._handle.wait()
            out.index_add_(0, sparse._index("send_index", device), back.to(out.dtype))
        self._handle = self._rows = None
        return out.transpose(0, 1).contiguous()

    def add_returned(self, acc) -> None:
        """Wait and add what the other ranks sent back for this rank's keys into ``acc`` (a ``RowSum`` over the
        shard's rows), one term per run of rows (the pieces several ranks return for the same rows summed
        first, in one reduction) or per run of ``back_runs``; the buffer's own rows are not read."""
        if self._handle is not None and self._sparse.pieces is not None:
            self._handle.wait()
            for (a, length, which), group in zip(self._sparse.back_groups, self._handle.groups):
                term = group[0] if len(which) == 1 else group.sum(0, dtype=torch.promote_types(group.dtype, acc.dtype))
                acc.add(a, a + length, term.transpose(0, 1))
        elif self._handle is not None:
            (back,) = self._handle.wait()
            back = back.transpose(0, 1)
            for a, at, length in self._sparse.back_runs:
                acc.add(a, a + length, back[:, at:at + length])
        self._handle = self._rows = None


class _Grouped:
    """One gradient's part of a transfer's handle (the received pieces [lo, hi) of what it fills) and the tensors
    those pieces are slices of (``post_scatter_add``)."""

    def __init__(self, handle, groups, lo: int, hi: int):
        self._handle, self.groups, self._lo, self._hi = handle, groups, lo, hi

    def wait(self):
        return self._handle.wait()[self._lo:self._hi]


@functools.lru_cache(maxsize=256)
def _same_rows(sent) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """The sent pieces ((peer, shard row, length), ...) grouped by the rows they cover: (shard row, length, the
    pieces' indices) for each distinct (row, length), in order of first appearance."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (_, a, length) in enumerate(sent):
        groups.setdefault((a, length), []).append(i)
    return tuple((a, length, tuple(which)) for (a, length), which in groups.items())


@functools.lru_cache(maxsize=64)
def _tables(ex: Exchange, layout, r: int, max_runs: int, max_pieces: int):
    """Rank ``r``'s runs and pieces of an exchange (computed once per plan, layout, rank and limits): whether
    nothing moves; the own rows' runs (shard row, buffer row, length) or None, and whether they are every row
    of the shard; the runs (shard row, row of what comes back, length) of the rows other ranks return
    gradients for; the runs (arrived row, buffer row, length) of the other ranks' rows; the direct pieces
    ((peer, shard row, length) sent, (peer, buffer row, length) received) or None; whether what comes back is
    added by runs of the shard's rows (``_Returning.add_returned``)."""
    skip = ex.moves_nothing
    _, _, send_index, own_index, place_own, place, _ = _indices(ex, layout, r)
    own_runs = _runs(own_index, place_own, limit=max_runs)
    own_all = own_runs is not None and own_index.numel() == ex.local_len
    back_runs = _runs(send_index, torch.arange(send_index.numel()), limit=4 * max_runs)
    place_runs = _runs(torch.arange(place.numel()), place, limit=4 * max_runs)
    _, most, fewest = _all_pieces(ex, layout)
    pieces = _rank_pieces(ex, layout, r) if not skip and fewest > 0 and most <= max_pieces else None
    return skip, own_runs, own_all, back_runs, place_runs, pieces, pieces is not None or back_runs is not None


@functools.lru_cache(maxsize=64)
def _indices(ex: Exchange, layout, r: int):
    """Rank ``r``'s splits and index tensors of an exchange (computed once per plan, layout and rank)."""
    w, n = ex.ring_size, ex.local_len
    send = [_index(ex.need[r][d]) if d != r else _index(()) for d in range(w)]
    send_splits = [rows.numel() for rows in send]
    recv_splits = [ex.rows(s, r) if s != r else 0 for s in range(w)]
    send_index = torch.cat(send)
    own_index = _index(ex.need[r][r])
    seq_len = w * n
    positions = [layouts.positions(layout, seq_len, w, s)[_index(ex.need[s][r])] for s in range(w)]
    # buffer row of each needed key: its rank among the needed positions (U_r in natural order)
    order = torch.argsort(torch.argsort(torch.cat(positions)))
    counts = [p.numel() for p in positions]
    starts = [sum(counts[:s]) for s in range(w)]
    place_own = order[starts[r]:starts[r] + counts[r]]
    place = torch.cat([order[starts[s]:starts[s] + counts[s]] for s in range(w) if s != r]) if w > 1 else order[:0]
    return send_splits, recv_splits, send_index, own_index, place_own, place, sum(counts)


def _pieces(ex: Exchange, positions: torch.Tensor, src: int, dst: int) -> list[tuple[int, int, int]]:
    """(row of ``src``, position, length) of the pieces ``src`` sends ``dst``: runs of need[src][dst] split
    where ``src``'s positions (``positions``, by row) stop being consecutive (Note [Sparse gather])."""
    out = []
    for a, b in ex.need[src][dst]:
        p = positions[a:b]
        cuts = [0] + ((p[1:] - p[:-1]) != 1).nonzero().flatten().add(1).tolist() + [b - a]
        out.extend((a + i, int(p[i]), j - i) for i, j in zip(cuts[:-1], cuts[1:]))
    return out


@functools.lru_cache(maxsize=64)
def _all_pieces(ex: Exchange, layout) -> tuple[dict, int, int]:
    """Every pair's pieces (``_pieces``), and the most and the fewest any rank sends and receives in all."""
    w = ex.ring_size
    positions = [layouts.positions(layout, w * ex.local_len, w, s) for s in range(w)]
    pieces = {(s, d): _pieces(ex, positions[s], s, d) for s in range(w) for d in range(w) if s != d}
    counts = [sum(len(pieces[r, d]) + len(pieces[d, r]) for d in range(w) if d != r) for r in range(w)]
    return pieces, max(counts), min(counts)


@functools.lru_cache(maxsize=64)
def _rank_pieces(ex: Exchange, layout, r: int):
    """Rank ``r``'s direct pieces: ((peer, shard row, length) sent, (peer, buffer row, length) received), in
    the order both ends list them (by peer, then by row)."""
    w = ex.ring_size
    pieces = _all_pieces(ex, layout)[0]
    sent = tuple((d, row, length) for d in range(w) if d != r for row, _, length in pieces[r, d])
    received = tuple((s, ex.compact(r, position), length) for s in range(w) if s != r
                     for _, position, length in pieces[s, r])
    return sent, received
