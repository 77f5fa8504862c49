"""The multi-process test harness: ``run_world(fn, world_size, *args, backend="gloo", timeout=60)``.

It lives in :mod:`distcomm._launch` (the demo uses it too); see that module for the design.
"""

from distcomm._launch import run_world

__all__ = ["run_world"]
