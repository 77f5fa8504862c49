"""Drop-in replacement for ``torch.distributed.nn.functional`` with exact gradients.

(Module docstring with the full gradient semantics is written once the ops land.)
"""

from distcomm._movement import *  # noqa: F401,F403
from distcomm._movement import __all__ as _movement_all
from distcomm._reduce import *  # noqa: F401,F403
from distcomm._reduce import __all__ as _reduce_all
from distcomm.ring import ring_pass

__all__ = [*_reduce_all, *_movement_all, "ring_pass"]
