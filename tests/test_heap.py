"""The symmetric heap (``runtime.heap``) and the communication primitives (``kernels.primitives``).

A small Triton kernel, written here, uses ``region`` / ``signal`` / ``wait_at_least`` the way the
library's kernels do: every rank writes a rank-, peer-, round- and position-dependent byte
pattern into every peer's heap, raises its flag there, and waits for every peer's flag; each
rank then checks every byte of its own heap in torch. A peer that never signals must turn into
a recorded timeout (status words), not a hang, and through ``Buffer`` into TimeoutError.

POSIX shared-memory segments must never outlive the ranks: each rank reports the
``/dev/shm/hybrid_ep_triton-*`` segments it has mapped (from /proc/self/maps), and the parent
checks after ``run_ranks`` returns that none of them exists any more, even when a rank was
killed with ``os._exit`` right after allocating, or with SIGKILL in the middle of a dispatch.
"""

from __future__ import annotations

import json
import os
import signal as signals
import threading
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.kernels.control import STATUS_OK, STATUS_TIMED_OUT
from hybrid_ep_triton.kernels.primitives import region, signal, wait_at_least
from hybrid_ep_triton.runtime.heap import allocate_heap
from hybrid_ep_triton.runtime.planner import MAX_PROGRAMS
from hybrid_ep_triton.tools.launcher import RankFailure, RanksTimedOut, rank_device

SHM_PREFIX = "/dev/shm/hybrid_ep_triton-"
FLAGS_OFF = 0  # int64 [W] flags: flag s = last round in which rank s finished writing here
DATA_OFF = 256  # uint8 [W, SLOT]: slot s is what rank s wrote here
SLOT = 1000  # not a multiple of BLOCK: the last block of a slot is partial
BLOCK = 256
TAIL = 77  # unused bytes at the end of the heap: must stay zero
STAGE = 9  # stage number the test kernel records on a timeout
NEVER_NS = 600 * 10**9  # a timeout that a test would hit only by hanging


def _heap_bytes(world: int) -> int:
    return DATA_OFF + world * SLOT + TAIL


@triton.jit
def _exchange_kernel(
    peer_bases_ptr,
    rank,
    world_size,
    round_no,
    status_ptr,
    timeout_ns,
    SLOT_BYTES: tl.constexpr,
    FLAGS_OFFSET: tl.constexpr,
    DATA_OFFSET: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    STAGE_NO: tl.constexpr,
):
    seq = round_no + tl.zeros([], tl.int64)  # round_no == 1 arrives as a constexpr on GPUs
    for peer in range(0, world_size):
        dst = region(peer_bases_ptr, peer, DATA_OFFSET + rank * SLOT_BYTES, tl.uint8)
        for b0 in range(0, SLOT_BYTES, BLOCK_BYTES):
            pos = b0 + tl.arange(0, BLOCK_BYTES)
            value = (rank * 37 + peer * 11 + round_no * 101 + pos * 7 + 1) % 251
            tl.store(dst + pos, value.to(tl.uint8), mask=pos < SLOT_BYTES)
    for peer in range(0, world_size):
        signal(region(peer_bases_ptr, peer, FLAGS_OFFSET, tl.int64) + rank, seq)
    my_flags = region(peer_bases_ptr, rank, FLAGS_OFFSET, tl.int64)
    for peer in range(0, world_size):
        wait_at_least(my_flags + peer, seq, timeout_ns, status_ptr, peer, STAGE_NO)


def _exchange(heap, rank, world, round_no, status, timeout_ns) -> None:
    _exchange_kernel[(1,)](
        heap.peer_bases,
        rank,
        world,
        round_no,
        status,
        timeout_ns,
        SLOT_BYTES=SLOT,
        FLAGS_OFFSET=FLAGS_OFF,
        DATA_OFFSET=DATA_OFF,
        BLOCK_BYTES=BLOCK,
        STAGE_NO=STAGE,
    )


def _pattern(src: int, dst: int, round_no: int) -> torch.Tensor:
    pos = torch.arange(SLOT, dtype=torch.int64)
    return ((src * 37 + dst * 11 + round_no * 101 + pos * 7 + 1) % 251).to(torch.uint8)


