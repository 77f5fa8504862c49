"""The installed release of the ``distcomm`` distribution (which ships both ``distcomm`` and
``distcomm_attention``), read from its metadata so that pyproject.toml is the one place it is written."""

from __future__ import annotations

import importlib.metadata

__all__ = ["__version__"]

try:
    __version__ = importlib.metadata.version("distcomm")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path (PYTHONPATH=.), not installed
    __version__ = "0.0.0+unknown"
