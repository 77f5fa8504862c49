"""Which collectives compile: graph breaks counted by ``torch._dynamo.explain``, and a fullgraph check.

    PYTHONPATH=. python scripts/compile_report.py                       # 2 gloo ranks on CPU, aot_eager
    PYTHONPATH=. python scripts/compile_report.py --backend inductor    # the default torch.compile backend
    PYTHONPATH=. python scripts/compile_report.py --device cuda         # 2 GPUs, NCCL

For every public op of ``distcomm.functional`` (every ReduceOp, uneven sizes, output arguments, the forms
that learn shapes at run time) and, where torch has the same op, ``torch.distributed.nn.functional``:

- graphs / breaks: ``torch._dynamo.explain`` of ``y = op(x)`` followed by a small computation (so that a
  break shows as two graphs);
- fullgraph: ``torch.compile(fn, fullgraph=True, backend=--backend)`` forward and backward, compared with
  eager: "= eager" (values and input grad bit for bit), "differs", or why it did not compile.

Prints a Markdown table (with the command) and writes it to ``--out`` (default: stdout only).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_util as U  # noqa: E402

R = dist.ReduceOp


class _OnGroup:
    """A functional module whose functions run on ``group`` (passed as ``group=``)."""

    def __init__(self, module, group):
        self._module, self._group = module, group

    def __getattr__(self, name):
        return functools.partial(getattr(self._module, name), group=self._group)


def _cases(rank: int, world: int, device: torch.device, group) -> list[tuple[str, object, object, object]]:
    """(name, distcomm fn, torch.distributed.nn fn or None, input maker); fn(x) -> tensor. Every op runs on
    ``group``."""
    import torch.distributed.nn.functional as torch_nn

    import distcomm.functional as distcomm_functional

    F, TF = _OnGroup(distcomm_functional, group), _OnGroup(torch_nn, group)

    def rand(*shape, dtype=torch.float32):
        torch.manual_seed(1000 * rank + len(shape))
        if dtype == torch.int64:
            return torch.randint(0, 16, shape, device=device)
        return torch.randint(0, 3, shape, device=device).to(dtype)  # small integers: ties and zeros

    rows = 3  # per-rank rows; uneven forms use rank + 1
    last = world - 1
    premul = dist._make_nccl_premul_sum(0.5 * (rank + 1))
    sizes = [r + 1 for r in range(world)]
    a2a_in = [(rank + j) % 3 for j in range(world)]
    a2a_out = [(i + rank) % 3 for i in range(world)]

    def out_like(shape):
        return torch.empty(shape, device=device)

    def stacked(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    cases = []
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        red = getattr(R, op)
        cases.append((f"all_reduce({op})", lambda x, red=red: F.all_reduce(x, red),
                      lambda x, red=red: TF.all_reduce(x, red), lambda: rand(rows, 4)))
    cases += [
        ("all_reduce(PREMUL_SUM)", lambda x: F.all_reduce(x, premul), None, lambda: rand(rows, 4)),
        ("all_reduce(BXOR), int64, forward only", lambda x: F.all_reduce(x, R.BXOR),
         lambda x: TF.all_reduce(x, R.BXOR), lambda: rand(rows, 4, dtype=torch.int64)),
        ("reduce(dst, MAX)", lambda x: F.reduce(x, last, R.MAX), lambda x: TF.reduce(x, last, R.MAX),
         lambda: rand(rows, 4)),
        ("broadcast(src)", lambda x: F.broadcast(x, last), lambda x: TF.broadcast(x, last), lambda: rand(rows, 4)),
        ("reduce_scatter (list, uneven, MIN)",
         lambda x: F.reduce_scatter(out_like((rank + 1, 4)), list(x.split(sizes)), R.MIN),
         None, lambda: rand(sum(sizes), 4)),
        ("reduce_scatter_tensor(dim=1, AVG)", lambda x: F.reduce_scatter_tensor(x, 1, R.AVG), None,
         lambda: rand(rows, 2 * world)),
        ("all_gather", lambda x: stacked(F.all_gather(x)), lambda x: stacked(TF.all_gather(x)),
         lambda: rand(rows, 4)),
        ("_all_gather_base", lambda x: F._all_gather_base(out_like((world * rows, 4)), x),
         lambda x: TF._all_gather_base(out_like((world * rows, 4)), x), lambda: rand(rows, 4)),
        ("all_gather_tensor(dim=1)", lambda x: F.all_gather_tensor(x, 1), None, lambda: rand(rows, 4)),
        ("all_gather_variable(sizes=...)", lambda x: F.all_gather_variable(x, 0, sizes=sizes)[0], None,
         lambda: rand(rank + 1, 4)),
        ("all_gather_variable() (learns sizes)", lambda x: F.all_gather_variable(x, 0)[0], None,
         lambda: rand(rank + 1, 4)),
        ("all_to_all_single (uneven splits)",
         lambda x: F.all_to_all_single(out_like((sum(a2a_out), 4)), x, a2a_out, a2a_in),
         lambda x: TF.all_to_all_single(out_like((sum(a2a_out), 4)), x, a2a_out, a2a_in),
         lambda: rand(sum(a2a_in), 4)),
        ("all_to_all (list)", lambda x: stacked(F.all_to_all([out_like((2, 4)) for _ in range(world)],
                                                             list(x.chunk(world)))),
         lambda x: stacked(TF.all_to_all([out_like((2, 4)) for _ in range(world)], list(x.chunk(world)))),
         lambda: rand(2 * world, 4)),
        ("gather(dst)", lambda x: stacked(F.gather(x, last)), lambda x: stacked(TF.gather(x, last)),
         lambda: rand(rows, 4)),
        ("scatter(src) with placeholders", lambda x: F.scatter(list(x.chunk(world)), 0),
         lambda x: TF.scatter(list(x.chunk(world)), 0), lambda: rand(2 * world, 4)),
        ("scatter(src), None off the source", lambda x: F.scatter(list(x.chunk(world)) if rank == 0 else None, 0),
         None, lambda: rand(2 * world, 4)),
        ("ring_pass(recv_shape=...)", lambda x: F.ring_pass(x, 1, recv_shape=((rank - 1) % world + 1, 4)), None,
         lambda: rand(rank + 1, 4)),
        ("ring_pass() (learns the shape)", lambda x: F.ring_pass(x, 1), None, lambda: rand(rank + 1, 4)),
    ]
    return cases


def _followed(fn):
    """fn then a small computation: a break inside fn shows as a second graph."""
    def run(x):
        return fn(2 * x) + 1
    return run


def _explain(fn, x) -> str:
    """"graphs / breaks", or why dynamo gave up on the whole function."""
    e = torch._dynamo.explain(_followed(fn))(x)
    if e.graph_count:
        return f"{e.graph_count} / {e.graph_break_count}"
    try:  # no graph at all: the error that made dynamo fall back (raised while tracing, nothing runs)
        torch.compile(_followed(fn), fullgraph=True, backend="eager")(x)
    except Exception as exc:  # noqa: BLE001  (reported in the table)
        return "no graph: " + _reason(exc)
    return "no graph"


def _reason(exc: BaseException) -> str:
    """The gist of a dynamo error: the raised exception's message if there is one, else its first line."""
    text = str(exc)
    if "is not supported under torch.compile" in text:
        return "raises 'not supported under torch.compile'"
    marker = "raised exception "
    if marker in text:
        text = text[text.index(marker) + len(marker):]
    return text.splitlines()[0][:110]


