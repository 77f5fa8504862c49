"""scripts/profile_host.py on the CPU (gloo, 2 ranks, a subprocess; seconds): the host time of a call with the
time of named sections of it (``--sections``) and rank 0's cProfile statistics (``--dump``); a section that
names no function is refused before any rank starts."""

import os
import pstats
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "profile_host.py"
SECTIONS = ("distcomm_attention._validation:verify_across_ring",
            "distcomm_attention.strategies.allgather:AllGatherKV.backward")


def _run(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_sections_and_dump(tmp_path):
    done = _run("--world", "2", "--seq", "512", "--docs", "lognormal", "--layout", "contiguous", "--strategies",
                "allgather", "--heads", "2/1", "--head-dim", "8", "--iters", "2", "--top", "3", "--sections",
                ",".join(SECTIONS), "--dump", str(tmp_path), "--out", str(tmp_path / "host.txt"))
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "host.txt").read_text()
    host = float(re.search(r"== allgather: GPU [0-9.]+ ms/call, host ([0-9.]+) ms/call", text).group(1))
    for spec in SECTIONS:  # each section timed inside the call: more than nothing, less than twice the call
        ms = float(re.search(r"([0-9.]+) ms  " + re.escape(spec), text).group(1))
        assert 0 < ms < 2 * host, (spec, ms, host)
    stats = pstats.Stats(str(tmp_path / "allgather_lognormal_w2.prof"))
    assert any(name == "verify_across_ring" for _, _, name in stats.stats), "the dump holds the call's functions"


def test_bad_section_exits_before_spawning():
    done = _run("--world", "2", "--sections", "distcomm_attention._validation:no_such_function", timeout=60)
    assert done.returncode == 2 and "'distcomm_attention._validation:no_such_function'" in done.stderr, done.stderr
