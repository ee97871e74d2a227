"""Tests of the multi-rank launcher (hybrid_ep_triton.tools.launcher)."""

from __future__ import annotations

import os
import pickle
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from hybrid_ep_triton.tools.launcher import RankFailure, RanksTimedOut, run_ranks

# Rank bodies must be module-level functions: they are pickled by reference into spawned ranks.


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_body(rank, world_size, tag):
    t = torch.tensor([rank + 1.0, 10.0 * rank], device=_device())
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "NCCL_NVLS_ENABLE")}
    return {"rank": rank, "world_size": world_size, "tag": tag, "sum": t, "env": env}


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


def _assert_gone(pid: int) -> None:
    """pid is no child of ours: it exited and was reaped (robust to the pid being reused)."""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_results_come_back_in_rank_order(launch, device, world_size):
    if device == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip("NCCL rejects two ranks of one communicator on one GPU")
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


def test_rank_exception_raises_rank_failure(launch):
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank1, 2)
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
