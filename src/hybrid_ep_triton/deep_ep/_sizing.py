"""Buffers sized at their first call and rebuilt larger when a call needs more tokens.

DeepEP streams chunks through fixed-size buffers, so its constructors take byte counts and no
token limit; a ``hybrid_ep_triton.Buffer`` preallocates for ``max_tokens_per_rank``, the hidden
size and the dtype. ``Sized`` holds the Buffers of one DeepEP object for one capacity (several
kinds of Buffer share it: token rows, metadata rows) and grows that capacity collectively:

- the first dispatch agrees on the largest token count of the ranks (a host all-gather) and
  sizes every Buffer for it, rounded up to a multiple of ``TOKEN_QUANTUM``;
- a later dispatch with more tokens than the capacity on some rank is refused by the Buffer on
  every rank (a ValueError in the same call, nothing moved: the Buffer's contract for a
  dispatch that computes a layout without max_recv_tokens); every rank then agrees on the
  largest token count again, builds Buffers for max(that, 1.5 x the old capacity) and repeats
  the call. A call without max_recv_tokens costs nothing more; a growth costs one refused
  layout step, a host all-gather and the new Buffers' construction (collective, a heap each).
- with max_recv_tokens (DeepEP's ``num_worst_tokens``, HybridEP's non-blocking mode) a rank's
  refusal does not reach its peers in the call on GPUs, so there is no growth: the rank with too
  many tokens raises ValueError naming the capacity (CPU ranks: every rank raises).

Earlier Buffers stay allocated until ``destroy()``: handles of calls made on them (a forward
pass's, kept for its backward) stay valid, and freeing symmetric memory is collective, which
garbage collection cannot be.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist

from .. import Buffer

TOKEN_QUANTUM = 16
GROWTH = 1.5


def gather(group: dist.ProcessGroup, value) -> list:
    """Every rank's ``value`` (a host collective over ``group``)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Sized:
    """The Buffers of one capacity, by kind, made on first use by ``make(kind, capacity)``."""

    def __init__(self, group: dist.ProcessGroup, make: Callable[[object, int], Buffer]):
        self.group = group
        self.make = make
        self.capacity: int | None = None
        self.buffers: dict = {}
        self.retired: list[Buffer] = []

    def buffer(self, kind) -> Buffer:
        """The Buffer of ``kind`` at the current capacity (collective when it is made)."""
        if kind not in self.buffers:
            self.buffers[kind] = self.make(kind, self.capacity)
        return self.buffers[kind]

    def size_for(self, num_tokens: int, at_least: int = 0) -> None:
        """Before the first call (collective): the capacity becomes the largest of every
        rank's max(num_tokens, at_least)."""
        if self.capacity is None:
            largest = max(gather(self.group, max(num_tokens, at_least)))
            self.capacity = round_up(max(largest, 1), TOKEN_QUANTUM)

    def run(self, num_tokens: int, call: Callable[[], tuple], growable: bool) -> tuple:
        """``call()`` (a dispatch on this object's Buffers that computes a layout); if some rank
        has more tokens than the capacity, grow it and call again (see the module)."""
        try:
            return call()
        except ValueError as refused:
            if not growable:
                if num_tokens > self.capacity:
                    raise ValueError(
                        f"{num_tokens} tokens is more than this buffer's capacity of "
                        f"{self.capacity} a rank, which a call with num_worst_tokens / "
                        "num_permuted_tokens cannot grow (no host synchronisation): make one "
                        "call with the largest token count without it first"
                    ) from refused
                raise
            largest = max(gather(self.group, num_tokens))
            if largest <= self.capacity:
                raise
        self._grow(largest)
        return call()

    def reset(self) -> None:
        """Retire the Buffers and forget the capacity: the next call sizes anew (rows of another
        shape or dtype; every rank passes such rows in the same call)."""
        self.retired.extend(self.buffers.values())
        self.buffers, self.capacity = {}, None

    def _grow(self, largest: int) -> None:
        self.retired.extend(self.buffers.values())
        self.buffers = {}
        self.capacity = round_up(max(largest, math.ceil(self.capacity * GROWTH)), TOKEN_QUANTUM)

    def destroy(self) -> None:
        """Free every Buffer, the retired ones too (collective)."""
        for buffer in [*self.retired, *self.buffers.values()]:
            buffer.destroy()
        self.retired, self.buffers = [], {}
