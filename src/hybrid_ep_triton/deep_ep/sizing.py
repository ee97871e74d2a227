"""A native Buffer sized at its first call and made again, collectively, when a call needs
another; and the helpers of rows and routing that the adapters share.

DeepEP streams chunks through fixed-size buffers, so its constructors take byte counts and no
token limit; a ``hybrid_ep_triton.Buffer`` preallocates for ``max_tokens_per_rank``, the hidden
size and the dtype. ``Sized`` holds the Buffer of one adapter object (its ``key``: what the
rows are, e.g. hidden size, dtype, experts, device) and its capacity of tokens a rank:

- the first call agrees on the key and the largest token count of the ranks (one host
  all-gather, which also carries a rank's refusal of its arguments to every rank) and makes the
  Buffer for it, rounded up to a multiple of ``TOKEN_QUANTUM``;
- a later call with more tokens than the capacity on some rank, or rows of another key, is
  refused by the Buffer on every rank (a ValueError in the same call, nothing moved: the
  Buffer's contract for a dispatch that computes a layout without max_recv_tokens); every rank
  then agrees on the largest token count and the key (a host all-gather), makes a Buffer for
  max(that, 1.5 x the old capacity) (or, for another key, for that count) and repeats the call;
  a call that a rank refused for another reason raises on every rank instead. A call that fits
  costs nothing more; a growth costs one refused layout step, a host all-gather and the new
  Buffer's construction (collective, a heap).
- with max_recv_tokens (DeepEP's ``num_worst_tokens``, HybridEP's non-blocking mode) a rank's
  refusal does not reach its peers in the call on GPUs, so there is no growth: the rank with too
  many tokens raises ValueError naming the capacity (CPU ranks: every rank raises); rows of
  another key are agreed on by a host all-gather before the call.

Earlier Buffers stay allocated until ``destroy()``: handles of calls made on them (a forward
pass's, kept for its backward) stay valid, and freeing symmetric memory is collective, which
garbage collection cannot be.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import Buffer
from ..runtime import checks
from ..runtime.checks import Refused, refusing
from .config import round_up

TOKEN_QUANTUM = 16
GROWTH = 1.5
# A refusal of an adapter's own check: (the native argument it stands for, the ValueError).
Refusal = tuple[str, ValueError]

__all__ = [
    "GROWTH", "TOKEN_QUANTUM", "Refusal", "Sized", "check_tensor", "gather", "need", "refusal",
    "refusing", "round_up", "rows_key", "token_ranks", "values_of",
]  # fmt: skip


def gather(group: dist.ProcessGroup, value) -> list:
    """Every rank's ``value`` (a host collective over ``group``)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def refusal(checks: Callable[[], None]) -> Refusal | None:
    """What ``checks()`` refused (it raises runtime.checks.Refused, through ``refusing``), or
    None when it passed."""
    try:
        checks()
    except Refused as refused:
        return refused.argument, refused.error
    return None


