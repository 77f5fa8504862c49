"""Layer 2: the example scripts under examples/, run on gloo worlds of CPU ranks.

``examples/dp_cp_training.py`` (data parallel x context parallel on a 2-D DeviceMesh, attention swapped for
ring attention) runs its ``--check`` mode at world 4 (dp 2 x cp 2): float64 training whose parameters must
equal the same steps run on one process on the whole global batch.
"""

import pytest
import torch

from tests.dist_harness import run_world


def _dp_cp_rank(rank, world, argv):
    from examples import dp_cp_training

    return dp_cp_training.run(dp_cp_training.parse_args(argv), torch.device("cpu"))


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_dp_cp_training_matches_single_process(layout):
    """The README's torchtitan-style recipe trains exactly like one process on the global batch."""
    argv = ["--dp", "2", "--cp", "2", "--layout", layout, "--steps", "2", "--seq", "16", "--check"]
    assert run_world(_dp_cp_rank, 4, argv, timeout=120) == [True] * 4


def _wrong_world_rank(rank, world):
    from examples import dp_cp_training

    try:
        dp_cp_training.run(dp_cp_training.parse_args(["--dp", "2", "--cp", "2"]), torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return None


def test_dp_cp_training_checks_the_mesh_size():
    """A dp x cp that does not match the ranks is refused before any communication."""
    assert run_world(_wrong_world_rank, 2) == ["--dp 2 x --cp 2 must equal the number of ranks, 2"] * 2
