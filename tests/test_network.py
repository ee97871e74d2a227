"""The network put of the primitives (``net_put_signal``), on which the path across nodes rests.

Each rank puts a block of its symmetric heap into the next rank's heap with a flag, and waits,
with the bounded spin, for the flag of the block put into its own heap. On CPU ranks the put is
a copy into the peer's shared memory that must come from the sender's own heap (a source
outside it fails loudly, as a NIC reads only registered memory); on GPUs it is NVSHMEM's
``nvshmemx_putmem_signal_block`` called from the Triton kernel, with NVSHMEM's device library
linked and the kernel's module initialised. On one GPU the rank puts into its own heap.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from conftest import assert_no_failures, ranks_fit

from hybrid_ep_triton.kernels.control import STATUS_OK
from hybrid_ep_triton.kernels.primitives import INTERPRETED, net_put_signal, wait_at_least
from hybrid_ep_triton.ops.launch import KernelLauncher
from hybrid_ep_triton.runtime.heap import allocate_heap
from hybrid_ep_triton.tools.launcher import rank_device

FLAG_OFF = 0  # int64: the round of the block that landed here
SRC_OFF = 256  # what this rank puts
DST_OFF = 8192  # where the previous rank's block lands
NBYTES = 5000  # more than one 4096-byte copy block of the CPU put, the last one partial
HEAP_BYTES = DST_OFF + NBYTES + 100
STAGE = 9
TIMEOUT_NS = 120 * 10**9


@triton.jit
def _put_kernel(
    net_bases_ptr,
    src_ptr,
    rank,
    pe,
    source,
    nbytes,
    heap_bytes,
    seq,
    status_ptr,
    timeout_ns,
    FLAG_OFF: tl.constexpr,
    DST_OFF: tl.constexpr,
    STAGE: tl.constexpr,
):
    seq = seq + tl.zeros([], tl.int64)  # a round of 1 arrives as a constexpr
    net_put_signal(net_bases_ptr, rank, pe, DST_OFF, src_ptr, nbytes, FLAG_OFF, seq, heap_bytes)
    my_flag = (tl.load(net_bases_ptr + rank) + FLAG_OFF).to(tl.pointer_type(tl.int64))
    wait_at_least(my_flag, seq, timeout_ns, status_ptr, source, STAGE)


def _launcher(heap, device: torch.device) -> KernelLauncher:
    options = {}
    on_compile = None
    if device.type == "cuda":
        from hybrid_ep_triton.runtime.nvshmem import init_module
        from hybrid_ep_triton.runtime.nvshmem_bitcode import device_library

        options, on_compile = {"extern_libs": device_library()}, init_module
    return KernelLauncher(
        _put_kernel,
        on_compile=on_compile,
        net_bases_ptr=heap.net_bases,
        heap_bytes=HEAP_BYTES,
        timeout_ns=TIMEOUT_NS,
        FLAG_OFF=FLAG_OFF,
        DST_OFF=DST_OFF,
        STAGE=STAGE,
        **options,
    )


def _pattern(src: int, round_no: int) -> torch.Tensor:
    pos = torch.arange(NBYTES, dtype=torch.int64)
    return ((src * 37 + round_no * 101 + pos * 7 + 1) % 251).to(torch.uint8)


def _put_body(rank: int, world: int) -> list[str]:
    failures = []
    dev = rank_device()
    # Every rank its own node: no peer pointers, only network puts.
    heap = allocate_heap(dist.group.WORLD, HEAP_BYTES, dev, ranks_per_node=1)
    others = [r for r, b in enumerate(heap.peer_bases.tolist()) if b and r != rank]
    if others:
        failures.append(f"rank {rank}: peer pointers to ranks of other nodes: {others}")
    launch = _launcher(heap, dev)
    pe, source = (rank + 1) % world, (rank - 1) % world
    status = torch.zeros(3, dtype=torch.int64, device=dev)
    for round_no in (1, 2):
        heap.local[SRC_OFF : SRC_OFF + NBYTES] = _pattern(rank, round_no).to(dev)
        dist.barrier()  # no put of this round before every source block is written
        launch(
            (1,),
            specialized=dict(rank=rank, pe=pe, source=source, nbytes=NBYTES, seq=round_no),
            aligned=dict(src_ptr=heap.local[SRC_OFF:], status_ptr=status),
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        what = f"rank {rank}, round {round_no}"
        if status.tolist() != [int(STATUS_OK), 0, 0]:
            failures.append(f"{what}: the wait for the flag timed out: {status.tolist()}")
        flag = int(heap.local[FLAG_OFF : FLAG_OFF + 8].cpu().view(torch.int64))
        if flag != round_no:
            failures.append(f"{what}: flag {flag}, expected {round_no}")
        got = heap.local[DST_OFF : DST_OFF + NBYTES].cpu()
        if not torch.equal(got, _pattern(source, round_no)):
            failures.append(f"{what}: {(got != _pattern(source, round_no)).sum()} bytes differ")
        if int(heap.local[DST_OFF + NBYTES :].count_nonzero()):
            failures.append(f"{what}: bytes past the block were written")
        dist.barrier()  # every rank checked this round before the next overwrites it
    heap.close()
    return failures


def test_put_with_signal_lands(launch, device):
    # Between two ranks (sharing a GPU where there is one), else one rank into its own heap.
    results = launch(_put_body, 2 if ranks_fit(device, 2) else 1)
    assert_no_failures(results)


def _outside_body(rank: int, world: int) -> list[str]:
    failures = []
    heap = allocate_heap(dist.group.WORLD, HEAP_BYTES, torch.device("cpu"), ranks_per_node=1)
    launch = _launcher(heap, torch.device("cpu"))
    status = torch.zeros(3, dtype=torch.int64)
    outside = torch.zeros(NBYTES, dtype=torch.uint8)  # private memory, not the heap
    for what, src, nbytes in (
        ("a tensor outside the heap", outside, NBYTES),
        ("a block running past the heap's end", heap.local[HEAP_BYTES - 100 :], NBYTES),
    ):
        try:
            launch(
                (1,),
                specialized=dict(rank=rank, pe=1 - rank, source=1 - rank, nbytes=nbytes, seq=1),
                aligned=dict(src_ptr=src, status_ptr=status),
            )
            failures.append(f"rank {rank}: a put from {what} did not raise")
        except Exception as e:  # the interpreter wraps it: InterpreterError(NetworkSourceError)
            if "NetworkSourceError" not in str(e) or "outside this rank" not in str(e):
                failures.append(f"rank {rank}: unclear error for {what}: {e!r}")
    if heap.local[DST_OFF:].count_nonzero() or heap.local[FLAG_OFF : FLAG_OFF + 8].any():
        failures.append(f"rank {rank}: a refused put wrote into the heap")
    dist.barrier()  # no rank unmaps its heap while the other still checks its own
    heap.close()
    return failures


@pytest.mark.skipif(not INTERPRETED, reason="the CPU put checks its source")
@pytest.mark.slow
def test_put_from_outside_the_heap_fails_loudly(launch):
    results = launch(_outside_body, 2)
    assert_no_failures(results)


def _load_body(rank: int, world: int) -> list[str]:
    """Compile the kernels of the path across nodes (EP16 as 2 nodes of 8) for this GPU with
    NVSHMEM's device library, load each module and initialise NVSHMEM's state in it."""
    from sm90_compile import compile_all

    from hybrid_ep_triton.runtime.nvshmem import init_module

    heap = allocate_heap(dist.group.WORLD, HEAP_BYTES, rank_device())  # initialises NVSHMEM
    loaded = []
    for label, compiled in compile_all([(16, 8)]):
        compiled._init_handles()
        init_module(compiled)
        loaded.append(label)
    heap.close()
    kernels = {word for label in loaded for word in label.split()}
    missing = {"layout_kernel", "dispatch_kernel", "combine_kernel"} - kernels
    return [f"no {sorted(missing)} among {loaded}"] if missing else []


@pytest.mark.gpu
def test_node_kernels_load_with_nvshmem(launch):
    results = launch(_load_body, 1)
    assert not results[0], results[0]
