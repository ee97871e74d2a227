"""Shared test setup: where multi-rank tests run.

HEP_TEST_DEVICE=cpu (default): ranks are CPU processes (gloo) running Triton kernels under the
interpreter. HEP_TEST_DEVICE=cuda: ranks use NCCL on the local GPUs, one GPU per rank; a test
with more ranks than GPUs is skipped (NCCL and NVSHMEM want one GPU per rank).
HEP_TEST_TIMEOUT (seconds, default 600) bounds each multi-rank launch.
"""

from __future__ import annotations

import os

import pytest

DEVICE = os.environ.get("HEP_TEST_DEVICE", "cpu")
TIMEOUT_S = float(os.environ.get("HEP_TEST_TIMEOUT", "600"))

if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"HEP_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
if DEVICE == "cpu":
    # Before any test module imports triton, so in-process kernels run interpreted too.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="gpu test: set HEP_TEST_DEVICE=cuda")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """The device multi-rank tests run on: "cpu" or "cuda"."""
    if DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("HEP_TEST_DEVICE=cuda but torch sees no CUDA device")
    return DEVICE


@pytest.fixture
def launch(device):
    """``launch(fn, world_size, *args, timeout_s=None, **kwargs)``: run_ranks on the chosen
    device (kwargs: run_ranks's other options, e.g. failure_grace_s)."""
    from hybrid_ep_triton.tools.launcher import run_ranks

    def _launch(fn, world_size: int, *args, timeout_s: float | None = None, **kwargs) -> list:
        if device == "cuda":
            import torch

            if world_size > torch.cuda.device_count():
                # NCCL and NVSHMEM want one GPU per rank.
                pytest.skip(f"{world_size} ranks need {world_size} GPUs")
        timeout = TIMEOUT_S if timeout_s is None else timeout_s
        return run_ranks(fn, world_size, *args, device=device, timeout_s=timeout, **kwargs)

    return _launch
