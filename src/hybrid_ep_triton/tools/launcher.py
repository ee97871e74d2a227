"""Multi-rank launcher: run functions on N spawned rank processes joined by torch.distributed.

Used by the tests, the demo, the soak and the benchmark. ``run_ranks`` starts fresh processes
for one function; a ``RankPool`` keeps its processes for many (the tests: starting a rank,
CUDA and NVSHMEM costs seconds, a call through a pool milliseconds).

Where ranks run: on ``device="cpu"`` they are CPU processes (gloo, ``TRITON_INTERPRET=1``). On
``device="cuda"`` rank r uses GPU r % count. While each GPU holds at most one rank, the ranks'
default group is NCCL; when ranks share GPUs it is gloo (NCCL rejects a communicator with two
ranks on one GPU), and ranks sharing a GPU need the CUDA MPS control daemon, or an explicit
opt-in to run time-sliced (tools/mps.py says why). Each then gets
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 // ranks per GPU unless the caller set one.
``rank_device()`` tells a rank's function where its tensors live.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import io
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import NamedTuple

import torch

from . import mps

__all__ = [
    "GpuSharingUnavailable",
    "RankFailure",
    "RankPool",
    "RanksTimedOut",
    "launch_plan",
    "rank_device",
    "run_ranks",
]

# How long failure collection waits for other ranks to report after the first failure (default).
_FAILURE_GRACE_S = 1.0
# The same for ranks sharing a GPU: longer than a Buffer's default timeout_s (60 s), so that a
# rank waiting on the failed peer raises its own TimeoutError, and than a context's exit under
# MPS; a rank that has neither reported nor left by then is hung (a rank can stay in NVSHMEM's
# initialisation after a peer failed, and without this bound the run would wait for its whole
# timeout).
_SHARING_FAILURE_GRACE_S = 180.0
# How long terminated ranks get to exit on SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 5.0
# How long a hung rank gets to write its Python stacks (SIGUSR1) before it is killed.
_DUMP_DELAY_S = 1.0
# How long ranks told to leave get for the orderly way out (a store barrier, NVSHMEM's
# finalisation) before they are killed.
_EXIT_TIMEOUT_S = 60.0
# A pool's process-group timeout: longer than any call, so that a hang is ended by the
# launcher's deadline (with stack dumps), not by a collective timing out in one rank first.
_POOL_PG_TIMEOUT_S = 3 * 3600.0
# Added to timeout_s for run_ranks's process-group timeout, for the same reason.
_PG_TIMEOUT_MARGIN_S = 60.0
# NVSHMEM fixes its heap's size when it initialises, from the first Buffer of a process; later
# Buffers of a pooled process may be larger. The size reserves address space, not memory (a
# heap of 2 GiB and one of 16 GiB take the same device memory).
_POOL_NVSHMEM_HEAP_BYTES = 16 << 30
# What the parent sends a rank: a task (this byte, then the pickled environment and task), or
# the word to leave, in order (through a barrier and NVSHMEM's finalisation) or at once.
_TASK = b"T"
_LEAVE_IN_ORDER = b"L"
_LEAVE_AT_ONCE = b"A"

# Set in a rank process by _rank_main: where its tensors live.
_RANK_DEVICE: torch.device | None = None
# Live pools: an MPS restart ends them first (the daemon quits once its clients have ended),
# and so does the exit of this process (multiprocessing would wait for their ranks forever).
_POOLS: set[RankPool] = set()
# Whether a rank sharing a GPU was killed since the last MPS restart.
_MPS_NEEDS_RESTART = False


class RankFailure(RuntimeError):
    """One or more ranks failed.

    ``failures`` maps each failing rank to its formatted traceback, or to how it died;
    ``pids`` maps every rank to its process id (all of them have exited when this is raised).
    """

    def __init__(self, message: str, failures: dict[int, str], pids: dict[int, int]):
        super().__init__(message)
        self.failures = failures
        self.pids = pids


class RanksTimedOut(RankFailure, TimeoutError):
    """The deadline passed; ``failures`` maps each rank still running to its Python stacks."""


class GpuSharingUnavailable(RuntimeError):
    """Ranks would share a GPU, but no MPS control daemon answers (and time-slicing was not
    allowed); raised before any rank starts."""


def rank_device() -> torch.device:
    """Where the calling rank's tensors live: in a rank this launcher started, its GPU or the
    CPU; elsewhere (torchrun) the current CUDA device with an NCCL default group, else the CPU."""
    if _RANK_DEVICE is not None:
        return _RANK_DEVICE
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_per_gpu(world_size: int) -> int:
    """The most ranks one local GPU holds when rank r uses GPU r % count (0 without GPUs)."""
    gpus = torch.cuda.device_count()
    return math.ceil(world_size / gpus) if gpus else 0


def can_share_gpus(allow_time_slicing: bool = False) -> bool:
    """Whether ranks may share GPUs here: an MPS control daemon answers, or time-slicing is
    allowed."""
    return allow_time_slicing or mps.daemon_answers()


class LaunchPlan(NamedTuple):
    env: dict[str, str]  # set in every rank's environment (os.environ's own values kept)
    backend: str  # of the ranks' default process group
    sharing: bool  # whether ranks share GPUs


def launch_plan(
    world_size: int,
    device: str,
    allow_time_slicing: bool = False,
    nvshmem_heap_bytes: int | None = None,
) -> LaunchPlan:
    """How ``world_size`` ranks start on ``device`` ("cpu" or "cuda"): their environment, their
    group's backend and whether they share GPUs. Raises ValueError for a bad request and
    GpuSharingUnavailable when ranks would share GPUs without an MPS daemon (and
    ``allow_time_slicing`` is False). ``nvshmem_heap_bytes``: NVSHMEM_SYMMETRIC_SIZE unless
    set (None: NVSHMEM sizes its heap from the first Buffer)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    per_gpu = ranks_per_gpu(world_size) if device == "cuda" else 0
    if device == "cuda" and not per_gpu:
        raise ValueError("device='cuda', but torch sees no CUDA device")
    sharing = per_gpu > 1
    if sharing and not can_share_gpus(allow_time_slicing):
        raise GpuSharingUnavailable(
            f"{world_size} ranks on {torch.cuda.device_count()} GPU(s) share GPUs, and no MPS "
            f"control daemon answers (time-sliced, every wait between ranks would take "
            f"milliseconds): {mps.HOW_TO}; or allow time-slicing explicitly"
        )
    env = {
        "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    if sharing and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.thread_percentage(per_gpu))
    if nvshmem_heap_bytes is not None and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(nvshmem_heap_bytes)
    backend = "gloo" if device == "cpu" or sharing else "nccl"
    return LaunchPlan(env, backend, sharing)


def run_ranks(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    device: str = "cpu",
    timeout_s: float = 300.0,
    failure_grace_s: float = _FAILURE_GRACE_S,
    allow_time_slicing: bool = False,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (spawn) and return
    the per-rank results in rank order; the processes end before this returns.

    ``fn`` must be a picklable module-level function, and ``args`` and the results picklable.
    CUDA tensors in a result come back detached, on the CPU. Each rank runs inside a default
    process group: see the module docstring for devices, groups and GPU sharing
    (``allow_time_slicing``: ranks may share GPUs without MPS). A rank whose ``fn`` returned
    waits for every other rank's ``fn`` to return before it tears its process group down.

    Raises :class:`RankFailure` if a rank raises or exits without returning (non-zero exit code,
    signal), and :class:`RanksTimedOut` if ranks are still running ``timeout_s`` seconds after the
    call; :class:`GpuSharingUnavailable` before starting any rank. After a failure or timeout
    every rank has exited before the exception propagates; its message holds each failing rank's
    traceback, or a hung rank's Python stack. After the first failure the other ranks get
    ``failure_grace_s`` seconds (at most until the deadline) to report or exit, e.g. to raise
    their own TimeoutError when a peer died; ranks sharing a GPU get at least 180 s, so that
    none is killed while MPS holds its context unless it is hung.
    """
    task = _task(fn, args)  # a function that cannot be pickled fails here, before any start
    pool = RankPool(
        world_size,
        device,
        allow_time_slicing=allow_time_slicing,
        pg_timeout_s=timeout_s + _PG_TIMEOUT_MARGIN_S,
        nvshmem_heap_bytes=None,
    )
    try:
        return pool._run(task, timeout_s, failure_grace_s)
    finally:
        pool.close()


class RankPool:
    """``world_size`` rank processes that run one function after another: ``run`` is
    ``run_ranks`` without the processes' start (CUDA, NVSHMEM and the process group are set up
    once). A failure or timeout ends every process of the pool (``usable`` turns False) and
    raises as ``run_ranks`` does; ``close`` ends them in order. Use as a context manager.

    Each call runs with the caller's environment of the moment (``os.environ``), so that what a
    rank reads at run time is what fresh processes would read. A pooled process keeps what
    calls leave behind (modules, compiled kernels, NVSHMEM, whose heap is then sized 16 GiB of
    address space unless ``NVSHMEM_SYMMETRIC_SIZE`` is set): calls must leave no collective
    state that the next call does not expect, e.g. destroy their Buffers.
    """

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        allow_time_slicing: bool = False,
        pg_timeout_s: float = _POOL_PG_TIMEOUT_S,
        nvshmem_heap_bytes: int | None = _POOL_NVSHMEM_HEAP_BYTES,
    ):
        plan = launch_plan(world_size, device, allow_time_slicing, nvshmem_heap_bytes)
        if plan.sharing:
            _restart_mps_if_needed()
        self.world_size = world_size
        self.device = device
        self.sharing = plan.sharing
        self.usable = True
        self._child_env = plan.env
        self._stack_dir = tempfile.TemporaryDirectory(prefix="hep-ranks-")
        self._stacks = [
            os.path.join(self._stack_dir.name, f"rank{r}.stack") for r in range(world_size)
        ]
        self._procs: list = []
        self._tasks: list = []  # parent -> rank
        self._results: list = []  # rank -> parent
        ctx = mp.get_context("spawn")
        try:
            with _environ(plan.env):
                for rank in range(world_size):
                    task_recv, task_send = ctx.Pipe(duplex=False)
                    result_recv, result_send = ctx.Pipe(duplex=False)
                    p = ctx.Process(
                        target=_rank_main,
                        args=(
                            rank,
                            world_size,
                            device,
                            plan.backend,
                            task_recv,
                            result_send,
                            self._stacks[rank],
                            pg_timeout_s,
                        ),
                        name=f"hep-rank{rank}",
                    )
                    try:
                        p.start()
                    finally:
                        task_recv.close()
                        result_send.close()
                    self._procs.append(p)
                    self._tasks.append(task_send)
                    self._results.append(result_recv)
        except BaseException:
            self._end(abort=True)
            raise
        _POOLS.add(self)

    def run(
        self,
        fn: Callable[..., object],
        *args: object,
        timeout_s: float = 300.0,
        failure_grace_s: float = _FAILURE_GRACE_S,
    ) -> list:
        """``fn(rank, world_size, *args)`` on every rank; as ``run_ranks``."""
        return self._run(_task(fn, args), timeout_s, failure_grace_s)

    def close(self) -> None:
        """End every rank in order: each leaves once all have been told to (a store barrier,
        then NVSHMEM's collective finalisation). Idempotent."""
        if self.usable:
            self._end(abort=False)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self._procs)}

    def _run(self, task: bytes, timeout_s: float, failure_grace_s: float) -> list:
        if not self.usable:
            raise RuntimeError("this RankPool has ended (after a failure, a timeout or close)")
        deadline = time.monotonic() + timeout_s
        message = _TASK + pickle.dumps((dict(os.environ, **self._child_env), task))
        for conn in self._tasks:
            _send(conn, message)  # a rank that died is reported by its sentinel
        try:
            return self._supervise(deadline, timeout_s, failure_grace_s)
        except BaseException:
            if self.usable:  # interrupted (KeyboardInterrupt): nothing may outlive the pool
                self._end(abort=True)
            raise

    def _supervise(self, deadline: float, timeout_s: float, failure_grace_s: float) -> list:
        n = self.world_size
        reports: dict[int, tuple[str, object]] = {}
        failures: dict[int, str] = {}
        released: set[int] = set()  # ranks told to leave after a failure: their exit is no news
        pending = {c: r for r, c in enumerate(self._results)}  # ranks yet to report
        alive = {p.sentinel: r for r, p in enumerate(self._procs)}

        def receive(rank: int) -> None:
            pending.pop(self._results[rank], None)
            try:
                reports[rank] = pickle.loads(self._results[rank].recv_bytes())
            except EOFError:  # it died: its exit tells how
                alive.pop(self._procs[rank].sentinel, None)
                exited(rank)
                return
            except Exception:
                reports[rank] = (
                    "error",
                    "result could not be unpickled:\n" + traceback.format_exc(),
                )
            if reports[rank][0] == "error":
                failures[rank] = str(reports[rank][1])

        def exited(rank: int) -> None:
            p = self._procs[rank]
            p.join(timeout=_TERMINATE_GRACE_S)  # the sentinel fired: this returns at once
            if self._results[rank] in pending and self._results[rank].poll(0):
                receive(rank)  # a report written just before exit
            pending.pop(self._results[rank], None)
            if rank in failures or rank in released:
                return
            how = _describe_exit(p.exitcode)
            if rank in reports:
                failures[rank] = f"returned a result but then {how}"
            else:
                failures[rank] = f"{how} without reporting a result (see its stderr)"

        def pump(until: float, stop_on_failure: bool) -> None:
            while pending and not (stop_on_failure and failures):
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return
                ready = wait(list(pending) + list(alive), timeout=remaining)
                for obj in ready:
                    if obj in pending:
                        receive(pending[obj])
                for obj in ready:
                    if obj in alive:
                        exited(alive.pop(obj))
                if failures:
                    # Ranks that have reported leave at once, so that peers still inside a
                    # collective with them see them go instead of waiting for them.
                    for rank in reports.keys() - released:
                        released.add(rank)
                        _send(self._tasks[rank], _LEAVE_AT_ONCE)

        for sentinel, rank in list(alive.items()):
            if not self._procs[rank].is_alive():  # died since the last call
                exited(alive.pop(sentinel))
        pump(deadline, stop_on_failure=True)
        if failures:
            # Give ranks failing at about the same time a moment to report too; ranks sharing
            # a GPU longer, so that none is killed while MPS holds its context unless it is hung.
            if self.sharing:
                failure_grace_s = max(failure_grace_s, _SHARING_FAILURE_GRACE_S)
            pump(min(deadline, time.monotonic() + failure_grace_s), stop_on_failure=False)
        if not failures and not pending:
            return [reports[r][1] for r in range(n)]
        running = sorted(pending.values())
        stacks = _stacks_of([self._procs[r] for r in running], [self._stacks[r] for r in running])
        self._end(abort=True, hung=tuple(running))
        if not failures:
            failures = {
                r: f"still running at the deadline; Python stacks:\n{stacks[i]}"
                for i, r in enumerate(running)
            }
            msg = f"rank(s) {running} of {n} still running after timeout_s={timeout_s:g} s\n"
            raise RanksTimedOut(msg + _format_failures(failures), failures, self.pids)
        msg = f"{len(failures)} of {n} rank(s) failed"
        if running:
            msg += f"; rank(s) {running} were still running and got terminated"
            for i, r in enumerate(running):
                failures[r] = f"still running, terminated; Python stacks:\n{stacks[i]}"
        msg += "\n" + _format_failures(failures)
        raise RankFailure(msg, failures, self.pids)

    def _end(self, abort: bool, hung: tuple[int, ...] = ()) -> None:
        """End every rank: in order (``abort`` False: each leaves through the process group's
        barrier and NVSHMEM's finalisation), or at once; the ``hung`` ranks are terminated
        straight away, the others once they have had their time to leave. Where a rank sharing
        a GPU was terminated, the MPS daemon is restarted before the next pool starts."""
        global _MPS_NEEDS_RESTART
        self.usable = False
        _POOLS.discard(self)
        for conn in self._tasks:
            _send(conn, _LEAVE_AT_ONCE if abort else _LEAVE_IN_ORDER)
        _stop([self._procs[r] for r in hung])
        # Ranks sharing a GPU get the whole exit time even when told to leave at once: a CUDA
        # context with NVSHMEM's heap may take more than _TERMINATE_GRACE_S to go under MPS
        # (after a failed test), and killing it there costs a restart of the MPS daemon.
        quick = abort and not self.sharing
        _wait_all(self._procs, _TERMINATE_GRACE_S if quick else _EXIT_TIMEOUT_S)
        if self.sharing and (hung or any(p.is_alive() for p in self._procs)):
            _MPS_NEEDS_RESTART = True
        _stop(self._procs)
        for conn in self._tasks + self._results:
            conn.close()
        self._stack_dir.cleanup()


