"""No retries: nothing in the tests, the launcher, the scripts or CI runs a failing thing again.

A test or launch that fails must fail; re-running it hides the failure. Checked over the sources of tests/,
distcomm/, distcomm_attention/, scripts/, examples/, .ci/ and the project's configuration:
1. pytest-rerunfailures and its kind: ``flaky`` markers, ``--reruns`` / ``reruns=``, ``rerunfailures``;
2. names of retry machinery in Python code (not comments, strings or test names): ``*_ATTEMPTS`` constants,
   names made of ``retry``, ``retries``, ``rerun``, ``reruns``, ``flaky``;
3. loops that launch (``run_world``, ``subprocess.run`` / ``Popen`` / ..., the multinode and docs launchers)
   and repeat on failure: a ``for ... in range(...)`` or ``while`` loop whose body launches and breaks, catches
   an exception or compares an exit code;
4. a launch repeated after a failure: the same launch called again inside an ``if`` or an ``except`` that
   follows a first call in the same function.
The checker is itself tested on the retry constructs that this tree once had.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ["tests", "distcomm", "distcomm_attention", "scripts", "examples", ".ci", ".github"]
CONFIG_FILES = ["pyproject.toml", "setup.cfg", "tox.ini", "pytest.ini", "Makefile"]
THIS = Path(__file__).resolve()

LAUNCH_NAMES = {"run_world", "_run_once", "_run_two_nodes", "_torchrun", "launch", "run_report"}
SUBPROCESS_LAUNCHES = {"run", "Popen", "call", "check_call", "check_output"}
RETRY_NAME = re.compile(r"(?i)^(?:[a-z0-9_]*_)?(?:retry|retries|retrying|rerun|reruns|flaky)(?:_[a-z0-9_]*)?$")
RERUN_TEXT = re.compile(r"--reruns\b|\breruns\s*=|rerunfailures|\bflaky\b|--lf\b|--last-failed\b")
EXIT_NAMES = {"returncode", "exitcode", "codes", "code"}


def _launch_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id in LAUNCH_NAMES:
        return func.id
    if isinstance(func, ast.Attribute):
        if func.attr in LAUNCH_NAMES:
            return func.attr
        if func.attr in SUBPROCESS_LAUNCHES and isinstance(func.value, ast.Name) and func.value.id == "subprocess":
            return f"subprocess.{func.attr}"
    return None


def _walk_local(node: ast.AST):
    """ast.walk without descending into nested functions or classes (their bodies are checked on their own)."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(child))


def _launches(node: ast.AST) -> list[tuple[str, int]]:
    return [(name, n.lineno) for n in _walk_local(node) if isinstance(n, ast.Call) and (name := _launch_name(n))]


def _checks_failure(loop: ast.AST) -> bool:
    for n in _walk_local(loop):
        if isinstance(n, (ast.Break, ast.ExceptHandler)):
            return True
        if isinstance(n, ast.Compare):
            names = {x.attr if isinstance(x, ast.Attribute) else getattr(x, "id", None) for x in ast.walk(n)}
            if names & EXIT_NAMES:
                return True
    return False


def python_findings(text: str, where: str) -> list[str]:
    """Retry constructs in one Python source."""
    found = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        return [f"{where}: cannot tokenize: {e}"]
    for tok in tokens:
        if tok.type == tokenize.NAME and not tok.string.startswith("test_") and (
                RETRY_NAME.match(tok.string) or re.fullmatch(r"[A-Z0-9_]*ATTEMPTS", tok.string)):
            found.append(f"{where}:{tok.start[0]}: retry name {tok.string!r}")
        if tok.type == tokenize.STRING and RERUN_TEXT.search(tok.string):
            found.append(f"{where}:{tok.start[0]}: rerun option in {tok.string[:60]!r}")
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While)):
            repeats = isinstance(node, ast.While) or (
                isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name) and node.iter.func.id == "range"
            )
            launches = _launches(node)
            if repeats and launches and _checks_failure(node):
                found.append(f"{where}:{node.lineno}: loop re-launching {launches[0][0]} on failure")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first: dict[str, int] = {}
            for name, line in sorted(_launches(node), key=lambda x: x[1]):
                first.setdefault(name, line)
            for inner in _walk_local(node):
                guarded = inner.body if isinstance(inner, (ast.If, ast.ExceptHandler)) else []
                for stmt in guarded:
                    for name, line in _launches(stmt) + ([(_launch_name(stmt.value), stmt.lineno)]
                                                         if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                                                         and _launch_name(stmt.value) else []):
                        if first.get(name, line) < line:
                            found.append(f"{where}:{line}: {name} launched again after a first call (line {first[name]})")
    return sorted(set(found))


