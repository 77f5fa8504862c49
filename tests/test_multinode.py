"""Layer 2: two "nodes" of 2 CPU ranks each, started by torchrun with the c10d rendezvous on localhost.

Two ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` agents run ``examples/multinode_check.py``,
which checks a collective over the 4 ranks, ring attention with one ring over both nodes and with one ring
per node (``ring_size=2``) against float64 references, and that the per-node rings hold only ranks of one
node. Every child runs in its own process group and is killed if the run does not finish in time.

No port is probed and bound later (a race with every other process on the machine): this test owns the
rendezvous store, a ``TCPStore`` listening on 127.0.0.1 at a port the kernel picks, and both agents join it as
clients (``is_host=0``); the store the workers form their process group on is created by the first agent on
a port the kernel picks too (torchrun shares it through the rendezvous). The run is never repeated.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multinode_check.py"
TIMEOUT_S = 150


def _torchrun(port: int, run_id: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", "is_host=0,join_timeout=60",
        "--max-restarts", "0",
        str(SCRIPT), "--device", "cpu",
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run_two_nodes() -> tuple[list[int], list[str]]:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    run_id = f"distcomm-test-{uuid.uuid4().hex[:8]}"
    nodes = [_torchrun(store.port, run_id) for _node in range(2)]
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in nodes:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for proc in nodes:
            if proc.poll() is None:  # timed out, or a peer failed first: end the whole session we started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [p.returncode for p in nodes], outputs


def test_two_nodes_with_torchrun_c10d_rendezvous():
    """Running across machines: torchrun's c10d rendezvous forms one world from two agents, collectives and
    ring attention (rings across and within nodes) match float64 references."""
    codes, outputs = _run_two_nodes()
    log = "\n".join(f"--- node {i} (exit {c}) ---\n{out}" for i, (c, out) in enumerate(zip(codes, outputs)))
    assert codes == [0, 0], log
    assert "multi-node check on 4 ranks over 2 node(s): all checks passed" in outputs[0] + outputs[1], log
    assert outputs[0].count(" ok") + outputs[1].count(" ok") >= 4, log
