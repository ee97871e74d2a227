"""The mask of failed ranks (kernels/peers.py): a Buffer's update, clean and query of it, whether
its waits mask a peer that runs out of time, and the farewell at destroy()."""

import torch

from ..kernels.control import MASK_FAILED, MASKS_NEW
from ..kernels.peers import FREE_TOGETHER, MASKED_HERE, farewell_kernel
from ..runtime.checks import check_flag, check_mask_out, check_maskable
from ..runtime.planner import fixed_regions, next_power_of_2
from .launch import KernelLauncher
from .runtime import Runtime, nvshmem_linking


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


def release(heap, rank: int, world_size: int, nodes: int, timeout_ns: int, device) -> None:
    """Free ``heap`` (a symmetric heap of ``world_size`` ranks on ``nodes`` nodes, runtime/heap.py)
    with the other ranks (on GPUs NVSHMEM's free waits for every rank) where ``farewell`` says
    so, else leave it without waiting for anyone: on GPUs the heap and NVSHMEM then stay until
    the process ends."""
    if farewell(heap, rank, world_size, nodes, timeout_ns, device):
        heap.close()
    else:
        heap.abandon()


def farewell(heap, rank: int, world_size: int, nodes: int, timeout_ns: int, device) -> bool:
    """Whether every rank says, within ``timeout_ns``, that it frees ``heap`` with the others,
    none masked here or by another rank (kernels/peers.py, farewell_kernel; a host
    synchronisation). Said again, it gives the same answer at once. The mask and farewell
    regions are where every plan of the world puts them, so that a heap reserved and never
    taken by a Buffer says farewell too."""
    if world_size == 1:
        return True
    regions = fixed_regions(world_size)
    compile_options, on_compile = nvshmem_linking(device, nodes)
    verdict = torch.zeros(1, dtype=torch.int64, device=device)
    launch = KernelLauncher(
        farewell_kernel,
        on_compile=on_compile,
        peer_bases_ptr=heap.peer_bases,
        net_bases_ptr=heap.net_bases,
        mask_off=regions["mask"],
        farewell_off=regions["farewell"],
        rank=rank,
        timeout_ns=timeout_ns,
        W=world_size,
        W_P2=next_power_of_2(world_size),
        NODES=nodes,
        num_warps=1,
        **compile_options,
    )
    launch((1,), specialized={}, aligned=dict(verdict_ptr=verdict))
    return int(verdict.item()) == FREE_TOGETHER.value
