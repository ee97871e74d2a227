"""The native Buffer behind an adapter's calls (``Sized``), made at the first call for its
rows' kind (``key``) and the ranks' largest token count, and made again when a call needs more
tokens or rows of another kind: the Buffer refuses that call on every rank, which then agree on
the new size in a host all-gather (docs/deep_ep.md, "Sizes"); and the helpers of handles, rows
and routing that the adapters share. Earlier Buffers stay until ``destroy()``: handles made on
them stay valid, and freeing symmetric memory is collective, which garbage collection is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import Buffer
from ..runtime.checks import RefusedEarlier, describe
from .config import round_up

TOKEN_QUANTUM = 16
GROWTH = 1.5
# An adapter's refusal of its own argument: (the native argument it stands for, the error).
Refusal = tuple[str, ValueError]

__all__ = [
    "GROWTH",
    "TOKEN_QUANTUM",
    "Handle",
    "Refusal",
    "Sized",
    "check_handle",
    "gather",
    "round_up",
    "rows_key",
    "tensor_problem",
    "values_of",
]


def gather(group: dist.ProcessGroup, value) -> list:
    """Every rank's ``value`` (a host collective over ``group``)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


class Handle(tuple):
    """A call's handle: DeepEP's (or HybridEP's) tuple of ``parts``, carrying the native handle
    (``native``), the native Buffer of the call (``buffer``) and ``more`` attributes: a tuple
    rebuilt from the parts lacks them, which the calls refuse (ValueError)."""

    def __new__(cls, parts, native, buffer: Buffer, **more):
        handle = super().__new__(cls, parts)
        handle.native, handle.buffer = native, buffer
        handle.__dict__.update(more)
        return handle


def check_handle(handle, expand: bool | None = None) -> None:
    """``handle`` is a Handle (of a Buffer of ``expand``, None: any), else a ValueError on this
    rank, as the native Buffer's for a handle that is none of its own."""
    if type(handle) is not Handle or expand not in (None, handle.buffer.expand):
        raise ValueError(
            "handle must be one that this buffer's calls returned (a tuple rebuilt from its "
            f"parts lacks the native handle and its token_slots), got {type(handle).__name__}"
        )


class Sized:
    """One native Buffer for rows of one key, made by ``make(key, capacity)`` when a call needs
    it (see the module); ``capacity``: tokens a rank that the first Buffer holds at least."""

    def __init__(self, group, make: Callable[[object, int], Buffer], capacity: int = 0):
        self.group, self.make, self.floor = group, make, capacity
        self.key, self.capacity = None, capacity
        self.buffer: Buffer | None = None
        self.retired: list[Buffer] = []

    def run(
        self,
        key,
        num_tokens: int,
        call,
        refused: Refusal | None,
        growable: bool = True,
        changed: str = "x",
    ):
        """``call(buffer, refusal)``, a dispatch with a new layout of ``num_tokens`` tokens on
        the Buffer for ``key`` (None where this rank ``refused`` an argument), which calls
        ``buffer.refuse(*refusal)`` first where refusal is given; ``growable``: without
        max_recv_tokens; ``changed``: the native argument that a new key stands for."""
        asked = refused  # this rank's own refusal, which no other Buffer serves
        if self.buffer is None or (refused is None and key != self.key and not growable):
            self._agree(key, num_tokens, refused)
        elif refused is None and key != self.key:  # made anew below if every rank's changed
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
            # (A refusal along a handle that this call tells of raises on every rank too.)
            told = isinstance(error, RefusedEarlier)
            everyone = gather(self.group, (None if asked or told else key, num_tokens))
            keys, largest = {k for k, _ in everyone}, max(n for _, n in everyone)
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
            raise ValueError(f"the ranks' rows differ in kind: {[k for k, _, _ in everyone]}")
        self._remake(key, max(n for _, n, _ in everyone))

    def _remake(self, key, largest: int) -> None:
        """The Buffer for ``key`` and at least ``largest`` tokens a rank (for the same key,
        GROWTH times the capacity at least)."""
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
    """The values of ``rows``: the tensor, or a (values, scales) pair's values."""
    return rows[0] if isinstance(rows, tuple) else rows


def rows_key(rows) -> tuple | None:
    """(H, dtype, device) of the Buffer for ``rows`` (a [T, H] tensor, or an FP8 pair of values
    and scales, whose Buffer's dtype is bf16), or None where they are neither."""
    values = values_of(rows)
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        return None
    return values.shape[1], torch.bfloat16 if values is not rows else values.dtype, values.device


def tensor_problem(name: str, t, dtype: torch.dtype, device, shape=None) -> str | None:
    """Why ``t`` is not a contiguous tensor of ``dtype`` on ``device`` (of ``shape``, None:
    any), as DeepEP asserts; None where it is."""
    if not (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.device == device
        and (shape is None or t.shape == shape)
        and t.is_contiguous()
    ):
        want = "" if shape is None else f" of shape {tuple(shape)}"
        return f"{name} must be a contiguous {dtype} tensor{want} on {device}, got {describe(t)}"
    return None
