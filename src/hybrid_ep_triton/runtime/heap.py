"""The symmetric heap: one buffer of the same size and layout on every rank of a group, and the
table of every rank's base address that the kernels turn into peer pointers.

- CUDA tensors (NCCL group): NVSHMEM through nvshmem4py (``runtime.nvshmem``); peers are reached
  over NVLink through NVSHMEM's peer mappings, and across nodes through NVSHMEM puts.
- CPU tensors (gloo group, TRITON_INTERPRET=1): POSIX shared memory. Each rank creates one
  segment in /dev/shm, the names go round the group, every rank maps every segment, and once all
  have mapped them each owner unlinks its own: the mappings live on, and nothing is left behind
  in /dev/shm even when a rank process is killed later.
"""

import mmap
import os
import uuid

import torch
import torch.distributed as dist

_SHM_DIR = "/dev/shm"


def node_of(rank: int, ranks_per_node: int) -> range:
    """The ranks of ``rank``'s node: ranks_per_node consecutive ranks."""
    first = rank // ranks_per_node * ranks_per_node
    return range(first, first + ranks_per_node)


class SharedMemoryHeap:
    """POSIX shared memory heap of CPU rank processes (collective constructor).

    local: uint8 [nbytes], this rank's segment, zero-filled.
    peer_bases: int64 [world], each rank's segment address as mapped in this process, for the
        ranks of this rank's node; 0 for the others, which simulate other nodes: they are
        reached only by the network puts of the kernels' primitives.
    net_bases: int64 [world], every rank's segment address, where those puts land.
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, ranks_per_node: int):
        rank = dist.get_rank(group)
        name = f"hybrid_ep_triton-{uuid.uuid4().hex}-r{rank}"
        path = os.path.join(_SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            names = [None] * dist.get_world_size(group)
            dist.all_gather_object(names, name, group=group)
            self._maps = [self._map(os.path.join(_SHM_DIR, n), nbytes) for n in names]
            dist.barrier(group=group)
        finally:
            os.close(fd)
            os.unlink(path)
        self._views = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self.local = self._views[rank]
        addresses = [v.data_ptr() for v in self._views]
        near = node_of(rank, ranks_per_node)
        self.peer_bases = torch.tensor(
            [a if r in near else 0 for r, a in enumerate(addresses)],
            dtype=torch.int64,
            device="cpu",
        )
        self.net_bases = torch.tensor(addresses, dtype=torch.int64, device="cpu")

    @staticmethod
    def _map(path: str, nbytes: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap every segment (idempotent). Tensors viewing the heap must be gone first."""
        self.local = self.peer_bases = self.net_bases = None
        self._views = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still exists; the mapping goes with it
                pass
        self._maps = []

    # Unmapping is local: nothing to wait for when a peer is gone.
    abandon = close


def allocate_heap(
    group: dist.ProcessGroup, nbytes: int, device: torch.device, ranks_per_node: int | None = None
):
    """A symmetric heap of ``nbytes`` bytes per rank on ``device`` (collective); nodes are
    ``ranks_per_node`` consecutive ranks (default: the whole group).

    Returns an object with ``local`` (uint8 [nbytes] on device), ``peer_bases`` (int64 [world]
    on device: each rank's heap as mapped here for the ranks of this node, 0 for the others),
    ``net_bases`` (int64 [world] on device: the addresses network puts take, see
    kernels/primitives.py), ``close()`` and ``abandon()`` (close where a peer is gone: without
    waiting for it).
    """
    ranks_per_node = ranks_per_node or dist.get_world_size(group)
    if device.type == "cuda":
        from .nvshmem import NvshmemAllocation

        return NvshmemAllocation(group, nbytes, device, ranks_per_node=ranks_per_node)
    return SharedMemoryHeap(group, nbytes, ranks_per_node)
