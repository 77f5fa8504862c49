"""Optional packages in tests: skip only when a package is absent; one that is installed but fails to import
is a failure (``pytest.importorskip`` would turn its ImportError into a skip)."""

import importlib
import importlib.util

import pytest

__all__ = ["require"]


def require(name: str):
    """The module ``name``, imported; the calling test (or module) is skipped when it is not installed."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)
    return importlib.import_module(name)
