"""The package structure and the demos.

1. static: no module under ``distcomm/`` imports ``distcomm_attention`` (the attention package builds on the
   core, never the other way round), read off every module's syntax tree;
2. single process: the demo's language model learns over the default 40 steps (~4 s);
3. gloo: ``python -m distcomm_attention.demo`` (the README's Quick start) and ``python -m distcomm.demo``
   run end to end with a few training steps and report success; the loss curves they plot agree step by
   step within the stated tolerance, and the figure labels what it shows.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import distcomm
from tests.optional import require

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


def test_lm_demo_learns():
    """The ring-attention LM's loss keeps falling over the demo's 40 steps and ends below what a model
    without attention can reach (so the curve shows learning through the ring, not a plateau)."""
    from distcomm_attention.demo import lm_training

    history = lm_training.train_single(40)["history"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert history[0] > 2.5  # ~ln(16): nothing known yet
    assert mean(history[-5:]) < 0.5 * history[0]
    assert mean(history[-5:]) < lm_training.BEST_WITHOUT_ATTENTION - 0.1
    assert mean(history[30:]) < mean(history[15:25]) - 0.15  # still learning in the last quarter


@pytest.mark.parametrize("module", ["distcomm_attention.demo.__main__", "distcomm.demo.__main__"])
def test_demo_runs_and_checks_pass(module, tmp_path, capsys, monkeypatch):
    """The Quick start's demo (and the core-only one) run on 2 local ranks, every check passes, and the
    plotted single-process and distributed loss curves agree at every step within the stated tolerance."""
    import importlib

    from distcomm.demo import _common

    plotted = []
    monkeypatch.setattr(_common, "plot", lambda path, curves, world: plotted.append((curves, world)))
    main = importlib.import_module(module).main
    assert main(["--world-size", "2", "--steps", "3", "--plot", str(tmp_path / "demo.png")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert ("ring-attention LM" in out) == module.startswith("distcomm_attention")
    [(curves, world)] = plotted
    assert world == 2 and len(curves) == (2 if module.startswith("distcomm_attention") else 1)
    for title, single, distributed in curves:
        assert len(single) == len(distributed) == 3
        assert max(_common.loss_gap(single, distributed)) <= _common.TOL, title


def test_demo_figure_labels_curves_and_differences(tmp_path):
    """Per experiment: the two labelled loss curves (step, loss) and beside them |single − distributed| on
    a log axis with the tolerance line; exact zeros are drawn too (a log axis has no 0)."""
    require("matplotlib")
    from distcomm.demo import _common

    curves = [("CLIP", [2.0, 1.5, 1.0], [2.0, 1.5 + 2e-16, 1.0]), ("LM", [3.0, 2.0, 1.0], [3.0, 2.0, 1.0 - 4e-16])]
    path = tmp_path / "demo.png"
    fig = _common.plot(str(path), curves, 2)
    assert path.stat().st_size > 10_000
    axes = fig.axes
    assert len(axes) == 4
    for row, (title, _, _) in enumerate(curves):
        curve_ax, gap_ax = axes[2 * row], axes[2 * row + 1]
        assert (curve_ax.get_title(), curve_ax.get_xlabel(), curve_ax.get_ylabel()) == (title, "step", "loss")
        assert [t.get_text() for t in curve_ax.get_legend().get_texts()] == ["single process", "2 ranks (distcomm)"]
        assert (gap_ax.get_xlabel(), gap_ax.get_ylabel(), gap_ax.get_yscale()) == ("step", "|single − distributed|", "log")
        labels = [t.get_text() for t in gap_ax.get_legend().get_texts()]
        assert labels[0] == "|single − distributed|" and "exactly equal" in labels[1] and "tolerance" in labels[2]
        drawn = sorted(x for line in gap_ax.get_lines()[:2] for x in line.get_xdata())
        assert drawn == [0, 1, 2]  # every step appears, the equal ones at the floor
        assert gap_ax.get_ylim()[1] > _common.TOL  # the tolerance line is inside the axes


def test_importing_the_packages_does_not_import_dynamo():
    """`import distcomm` / `import distcomm_attention` stay fast: torch._dynamo (seconds to import) is loaded
    only when something is compiled."""
    code = "import sys, distcomm, distcomm_attention; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
