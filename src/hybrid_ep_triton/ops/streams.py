"""Calls on a Buffer's communication stream (``async_finish``), overlapped with the caller's."""

import torch

from .handle import DispatchHandle


class CommStream:
    """A Buffer's communication stream, made at its first asynchronous call on a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: torch.cuda.Stream | None = None

    def run(self, call, inputs: tuple, previous_event, async_finish: bool):
        """Run ``call`` (returns a tensor, a tuple of tensors, None or handles) on the calling
        stream (after ``previous_event`` when given), or with async_finish on the
        communication stream, after the caller's work so far or after previous_event; returns
        (outputs, event): the event completes with the call (None without async_finish or on
        the CPU). ``inputs``: tensors the call reads (None allowed)."""
        if not async_finish or self.device.type != "cuda":
            if previous_event is not None:
                torch.cuda.current_stream().wait_event(previous_event)
            return call(), None
        caller = torch.cuda.current_stream()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        comm = self.stream
        if previous_event is not None:
            comm.wait_event(previous_event)
        else:
            comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            outputs = call()
        # The caching allocator must not hand these blocks to another stream while in use:
        # inputs are read on comm, outputs (allocated on comm) are used on the caller's stream.
        for t in inputs:
            if t is not None:
                t.record_stream(comm)
        for out in outputs if isinstance(outputs, tuple) else (outputs,):
            if isinstance(out, DispatchHandle):
                for part in (out.state, out.recv_topk_idx):
                    if part is not None:
                        part.record_stream(caller)
            elif isinstance(out, torch.Tensor):
                out.record_stream(caller)
        return outputs, comm.record_event()
