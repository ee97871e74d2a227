"""Tests of the multi-rank launcher (hybrid_ep_triton.tools.launcher)."""

from __future__ import annotations

import os
import pickle
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import skip_unless_ranks_fit

from hybrid_ep_triton.tools import launcher, mps
from hybrid_ep_triton.tools.launcher import (
    GpuSharingUnavailable,
    RankFailure,
    RankPool,
    RanksTimedOut,
    launch_plan,
    rank_device,
    run_ranks,
)

# Rank bodies must be module-level functions: they are pickled by reference into spawned ranks.
ENV_KEYS = (
    "TRITON_INTERPRET",
    "NCCL_NVLS_ENABLE",
    "HEP_TEST_PROBE",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
)


def _all_reduce_body(rank, world_size, tag):
    t = torch.tensor([rank + 1.0, 10.0 * rank], device=rank_device())
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "sum": t,
        "env": env,
        "pid": os.getpid(),
        "backend": dist.get_backend(),
    }


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _exit3_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _sigkill_rank0(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _unpicklable_result(rank, world_size):
    return lambda: rank


def _hang(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0 and dist.get_backend() == "gloo":
        dist.recv(torch.empty(1), src=1)  # rank 1 never sends
    threading.Event().wait()  # never returns


def _hang_unless_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    threading.Event().wait()  # rank 0 never returns


def _assert_gone(pid: int) -> None:
    """pid is no child of ours: it exited and was reaped (robust to the pid being reused)."""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_results_come_back_in_rank_order(launch, device, world_size):
    before = os.environ.get("MASTER_PORT")
    out = launch(_all_reduce_body, world_size, "tag")
    assert [r["rank"] for r in out] == list(range(world_size))
    n = world_size
    expected = torch.tensor([n * (n + 1) / 2, 5.0 * n * (n - 1)])
    for r in out:
        assert r["world_size"] == world_size and r["tag"] == "tag"
        assert r["sum"].device.type == "cpu"
        torch.testing.assert_close(r["sum"], expected)
        assert r["env"]["NCCL_NVLS_ENABLE"] == "0"
        assert r["env"]["TRITON_INTERPRET"] == ("1" if device == "cpu" else None)
    assert os.environ.get("MASTER_PORT") == before  # parent environment restored


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "run_ranks"])
def test_rank_exception_raises_rank_failure(launch, fresh):
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank1, 2, fresh=fresh)
    exc = info.value
    assert not isinstance(exc, RanksTimedOut)
    assert set(exc.failures) == {1}
    assert "Traceback" in exc.failures[1] and "ValueError: boom on rank 1" in exc.failures[1]
    assert "--- rank 1 ---" in str(exc) and "ValueError: boom on rank 1" in str(exc)
    for pid in exc.pids.values():
        _assert_gone(pid)


def test_exit_code_is_reported(launch):
    with pytest.raises(RankFailure) as info:
        launch(_exit3_on_rank1, 2)
    assert set(info.value.failures) == {1}
    assert "exited with code 3" in str(info.value)


def test_signal_death_is_reported(launch):
    with pytest.raises(RankFailure) as info:
        launch(_sigkill_rank0, 2)
    assert 0 in info.value.failures
    assert "killed by SIGKILL" in info.value.failures[0]


def test_unpicklable_result_is_a_failure(launch):
    with pytest.raises(RankFailure, match="could not be pickled"):
        launch(_unpicklable_result, 2)


def test_unpicklable_fn_fails_in_parent():
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_ranks(lambda rank, world_size: rank, 2)


@pytest.mark.slow
def test_hung_ranks_time_out_and_are_killed(launch, tmp_path):
    with pytest.raises(RanksTimedOut) as info:
        launch(_hang, 2, str(tmp_path), timeout_s=8)
    exc = info.value
    assert isinstance(exc, TimeoutError) and isinstance(exc, RankFailure)
    assert set(exc.failures) == {0, 1}
    assert "still running after timeout_s=8" in str(exc)
    for pid in exc.pids.values():
        _assert_gone(pid)
    for rank in (0, 1):
        pid_file = tmp_path / f"{rank}.pid"
        if pid_file.exists():  # the rank reached _hang: its stack must show it
            assert int(pid_file.read_text()) == exc.pids[rank]
            assert "_hang" in exc.failures[rank]


@pytest.mark.slow
@pytest.mark.timeout(240)  # the run's own deadline is an hour: waiting for it is the fault
def test_a_rank_hung_beside_a_failed_gpu_sharer_is_ended_before_the_deadline(monkeypatch):
    """Ranks sharing a GPU get longer than others to report after a peer failed, not until the
    run's deadline: a rank that neither reports nor leaves is hung, ended with its stack."""
    monkeypatch.setattr(launcher, "_SHARING_FAILURE_GRACE_S", 5.0)
    monkeypatch.setattr(launcher, "_MPS_NEEDS_RESTART", False)
    pool = RankPool(2, "cpu")
    pool.sharing = True  # as on a GPU under MPS, without the daemon's restart after a kill
    with pytest.raises(RankFailure) as info:
        pool.run(_hang_unless_rank1, timeout_s=3600)
    exc = info.value
    assert not isinstance(exc, RanksTimedOut) and set(exc.failures) == {0, 1}
    assert "boom on rank 1" in exc.failures[1]
    assert "still running, terminated" in exc.failures[0]
    assert "_hang_unless_rank1" in exc.failures[0]  # its stack
    assert launcher._MPS_NEEDS_RESTART  # a killed sharer: the daemon restarts before the next pool
    for pid in exc.pids.values():
        _assert_gone(pid)


