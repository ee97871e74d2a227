"""``Buffer``: the library's one public class, expert-parallel dispatch and combine.

Each method checks its inputs (runtime/checks.py), agrees with the other ranks on refusals
(ops/refusal.py) and hands off to ops; docs/reference.md is the full reference.
"""

from typing import NoReturn

import torch
import torch.distributed as dist

from .ops import low_latency, masks, operators, status
from .ops.handle import ALONG_A_HANDLE, REFUSABLE, DispatchHandle, check_handle
from .ops.low_latency import LowLatencyHandle
from .ops.refusal import Refusals
from .ops.reserved import ReservedHeap
from .ops.runtime import agreed_plan, make_runtime
from .ops.scaled_rows import ScaledValues
from .ops.streams import CommStream
from .ops.token_counts import token_counts
from .runtime.checks import (
    SUPPORTED_DTYPES,
    BufferOptions,
    DispatchArguments,
    LowLatencyCombineArguments,
    LowLatencyDispatchArguments,
    check_combine_inputs,
    check_dispatch_inputs,
    ranks_per_host,
)
from .runtime.planner import low_latency_bytes

DEFAULT_TIMEOUT_S = 60.0

__all__ = ["DEFAULT_TIMEOUT_S", "SUPPORTED_DTYPES", "Buffer", "ranks_per_host"]