def _forward_backward(fn, x0: torch.Tensor):
    x = x0.clone().requires_grad_(x0.is_floating_point())
    y = fn(x)
    if x.requires_grad:
        (y * torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view(y.shape)).sum().backward()
    return y.detach(), x.grad


def _fullgraph(fn, x0: torch.Tensor, backend: str, fullgraph: bool = True) -> str:
    """Compile (with fullgraph) and compare forward + backward with eager."""
    torch._dynamo.reset()
    eager = _forward_backward(_followed(fn), x0)
    try:
        compiled = _forward_backward(torch.compile(_followed(fn), fullgraph=fullgraph, backend=backend), x0)
    except Exception as exc:  # noqa: BLE001
        if "learns" in str(exc):
            return "graph break (error under fullgraph)"
        return "no: " + _reason(exc)
    same = torch.equal(eager[0], compiled[0]) and (
        (eager[1] is None and compiled[1] is None) or torch.equal(eager[1], compiled[1]))
    return "= eager" if same else "differs from eager"


def run_rank(rank: int, world: int, cfg: dict) -> list:
    warnings.filterwarnings("ignore")
    device = U.rank_device(cfg["backend"])
    # Every op runs on a group of all ranks with a long timeout: the ranks compile different graphs (uneven
    # shapes) and may reach a collective minutes apart.
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=cfg["timeout"]))
    rows = []
    for name, ours, theirs, make in _cases(rank, world, device, group):
        x = make()
        row = [name, _explain(ours, x)]
        if name.startswith("scatter(src), None"):
            # Without fullgraph: the source compiles its scatter, the others break and run it eagerly (a
            # fullgraph error on one side only would leave the other waiting in the exchange).
            result = _fullgraph(ours, x, cfg["compile_backend"], fullgraph=False)
            row.append(f"{'compiles' if rank == 0 else 'graph break'}, {result} without fullgraph")
        else:
            row.append(_fullgraph(ours, x, cfg["compile_backend"]))
        row.append(_explain(theirs, x) if theirs is not None else "-")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend for the fullgraph check")
    p.add_argument("--out", help="also write the Markdown table to this file")
    args = p.parse_args(argv)
    comm = "nccl" if args.device == "cuda" else "gloo"
    cfg = {"backend": comm, "compile_backend": args.backend, "timeout": 1800}
    results = U.launch(run_rank, args.world_size, cfg, backend=comm, timeout=cfg["timeout"])
    if results is None:
        return 0
    table = []
    for i, row in enumerate(results[0]):
        cells = list(row)
        for c in range(1, len(cells)):
            if any(r[i][c] != cells[c] for r in results[1:]):  # ranks that differ (scatter's source) say so
                cells[c] = "; ".join(f"rank {k}: {r[i][c]}" for k, r in enumerate(results))
        table.append(cells)
    text = (f"`{U.command_line()}` ({args.world_size} ranks, {comm}, torch {torch.__version__}, "
            f"fullgraph backend {args.backend})\n\n")
    text += U.markdown_table(["op", "graphs / breaks", f"fullgraph fwd+bwd ({args.backend})",
                              "torch.distributed.nn.functional: graphs / breaks"], table, align="llll")
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
