"""What the device recorded for the host, as exceptions: a timed-out wait's status (control
block STATUS words) and an exact-mode layout's report (REPORT_* words in pinned host memory).

A timed-out wait leaves the Buffer unusable (``Runtime.broken``): a peer did not answer, and the
ranks' sequence numbers no longer agree. Invalid routing and refused inputs do not: every rank
saw them in the same layout exchange (a refused call along a handle in the next one).
"""

import time

import torch

from ..kernels.control import (
    INFO_BAD_ROW,
    INFO_CAUSE,
    INFO_ROWS,
    INFO_SOURCE,
    LL_REFUSED,
    REPORT_CAUSE,
    REPORT_EXPERTS,
    REPORT_ROWS,
    REPORT_TAG,
    STAGE_COMBINE_DATA,
    STAGE_COMBINE_NET,
    STAGE_COMBINE_READY,
    STAGE_DISPATCH_DATA,
    STAGE_DISPATCH_NET,
    STAGE_DISPATCH_OUTPUTS,
    STAGE_DISPATCH_QUANTIZED,
    STAGE_DISPATCH_READY,
    STAGE_LAYOUT,
    STAGE_LL_COMBINE,
    STAGE_LL_DISPATCH,
    STAGE_LL_FREED,
    STATUS,
    STATUS_WORDS,
)
from ..runtime.checks import RefusedEarlier
from .handle import ALONG_A_HANDLE, INVALID_ROUTING, DispatchHandle, refused_argument
from .runtime import Runtime

_STAGES = {
    int(STAGE_LAYOUT): "the dispatch layout exchange",
    int(STAGE_DISPATCH_READY): "the start of dispatch (peer not ready)",
    int(STAGE_DISPATCH_DATA): "dispatch token chunks",
    int(STAGE_COMBINE_READY): "the start of combine (peer not ready)",
    int(STAGE_COMBINE_DATA): "combine partial sums",
    int(STAGE_DISPATCH_NET): "dispatch token chunks over the network",
    int(STAGE_COMBINE_NET): "combine partial sums over the network",
    int(STAGE_DISPATCH_QUANTIZED): "dispatch's quantization of this rank's rows",
    int(STAGE_DISPATCH_OUTPUTS): "the host's outputs of an exact-mode dispatch",
    int(STAGE_LL_DISPATCH): "low-latency dispatch rows",
    int(STAGE_LL_COMBINE): "low-latency combine rows",
    int(STAGE_LL_FREED): (
        "the receive of its low-latency call two calls back (a receive hook not called?)"
    ),
}
_STATUS = slice(int(STATUS), int(STATUS) + int(STATUS_WORDS))
# The report's words read, one slice of host memory: REPORT_ROWS, REPORT_SOURCE, REPORT_BAD_ROW,
# the REPORT_STATUS words, REPORT_CAUSE, in this order (kernels/control.py).
_REPORT_VALUES = slice(int(REPORT_ROWS), int(REPORT_CAUSE) + 1)
# The same from the handle's info and the control block, read from the device.
_INFO_VALUES = (int(INFO_ROWS), int(INFO_SOURCE), int(INFO_BAD_ROW))


def check_after_launch(rt: Runtime) -> None:
    """After every launch: CPU ranks' launches are synchronous, so a timed-out wait is raised
    now; on GPUs, where launches are asynchronous, it is read where the host synchronises
    (``read_report``)."""
    if not rt.on_gpu:
        raise_on_status(rt, *rt.control[_STATUS].tolist())


def check_low_latency(rt: Runtime, refusals: bool = True) -> None:
    """What the device recorded of low-latency calls (synchronises on GPUs): TimeoutError (a
    wait timed out), or with ``refusals`` ValueError (a rank refused a call: its host refused
    the inputs, or its dispatch's topk_idx held an expert id outside [-1, E); the outputs of
    that call are not valid), after which the record is cleared."""
    code, peer, stage, refused = rt.control[
        [*range(int(STATUS), int(STATUS) + int(STATUS_WORDS)), int(LL_REFUSED)]
    ].tolist()
    raise_on_status(rt, code, peer, stage)
    if refused and refusals:
        rt.control[int(LL_REFUSED)] = 0
        raise ValueError(_low_latency_refusal(rt, refused - 1))


def _low_latency_refusal(rt: Runtime, source: int) -> str:
    """What LL_REFUSED's ``source`` did: this rank only records itself for an invalid topk_idx
    (its host raises its own refusals in the call)."""
    experts = rt.plan.num_experts
    if source == rt.rank:
        return (
            f"rank {source} (this rank): the topk_idx of a low-latency dispatch held an expert "
            f"id outside [-1, {experts}), so the call was refused: no rank received rows from "
            "this one, and the call's outputs here are not valid"
        )
    return (
        f"rank {source} refused a low-latency call (its host refused the inputs, or its "
        f"topk_idx held an expert id outside [-1, {experts}); its own ValueError says which): "
        "that call's outputs here are not valid"
    )