class Buffer:
    """Expert-parallel dispatch and combine over one group of ranks (docs/reference.md).

    Rank r owns global experts [r * L, (r + 1) * L), L = num_experts / group size. Every call
    is collective: every rank makes it, in the same order. The constructor allocates the
    worst-case buffers once.

    Args:
        group: torch.distributed group of the expert-parallel ranks (None: the default group).
        hidden_size: H, elements per token row.
        max_tokens_per_rank: most tokens any rank passes to one dispatch.
        num_experts: E, global experts, divisible by the group size.
        dtype: token rows' dtype: torch.bfloat16, torch.float16 or torch.float32.
        num_sms: SMs' worth of warps for the programs that move data between ranks, 1..132.
        timeout_s: seconds any wait on another rank may last before TimeoutError.
        expand: True: rows grouped by local expert; False: one row per token, as DeepEP's.
        ranks_per_node: R, consecutive ranks joined by NVLink (a node); None: those of a host.
        device: where tokens live: None, a CUDA device (this process's), or the CPU.
        agree_on_inputs: every call first agrees on the host that every rank's inputs passed.
        low_latency_tokens: M <= 65535, most tokens a rank passes to a low-latency call (0: none).
        mask_failed_ranks: a wait that runs out masks the peer instead of TimeoutError.
        heap: an ops.reserved.ReservedHeap that every rank reserved earlier (for adapters):
            where this Buffer fits it, the constructor calls no collective (the ranks'
            arguments, the same by the caller's rule, are not compared); else as without.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        hidden_size: int,
        max_tokens_per_rank: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sms: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        expand: bool = True,
        ranks_per_node: int | None = None,
        device: torch.device | str | None = None,
        agree_on_inputs: bool = False,
        low_latency_tokens: int = 0,
        mask_failed_ranks: bool = False,
        heap: ReservedHeap | None = None,
    ):
        options = BufferOptions.of(locals())
        group = group if group is not None else dist.group.WORLD
        taken = None  # the reserved heap, where this Buffer fits it
        if heap is not None:
            plan, device, context_sms = agreed_plan(group, options, heap.ranks_per_node)
            taken = heap.take() if heap.fits(plan, device) else None
        if taken is None:
            plan, device, context_sms = agreed_plan(group, options)
        self.group = group
        self.hidden_size = hidden_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_experts = num_experts
        self.dtype = dtype
        self.expand = expand
        self.ranks_per_node = plan.ranks_per_node
        self.device = device
        self.timeout_s = float(timeout_s)
        self.agree_on_inputs = agree_on_inputs
        self.low_latency_tokens, self.mask_failed_ranks = low_latency_tokens, mask_failed_ranks
        self._rt = make_runtime(plan, group, device, timeout_s, context_sms, taken)
        self._id = operators.register(self._rt)
        self._streams = CommStream(device)
        self._refusals = Refusals(self._rt, agree_on_inputs)
        self._overflows = status.Overflows(self._rt.rank)
        self._low_latency = low_latency.Calls(self._rt, self._id, self._streams, self._check_usable)
        masks.mask_failed(self._rt, mask_failed_ranks)

    # -- normal mode ------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        pad_multiple: int = 1,
        max_recv_tokens: int | None = None,
        handle: DispatchHandle | None = None,
        quantize: bool | str = False,
        expert_recv_stats: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
        async_finish: bool = False,
    ):
        """Send every token to the ranks that hold its experts (docs/reference.md#dispatch).

        Args:
            x: [T, H] of the Buffer's dtype, or a block-scaled pair (values, scales).
            topk_idx: [T, K] int32/int64 global expert ids, -1 for an unused slot.
            topk_weights: [T, K] float32 or None.
            pad_multiple: pad each expert's rows to a multiple of this (expand=True).
            max_recv_tokens: None: exactly the rows needed; M: M rows, no host synchronisation.
            handle: an earlier dispatch's: send new rows along its routing.
            quantize: "fp8" (or True), "mxfp8" or "nvfp4": quantize x as it is sent.
            expert_recv_stats: int64 [L] or None: adds each local expert's received rows.
            previous_event: a CUDA event to wait for first.
            async_finish: run on the communication stream and also return an event.

        Returns: expand=True: (recv_x [N, H], recv_weights [N] float32 or None,
        tokens_per_expert [L] int64, handle); expand=False: (recv_x, recv_topk_idx [N, K] int32,
        recv_topk_weights [N, K] float32 or None, tokens_per_expert, handle); then the event
        with async_finish. recv_x is a pair of a block-scaled format's.
        """
        return self._dispatch(DispatchArguments.of(locals()))

    def _dispatch(self, args: DispatchArguments):
        """``dispatch`` of its arguments' record (a method of its own: see
        ArgumentRecord.of)."""
        handle, max_recv_tokens = args.handle, args.max_recv_tokens
        call = "dispatch" if handle is None else "cached dispatch"
        self._refusals.usable_for(call, self._check_usable)
        rt = self._rt
        refuse = lambda argument: self._refusals.refuse_dispatch(  # noqa: E731
            handle, call, argument, max_recv_tokens
        )
        with self._refusals.of(call, refuse, handle, along=handle is not None) as checks:
            checks.check_handle()
            x, x_scales, scaled = check_dispatch_inputs(rt.plan, rt.device, args, ScaledValues)
        topk_idx, topk_weights = args.topk_idx, args.topk_weights
        if handle is None:
            self._refusals.tell_along(max_recv_tokens)
            topk_idx = topk_idx.contiguous()
        if x_scales is None and isinstance(x, ScaledValues):
            x = x.dequantize()  # (what every torch op sees of it, with its gradient)
        (recv_x, recv_scales, recv_weights, new_handle), event = self._streams.run(
            lambda: operators.run_any_dispatch(
                rt,
                self._id,
                x,
                x_scales,
                topk_idx,
                topk_weights,
                args.pad_multiple,
                max_recv_tokens,
                handle,
                scaled,
                args.expert_recv_stats,
            ),
            (x, x_scales, topk_idx, topk_weights),
            args.previous_event,
            args.async_finish,
        )
        if handle is None:
            self._overflows.track(new_handle)
        if recv_scales is not None:
            recv_x = recv_x, recv_scales
        tokens_per_expert = new_handle.tokens_per_expert
        if self.expand:
            outputs = recv_x, recv_weights, tokens_per_expert, new_handle
        else:
            outputs = recv_x, new_handle.recv_topk_idx, recv_weights, tokens_per_expert, new_handle
        return (*outputs, event) if args.async_finish else outputs

    def combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        *,
        weights: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
        async_finish: bool = False,
    ):
        """Send expert outputs back to their tokens' ranks and sum them per token
        (docs/reference.md#combine).

        Args:
            y: [N, H] of the Buffer's dtype in recv_x's row order.
            handle: the dispatch's that produced recv_x.
            weights: [N] float32 factors of the rows (e.g. recv_weights), or None for 1.
            topk_weights: token rows (expand=False) only: [N, K] float32 per-slot values of
                the rows (e.g. recv_topk_weights, no gradient), summed back per token too.
            previous_event, async_finish: as for ``dispatch``.

        Returns: out [T, H], each token's sum in fp32 of weight * y; with topk_weights also
        combined_topk_weights [T, K] float32, each token's sum of its rows' topk_weights (in
        the same launch); then the event with async_finish.
        """
        self._refusals.usable_for("combine", self._check_usable)
        rt = self._rt
        refuse = lambda argument: self._refusals.refuse_along(  # noqa: E731
            handle, "combine", f"combine's {argument}"
        )
        with self._refusals.of("combine", refuse, handle, along=True) as checks:
            checks.check_handle()
            check_combine_inputs(
                rt.plan, rt.device, y, weights, topk_weights, handle, previous_event
            )
        if isinstance(y, ScaledValues):
            y = y.dequantize()
        (out, combined), event = self._streams.run(
            lambda: operators.run_combine(rt, self._id, y, weights, handle, topk_weights),
            (y, weights, topk_weights),
            previous_event,
            async_finish,
        )
        outputs = out if topk_weights is None else (out, combined)
        if async_finish:
            return (*outputs, event) if topk_weights is not None else (out, event)
        return outputs

    def refuse(
        self,
        call: str,
        argument: str,
        error: ValueError,
        *,
        handle: DispatchHandle | None = None,
        max_recv_tokens: int | None = None,
    ) -> NoReturn:
        """An adapter's own check of ``argument`` failed on this rank: run this rank's part of
        ``call`` as a refused input's (docs/reference.md#errors), so that no peer waits and
        nothing moves, then raise ``error``.

        Args:
            call: "dispatch" (along ``handle``: a cached one) or "combine" (along ``handle``).
            argument: the native argument it stands for: x, topk_idx, topk_weights,
                pad_multiple, max_recv_tokens or previous_event of a dispatch; x, topk_weights,
                handle or previous_event of a cached dispatch; y, weights, topk_weights or
                previous_event of a combine.
            error: the ValueError this rank raises.
            handle: the handle of a cached dispatch or a combine.
            max_recv_tokens: a dispatch's mode (None: exact), as the peers' call has it.
        """
        self._check_usable()
        if call not in ("dispatch", "combine"):
            raise ValueError(f"call must be 'dispatch' or 'combine', got {call!r}")
        along = "cached dispatch" if call == "dispatch" else "combine"
        if handle is not None and f"{along}'s {argument}" not in ALONG_A_HANDLE:
            raise ValueError(f"{along} has no refusable argument {argument!r}")
        if handle is None and (call != "dispatch" or argument not in REFUSABLE):
            raise ValueError(f"a dispatch has no refusable argument {argument!r}")
        if self.agree_on_inputs:
            self._refusals.agree(call, argument, error)
        if handle is None:
            self._refusals.refuse_dispatch(None, call, argument, max_recv_tokens)
        elif call == "dispatch":
            self._refusals.refuse_dispatch(handle, along, argument, None)
        else:
            self._refusals.refuse_along(handle, call, f"{along}'s {argument}")
        raise error

    def check(self, handle: DispatchHandle | None = None) -> None:
        """Synchronise and raise what the device recorded for ``handle``'s dispatch, or (None,
        a low-latency handle) for the low-latency calls (docs/reference.md#errors): TimeoutError,
        ValueError (invalid routing, a refused input), OverflowError (past max_recv_tokens)."""
        if handle is None or isinstance(handle, LowLatencyHandle):
            self._check_usable()
            status.check_low_latency(self._rt)
            return
        check_handle(handle, self._rt.device)
        status.read_report(self._rt, handle)
        self._overflows.check(handle)

    # -- low-latency mode (decode) -----------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        previous_event: torch.cuda.Event | None = None,
    ):
        """DeepEP's low-latency dispatch: one launch, fixed per-expert blocks of rows, no host
        synchronisation (docs/reference.md#low-latency-mode).

        Args:
            x: [T, H] tokens of the Buffer's dtype, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: [T, K] int32/int64 global expert ids, -1 for an unused slot (an id
                outside [-1, E) refuses the call on the device: docs/reference.md).
            num_max_dispatch_tokens_per_rank: M', the same on every rank, 1..low_latency_tokens.
            num_experts: E, the Buffer's.
            cumulative_local_expert_recv_stats: int32 [L] or None: adds each local expert's rows.
            use_fp8: rows as e4m3 values and a float32 scale per 128 channels (H % 128 == 0).
            round_scale: FP8 scales rounded up to powers of two.
            use_ue8m0: scales as UE8M0 exponents, four to an int32 (needs round_scale).
            async_finish, previous_event: as for ``dispatch``.
            return_recv_hook: launch the sends only; ``hook()`` launches the receive.

        Returns: recv_x [L, W * M', H] (use_fp8: (values, scales)), recv_count [L] int32,
        handle (src_info, layout_range first), event or None, hook or None.
        """
        arguments = LowLatencyDispatchArguments.of(locals())
        self._check_usable()
        return self._low_latency.dispatch(arguments)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
    ):
        """DeepEP's low-latency combine: expert outputs back to their tokens, summed with the
        tokens' weights, in one launch (docs/reference.md#low-latency-mode).

        Args:
            x: [L, W * M', H] expert outputs in recv_x's rows (zero_copy: the combine buffer).
            topk_idx: [T, K], the dispatch's. topk_weights: [T, K] float32.
            handle: the dispatch's.
            zero_copy: x is get_next_low_latency_combine_buffer's, the experts wrote into it.
            async_finish, return_recv_hook, previous_event: as for ``low_latency_dispatch``.
            out: [T, H] of the Buffer's dtype to write into, or None.

        Returns: combined_x [T, H] (each token's weighted sum, in fp32), event, hook.
        """
        arguments = LowLatencyCombineArguments.of(locals())
        self._check_usable()
        return self._low_latency.combine(arguments)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """[L, W * M', H] in the heap for experts' outputs, read by the next call (zero_copy)."""
        self._check_usable()
        return self._low_latency.next_combine_buffer(handle)

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """DeepEP's call to zero its flags (none here): a barrier of the live ranks."""
        self._check_usable()
        self._low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    low_latency_bytes = staticmethod(low_latency_bytes)
    token_counts = staticmethod(token_counts)

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """Mask ``rank`` (not this one) or unmask it, in stream order: the calls skip it."""
        self._check_usable()
        masks.update_mask(self._rt, rank, masked)

    def clean_mask(self) -> None:
        """Unmask every rank, in stream order."""
        self._check_usable()
        masks.update_mask(self._rt, None, False)

    def query_mask(self, out: torch.Tensor) -> None:
        """out: int32 [W] on the Buffer's device, 1 where a rank is masked (stream order)."""
        self._check_usable()
        masks.query_mask(self._rt, out)

    @property
    def masked_ranks(self) -> list[int]:
        """The masked ranks (reads the device)."""
        self._check_usable()
        return masks.masked_ranks(self._rt)

    # -- state ------------------------------------------------------------------------------

    @property
    def network_rows(self) -> int:
        """Token rows this rank's dispatches have put over the network (synchronises)."""
        return self._rt.network_rows

    @property
    def kernel_builds(self) -> int:
        """Kernel specialisations this Buffer's calls have taken (compiled or loaded)."""
        return self._rt.kernel_builds

    @property
    def kernel_build_seconds(self) -> float:
        """Host seconds spent in the first launches of those specialisations."""
        return self._rt.kernel_build_seconds

    def destroy(self) -> None:
        """Free the symmetric buffers with the other ranks (idempotent) where every rank says so
        within timeout_s, else leave them to the process's end (a rank masked, gone or
        silent)."""
        if getattr(self, "_rt", None) is not None:
            operators.unregister(self._id)
            rt = self._rt
            masks.release(rt.heap, rt.rank, rt.world_size, rt.plan.nodes, rt.timeout_ns, rt.device)
            self._rt = None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # -- checks -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._rt is None:
            raise RuntimeError("this Buffer was destroyed")
        if self._rt.broken is not None:
            raise RuntimeError(f"this Buffer is unusable after an earlier error: {self._rt.broken}")
