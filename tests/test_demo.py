"""The package structure and the demos.

1. static: no module under ``distcomm/`` imports ``distcomm_attention`` (the attention package builds on the
   core, never the other way round), read off every module's syntax tree;
2. gloo: ``python -m distcomm_attention.demo`` (the README's Quick start) and ``python -m distcomm.demo``
   run end to end with a few training steps and report success.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import distcomm

CORE = pathlib.Path(distcomm.__file__).parent


def _imported_modules(tree: ast.AST) -> list[str]:
    """Modules named by import statements and by ``importlib.import_module("...")`` / ``__import__("...")``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
    return names


def test_core_package_does_not_import_attention_package():
    """distcomm stays usable (and importable) without distcomm_attention: the dependency goes one way only."""
    offenders = {}
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    for path in files:
        found = [m for m in _imported_modules(ast.parse(path.read_text(), str(path)))
                 if m == "distcomm_attention" or m.startswith("distcomm_attention.")]
        if found:
            offenders[str(path.relative_to(CORE.parent))] = found
    assert not offenders, offenders


def test_import_scanner_sees_every_import_form():
    """The scan above catches plain, from- and dynamic imports (otherwise its silence would prove nothing)."""
    source = "import distcomm_attention\nfrom distcomm_attention.api import x\nimportlib.import_module('distcomm_attention.demo')\n"
    assert _imported_modules(ast.parse(source)) == ["distcomm_attention", "distcomm_attention.api", "distcomm_attention.demo"]


@pytest.mark.parametrize("module", ["distcomm_attention.demo.__main__", "distcomm.demo.__main__"])
def test_demo_runs_and_checks_pass(module, tmp_path, capsys):
    """The Quick start's demo (and the core-only one) run on 2 local ranks and every check passes."""
    import importlib

    main = importlib.import_module(module).main
    assert main(["--world-size", "2", "--steps", "2", "--plot", str(tmp_path / "demo.png")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert ("ring-attention LM" in out) == module.startswith("distcomm_attention")


def test_importing_the_packages_does_not_import_dynamo():
    """`import distcomm` / `import distcomm_attention` stay fast: torch._dynamo (seconds to import) is loaded
    only when something is compiled."""
    code = "import sys, distcomm, distcomm_attention; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