def text_findings(text: str, where: str) -> list[str]:
    """Rerun options in a non-Python file (configuration, shell); comment lines are skipped."""
    return [f"{where}:{i}: rerun option in {line.strip()[:80]!r}"
            for i, line in enumerate(text.splitlines(), 1)
            if not line.lstrip().startswith("#") and RERUN_TEXT.search(line)]


def _sources() -> list[Path]:
    files = []
    for d in SOURCE_DIRS:
        if (ROOT / d).is_dir():
            files += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    files += [ROOT / f for f in CONFIG_FILES if (ROOT / f).is_file()]
    return [p for p in files if p.resolve() != THIS and p.suffix not in {".pyc", ".png", ".json", ".md"}]


def tree_findings() -> list[str]:
    found = []
    for path in _sources():
        where = str(path.relative_to(ROOT))
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += python_findings(text, where) if path.suffix == ".py" else text_findings(text, where)
    return found


def test_the_scan_covers_the_launcher_and_the_tests():
    names = {str(p.relative_to(ROOT)) for p in _sources()}
    for needed in ("distcomm/_launch.py", "tests/test_docs.py", "tests/test_multinode.py", "pyproject.toml", ".ci/run"):
        assert needed in names, needed


def test_no_retry_anywhere():
    found = tree_findings()
    assert not found, "retry constructs (a failing test or launch must fail, never run again):\n" + "\n".join(found)


# The retry constructs this tree once had, and their kind: each must be found.
RETRIES = {
    "launcher start-up": '''
_START_ATTEMPTS = 3
def run_world(fn, world_size):
    for attempt in range(_START_ATTEMPTS):
        try:
            return _run_once(fn, world_size)
        except _StartFailed:
            if attempt + 1 == _START_ATTEMPTS:
                raise
''',
    "docs block": '''
def test_block(argv):
    for i in range(3):
        done = subprocess.run(argv, capture_output=True)
        if done.returncode == 0:
            break
    assert done.returncode == 0
''',
    "multinode rerun": '''
def test_two_nodes():
    codes, outputs = _run_two_nodes()
    if codes[0] != 0 and "address already in use" in outputs[0]:
        codes, outputs = _run_two_nodes()
    assert codes == [0, 0]
''',
    "rerun in except": '''
def test_world():
    try:
        out = run_world(f, 2)
    except RuntimeError:
        out = run_world(f, 2)
''',
    "while loop": '''
def go():
    while True:
        proc = subprocess.Popen(["x"])
        if proc.wait() == 0:
            break
''',
    "flaky marker": '''
import pytest
@pytest.mark.flaky(reruns=2)
def test_x():
    pass
''',
    "reruns in a string": '''
ARGS = ["-p", "rerunfailures", "--reruns", "3"]
''',
}


@pytest.mark.parametrize("name", RETRIES)
def test_the_checker_finds_each_kind_of_retry(name):
    assert python_findings(RETRIES[name], name), f"{name} was not found:\n{RETRIES[name]}"


def test_the_checker_finds_rerun_options_in_configuration():
    assert text_findings('[tool.pytest.ini_options]\naddopts = "--reruns 2"\n', "pyproject.toml")
    assert text_findings("pytest -p rerunfailures tests\n", ".ci/run")
    assert not text_findings("# never use --reruns\npytest tests\n", ".ci/run")


def test_the_checker_leaves_plain_code_alone():
    """Loops that launch different things, repeated launches that check nothing, helpers that catch an error to
    compare its message: none of them re-runs a failure."""
    clean = '''
def bench(configs):
    for cfg in configs:
        try:
            run_report(rank_fn, 2, cfg, backend="gloo", timeout=60, summarize=len)
        except RuntimeError:
            pass

def repeat_same():
    results = [run_world(f, 2) for _ in range(3)]
    for _ in range(3):
        run_world(f, 2)

def attempt(key, fn):
    try:
        fn()
    except ValueError as e:
        return str(e)

def test_docs(argv):
    done = subprocess.run(argv)
    assert done.returncode == 0
'''
    assert python_findings(clean, "clean") == []
