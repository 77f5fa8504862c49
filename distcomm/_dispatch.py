"""The one point where eager code reaches the compiled path: :func:`compiled_path`.

Note [Import direction of the compiled path]
    The compiled path (:mod:`distcomm._compile`) imports the eager modules at its top; no eager module
    imports it. A public function validates its arguments, and under ``torch.compile`` hands them to the
    function of the same name in :mod:`distcomm._compile.path`, which it finds here, at call time:

        distcomm.functional ──► _all_gather, _all_to_all, _gather_scatter, _reduce, _reduce_scatter, ring
                                  │ public functions, when compiling: compiled_path().<name>(...)
                                  ▼
                                _dispatch.compiled_path()
                                  ┆ imported on the first compile only
                                  ▼
                                _compile.path ──► _compile.ops ──► the eager modules' raw collectives
                                  └──────────────────────────────► the eager modules (shape-learning forms)

    The dotted edge is the package's only import that points back: importing the compiled path loads
    ``torch._dynamo`` (seconds), which ``import distcomm`` must not pay for, and an eager module that
    imported it at its top would close a circle. Every eager module calls :func:`compiled_path`, and
    nothing else in eager code names the compiled modules (tests/test_package_layout.py checks both).
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["compiled_path"]


def compiled_path() -> ModuleType:
    """:mod:`distcomm._compile.path`, imported on the first call (under ``torch.compile``)."""
    from distcomm._compile import path

    return path
