"""Import a script of scripts/ as a module (the benchmark tests call its helpers): ``import_script(name)``."""

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def import_script(name: str):
    """scripts/<name>.py as a module; scripts/ is on sys.path only while it imports (its sibling imports)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
