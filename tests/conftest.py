"""Shared test setup: where multi-rank tests run.

HEP_TEST_DEVICE=cpu (default): ranks are CPU processes (gloo) running Triton kernels under the
interpreter. HEP_TEST_DEVICE=cuda: ranks run on the local GPUs, rank r on GPU r % count; a test
with more ranks than GPUs runs with ranks sharing GPUs when a CUDA MPS control daemon answers
(or HEP_TEST_TIME_SLICED=1 allows them to share time-sliced), and is skipped otherwise.
HEP_TEST_TIMEOUT (seconds, default 600) bounds each multi-rank launch. HEP_TEST_BUDGET_S (seconds,
default none) skips the tests that would start after that long, so that a run inside a device
call's time limit ends with its report instead of being killed.

Multi-rank tests run through rank pools, one per world size, kept for the session (a test's
failure or timeout ends its pool, and the next test of that size gets a fresh one): a call then
costs no process start, CUDA or NVSHMEM initialisation.
"""

from __future__ import annotations

import collections
import os
import sys
import time
import traceback

import pytest

DEVICE = os.environ.get("HEP_TEST_DEVICE", "cpu")
TIMEOUT_S = float(os.environ.get("HEP_TEST_TIMEOUT", "600"))
TIME_SLICED = os.environ.get("HEP_TEST_TIME_SLICED") == "1"
BUDGET_S = float(os.environ.get("HEP_TEST_BUDGET_S", "inf"))
_SESSION_START = time.monotonic()


def raised(error: BaseException) -> str:
    """A rank body's failure line for ``error``: its repr and the last three frames in this
    library (the frames that say where, without the launcher's and torch's)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "hybrid_ep_triton" in f.filename] or frames
    return f"raised {error!r}\n" + "".join(traceback.format_list(ours[-3:])).rstrip()


def assert_no_failures(results: list) -> None:
    """Every rank's failure messages (``launch``'s results: a list per rank), none expected."""
    failures = [msg for per_rank in results for msg in per_rank]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures)


def expect_error(failures: list[str], error: type, words: str, call) -> None:
    """Record a failure in ``failures`` unless ``call()`` raises ``error`` with ``words`` in its
    message."""
    try:
        call()
    except error as e:
        if words not in str(e):
            failures.append(f"{error.__name__} without {words!r}: {e}")
    else:
        failures.append(f"no {error.__name__} ({words!r})")


if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"HEP_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
if DEVICE == "cpu":
    # Before any test module imports triton, so in-process kernels run interpreted too.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item):
    if time.monotonic() - _SESSION_START > BUDGET_S:
        pytest.skip(f"HEP_TEST_BUDGET_S={BUDGET_S:g} spent before this test started")


def pytest_runtest_logreport(report):
    """With a budget (a run inside a device call, whose time limit may kill pytest before its
    summary): each test's outcome and seconds, and a failure's report, as they happen."""
    if BUDGET_S == float("inf") or (report.when != "call" and not report.failed):
        return
    print(f"[{report.outcome} in {report.duration:.1f} s] {report.nodeid}", file=sys.__stderr__)
    if report.failed:
        print(report.longreprtext, file=sys.__stderr__, flush=True)


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        # Tests that run ranks first, then those that use the GPU in this process: a CUDA
        # context here makes this process a client of the MPS daemon, which can then not be
        # restarted after a rank sharing the GPU was killed, and every later pool would fail
        # (tools/launcher._restart_mps_if_needed).
        items.sort(key=lambda item: "launch" not in item.fixturenames)
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

        # device_count asks NVML; is_available would initialise CUDA in this process, which
        # makes it a client of the MPS daemon that ranks sharing a GPU use: the daemon could
        # then not be restarted while the tests run (tools/launcher._restart_mps_if_needed).
        if torch.cuda.device_count() == 0:
            pytest.fail("HEP_TEST_DEVICE=cuda but torch sees no CUDA device")
    return DEVICE


# Pools kept alive at once (each rank holds a CUDA context and NVSHMEM's state, about 4 GiB of
# device memory on an H200, or a few hundred MiB of host memory on CPU ranks): the least
# recently used one ends first. HEP_TEST_MAX_POOLS lowers it where pytest-xdist runs several
# sessions on one GPU.
MAX_POOLS = int(os.environ.get("HEP_TEST_MAX_POOLS", "3"))


@pytest.fixture(scope="session")
def rank_pools():
    """The session's RankPools by world size, most recently used last; closed at the end."""
    pools: collections.OrderedDict = collections.OrderedDict()
    yield pools
    for pool in pools.values():
        pool.close()


def ranks_fit(device: str, world_size: int) -> bool:
    """Whether ``world_size`` ranks can run here: on CPU ranks always; on GPUs one per GPU, or
    sharing GPUs where an MPS daemon answers (or HEP_TEST_TIME_SLICED=1)."""
    if device != "cuda":
        return True
    from hybrid_ep_triton.tools import launcher

    return launcher.ranks_per_gpu(world_size) == 1 or launcher.can_share_gpus(TIME_SLICED)


def skip_unless_ranks_fit(device: str, world_size: int) -> None:
    """Skip when ``world_size`` ranks would share GPUs and cannot (no MPS daemon)."""
    if not ranks_fit(device, world_size):
        from hybrid_ep_triton.tools import mps

        pytest.skip(f"{world_size} ranks share GPUs here and no MPS daemon answers: {mps.HOW_TO}")


def skip_if_a_killed_rank_shares_a_gpu(world_size: int) -> None:
    """Skip a test that kills a rank outright where its ranks share GPUs: under MPS the kill
    takes the other ranks of the GPU down with it (docs/testing.md, One GPU under MPS), which
    no library can mask."""
    if DEVICE != "cuda":
        return
    from hybrid_ep_triton.tools import launcher

    if launcher.ranks_per_gpu(world_size) > 1:
        pytest.skip(
            "a rank killed outright under MPS takes its GPU's other ranks down with it "
            "(docs/testing.md, One GPU under MPS)"
        )


@pytest.fixture
def launch(device, rank_pools):
    """``launch(fn, world_size, *args, timeout_s=None, fresh=False, **kwargs)``: ``fn`` on
    ``world_size`` ranks of the chosen device, through the session's pool of that size (or, with
    ``fresh``, through run_ranks's own new processes); kwargs: the launcher's other options,
    e.g. failure_grace_s."""
    from hybrid_ep_triton.tools.launcher import RankPool, run_ranks

    def _launch(fn, world_size: int, *args, timeout_s=None, fresh=False, **kwargs) -> list:
        skip_unless_ranks_fit(device, world_size)
        timeout = TIMEOUT_S if timeout_s is None else timeout_s
        if fresh:
            return run_ranks(
                fn,
                world_size,
                *args,
                device=device,
                timeout_s=timeout,
                allow_time_slicing=TIME_SLICED,
                **kwargs,
            )
        pool = rank_pools.pop(world_size, None)
        if pool is None or not pool.usable:
            while len(rank_pools) >= MAX_POOLS:
                rank_pools.popitem(last=False)[1].close()
            pool = RankPool(world_size, device, allow_time_slicing=TIME_SLICED)
        rank_pools[world_size] = pool
        return pool.run(fn, *args, timeout_s=timeout, **kwargs)

    return _launch