class Sized:
    """One native Buffer for rows of one key, made by ``make(key, capacity)`` when a call needs
    it (see the module). ``capacity``: the tokens a rank that the first Buffer holds at least."""

    def __init__(self, group: dist.ProcessGroup, make: Callable[[object, int], Buffer],
                 capacity: int = 0):  # fmt: skip
        self.group, self.make, self.floor = group, make, capacity
        self.key, self.capacity = None, capacity
        self.buffer: Buffer | None = None
        self.retired: list[Buffer] = []

    def run(self, key, num_tokens: int, call, refused: Refusal | None, growable: bool = True,
            changed: str = "x"):  # fmt: skip
        """``call(buffer, refused)``: a dispatch with a new layout on the Buffer for ``key``
        (None where this rank ``refused`` an argument) of ``num_tokens`` tokens; ``call`` runs
        ``buffer.refuse`` first where given. ``changed``: the native argument a new key stands
        for. See the module for the rest."""
        asked = refused  # this rank's own refusal, which no other Buffer serves
        if self.buffer is None or (refused is None and key != self.key and not growable):
            self._agree(key, num_tokens, refused)
        elif refused is None and key != self.key:  # remade below if every rank's key changed
            why = f"this rank's call needs a Buffer for {key}, the Buffer is for {self.key}"
            refused = changed, ValueError(why + ", and the other ranks' calls do not change alike")
        try:
            return call(self.buffer, refused)
        except ValueError as error:
            if not growable:
                if refused is None and num_tokens > self.capacity:
                    raise ValueError(
                        f"{num_tokens} tokens is more than this buffer's capacity of "
                        f"{self.capacity} a rank, which a call with num_worst_tokens / "
                        "num_permuted_tokens cannot grow (no host synchronisation): make one "
                        "call with the largest token count without it first"
                    ) from error
                raise
            # (A refusal along a handle that this call tells of makes it raise on every rank.)
            told = "in an earlier call along a handle" in str(error)
            everyone = gather(self.group, (None if asked or told else key, num_tokens))
            keys = {k for k, _ in everyone}
            largest = max(n for _, n in everyone)
            if None in keys or len(keys) > 1 or (key == self.key and largest <= self.capacity):
                raise
        self._remake(key, largest)
        return call(self.buffer, None)

    def _agree(self, key, num_tokens: int, refused: Refusal | None) -> None:
        """Every rank's key and token count, or a ValueError on every rank where one refused
        its arguments or the keys differ (collective); then the Buffer for them."""
        said = None if refused is None else f"its {refused[0]}: {refused[1]}"
        everyone = gather(self.group, (key, num_tokens, said))
        if refused is not None:
            raise refused[1]
        for rank, (_, _, said) in enumerate(everyone):
            if said is not None:
                raise ValueError(f"rank {rank} refused {said}")
        if len({k for k, _, _ in everyone}) > 1:
            raise ValueError(f"the ranks passed rows of different kinds: {everyone}")
        self._remake(key, max(n for _, n, _ in everyone))

    def _remake(self, key, largest: int) -> None:
        """The Buffer for ``key`` and at least ``largest`` tokens a rank (grown by GROWTH at
        least where the key is the same)."""
        if self.buffer is not None:
            self.retired.append(self.buffer)
        least = math.ceil(self.capacity * GROWTH) if key == self.key else self.floor
        self.key, self.capacity = key, round_up(max(largest, least, 1), TOKEN_QUANTUM)
        self.buffer = self.make(key, self.capacity)

    def destroy(self) -> None:
        """Free every Buffer, the retired ones too (collective)."""
        for buffer in [*self.retired, self.buffer]:
            if buffer is not None:
                buffer.destroy()
        self.retired, self.buffer, self.key = [], None, None


def values_of(rows):
    """The values of ``rows``: the tensor, or an FP8 pair's values."""
    return rows[0] if isinstance(rows, tuple) else rows


def rows_key(rows) -> tuple | None:
    """(hidden size, dtype, device) of a Buffer for ``rows`` (a [T, H] tensor, or a pair of FP8
    values and scales, whose Buffer's dtype is bf16), or None where they are neither."""
    values = values_of(rows)
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        return None
    return values.shape[1], torch.bfloat16 if values is not rows else values.dtype, values.device


def token_ranks(slots: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """[T, W] bool: whether token t has an expert on rank r (``slots`` [T, K] global ids, -1
    unused; with one expert a rank: whether it goes to expert r)."""
    ranks = torch.where(slots >= 0, slots // experts_per_rank, -1)
    return (ranks[:, :, None] == torch.arange(world, device=slots.device)).any(1)


def need(ok: bool, message: str) -> None:
    """ValueError(``message``) unless ``ok`` (inside ``refusing``: a Refused)."""
    if not ok:
        raise ValueError(message)


def check_tensor(name: str, t, dtype: torch.dtype, device, shape: tuple | None = None) -> None:
    """``t``: a contiguous tensor of ``dtype`` on ``device`` (and ``shape``), as DeepEP asserts."""
    checks.check_tensor(name, t, shape, dtype, device)
    need(t.is_contiguous(), f"{name} must be contiguous")