@atexit.register
def _end_pools() -> None:
    for pool in list(_POOLS):
        pool._end(abort=True)


def _restart_mps_if_needed() -> None:
    """Before ranks start on shared GPUs: if a rank sharing a GPU was killed since the last
    restart, end every live pool and restart the MPS control daemon."""
    global _MPS_NEEDS_RESTART
    if not _MPS_NEEDS_RESTART:
        return
    for pool in list(_POOLS):
        pool.close()
    if torch.cuda.is_initialized():
        # This process is a client of the daemon too: it would wait for itself.
        raise RuntimeError(
            "a rank sharing a GPU was killed while MPS held its context, and the MPS daemon "
            "cannot be restarted from this process, which has a CUDA context of its own (the "
            f"daemon waits for its clients to end): end this process, then `{mps.STOP}` and "
            f"`{mps.START}`"
        )
    mps.restart_daemon()
    _MPS_NEEDS_RESTART = False


def _task(fn: Callable, args: tuple) -> bytes:
    return pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)


def _rank_main(rank, world_size, device, backend, tasks, results, stack_path, pg_timeout_s):
    """Child entry point: join the process group, then run each task that arrives through
    ``tasks`` and report through ``results``, until told to leave (see _TASK)."""
    global _RANK_DEVICE
    import torch.distributed as dist

    stack_file = open(stack_path, "w")  # stays open: faulthandler writes to it on SIGUSR1
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
        )
        kwargs = {}
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            _RANK_DEVICE = torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl":
                kwargs["device_id"] = _RANK_DEVICE  # eager NCCL init
        else:
            _RANK_DEVICE = torch.device("cpu")
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **kwargs,
        )
    except BaseException:
        results.send_bytes(_dumps(("error", traceback.format_exc())))
        os._exit(1)
    while True:
        try:
            message = tasks.recv_bytes()
        except EOFError:  # the parent is gone
            message = _LEAVE_AT_ONCE
        if message[:1] != _TASK:
            break
        env, task = pickle.loads(message[1:])
        with _environ_exactly(env):
            try:
                fn, args = pickle.loads(task)
                payload = _dumps(("ok", fn(rank, world_size, *args)))
            except BaseException:
                payload = _dumps(("error", traceback.format_exc()))
        results.send_bytes(payload)
    if message == _LEAVE_IN_ORDER:
        _store_barrier(store, "done", world_size)  # no rank tears down while others still talk
        dist.destroy_process_group()
        if world_size > 1:
            # Rank 0 hosts the store: it leaves last, once every other rank is done with it.
            if rank == 0:
                store.wait(["hep/all_left"])
            elif store.add("hep/left", 1) == world_size - 1:
                store.set("hep/all_left", "1")
        if device == "cuda":
            torch.cuda.synchronize()  # no kernel of this rank runs as its context goes
    # Exit without the atexit handlers, NVSHMEM's collective finalisation among them: after a
    # failure peers may be gone or stuck, and with several PEs on one GPU under MPS it can hang
    # for more than a minute. The process's exit frees its memory.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _store_barrier(store, name: str, world_size: int) -> None:
    if store.add(f"hep/{name}/count", 1) == world_size:
        store.set(f"hep/{name}/open", "1")
    store.wait([f"hep/{name}/open"])


