"""The mask of failed ranks (kernels/peers.py): a Buffer's update, clean and query of it, whether
its waits mask a peer that runs out of time, and the farewell at destroy()."""

import torch

from ..kernels.control import MASK_FAILED, MASKS_NEW
from ..kernels.peers import FREE_TOGETHER, MASKED_HERE, farewell_kernel
from ..runtime.checks import check_flag, check_mask_out, check_maskable
from ..runtime.planner import next_power_of_2
from .launch import KernelLauncher
from .runtime import Runtime


def mask_failed(rt: Runtime, on: bool) -> None:
    """Buffer(mask_failed_ranks=on): a wait that runs out masks its peer, or records a timeout."""
    rt.control[int(MASK_FAILED)] = int(on)


def mask_words(rt: Runtime) -> torch.Tensor:
    """This rank's mask in its heap, int64 [W] (nonzero: the calls skip that rank)."""
    start = rt.plan.heap.mask
    return rt.heap.local[start : start + 8 * rt.world_size].view(torch.int64)


def update_mask(rt: Runtime, rank: int | None, masked: bool) -> None:
    """Buffer.update_mask (rank None: every other rank, Buffer.clean_mask), in stream order; the
    next launch tells the other ranks of a new mask."""
    news = rt.control[int(MASKS_NEW)]
    if rank is None:
        mask_words(rt).zero_()
        news.fill_(0)
        return
    check_maskable(rank, rt.rank, rt.world_size)
    check_flag("masked", masked)
    mask_words(rt)[rank].fill_(int(MASKED_HERE) if masked else 0)
    if masked:
        news.fill_(1)


def query_mask(rt: Runtime, out: torch.Tensor) -> None:
    """Buffer.query_mask: 1 where a rank is masked, into ``out`` int32 [W], in stream order."""
    check_mask_out(out, rt.world_size, rt.device)
    out.copy_(mask_words(rt) != 0)


def masked_ranks(rt: Runtime) -> list[int]:
    """Buffer.masked_ranks (reads the device)."""
    return torch.nonzero(mask_words(rt)).flatten().tolist()


def release(rt: Runtime) -> None:
    """Free ``rt``'s heap with the other ranks (on GPUs NVSHMEM's free waits for every rank)
    where ``farewell`` says so, else leave it without waiting for anyone: on GPUs the heap and
    NVSHMEM then stay until the process ends."""
    if farewell(rt):
        rt.heap.close()
    else:
        rt.heap.abandon()


def farewell(rt: Runtime) -> bool:
    """Whether every rank says, within timeout_s, that it frees the heap with the others, none
    masked here or by another rank (kernels/peers.py, farewell_kernel; a host
    synchronisation). Said again, it gives the same answer at once."""
    if rt.world_size == 1:
        return True
    heap = rt.plan.heap
    verdict = torch.zeros(1, dtype=torch.int64, device=rt.device)
    launch = KernelLauncher(
        farewell_kernel,
        on_compile=rt.on_compile,
        peer_bases_ptr=rt.heap.peer_bases,
        net_bases_ptr=rt.heap.net_bases,
        mask_off=heap.mask,
        farewell_off=heap.farewell,
        rank=rt.rank,
        timeout_ns=rt.timeout_ns,
        W=rt.world_size,
        W_P2=next_power_of_2(rt.world_size),
        NODES=rt.plan.nodes,
        num_warps=1,
        **rt.compile_options,
    )
    launch((1,), specialized={}, aligned=dict(verdict_ptr=verdict))
    return int(verdict.item()) == FREE_TOGETHER.value
