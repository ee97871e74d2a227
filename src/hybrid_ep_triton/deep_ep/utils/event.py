"""DeepEP's ``EventHandle`` and ``EventOverlap``: a point in a CUDA stream that another stream
can wait for. On CPU ranks (no CUDA) every call is synchronous, so a handle holds no event and
waiting on it returns at once."""

from __future__ import annotations

import torch


class EventHandle:
    """An event recorded on the current CUDA stream when made (DeepEP's ``EventHandle()``).

    Without CUDA it records nothing and ``current_stream_wait`` returns at once (calls on CPU
    ranks finish before they return).
    """

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record()

    @classmethod
    def of(cls, event: torch.cuda.Event | None) -> EventHandle:
        """A handle of a call's completion: ``event`` (None: the call has completed)."""
        handle = cls.__new__(cls)
        handle.event = event
        return handle

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (nothing to wait for without)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's wrapper of an optional ``EventHandle``: ``current_stream_wait()``, and ``with``
    (the current stream waits at the block's end).

    Args:
        event: the EventHandle, or None (a call made without async_finish).
        extra_tensors: tensors to keep alive until the wait (kept, as in DeepEP).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event (DeepEP asserts there is one; so here)."""
        if self.event is None:
            raise ValueError("this EventOverlap holds no event (the call was not async_finish)")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait) -> None:
        """A function to call once, after the next ``current_stream_wait``."""
        if self.hook_after_wait is not None:
            raise ValueError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def native_event(previous_event: EventOverlap | None):
    """The torch.cuda.Event inside a DeepEP previous_event, for a native call (None: none, or
    CPU ranks)."""
    return getattr(getattr(previous_event, "event", None), "event", None)


def overlap(outputs: tuple, async_finish: bool) -> EventOverlap:
    """DeepEP's event of a native call's ``outputs`` (with async_finish the last: an event, or
    None on CPU ranks, whose calls complete before they return)."""
    return EventOverlap(EventHandle.of(outputs[-1]) if async_finish else None)
