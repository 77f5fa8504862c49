"""distcomm: differentiable collectives for PyTorch with exact gradients."""

from distcomm._check import check_mode, is_check_mode, set_check_mode
from distcomm.functional import all_gather_tensor, all_gather_variable, reduce_scatter_tensor
from distcomm.ring import RingComm, RingHandle, ring_pass

__all__ = [
    "all_gather_variable",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "RingComm",
    "RingHandle",
    "ring_pass",
    "check_mode",
    "set_check_mode",
    "is_check_mode",
]
from distcomm._version import __version__  # noqa: E402