def reported_tokens_per_expert(rt: Runtime, tag: int) -> list[int] | None:
    """tokens_per_expert as the exact-mode layout launch given ``tag`` reported it into host
    memory (read_report has returned its row count), or None where the report is another
    launch's (read_report took the device's info instead)."""
    report = rt.report_words
    if report[REPORT_TAG] != tag:
        return None
    return report[int(REPORT_EXPERTS) : int(REPORT_EXPERTS) + rt.plan.experts_per_rank].tolist()


def raise_on_status(rt: Runtime, code: int, peer: int, stage: int) -> None:
    """TimeoutError naming the peer and the stage if a wait timed out (``code``), after which
    the Buffer is unusable."""
    if code:
        rt.broken = (
            f"rank {rt.rank}: rank {peer} did not answer within {rt.timeout_ns / 1e9:g} s at "
            f"{_STAGES.get(stage, f'stage {stage}')}"
        )
        raise TimeoutError(rt.broken)


def read_report(rt: Runtime, handle: DispatchHandle, tag: int = 0) -> int:
    """What the device recorded for ``handle``'s dispatch: raises TimeoutError (a wait timed
    out) or ValueError (invalid routing, or an input a rank's host refused, on some rank);
    returns the rows the output needs (expert-major or token rows). With the ``tag`` its
    layout launch was given, from the report the layout kernel writes into host memory (the
    host polls it: no stream synchronisation, no copy); else one device-to-host read."""
    report = rt.report_words
    deadline = time.monotonic() + 2 * rt.timeout_ns / 1e9
    while tag and report[REPORT_TAG] != tag and time.monotonic() < deadline:
        pass
    if tag and report[REPORT_TAG] == tag:
        needed, src, row, code, peer, stage, cause = report[_REPORT_VALUES].tolist()
    else:  # no tag, or the device did not get there: its error surfaces here
        info = handle.state
        needed, src, row, code, peer, stage, cause = torch.cat(
            [info[list(_INFO_VALUES)], rt.control[_STATUS], info[int(INFO_CAUSE)][None]]
        ).tolist()
    raise_on_status(rt, code, peer, stage)
    if src < 0:
        return needed
    if cause != INVALID_ROUTING:
        argument = refused_argument(cause)
        if argument in ALONG_A_HANDLE:
            raise RefusedEarlier(
                f"rank {src} refused its {argument} in an earlier call along a handle (its own "
                "ValueError said why), so that call's outputs on the other ranks are not "
                "valid; nothing was dispatched"
            )
        raise ValueError(
            f"rank {src} refused its {argument} (its own ValueError says why); "
            "nothing was dispatched"
        )
    if src == rt.rank:
        detail = f"row {row} has an id outside [-1, {rt.plan.num_experts}) or a repeated id"
    else:
        detail = f"rank {src} passed an invalid topk_idx"
    raise ValueError(f"topk_idx: {detail}; nothing was dispatched")


class Overflows:
    """A Buffer's max_recv_tokens dispatches whose overflow nobody has checked yet: (the
    handle's state, whose [0] is the rows it needed, M), at most ``MOST`` of them."""

    MOST = 1024

    def __init__(self, rank: int):
        self.rank = rank
        self.unchecked: list[tuple[torch.Tensor, int]] = []

    def track(self, handle: DispatchHandle) -> None:
        """Remember an unchecked max_recv_tokens dispatch; after an exact-mode one (which has
        synchronised already, once its collective work is done, so no peer is left waiting)
        raise the overflows of earlier ones."""
        if handle.max_recv_tokens is not None:
            if len(self.unchecked) < self.MOST:
                self.unchecked.append((handle.state, handle.max_recv_tokens))
        elif self.unchecked:
            pending, self.unchecked = self.unchecked, []
            self._raise(pending)

    def check(self, handle: DispatchHandle) -> None:
        """OverflowError if ``handle``'s dispatch needed more rows than it had; forgotten as
        unchecked (synchronises)."""
        self.unchecked = [entry for entry in self.unchecked if entry[0] is not handle.state]
        if handle.max_recv_tokens is not None:
            self._raise([(handle.state, handle.max_recv_tokens)])

    def _raise(self, dispatches: list[tuple[torch.Tensor, int]]) -> None:
        """OverflowError for the first of ``dispatches`` (a handle's state, M) that needed more
        than M rows."""
        needed = torch.stack([state[0] for state, _ in dispatches]).tolist()
        for (_, limit), rows in zip(dispatches, needed, strict=True):
            if rows > limit:
                raise OverflowError(
                    f"rank {self.rank}: a dispatch needed {rows} rows but max_recv_tokens is "
                    f"{limit}; the rows past it were dropped. Size max_recv_tokens as "
                    "world * max_tokens_per_rank * min(K, L) + L * (pad_multiple - 1) to never "
                    "drop a row"
                )
