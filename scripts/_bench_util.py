"""Shared helpers for the benchmark scripts: launching ranks, timing, cross-rank agreement, tables,
JSON and plots.

Every benchmark runs the same code on every rank. Rank functions are ``fn(rank, world_size, cfg) -> dict``;
:func:`launch` runs them either under ``torchrun`` (``RANK``/``WORLD_SIZE`` set: this process is one rank)
or by starting ``world_size`` local ranks itself (:func:`distcomm._launch.run_world`, NCCL on GPUs, gloo on
CPU). Decisions that change which collectives run (a failed case, the time budget) are agreed across ranks
with one tiny all-reduce, so ranks never diverge into a hang.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) can take the host's GPUs down on the benchmark machines: keep it off.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Recorded with every result: they change what a run measures.
RECORDED_ENV = (*SAFE_ENV, "TORCH_NCCL_HIGH_PRIORITY")

MiB = 1 << 20
GiB = 1 << 30


def set_nccl_priority(priority: str) -> None:
    """``--nccl-priority``: "high" puts NCCL on high-priority CUDA streams (``TORCH_NCCL_HIGH_PRIORITY=1``,
    read when a process group is created), so a transfer posted next to a kernel that fills the GPU gets
    SMs as soon as it is ready instead of after that kernel; "default" leaves the variable alone."""
    if priority == "high":
        os.environ["TORCH_NCCL_HIGH_PRIORITY"] = "1"


def set_safe_env() -> None:
    """Set the NCCL/NVSHMEM variables of ``SAFE_ENV`` unless the user set them."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)


# ----------------------------------------------------------------------------------------------- parsing
_BYTE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "K": 1 << 10, "MB": MiB, "M": MiB, "GB": GiB, "G": GiB}


def out_dir(out: str | None, smoke: bool) -> str:
    """``--out``: as given, else docs/bench, or for a ``--smoke`` run a new temporary folder (a plumbing check
    does not overwrite the recorded results)."""
    if out is not None:
        return out
    if smoke:
        import tempfile

        return tempfile.mkdtemp(prefix="distcomm_smoke_")
    return "docs/bench"