def _expected_heap(rank: int, world: int, flags: list[int], rounds: list[int]) -> torch.Tensor:
    """Every byte of ``rank``'s heap after source s wrote round rounds[s] (0: nothing)."""
    want = torch.zeros(_heap_bytes(world), dtype=torch.uint8)
    want[FLAGS_OFF : FLAGS_OFF + 8 * world] = torch.tensor(flags, dtype=torch.int64).view(
        torch.uint8
    )
    for src, round_no in enumerate(rounds):
        if round_no:
            start = DATA_OFF + src * SLOT
            want[start : start + SLOT] = _pattern(src, rank, round_no)
    return want


def _compare_heap(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    got = got.cpu()
    if torch.equal(got, want):
        return []
    bad = (got != want).nonzero().flatten()
    first = int(bad[0])
    return [
        f"{what}: {bad.numel()} heap bytes differ, first at byte {first} "
        f"(got {int(got[first])}, expected {int(want[first])})"
    ]


def _mapped_segments() -> list[str]:
    """Paths of the hybrid_ep_triton shared-memory segments mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(SHM_PREFIX):
                paths.add(fields[5].strip().removesuffix(" (deleted)"))
    return sorted(paths)


def _assert_no_leftovers(results_segments: list[list[str]], world: int) -> None:
    for rank, segs in enumerate(results_segments):
        # Every rank maps every rank's segment: a vacuous list would hide a broken probe.
        assert len(segs) >= world, f"rank {rank} reported {segs}, expected >= {world} segments"
    left = sorted({p for segs in results_segments for p in segs if os.path.exists(p)})
    assert not left, f"shared-memory segments left behind: {left}"


def _skip_unless_cpu(device: str) -> None:
    if device != "cpu":
        pytest.skip("POSIX shared-memory heap: CPU ranks only")


# --- every rank writes into every peer ------------------------------------------------------


def _exchange_body(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    failures: list[str] = []
    dev = rank_device()
    heap = allocate_heap(dist.group.WORLD, _heap_bytes(world_size), dev)
    segments = _mapped_segments()
    failures += _compare_heap(
        f"rank {rank}: fresh heap",
        heap.local,
        torch.zeros(_heap_bytes(world_size), dtype=torch.uint8),
    )
    dist.barrier()  # every heap checked fresh before any peer writes into it
    status = torch.zeros(3, dtype=torch.int64, device=dev)
    for round_no in (1, 2):  # round 2 overwrites round 1: a stale flag must not satisfy it
        _exchange(heap, rank, world_size, round_no, status, NEVER_NS)
        if status.tolist() != [int(STATUS_OK), 0, 0]:
            failures.append(f"rank {rank}, round {round_no}: status words {status.tolist()}")
        want = _expected_heap(rank, world_size, [round_no] * world_size, [round_no] * world_size)
        failures += _compare_heap(f"rank {rank}, round {round_no}", heap.local, want)
        dist.barrier()  # every rank verified before anyone writes the next round
    heap.close()
    if _mapped_segments():
        failures.append(f"rank {rank}: close() left segments mapped: {_mapped_segments()}")
    return failures, segments


@pytest.mark.parametrize(
    "world_size", [2, *(pytest.param(w, marks=pytest.mark.slow) for w in (4, 8))]
)
def test_every_rank_writes_every_peer(launch, device, world_size):
    results = launch(_exchange_body, world_size)
    failures = [msg for per_rank, _ in results for msg in per_rank]
    assert not failures, "\n".join(failures)
    if device == "cpu":
        _assert_no_leftovers([segs for _, segs in results], world_size)


# --- a peer that never signals ---------------------------------------------------------------


def _missing_peer_body(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    failures: list[str] = []
    dev = rank_device()
    heap = allocate_heap(dist.group.WORLD, _heap_bytes(world_size), dev)
    segments = _mapped_segments()
    if rank == 0:
        status = torch.zeros(3, dtype=torch.int64, device=dev)
        _exchange(heap, rank, world_size, 1, status, 2 * 10**9)  # rank 1 never signals
        if status.tolist() != [int(STATUS_TIMED_OUT), 1, STAGE]:
            failures.append(
                f"status after the timeout: {status.tolist()}, expected "
                f"[{STATUS_TIMED_OUT}, 1, {STAGE}] (code, peer, stage)"
            )
        # A recorded status makes every later wait return at once, however long its timeout.
        _exchange(heap, rank, world_size, 2, status, NEVER_NS)
        if status.tolist() != [int(STATUS_TIMED_OUT), 1, STAGE]:
            failures.append(f"status after a second launch: {status.tolist()}")
        want = _expected_heap(rank, world_size, [2, 0], [2, 0])  # rank 0 wrote its own slot
        failures += _compare_heap("rank 0", heap.local, want)
    dist.barrier()
    if rank == 1:  # rank 0's one-sided writes landed although rank 1 launched nothing
        failures += _compare_heap(
            "rank 1", heap.local, _expected_heap(1, world_size, [2, 0], [2, 0])
        )
    heap.close()
    return failures, segments


def test_missing_peer_records_a_timeout(launch, device):
    results = launch(_missing_peer_body, 2, timeout_s=300)
    failures = [msg for per_rank, _ in results for msg in per_rank]
    assert not failures, "\n".join(failures)
    if device == "cpu":
        _assert_no_leftovers([segs for _, segs in results], 2)


# --- through Buffer --------------------------------------------------------------------------

H, T = 8, 4


def _expect_timeout(failures, what, call, stage: str) -> None:
    try:
        call()
        failures.append(f"{what}: no TimeoutError")
    except TimeoutError as e:
        for part in ("rank 1", stage):
            if part not in str(e):
                failures.append(f"{what}: TimeoutError {str(e)!r} does not mention {part!r}")
    except Exception as e:
        failures.append(f"{what}: raised {e!r}, expected TimeoutError")


def _expect_unusable(failures, what: str, buf: Buffer, x, idx) -> None:
    for name, call in (
        ("dispatch", lambda: buf.dispatch(x, idx)),
        ("combine", lambda: buf.combine(x, None)),
    ):
        try:
            call()
            failures.append(f"{what}: {name} on the broken Buffer did not raise")
        except RuntimeError as e:
            if "unusable" not in str(e) or "rank 1" not in str(e):
                failures.append(f"{what}: {name} on the broken Buffer: unclear error {e}")
        except Exception as e:
            failures.append(f"{what}: {name} on the broken Buffer raised {e!r}")


def _skipped_call_body(
    rank: int, world_size: int, ranks_per_node: int | None
) -> tuple[list[str], list[str]]:
    """Rank 1 skips collective calls that rank 0 makes; rank 0 must time out, naming it (with
    ranks_per_node=1 rank 1 is on another node, reached by network puts only)."""
    failures: list[str] = []
    dev = rank_device()
    x = torch.randn(T, H).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1]], device=dev)
    make = dict(
        hidden_size=H,
        max_tokens_per_rank=T,
        num_experts=4,
        timeout_s=3,
        ranks_per_node=ranks_per_node,
        device=dev,
    )

    # 0. Every rank dispatches and combines once, so that each has built and loaded the kernels:
    # on GPUs a rank's first call does (tens of seconds under MPS), and a peer's kernel waiting
    # for it meanwhile would time out after this Buffer's 3 s.
    buf = Buffer(None, **make)
    segments = set(_mapped_segments())
    recv_x, _, _, handle = buf.dispatch(x, idx)
    buf.combine(recv_x, handle)
    dist.barrier()
    buf.destroy()

    # 1. Rank 1 skips a dispatch (exact mode).
    buf = Buffer(None, **make)
    segments.update(_mapped_segments())
    if rank == 0:
        what = "dispatch skipped by rank 1"
        _expect_timeout(failures, what, lambda: buf.dispatch(x, idx), "layout exchange")
        _expect_unusable(failures, what, buf, x, idx)
    dist.barrier()
    buf.destroy()
    buf.destroy()  # idempotent

    # 2. Rank 1 skips a dispatch in max_recv_tokens mode (CPU ranks raise at once, GPUs in check).
    buf = Buffer(None, **make)
    segments.update(_mapped_segments())
    if rank == 0:
        what = "max-mode dispatch skipped by rank 1"

        def call():
            handle = buf.dispatch(x, idx, max_recv_tokens=16)[3]
            buf.check(handle)

        _expect_timeout(failures, what, call, "layout exchange")
        _expect_unusable(failures, what, buf, x, idx)
    dist.barrier()
    buf.destroy()

    # 3. Both dispatch; rank 1 skips the combine (CPU ranks raise at once, GPUs in check).
    buf = Buffer(None, **make)
    segments.update(_mapped_segments())
    recv_x, _, _, handle = buf.dispatch(x, idx)
    if rank == 0:
        what = "combine skipped by rank 1"

        def call():
            buf.combine(recv_x, handle)
            buf.check(handle)

        _expect_timeout(failures, what, call, "start of combine")
        _expect_unusable(failures, what, buf, x, idx)
    dist.barrier()
    buf.destroy()

    # 4. Mismatched calls: rank 0 dispatches (cached handle) while rank 1 combines. Both time
    # out at the start of their call instead of taking each other's data for their own.
    mismatched = Buffer(None, **make)
    segments.update(_mapped_segments())
    recv_x, _, _, handle = mismatched.dispatch(x, idx)
    if rank == 0:

        def call():
            mismatched.dispatch(x, handle=handle)
            mismatched.check(handle)

        _expect_timeout(failures, "dispatch met by a combine", call, "start of dispatch")
    else:

        def call():
            mismatched.combine(recv_x, handle)
            mismatched.check(handle)

        _expect_timeout(failures, "combine met by a dispatch", call, "start of combine")
    dist.barrier()
    mismatched.destroy()
    try:
        buf.dispatch(x, idx)
        failures.append(f"rank {rank}: dispatch on a destroyed Buffer did not raise")
    except RuntimeError as e:
        if "destroyed" not in str(e):
            failures.append(f"rank {rank}: dispatch after destroy: unclear error {e}")
    if dist.get_backend() == "gloo" and _mapped_segments():
        failures.append(f"rank {rank}: destroy() left segments mapped: {_mapped_segments()}")
    return failures, sorted(segments)


@pytest.mark.parametrize(
    "ranks_per_node", [None, pytest.param(1, marks=pytest.mark.slow)], ids=["one_node", "two_nodes"]
)
def test_buffer_times_out_on_a_skipped_call(launch, device, ranks_per_node):
    results = launch(_skipped_call_body, 2, ranks_per_node, timeout_s=300)
    failures = [msg for per_rank, _ in results for msg in per_rank]
    assert not failures, "\n".join(failures)
    if device == "cpu":
        _assert_no_leftovers([segs for _, segs in results], 2)


# --- a rank killed after allocating ----------------------------------------------------------


def _killed_body(rank: int, world_size: int, out_dir: str) -> int:
    heap = allocate_heap(dist.group.WORLD, _heap_bytes(world_size), torch.device("cpu"))
    with open(os.path.join(out_dir, f"rank{rank}.segments"), "w") as f:
        f.write("\n".join(_mapped_segments()))
    dist.barrier()  # both reports are written
    if rank == 1:
        os._exit(3)  # no close(), no finally blocks, no process-group teardown
    del heap
    return rank


def test_no_leftovers_when_a_rank_is_killed(launch, device, tmp_path):
    _skip_unless_cpu(device)
    with pytest.raises(RankFailure) as info:
        launch(_killed_body, 2, str(tmp_path), timeout_s=300)
    assert 1 in info.value.failures and "exited with code 3" in info.value.failures[1], str(
        info.value
    )
    segments = [(tmp_path / f"rank{r}.segments").read_text().split() for r in range(2)]
    _assert_no_leftovers(segments, 2)


# --- a rank killed in the middle of a dispatch -----------------------------------------------
#
# Three ranks dispatch along a cached handle, so the call is the data-move kernel alone. Rank 0
# (EARLY) and the victim (rank 2) start it at once; rank 1 (LATE) starts it only once the victim
# is dead. A watcher thread in the victim polls the victim's own heap and SIGKILLs its process
# when both its own and EARLY's "dispatch started" flags have landed there: the data move is
# then running on the victim, which cannot get past its handshake (it waits for LATE), so it
# dies before it has sent a single token, every time. Both survivors then wait for it (for its
# token chunks, or for the start of its channels that had not begun), and must raise
# TimeoutError naming rank 2 and a dispatch stage, timeout_s after the death.

KILL_TIMEOUT_S = 5.0  # the Buffer's timeout_s; EARLY waits for LATE for part of it
KILL_MARGIN_S = 20.0  # interpreted kernels on a loaded 2-core machine
EARLY, LATE, VICTIM = 0, 1, 2
KILL_T, KILL_H = 8, 8  # tokens per rank, hidden size


def _own_flags(buf: Buffer, region: str) -> torch.Tensor:
    """int64 [W, n] view of a flag region of this rank's own heap: row s holds what rank s
    signalled here. Buffer internals, read by the test only."""
    rt = buf._rt
    if region == "dispatch_ready":  # one flag per program
        width = MAX_PROGRAMS
    else:  # chunk_flags: one per (chunk, column slice)
        width = rt.plan.max_chunks * rt.plan.config.h_slices
    start = getattr(rt.plan.heap, region)
    flags = rt.heap.local[start : start + 8 * rt.world_size * width].view(torch.int64)
    return flags.view(rt.world_size, width)


def _kill_self_when(started) -> None:
    """Watcher thread: SIGKILL this process as soon as ``started()`` is true."""

    def watch() -> None:
        while not started():
            time.sleep(0.001)
        os.kill(os.getpid(), signals.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _wait_until_dead(pid: int, limit_s: float = 120.0) -> float:
    """Poll /proc until ``pid`` is a zombie or gone; returns time.monotonic() then."""
    until = time.monotonic() + limit_s
    while time.monotonic() < until:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or the read
            state = "X"
        if state in ("Z", "X"):
            return time.monotonic()
        time.sleep(0.001)
    raise AssertionError(f"rank {VICTIM} (pid {pid}) still alive after {limit_s:g} s")


def _killed_mid_dispatch_body(rank: int, world_size: int, out_dir: str) -> None:
    experts = 2 * world_size
    x = torch.randn(KILL_T, KILL_H).to(torch.bfloat16)
    # Every token goes to every rank (one of its two experts), so every rank waits for
    # token chunks from every other rank.
    idx = torch.arange(world_size)[None, :] * 2 + torch.arange(KILL_T)[:, None] % 2
    buf = Buffer(
        None,
        hidden_size=KILL_H,
        max_tokens_per_rank=KILL_T,
        num_experts=experts,
        timeout_s=KILL_TIMEOUT_S,
    )
    record = {"pid": os.getpid(), "segments": _mapped_segments()}
    handle = buf.dispatch(x, idx)[3]  # the layout: the next dispatch is the data move alone
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    ready, chunks = _own_flags(buf, "dispatch_ready"), _own_flags(buf, "chunk_flags")
    ready_before, chunks_before = ready[:, 0].clone(), chunks.clone()
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(record, f)
    dist.barrier()  # the last collective outside the killed dispatch
    if rank == VICTIM:
        _kill_self_when(
            lambda: bool((ready[[VICTIM, EARLY], 0] > ready_before[[VICTIM, EARLY]]).all())
        )
        buf.dispatch(x, handle=handle)  # waits in the handshake for LATE until it is killed
        raise AssertionError("the victim's dispatch returned")
    if rank == LATE:
        record["died"] = _wait_until_dead(pids[VICTIM])
        # What the victim left in this heap: it started the data move, but sent no chunk.
        record["victim_started"] = bool(ready[VICTIM, 0] > ready_before[VICTIM])
        record["victim_chunks"] = int((chunks[VICTIM] != chunks_before[VICTIM]).sum())
    try:
        buf.dispatch(x, handle=handle)
        record["error"] = None
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        record["raised_at"] = time.monotonic()
        with open(path, "w") as f:
            json.dump(record, f)
    raise AssertionError("dispatch returned although rank 2 died")


@pytest.mark.slow
def test_rank_killed_mid_dispatch(launch, device, tmp_path):
    """A rank SIGKILLed inside a dispatch's data move: both survivors raise TimeoutError naming
    it and the stage, timeout_s after its death; the launcher reports the death; no shm."""
    _skip_unless_cpu(device)
    with pytest.raises(RankFailure) as info:
        launch(
            _killed_mid_dispatch_body,
            3,
            str(tmp_path),
            timeout_s=300,
            failure_grace_s=KILL_TIMEOUT_S + KILL_MARGIN_S,
        )
    assert not isinstance(info.value, RanksTimedOut), str(info.value)
    failures = info.value.failures  # survivors still running after the grace would be here
    assert "was killed by SIGKILL" in failures.get(VICTIM, ""), str(info.value)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert records[VICTIM]["pid"] == info.value.pids[VICTIM]
    late = records[LATE]
    assert "died" in late, f"rank {LATE} did not see rank {VICTIM} die\n{info.value}"
    assert late["victim_started"] and late["victim_chunks"] == 0, late  # died mid-dispatch
    for r in (EARLY, LATE):
        error = records[r].get("error")
        assert error and error.startswith("TimeoutError: "), f"rank {r}: {error}\n{info.value}"
        # The victim's first channel started, its others may not have: either dispatch stage.
        assert f"rank {VICTIM} did not answer" in error, error
        assert "dispatch token chunks" in error or "start of dispatch" in error, error
        assert error.splitlines()[0] in failures.get(r, ""), str(info.value)  # reported too
        # Its last wait began after the death (LATE only started then) and lasted timeout_s.
        after = records[r]["raised_at"] - late["died"]
        assert KILL_TIMEOUT_S <= after <= KILL_TIMEOUT_S + KILL_MARGIN_S, (r, after)
    _assert_no_leftovers([rec["segments"] for rec in records], 3)
