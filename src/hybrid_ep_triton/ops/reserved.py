"""A symmetric heap that every rank of a group reserves together before the sizes of the Buffer
that will use it are known: a Buffer made in it later calls no collective, so a rank that never
makes it holds no one up. DeepEP's Buffer allocates its buffers in its constructor, and its
programs may lose a rank before the first low-latency call (test_low_latency.py
--shrink-test): ``hybrid_ep_triton.deep_ep`` reserves its low-latency Buffer's heap so."""

import torch
import torch.distributed as dist

from ..runtime.heap import allocate_heap
from ..runtime.planner import Plan
from . import masks


class ReservedHeap:
    """``nbytes`` bytes of symmetric heap per rank of ``group`` on ``device``, nodes of
    ``ranks_per_node`` consecutive ranks (collective), zero-filled, for one Buffer
    (``Buffer(heap=...)``)."""

    def __init__(
        self, group: dist.ProcessGroup, nbytes: int, device: torch.device, ranks_per_node: int
    ):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.nbytes, self.device, self.ranks_per_node = nbytes, device, ranks_per_node
        self._heap = allocate_heap(group, nbytes, device, ranks_per_node)

    def fits(self, plan: Plan, device: torch.device) -> bool:
        """Whether a Buffer of ``plan`` on ``device`` can take this heap (the same on every
        rank where they pass the same sizes)."""
        return (
            self._heap is not None
            and plan.heap.total_bytes <= self.nbytes
            and plan.ranks_per_node == self.ranks_per_node
            and device == self.device
        )

    def take(self):
        """The heap (runtime/heap.py), which the taking Buffer frees at its destroy()."""
        heap, self._heap = self._heap, None
        return heap

    def release(self, timeout_s: float) -> None:
        """Free the heap if no Buffer took it: with the other ranks where every one says so
        within ``timeout_s`` (a rank whose Buffer took its own says so at its destroy()),
        else left to the process's end (``masks.release``)."""
        if self._heap is not None:
            nodes = self.world_size // self.ranks_per_node
            heap, self._heap = self._heap, None
            timeout_ns = int(timeout_s * 1e9)
            masks.release(heap, self.rank, self.world_size, nodes, timeout_ns, self.device)
