"""Shared fixtures: TRITON_INTERPRET is set before any kernel module is imported, GPU tests are skipped
without CUDA devices."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when @triton.jit decorates: it must be set before distcomm_attention's kernels import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (run on the GPU machine)")
    config.addinivalue_line("markers", "gpu2: needs at least 2 CUDA GPUs (NCCL)")


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip1 = pytest.mark.skip(reason="needs a CUDA GPU")
    skip2 = pytest.mark.skip(reason="needs 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip1)
        if "gpu2" in item.keywords and n < 2:
            item.add_marker(skip2)
