"""The refusal protocol: how an input that one rank's host refuses reaches every rank, so that
no peer waits for a call that this rank will not make, and the Buffer stays usable.

A rank whose host refuses an argument of a dispatch with a new layout still runs the layout,
with no tokens, publishing the argument's code (handle.refusal_code) instead of its counts: every
rank's layout reports it and nothing moves. A refused call along a handle (a cached dispatch,
a combine) still runs with zero rows, so that no peer waits; its refusal is published by this
rank's next dispatch with a new layout (``Refusals``). With ``agree_on_inputs`` every call first
gathers, on the host, whether each rank's host passed its inputs.
"""

from ..runtime.checks import Refused, RefusedEarlier, gather_or_refuse, refusing
from . import operators
from .handle import DispatchHandle, check_handle
from .runtime import Runtime


class Refusals:
    """One Buffer's side of the protocol: its group, whether it agrees on inputs before every
    call, and the refusal along a handle that its next dispatch with a new layout must publish.

    ``with refusals.of(call, refuse, handle) as checks:`` around a call's checks (starting with
    ``checks.check_handle()``): a Refused raised there (see runtime/checks.refusing) is, with
    agree_on_inputs, told to every rank first; then ``refuse(argument)`` runs this rank's part
    of the call so that no peer waits, and the check's ValueError is raised. With
    agree_on_inputs a call whose checks pass agrees too.
    """

    def __init__(self, rt: Runtime, agree_on_inputs: bool):
        self.rt, self.agree_on_inputs = rt, agree_on_inputs
        # A refused call along a handle that the next new-layout dispatch must tell the peers
        # of: the argument (one of handle.ALONG_A_HANDLE), or None.
        self.along: str | None = None

    def of(
        self, call: str, refuse, handle: DispatchHandle | None = None, along: bool = False
    ) -> "_Call":
        """The context of a ``call``'s checks, ``along`` a ``handle`` (a cached dispatch, a
        combine) or not. Without agree_on_inputs an argument that is none of this Buffer's
        handles is a ValueError at once, and the call takes no part in the protocol (it cannot
        run along it); with it, the handle is a refusable argument like the others."""
        if along and not self.agree_on_inputs:
            check_handle(handle, self.rt.device)
        return _Call(self, call, refuse, handle, along)

    def usable_for(self, call: str, check_usable) -> None:
        """``check_usable()`` (the Buffer's: RuntimeError if it is destroyed or broken), told to
        every rank first with agree_on_inputs, whose peers would otherwise wait in the host
        collective of this ``call``."""
        try:
            check_usable()
        except RuntimeError as error:
            if self.agree_on_inputs:
                self.agree(call, error=error)
            raise

    def agree(self, call: str, argument: str = "", error: Exception | None = None) -> None:
        """agree_on_inputs: whether every rank's host passed its inputs of this ``call``
        (collective, on the host): if one refused ``argument`` (``error`` says why), that error
        on the refusing rank and a ValueError naming it on every other, before anything moves."""
        subject = f"its {call}'s {argument}" if argument else f"its {call}"
        gather_or_refuse(self.rt.group, None, error, subject)

    def refuse_dispatch(self, handle, call: str, argument: str, max_recv_tokens) -> None:
        """This rank's part of a dispatch (``call``: "dispatch" or "cached dispatch") whose
        ``argument`` its host refused: with a new layout (``handle`` None) one that publishes the
        refusal, in the mode the call asked for; along a handle one with zero rows."""
        if handle is None:
            count = isinstance(max_recv_tokens, int) and not isinstance(max_recv_tokens, bool)
            mode = max_recv_tokens if count and max_recv_tokens >= 0 else None
            operators.run_refused_dispatch(self.rt, argument, mode)
        else:
            self.refuse_along(handle, "dispatch", f"{call}'s {argument}")

    def refuse_along(self, handle: DispatchHandle, call: str, argument: str) -> None:
        """This rank's host refused ``argument`` (one of handle.ALONG_A_HANDLE) of a ``call`` along
        ``handle``: run the call with zero rows, so that no peer waits for this rank, and
        remember the refusal for the next dispatch with a new layout to publish."""
        operators.run_refused_call_along(self.rt, handle, call)
        if self.along is None:  # (the first that the peers have not heard of)
            self.along = argument

    def tell_along(self, max_recv_tokens: int | None) -> None:
        """Before a dispatch with a new layout: if a call along a handle was refused, this
        dispatch's layout publishes that refusal instead of this rank's counts, so that every
        rank raises ValueError (as for a refused input of this dispatch) and nothing moves."""
        if self.along is None:
            return
        argument, self.along = self.along, None
        operators.run_refused_dispatch(self.rt, argument, max_recv_tokens)
        raise RefusedEarlier(
            f"rank {self.rt.rank} (this rank) refused its {argument} in an earlier call along a "
            "handle, so that call's outputs on the other ranks are not valid: this dispatch "
            "tells every rank and moved nothing (the next one goes ahead)"
        )


class _Call:
    """``Refusals.of``'s context manager (a class: entered at every call, see refusing)."""

    __slots__ = ("refusals", "call", "refuse", "handle", "along")

    def __init__(self, refusals: Refusals, call: str, refuse, handle, along: bool):
        self.refusals, self.call, self.refuse = refusals, call, refuse
        self.handle, self.along = handle, along

    def __enter__(self) -> "_Call":
        return self

    def check_handle(self) -> None:
        """With agree_on_inputs, the handle of a call along one, as a refusable argument."""
        if self.along and self.refusals.agree_on_inputs:
            with refusing("handle"):
                check_handle(self.handle, self.refusals.rt.device)

    def __exit__(self, kind, error, traceback) -> None:
        refusals = self.refusals
        if kind is None:
            if refusals.agree_on_inputs:
                refusals.agree(self.call)
            return
        if not issubclass(kind, Refused):
            return
        if refusals.agree_on_inputs:
            refusals.agree(self.call, error.argument, error.error)
        # No peer may wait for this rank, and every one must hear why.
        self.refuse(error.argument)
        raise error.error from None
