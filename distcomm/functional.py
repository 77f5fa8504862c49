"""Drop-in replacement for ``torch.distributed.nn.functional`` with exact gradients.

Write ``import distcomm.functional as F`` where you had ``import torch.distributed.nn.functional as F``:
names, signatures, defaults and return types are the same (``src``/``dst`` are global ranks), plus extras
(``all_gather_variable``, ``all_gather_tensor``, ``reduce_scatter_tensor``, ``ring_pass``).
Every function also compiles with ``torch.compile(fullgraph=True)``, forward and backward (Note [Compiled
collectives] in :mod:`distcomm._compile.ops`).

``group`` is, everywhere: ``None`` (the default group), a ``ProcessGroup``, a 1-D ``DeviceMesh`` such as
``mesh["cp"]``, or ``(mesh, dim_name)`` for one dim of a multi-dimensional mesh (resolved per call in
``distcomm/_groups.py``).

Note [Gradient convention]
    The training loss is the sum of the per-rank losses, L = sum_r L_r, and g_r = dL_r/dy_r is the grad
    that arrives on rank r. Every backward returns on rank j the exact vector-Jacobian product
    x̄_j = sum_r (dy_r/dx_j)^T g_r:

        op                      x̄_j                                              adjoint collective
        all_reduce SUM          sum_r g_r                                        all_reduce SUM
        all_reduce AVG          (1/W) sum_r g_r                                  all_reduce SUM, scaled
        all_reduce PREMUL_SUM   f_j sum_r g_r                                    all_reduce SUM
        all_reduce PRODUCT      (sum_r g_r) * prod_{i!=j} x_i (zero-safe)        2-3 all_reduces
        all_reduce MAX / MIN    (sum_r g_r) * [x_j == y] / #ties  (NaN: NaN)     2 all_reduces
        reduce(dst, op)         as all_reduce(op) with only g_dst counted        broadcast from dst (+ above)
        broadcast(src)          src: sum_r g_r, others 0                          reduce SUM to src
        all_gather              sum_r g_r[slice j]                                reduce_scatter SUM
        reduce_scatter          all_gather of the grads (masked for MAX/MIN)      all_gather
        gather(dst) / scatter   g_dst[j] / stack_r g_r on src                     scatter / gather
        all_to_all              the grads routed back, splits swapped             all_to_all
        ring_pass(shift)        g_{j + shift}                                     ring_pass(-shift)

    Bitwise ops and integer/bool tensors work forward; asking for their gradient is an error. Whenever an
    input requires grad every output requires grad on every rank (zeros off the root included), so every
    rank takes part in the backward collective its peers wait in. Without a process group, or with one
    rank, every op is the single-process identity. Megatron/DTensor "replicated" semantics (no reduction in
    backward) are a different convention and are not used here.
"""

from torch.distributed import ReduceOp, group  # noqa: F401  (torch's module exposes both)

from distcomm._all_gather import _all_gather_base, all_gather, all_gather_tensor, all_gather_variable
from distcomm._all_to_all import all_to_all, all_to_all_single
from distcomm._gather_scatter import gather, scatter
from distcomm._reduce import all_reduce, broadcast, reduce
from distcomm._reduce_scatter import reduce_scatter, reduce_scatter_tensor
from distcomm._scan import scan
from distcomm.ring import ring_pass

__all__ = [
    "all_reduce",
    "reduce",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_gather",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "all_gather_tensor",
    "all_gather_variable",
    "ring_pass",
    "scan",
    "ReduceOp",
    "group",
]
