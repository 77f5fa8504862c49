"""The sparse all-gather of keys and the sparse reduce-scatter of their gradients (Note [Exchange plan]).

Note [Sparse gather]
    With an exchange plan ``ex`` the all-gather KV strategy gathers, on rank r, only the keys its queries can
    see: rank s sends rank r its rows need[s][r] (one all-to-all-v for k, v together, one for the key mask),
    and rank r places what arrives at the compacted buffer rows of those keys' global positions:

        rank s:  k_s[need[s][0]] | k_s[need[s][1]] | ...      --all_to_all_v-->    rank r: recv (by source)
        rank r:  buffer[place] = recv   (buffer: the union U_r in natural order; ``place`` a permutation)

    The backward is the adjoint: the buffer's dK/dV rows go back to their owners (all-to-all-v with the
    splits exchanged), and each owner adds every rank's contribution to its rows (``index_add_``, in fp32).
    An exchange in which no rank sends another anything (every document on one rank) is skipped by every
    rank: rank r's buffer is then its own rows.
"""

from __future__ import annotations

import torch

from distcomm_attention.planning import layouts
from distcomm_attention.planning.exchange import Exchange

__all__ = ["SparseGather"]


def _rows(ranges) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


class SparseGather:
    """Rank ``transport.rank``'s side of a call's sparse exchange (see Note [Sparse gather])."""

    def __init__(self, transport, ex: Exchange, layout):
        self.transport, self.ex = transport, ex
        r, w, n = transport.rank, ex.ring_size, ex.local_len
        self.skip = ex.moves_nothing
        send = [_rows(ex.need[r][d]) for d in range(w)]
        self.send_splits = [len(rows) for rows in send]
        self.recv_splits = [ex.rows(s, r) for s in range(w)]
        self.send_index = torch.tensor([i for rows in send for i in rows], dtype=torch.int64)
        seq_len = w * n
        received = [layouts.positions(layout, seq_len, w, s)[torch.tensor(_rows(ex.need[s][r]), dtype=torch.int64)]
                    for s in range(w)]
        positions = torch.cat(received) if received else torch.zeros(0, dtype=torch.int64)
        # buffer row of each received row: its rank among the needed positions (U_r in natural order)
        self.place = torch.argsort(torch.argsort(positions))
        self.buffer_len = int(positions.numel())
        self._on: dict = {}

    def _index(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device, non_blocking=True)
        return self._on[key]

    def gather(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """(B, n, ...) local tensors -> (B, m, ...) buffers of the needed keys (None stays None)."""
        present = [t for t in tensors if t is not None]
        if not present:
            return tensors
        device = present[0].device
        send_index = self._index("send_index", device)
        place = self._index("place", device)
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            rows = t.transpose(0, 1).index_select(0, send_index)
            if self.skip:  # only own rows: already in buffer order (a rank's own positions increase)
                recv = rows
            else:
                wire = rows.view(torch.uint8) if t.dtype == torch.bool else rows
                (recv,) = self.transport.all_to_all_v(wire, self.send_splits, self.recv_splits).wait()
                recv = recv.view(torch.bool) if t.dtype == torch.bool else recv
            buffer = torch.empty_like(recv)
            buffer[place] = recv
            out.append(buffer.transpose(0, 1).contiguous())
        return tuple(out)

    def scatter_add(self, grad: torch.Tensor, local_len: int) -> torch.Tensor:
        """(B, m, ...) buffer gradients -> (B, n, ...) this rank's rows, every rank's contributions summed in
        ``grad``'s dtype (the adjoint of :meth:`gather`)."""
        device = grad.device
        rows = grad.transpose(0, 1).index_select(0, self._index("place", device))
        if not self.skip:
            (rows,) = self.transport.all_to_all_v(rows.contiguous(), self.recv_splits, self.send_splits).wait()
        out = torch.zeros((local_len,) + tuple(rows.shape[1:]), dtype=grad.dtype, device=device)
        out.index_add_(0, self._index("send_index", device), rows)
        return out.transpose(0, 1).contiguous()