class _CpuPickler(pickle.Pickler):
    """Pickles tensors on any device as detached CPU tensors (the parent must not touch GPUs)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _identity, (obj.detach().cpu(),)
        return NotImplemented


def _identity(x):
    return x


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    try:
        _CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:
        return pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc()))
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Set env in os.environ (inherited by spawned children) and restore it afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _environ_exactly(env: dict[str, str]) -> Iterator[None]:
    """os.environ is ``env`` inside, what it was before afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _send(conn, message: bytes) -> None:
    try:
        conn.send_bytes(message)
    except OSError:
        pass  # the rank is gone already


def _stacks_of(procs, paths: list[str]) -> list[str]:
    """The Python stacks of running ranks: each writes them into its file on SIGUSR1
    (faulthandler, from the signal handler, also while blocked in C code)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
    if procs:
        time.sleep(_DUMP_DELAY_S)
    return [_read(path) or "(no stack dumped)" for path in paths]


def _stop(procs) -> None:
    """Terminate every live process, kill those still alive after a grace period, reap all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    _wait_all(procs, _TERMINATE_GRACE_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    _wait_all(procs, _TERMINATE_GRACE_S)
    for p in procs:
        # A ready sentinel only means the process closed its fds; join then waits in waitpid
        # for the exit to finish (it cannot block: the process is dying or SIGKILLed).
        p.join(timeout=_TERMINATE_GRACE_S)


def _wait_all(procs, timeout_s: float) -> None:
    """Wait until every process has exited, or timeout_s has passed."""
    until = time.monotonic() + timeout_s
    pending = {p.sentinel for p in procs if p.is_alive()}
    while pending:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return
        pending.difference_update(wait(list(pending), timeout=remaining))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def _format_failures(failures: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in sorted(failures))