def parse_bytes(text: str) -> int:
    """'1MB' -> 1048576, '64KB', '1GB', '4096' (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    if unit not in _BYTE_UNITS or not num:
        raise ValueError(f"bad size {text!r}: expected e.g. 64KB, 16MB, 1GB")
    return int(float(num) * _BYTE_UNITS[unit])


def parse_count(text: str) -> int:
    """'8k' -> 8192, '128K' -> 131072, '4096' -> 4096."""
    t = text.strip().lower()
    if t.endswith("k"):
        return int(float(t[:-1]) * 1024)
    return int(t)


def parse_list(text: str, parse: Callable[[str], object] = str) -> list:
    """Comma-separated list."""
    return [parse(part) for part in text.split(",") if part.strip()]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", GiB), ("MB", MiB), ("KB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def fmt_count(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


# ------------------------------------------------------------------------------------------------- launch
def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_lead_process() -> bool:
    """False only on the torchrun ranks other than 0 (they leave the reporting to rank 0)."""
    return not under_torchrun() or os.environ["RANK"] == "0"


def launch(fn, world_size: int, cfg: dict, *, backend: str, timeout: float) -> list | None:
    """Run ``fn(rank, world_size, cfg)`` on every rank.

    Returns the list of per-rank results when this process started the ranks, ``[result]`` on rank 0
    under torchrun, and ``None`` on the other torchrun ranks (they have nothing to write).
    """
    set_safe_env()
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(local % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **kwargs)
        try:
            result = fn(rank, world, cfg)
        finally:
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.destroy_process_group()
        return [result] if rank == 0 else None
    from distcomm._launch import run_world

    return run_world(fn, world_size, cfg, backend=backend, timeout=timeout)


def rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------- cross-rank facts
def all_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks (one tiny all-reduce; the identity without a process group)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_min_max(value: float, device: torch.device) -> tuple[float, float]:
    """(min over ranks, max over ranks) of one number."""
    lo, hi = all_max([-value, value], device)
    return -lo, hi


def error_text(exc: BaseException) -> str:
    """One line: the exception type, its message and where it was raised (file:line)."""
    msg = " ".join(str(exc).split())
    if len(msg) > 400:
        msg = msg[:400] + " ..."
    where = ""
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        last = tb[-1]
        where = f" [{Path(last.filename).name}:{last.lineno}]"
    return f"{type(exc).__name__}: {msg}{where}"


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def guarded(fn: Callable[[], object], device: torch.device) -> tuple[object, str | None]:
    """Run ``fn``; return (result, None) or (None, error text). The outcome is agreed across ranks.

    If ``fn`` fails on any rank, every rank reports an error (a failure elsewhere reads "failed on
    another rank"), so all ranks take the same path afterwards.
    """
    result, err = None, None
    try:
        result = fn()
    except Exception as exc:  # one failing method must not end the benchmark
        err = error_text(exc)
        result = None
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    if err is not None:
        try:
            release_memory(device)
        except Exception:
            pass
    (failed,) = all_max([1.0 if err else 0.0], device)
    if failed and err is None:
        err, result = "failed on another rank", None
    return result, err


class Budget:
    """A wall-clock budget checked before each case; every rank takes the same decision."""

    def __init__(self, seconds: float, device: torch.device):
        self.seconds = seconds
        self.device = device
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def exhausted(self) -> bool:
        (over,) = all_max([1.0 if self.elapsed() > self.seconds else 0.0], self.device)
        return bool(over)


# ------------------------------------------------------------------------------------------------- timing
SLEEP_CYCLES_PER_S = 2e9  # torch.cuda._sleep's cycles per second, about (1e6 cycles: 0.52 ms on an H100)


def gpu_sleep(device: torch.device, seconds: float) -> None:
    """Queue about ``seconds`` of GPU work (CUDA; nothing elsewhere): what a host-time measure puts ahead of a
    call so that the host never waits for the GPU unless the call synchronises."""
    if device.type == "cuda":
        torch.cuda._sleep(int(SLEEP_CYCLES_PER_S * seconds))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_seconds(fn: Callable[[], object], iters: int, ahead_s: float = 0.0) -> float:
    """Median CUDA seconds of one call of ``fn``, CUDA events around each call alone; ``ahead_s`` > 0: a GPU
    sleep that long queued before each call, so the host has queued the call's kernels before the GPU
    reaches them: their time without host gaps (unless the call synchronises)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead_s > 0:
            torch.cuda.synchronize()
            gpu_sleep(torch.device("cuda"), ahead_s)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def host_seconds(fn: Callable[[], object], gpu_s: float, iters: int, device: torch.device) -> float:
    """Median host seconds of one call of ``fn``, each call behind a GPU sleep of twice ``gpu_s`` (at least
    2 ms; on CUDA), so the host never waits for the GPU: the Python and launch time of the call, what bounds a
    call whose GPU work is shorter. NaN where a call returned only after the sleep had ended (the call waited
    for the GPU, or the sleep was too short): then the host time is not known."""
    times, waited = [], False
    for _ in range(iters):
        synchronize(device)
        gpu_sleep(device, 2 * max(gpu_s, 1e-3))
        slept = torch.cuda.Event() if device.type == "cuda" else None
        if slept is not None:
            slept.record()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        waited = waited or (slept is not None and slept.query())
    synchronize(device)
    return math.nan if waited else sorted(times)[len(times) // 2]


def time_loop(fn: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
              barrier: bool = True) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` back-to-back calls after ``warmup`` calls.

    CUDA: one pair of CUDA events around the loop (GPU time, including any CPU launch gaps, so Python
    overhead that the GPU cannot hide is counted). CPU: ``time.perf_counter``. With ``barrier`` the ranks
    are lined up (device synchronize + barrier) before the timed loop.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    if barrier:
        all_max([0.0], device)  # a tiny all-reduce read back on the host lines the ranks up
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


class PeakMemory:
    """``with PeakMemory(device) as pm: ...`` then ``pm.bytes``: peak allocated bytes inside the block
    (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; ``None`` on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        return False


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def count_collectives(fn: Callable[[], object]) -> dict[str, int]:
    """Run ``fn`` once under the CPU profiler; count the process-group operations it issued.

    Counts dispatcher ops named ``c10d::*`` (every ProcessGroup collective and point-to-point call, NCCL
    and gloo alike) and ``_c10d_functional::*`` (functional collectives), except waits.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr():  # some builds print a line to stderr at every profiler start and stop
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        if not (name.startswith("c10d::") or name.startswith("_c10d_functional::")):
            continue
        if "wait" in name or "wrap_tensor" in name:
            continue
        short = name.split("::", 1)[1]
        counts[short] = counts.get(short, 0) + 1
    return dict(sorted(counts.items()))


# ------------------------------------------------------------------------------------------ tables, JSON
class Table:
    """Fixed-width table printed row by row (flushed), on rank 0 only."""

    def __init__(self, columns: Sequence[tuple[str, int]], enabled: bool = True):
        self.columns = list(columns)
        self.enabled = enabled

    def _line(self, cells) -> str:
        # width > 0: right-aligned (numbers); width < 0: left-aligned (names)
        parts = [str(c).ljust(-w) if w < 0 else str(c).rjust(w) for (_, w), c in zip(self.columns, cells)]
        return "  ".join(parts).rstrip()

    def header(self, title: str | None = None) -> None:
        if not self.enabled:
            return
        if title:
            print(f"\n{title}", flush=True)
        line = self._line([name for name, _ in self.columns])
        print(line, flush=True)
        print("-" * len(line), flush=True)

    def row(self, cells) -> None:
        if self.enabled:
            print(self._line(cells), flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)


def git_commit() -> str | None:
    """$DISTCOMM_COMMIT when set (a copied tree whose git metadata is missing or stale), else the checkout's
    short commit."""
    if os.environ.get("DISTCOMM_COMMIT"):
        return os.environ["DISTCOMM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        commit = out.stdout.strip()
    except Exception:
        commit = ""
    return commit or None


def command_line() -> str:
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return "PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in [str(script), *sys.argv[1:]])


def env_info(backend: str, world_size: int) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": backend,
        "world_size": world_size,
        "host": platform.node(),
        "git_commit": git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
        info["gpu_count"] = torch.cuda.device_count()
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            info["nccl"] = None
    try:
        from importlib.metadata import version

        info["triton"] = version("triton")
    except Exception:
        info["triton"] = None
    info["env"] = {k: os.environ.get(k) for k in RECORDED_ENV}
    return info


def write_json(path: Path, data: dict) -> None:
    """Write atomically (a partial file is never left behind by a crash mid-write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except Exception:
        return None


# -------------------------------------------------------------------------------------------------- plots
def plot_panels(path: Path, panels: list[dict], *, title: str, ncols: int = 2) -> Path | None:
    """Draw line panels with matplotlib (Agg) and save a PNG; ``None`` (with a note) without matplotlib.

    Each panel: {"title", "xlabel", "ylabel", "xscale", "yscale", "xticks": [(value, label)],
    "series": [{"label", "x", "y", "style", "color"}], "hlines": [(y, label)], "ylim": (lo, hi)}.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no plot; pip install matplotlib)", flush=True)
        return None
    nrows = max(1, math.ceil(len(panels) / ncols))
    ncols = min(ncols, max(1, len(panels)))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.3 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels):
        labelled = 0
        for s in panel.get("series", []):
            pts = [(x, y) for x, y in zip(s["x"], s["y"]) if y is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, s.get("style", "o-"), label=s["label"], color=s.get("color"), ms=4, lw=1.5)
            labelled += not s["label"].startswith("_")
        for y, label in panel.get("hlines", []):
            ax.axhline(y, color="gray", ls=":", lw=1)
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7, color="gray",
                        va="bottom")
        if panel.get("xscale"):
            ax.set_xscale(panel["xscale"], **({"base": 2} if panel["xscale"] == "log" else {}))
        if panel.get("yscale"):
            ax.set_yscale(panel["yscale"])
        if panel.get("xticks"):
            ticks = panel["xticks"]
            ax.set_xticks([t for t, _ in ticks])
            ax.set_xticklabels([lab for _, lab in ticks], fontsize=8, rotation=45 if len(ticks) > 6 else 0)
            ax.minorticks_off()
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        if labelled:
            ax.legend(fontsize=7, ncol=panel.get("legend_cols", 1))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A GitHub-flavoured Markdown table; ``align`` has one letter per column, "l" or "r" (default: the
    first column left, the others right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join(":---" if a == "l" else "---:" for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_header(title: str, report: dict) -> str:
    """Title, the command that produced the numbers, and the machine."""
    env = report.get("env", {})
    hw = (f"{env.get('world_size')} x {env.get('gpu', 'CPU')}, torch {env.get('torch')}, {env.get('backend')}"
          + (f" (NCCL {env['nccl']})" if env.get("nccl") else "") + f", triton {env.get('triton')}")
    return (f"## {title}\n\nMeasured {env.get('time_utc', '')} on {hw}, commit {env.get('git_commit')}, with\n\n"
            f"```bash\n{report.get('command', '')}\n```\n")


def run_report(run_rank, world: int, cfg: dict, *, backend: str, timeout: float, summarize) -> tuple[dict | None, str | None]:
    """Launch ``run_rank`` on ``world`` ranks and return (rank 0's report, failure text or None).

    On a hang or a crashed rank the JSON that rank 0 wrote so far is read back, re-summarised with
    ``summarize(report)`` and rewritten, so a partial run still yields its table. Returns (None, None) on the
    processes that are not the lead under torchrun, and (None, failure) when nothing can be recovered.
    """
    out = Path(cfg["out"])
    try:
        results = launch(run_rank, world, cfg, backend=backend, timeout=timeout)
        if results is None:
            return None, None
        return results[0], None
    except Exception as exc:  # a hang or a crashed rank: keep what rank 0 wrote so far
        failure = error_text(exc)
        print(f"\nrun ended early: {failure}", flush=True)
        if not is_lead_process():
            return None, failure
        report = read_json(out / cfg["json_name"])
        if report is None:
            return None, failure
        report["summary"] = summarize(report)
        report["failure"] = failure
        write_json(out / cfg["json_name"], report)
        return report, failure
