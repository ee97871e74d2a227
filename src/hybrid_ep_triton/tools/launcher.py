"""Multi-rank launcher: run one function on N spawned processes joined by torch.distributed.

Used by the tests, the demo and the benchmark. Each rank is a fresh ``spawn`` process with its
own default process group (gloo on ``device="cpu"``, NCCL on ``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait

import torch

__all__ = ["RankFailure", "RanksTimedOut", "run_ranks"]

# How long failure collection waits for other ranks to report after the first failure (default).
_FAILURE_GRACE_S = 1.0
# How long terminated ranks get to exit on SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 5.0
# A rank still running this long after the deadline dumps its Python stacks and exits.
_DUMP_DELAY_S = 1.0
# Added to timeout_s for the ranks' process-group timeout, so that a hang is ended by the
# launcher's deadline (with stack dumps), not by a collective timing out in one rank first.
_PG_TIMEOUT_MARGIN_S = 60.0


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


def run_ranks(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    device: str = "cpu",
    timeout_s: float = 300.0,
    failure_grace_s: float = _FAILURE_GRACE_S,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (spawn) and return
    the per-rank results in rank order.

    ``fn`` must be a picklable module-level function, and ``args`` and the results picklable.
    CUDA tensors in a result come back detached, on the CPU. Each rank runs inside a default
    process group (gloo for ``device="cpu"``, where ``TRITON_INTERPRET=1`` is set; NCCL for
    ``device="cuda"``, where rank r uses GPU ``r % torch.cuda.device_count()``; NCCL collectives
    fail when ranks outnumber GPUs, since NCCL rejects two ranks of one communicator on one GPU).
    A rank whose ``fn`` returned waits for every other rank's ``fn`` to return before it tears
    its process group down.

    Raises :class:`RankFailure` if a rank raises or exits without returning (non-zero exit code,
    signal), and :class:`RanksTimedOut` if ranks are still running ``timeout_s`` seconds after the
    call. Either way every remaining rank is terminated (then killed) before the exception
    propagates; its message holds each failing rank's traceback, or a hung rank's Python stack.
    After the first failure the other ranks get ``failure_grace_s`` seconds (at most until the
    deadline) to report or exit, e.g. to raise their own TimeoutError when a peer died.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    deadline = time.monotonic() + timeout_s
    ctx = mp.get_context("spawn")
    env = {
        "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    procs: list = []
    conns: list = []
    with tempfile.TemporaryDirectory(prefix="hep-ranks-") as stack_dir:
        stacks = [os.path.join(stack_dir, f"rank{r}.stack") for r in range(world_size)]
        try:
            with _environ(env):
                for rank in range(world_size):
                    recv, send = ctx.Pipe(duplex=False)
                    conns.append(recv)
                    p = ctx.Process(
                        target=_rank_main,
                        args=(fn, rank, world_size, args, device, deadline, send, stacks[rank]),
                        name=f"hep-rank{rank}",
                    )
                    try:
                        p.start()
                    finally:
                        send.close()
                    procs.append(p)
            return _supervise(procs, conns, stacks, deadline, timeout_s, failure_grace_s)
        finally:
            _stop(procs)
            for c in conns:
                c.close()


def _supervise(procs, conns, stacks, deadline, timeout_s, failure_grace_s) -> list:
    n = len(procs)
    reports: dict[int, tuple[str, object]] = {}
    failures: dict[int, str] = {}
    timed_out: set[int] = set()  # ranks that dumped their stacks at the deadline and exited
    open_conns = {c: r for r, c in enumerate(conns)}
    running = {p.sentinel: r for r, p in enumerate(procs)}

    def receive(rank: int) -> None:
        conn = conns[rank]
        open_conns.pop(conn, None)
        try:
            reports[rank] = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        except Exception:
            reports[rank] = ("error", "result could not be unpickled:\n" + traceback.format_exc())
        if reports[rank][0] == "error":
            failures[rank] = str(reports[rank][1])

    def exited(rank: int) -> None:
        p = procs[rank]
        p.join(timeout=_TERMINATE_GRACE_S)  # the sentinel fired: this returns at once
        if conns[rank] in open_conns and conns[rank].poll(0):
            receive(rank)  # a report written just before exit
        code = p.exitcode
        if rank in failures or code == 0 and rank in reports:
            return
        if rank not in reports and _read(stacks[rank]):
            timed_out.add(rank)  # its watchdog fired: it was still running at the deadline
            return
        how = _describe_exit(code)
        if rank in reports:
            failures[rank] = f"returned a result but then {how}"
        else:
            failures[rank] = f"{how} without reporting a result (see its stderr)"

    def pump(until: float, stop_on_failure: bool) -> None:
        while running and not (stop_on_failure and failures):
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            ready = wait(list(open_conns) + list(running), timeout=remaining)
            for obj in ready:
                if obj in open_conns:
                    receive(open_conns[obj])
            for obj in ready:
                if obj in running:
                    exited(running.pop(obj))

    pump(deadline, stop_on_failure=True)
    if failures:
        # Give ranks failing at about the same time a moment to report too.
        pump(min(deadline, time.monotonic() + failure_grace_s), stop_on_failure=False)
    hung = sorted(set(running.values()) | timed_out)
    if hung and not failures:
        # Hung ranks dump their stacks and exit _DUMP_DELAY_S after the deadline.
        patience = deadline + _DUMP_DELAY_S + _TERMINATE_GRACE_S - time.monotonic()
        _wait_all(procs, patience)
        _stop(procs)
        for r in hung:
            state = "returned a result but was still exiting" if r in reports else "still running"
            stack = _read(stacks[r]) or "(no stack dumped)"
            failures[r] = f"{state} at the deadline; Python stacks:\n{stack}"
        msg = (
            f"rank(s) {hung} of {n} still running after timeout_s={timeout_s:g} s\n"
            + _format_failures(failures)
        )
        raise RanksTimedOut(msg, failures, _pids(procs))
    if failures:
        _stop(procs)
        msg = f"{len(failures)} of {n} rank(s) failed"
        terminated = [r for r in hung if r not in failures]
        if terminated:
            msg += f"; rank(s) {terminated} were still running and got terminated"
        msg += "\n" + _format_failures(failures)
        raise RankFailure(msg, failures, _pids(procs))
    return [reports[r][1] for r in range(n)]


def _rank_main(fn, rank, world_size, args, device, deadline, conn, stack_path) -> None:
    """Child entry point: join the process group, run fn, report through conn.

    ``deadline`` is the parent's time.monotonic() deadline (the clock is system-wide): a rank
    still running _DUMP_DELAY_S after it writes all its threads' stacks to stack_path and exits.
    """
    import torch.distributed as dist

    stack_file = open(stack_path, "w")  # stays open: the faulthandler watchdog writes to it
    delay = max(deadline + _DUMP_DELAY_S - time.monotonic(), 0.1)
    faulthandler.dump_traceback_later(delay, exit=True, file=stack_file)
    timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0) + _PG_TIMEOUT_MARGIN_S)
    ok = False
    try:
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
                if world_size <= torch.cuda.device_count():
                    # Eager NCCL init. Not when ranks share GPUs: NCCL rejects a communicator
                    # with two ranks on one GPU, so those ranks must avoid NCCL collectives.
                    kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group(
                backend="gloo" if device == "cpu" else "nccl",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                **kwargs,
            )
            payload = _dumps(("ok", fn(rank, world_size, *args)))
            ok = True
        except BaseException:
            payload = _dumps(("error", traceback.format_exc()))
        conn.send_bytes(payload)
        if ok:
            # No rank tears down while others may still talk to it (gloo pairs, the store).
            _store_barrier(store, "done", world_size)
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if ok and world_size > 1:
        # Rank 0 hosts the store: it leaves last, once every other rank is done with it.
        if rank == 0:
            store.wait(["hep/all_left"])
        elif store.add("hep/left", 1) == world_size - 1:
            store.set("hep/all_left", "1")


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


def _pids(procs) -> dict[int, int]:
    return {r: p.pid for r, p in enumerate(procs)}