# --- pools -------------------------------------------------------------------------------------


def test_a_pool_keeps_its_ranks_and_gives_each_call_the_callers_environment(device, monkeypatch):
    skip_unless_ranks_fit(device, 2)
    with RankPool(2, device) as pool:
        monkeypatch.setenv("HEP_TEST_PROBE", "first")
        first = pool.run(_all_reduce_body, "a", timeout_s=300)
        monkeypatch.setenv("HEP_TEST_PROBE", "second")
        second = pool.run(_all_reduce_body, "b", timeout_s=300)
        pids = pool.pids
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == list(pids.values())
    assert [r["env"]["HEP_TEST_PROBE"] for r in first + second] == ["first"] * 2 + ["second"] * 2
    assert [r["tag"] for r in second] == ["b", "b"]
    for pid in pids.values():  # close() ended them in order
        _assert_gone(pid)


def test_a_failure_ends_the_pool_and_launch_starts_a_fresh_one(launch, device):
    first = launch(_all_reduce_body, 2, "before")
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank1, 2)
    assert set(info.value.failures) == {1}
    for pid in info.value.pids.values():
        _assert_gone(pid)
    again = launch(_all_reduce_body, 2, "after")
    assert {r["pid"] for r in again}.isdisjoint(r["pid"] for r in first)
    assert [r["tag"] for r in again] == ["after", "after"]


def test_an_ended_pool_refuses_calls(device):
    skip_unless_ranks_fit(device, 1)
    pool = RankPool(1, device)
    pool.close()
    with pytest.raises(RuntimeError, match="has ended"):
        pool.run(_all_reduce_body, "x")


# --- ranks sharing GPUs (decided here without GPUs) --------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(count, mps_answers)``: make the launcher see ``count`` GPUs and an MPS daemon that
    answers or not; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unset."""
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)

    def _set(count: int, mps_answers: bool) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(mps, "daemon_answers", lambda: mps_answers)

    return _set


def test_ranks_sharing_a_gpu_take_gloo_and_a_share_of_its_sms(gpus, monkeypatch):
    gpus(2, mps_answers=True)
    one_each = launch_plan(2, "cuda")
    assert one_each.backend == "nccl" and not one_each.sharing
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in one_each.env
    for world, share in ((3, "50"), (4, "50"), (8, "25"), (16, "12")):
        plan = launch_plan(world, "cuda")  # GPU 0 holds ranks 0, 2, 4, ...
        assert plan.backend == "gloo" and plan.sharing, world
        assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == share, world
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")  # the caller's own is kept
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in launch_plan(8, "cuda").env
    assert launch_plan(4, "cpu").backend == "gloo"


def test_ranks_sharing_a_gpu_without_mps_fail_before_any_start(gpus, monkeypatch):
    gpus(1, mps_answers=False)

    def no_start(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher.mp, "get_context", no_start)
    for start in (
        lambda: RankPool(2, "cuda"),
        lambda: run_ranks(_raise_on_rank1, 2, device="cuda"),
    ):
        with pytest.raises(GpuSharingUnavailable) as info:
            start()
        assert mps.START in str(info.value) and mps.STOP in str(info.value)
    assert launch_plan(2, "cuda", allow_time_slicing=True).sharing
    assert not launch_plan(1, "cuda").sharing  # one rank shares nothing: no daemon needed


def test_daemon_answers_only_when_its_control_program_does(tmp_path, monkeypatch):
    """A stand-in for nvidia-cuda-mps-control, answering as the real one does (exit 1 and
    'Cannot find MPS control daemon process' without a daemon)."""
    control = tmp_path / mps.CONTROL
    # Only the stand-in on PATH: a GPU machine has the real one, whose daemon may be running.
    monkeypatch.setenv("PATH", str(tmp_path))
    absent = "echo 'Cannot find MPS control daemon process'; exit 1"
    for body, answers in (("echo 521; exit 0", True), (absent, False)):
        control.write_text(f"#!/bin/sh\nwhile read -r query; do :; done\n{body}\n")
        control.chmod(0o755)
        assert mps.daemon_answers() is answers, body
    control.unlink()
    assert mps.daemon_answers() is False  # not installed


def test_a_killed_gpu_sharer_restarts_mps_after_every_pool_ends(monkeypatch):
    class Pool:  # a live pool, as the launcher's registry holds it
        def close(self) -> None:
            launcher._POOLS.discard(self)

    restarts = []
    monkeypatch.setattr(mps, "restart_daemon", lambda: restarts.append(len(launcher._POOLS)))
    monkeypatch.setattr(launcher, "_MPS_NEEDS_RESTART", True)
    monkeypatch.setattr(launcher, "_POOLS", {Pool(), Pool()})
    # This process a client of the daemon too (on a GPU machine, after an in-process GPU test):
    # it cannot restart it, and says so, after ending the pools.
    monkeypatch.setattr(launcher.torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be restarted from this process"):
        launcher._restart_mps_if_needed()
    assert restarts == [] and not launcher._POOLS and launcher._MPS_NEEDS_RESTART
    launcher._POOLS.update({Pool(), Pool()})
    monkeypatch.setattr(launcher.torch.cuda, "is_initialized", lambda: False)
    launcher._restart_mps_if_needed()
    assert restarts == [0] and not launcher._MPS_NEEDS_RESTART
    launcher._restart_mps_if_needed()
    assert restarts == [0]  # once per kill
