"""Low-latency launches (kernels/low_latency.py): outputs in DeepEP's shapes, the send and
receive halves of each call, and the handle that combine takes."""

from typing import NamedTuple

import torch

from ..kernels.low_latency import (
    COUNTED,
    low_latency_combine_kernel,
    low_latency_dispatch_kernel,
)
from ..runtime.checks import (
    LowLatencyCombineArguments,
    LowLatencyDispatchArguments,
    check_int,
    check_low_latency_combine,
    check_low_latency_dispatch,
    describe,
)
from ..runtime.planner import (
    FP8_GROUP,
    LOW_LATENCY_FP8_GROUPS,
    LOW_LATENCY_ROW_GROUPS,
    ceil_div,
    next_power_of_2,
)
from . import operators, status
from .launch import KernelLauncher
from .runtime import Runtime

# Warps of a low-latency program: most move a few rows, and many programs hide the latency of
# each one's scan and waits.
_WARPS = 4
# Columns of a tile's row (combine: of its fp32 sums), and rows of a tile.
_BLOCK_H = 2048
_COMBINE_BLOCK_H = 1024
_TILE_ROWS = 4
# Most topk_idx entries a sending program scans at a time.
_MOST_SCANNED = 1024
# Software pipelining of the copies' and sums' loops over a row's tiles (tl.range's
# num_stages; 1: none), and column parts of a slice that combine's receive role takes to a
# program each.
_STAGES = 1
_SUM_PARTS = 2


class LowLatencyHandle(NamedTuple):
    """A low-latency dispatch's handle: DeepEP's (src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts), then what combine needs besides.

    src_info: [L, W * M'] int32, each received row's source token index.
    layout_range: [L, W] int64, (first row << 32) | rows of local expert e from rank j.
    token_slots: [T, K] int32, each (token, slot)'s row among its expert's rows from this rank.
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    token_slots: torch.Tensor


class DispatchOutputs(NamedTuple):
    """What a low-latency dispatch writes: recv_x [L, W * M', H] (FP8 values with FP8), the
    storage of its scales (``scale_storage``; an empty tensor without FP8), recv_count [L]
    int32, the handle's src_info, layout_range and token_slots, and the call's sequence number
    (int64 [1], which a receive launched later reads)."""

    recv_x: torch.Tensor
    scale_storage: torch.Tensor
    recv_count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor
    token_slots: torch.Tensor
    call_seq: torch.Tensor


def allocate_dispatch(
    rt: Runtime, num_tokens: int, topk: int, max_tokens: int, *, fp8: bool, ue8m0: bool
) -> DispatchOutputs:
    """Outputs of a dispatch of ``num_tokens`` tokens with ``topk`` slots, sized for
    ``max_tokens`` (M') tokens a rank. FP8 scales are stored as DeepEP lays them out (for TMA,
    rows fastest): [L, G, rows] float32, or with UE8M0 [L, ceil(G / 4), rows] int32 whose byte
    i is group 4p + i's exponent, as bytes [L, ceil(G / 4), 4 * rows] (``caller_scales`` gives
    the caller's view)."""
    plan, device = rt.plan, rt.device
    experts, hidden = plan.experts_per_rank, plan.hidden
    rows = rt.world_size * max_tokens
    if fp8:
        recv_x = torch.empty(experts, rows, hidden, dtype=torch.float8_e4m3fn, device=device)
        groups = hidden // FP8_GROUP
        if ue8m0:
            storage = torch.empty(
                experts, ceil_div(groups, 4), rows, dtype=torch.int32, device=device
            ).view(torch.uint8)
        else:
            storage = torch.empty(experts, groups, rows, dtype=torch.float32, device=device)
    else:
        recv_x = torch.empty(experts, rows, hidden, dtype=plan.dtype, device=device)
        storage = torch.empty(0, dtype=torch.float32, device=device)
    return DispatchOutputs(
        recv_x=recv_x,
        scale_storage=storage,
        recv_count=torch.empty(experts, dtype=torch.int32, device=device),
        src_info=torch.empty(experts, rows, dtype=torch.int32, device=device),
        layout_range=torch.empty(experts, rt.world_size, dtype=torch.int64, device=device),
        token_slots=torch.empty(num_tokens, topk, dtype=torch.int32, device=device),
        call_seq=torch.empty(1, dtype=torch.int64, device=device),
    )


def caller_scales(storage: torch.Tensor) -> torch.Tensor:
    """The scales of a dispatch as the caller gets them, from their storage: [L, rows, G]
    float32 or [L, rows, ceil(G / 4)] int32 (UE8M0), rows fastest."""
    if storage.dtype == torch.uint8:
        storage = storage.view(torch.int32)
    return storage.transpose(1, 2)


def combine_buffer(rt: Runtime, max_tokens: int, area: int) -> torch.Tensor:
    """Send area ``area`` (0 or 1) of this rank's heap as the buffer [L, W * M', H] of the
    Buffer's dtype that combine reads expert outputs from with zero_copy (and that a combine
    across nodes puts rows from)."""
    plan = rt.plan
    start = _send_off(rt, area)
    shape = (plan.experts_per_rank, rt.world_size * max_tokens, plan.hidden)
    size = shape[0] * shape[1] * shape[2] * plan.dtype.itemsize
    return rt.heap.local[start : start + size].view(plan.dtype).view(shape)


def _send_off(rt: Runtime, area: int) -> int:
    """Byte offset of send area ``area`` (0 or 1) in the heap."""
    ll = rt.plan.low_latency
    return rt.plan.heap.ll_send + area * ll.area_rows * ll.row_bytes


def _heap_constants(rt: Runtime) -> dict:
    plan, heap, ll = rt.plan, rt.plan.heap, rt.plan.low_latency
    return dict(
        peer_bases_ptr=rt.heap.peer_bases,
        net_bases_ptr=rt.heap.net_bases,
        heap_bytes=heap.total_bytes,
        freed_off=heap.ll_freed,
        mask_off=heap.mask,
        flags_off=heap.ll_flags,
        own_off=heap.ll_own,
        quantized_off=heap.ll_quantized,
        staging_off=heap.ll_staging,
        control_ptr=rt.control,
        timeout_ns=rt.timeout_ns,
        rank=rt.rank,
        W=rt.world_size,
        L=plan.experts_per_rank,
        B=ll.remote_blocks,
        M=ll.tokens,
        S=ll.slices,
        ROW_BYTES=ll.row_bytes,
        ROWS=_TILE_ROWS,
        STAGES=_STAGES,
        NODES=plan.nodes,
        num_warps=_WARPS,
        **rt.compile_options,
    )


def _dispatch_launcher(rt: Runtime) -> KernelLauncher:
    return KernelLauncher(
        low_latency_dispatch_kernel,
        on_compile=rt.on_compile,
        scratch_ptr=rt.ll_scratch,
        **_heap_constants(rt),
    )


def _combine_launcher(rt: Runtime) -> KernelLauncher:
    return KernelLauncher(
        low_latency_combine_kernel, on_compile=rt.on_compile, **_heap_constants(rt)
    )


def token_groups(fp8: bool) -> int:
    """128-channel groups of a token's row that a dispatch program takes (the GROUPS its
    launch passes)."""
    return LOW_LATENCY_FP8_GROUPS if fp8 else LOW_LATENCY_ROW_GROUPS


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every row of each tensor (its last dimension) starts 16-byte aligned."""
    return all(
        t.data_ptr() % 16 == 0
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in tensors
    )


def launch_dispatch(
    rt: Runtime,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    stats: torch.Tensor | None,
    outputs: DispatchOutputs,
    *,
    round_scale: bool,
    ue8m0: bool,
    send: bool,
    receive: bool,
    area: int,
    refused: bool = False,
) -> None:
    """Launch the send half, the receive half, or both, of a dispatch of x [T, H] routed by
    topk_idx [T, K] into ``outputs`` (FP8 where they have scales); ``area``: the send area of
    this call (the host's parity); ``refused``: this rank's host refused the call (x and
    topk_idx are then empty)."""
    plan, ll = rt.plan, rt.plan.low_latency
    num_tokens, topk = topk_idx.shape
    fp8 = outputs.scale_storage.numel() > 0
    groups = plan.hidden // FP8_GROUP
    chunks = ceil_div(ceil_div(plan.hidden, FP8_GROUP), token_groups(fp8))
    token_programs = num_tokens * chunks if send else 0
    senders = ll.remote_blocks * ll.slices if send else 0
    counters = ceil_div(plan.experts_per_rank, COUNTED.value) if send else 0
    receivers = plan.experts_per_rank * (rt.world_size - 1) if receive else 0
    grid = token_programs + counters + senders + receivers
    rows = outputs.recv_x.shape[1]
    if not fp8:
        scale_plane = scale_row_step = scale_step = 0
    elif ue8m0:
        scale_plane, scale_row_step, scale_step = ceil_div(groups, 4) * rows * 4, 4, rows * 4
    else:
        scale_plane, scale_row_step, scale_step = groups * rows, 1, rows
    rt.launcher(_dispatch_launcher)(
        (max(grid, 1),),
        specialized=dict(
            x_ptr=x,
            x_stride=x.stride(0),
            topk_ptr=topk_idx,
            num_tokens=num_tokens,
            stats_ptr=stats if stats is not None else outputs.recv_count,
            hidden=plan.hidden,
            rows=rows,
            row_bytes=outputs.recv_x[0, 0].nbytes,
            scale_plane=scale_plane,
            scale_row_step=scale_row_step,
            scale_step=scale_step,
            send_off=_send_off(rt, area),
            refused=int(refused),
            K=topk,
            K_P2=next_power_of_2(topk),
            SCAN=min(_MOST_SCANNED, next_power_of_2(max(ll.tokens * topk, 1))),
            GROUPS=token_groups(fp8),
            QC_P2=next_power_of_2(ll.token_chunks),
            BLOCK_H=_BLOCK_H,
            G_P2=next_power_of_2(max(groups, 1)),
            FP8=fp8,
            ROUND=round_scale,
            UE8M0=ue8m0,
            ALIGNED=_aligned(x) and plan.hidden * x.element_size() % 16 == 0,
            HAS_STATS=stats is not None,
            SEND=send,
            RECEIVE=receive,
        ),
        aligned=dict(
            slots_ptr=outputs.token_slots,
            recv_ptr=outputs.recv_x.view(torch.uint8),
            scales_ptr=outputs.scale_storage,
            src_info_ptr=outputs.src_info,
            layout_range_ptr=outputs.layout_range,
            recv_count_ptr=outputs.recv_count,
            seq_ptr=outputs.call_seq,
        ),
    )


def launch_combine(
    rt: Runtime,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    token_slots: torch.Tensor,
    layout_range: torch.Tensor,
    out: torch.Tensor,
    call_seq: torch.Tensor,
    *,
    zero_copy: bool,
    send: bool,
    receive: bool,
    area: int,
    refused: bool = False,
) -> None:
    """Launch the send half, the receive half, or both, of a combine of expert outputs x [L,
    W * M', H] into out [T, H] (``area``: the send area of this call, which with zero_copy x
    is; ``refused``: this rank's host refused the call, whose tensors are then stand-ins)."""
    plan, slices = rt.plan, rt.plan.low_latency.slices
    num_tokens, topk = topk_idx.shape
    senders = plan.experts_per_rank * (rt.world_size - 1) * slices if send else 0
    grid = senders + (num_tokens * slices * _SUM_PARTS if receive else 0)
    rt.launcher(_combine_launcher)(
        (max(grid, 1),),
        specialized=dict(
            x_ptr=x,
            x_plane=x.stride(0),
            x_row=x.stride(1),
            topk_ptr=topk_idx,
            weights_ptr=topk_weights,
            out_ptr=out,
            num_tokens=num_tokens,
            hidden=plan.hidden,
            rows=x.shape[1],
            send_off=_send_off(rt, area),
            refused=int(refused),
            K=topk,
            K_P2=next_power_of_2(topk),
            BLOCK_H=_COMBINE_BLOCK_H,
            PARTS=_SUM_PARTS,
            ALIGNED=_aligned(x, out) and plan.hidden * x.element_size() % 16 == 0,
            ZERO_COPY=zero_copy,
            SEND=send,
            RECEIVE=receive,
        ),
        aligned=dict(slots_ptr=token_slots, layout_range_ptr=layout_range, seq_ptr=call_seq),
    )


def run_refused_dispatch(rt: Runtime, area: int) -> None:
    """This rank's part of a low-latency dispatch whose inputs its host refused: no rows, and
    REFUSED in every flag, so that no peer waits and every peer records the refusal (what this
    rank receives is dropped)."""
    plan = rt.plan
    outputs = allocate_dispatch(rt, 0, 1, plan.low_latency.tokens, fp8=False, ue8m0=False)
    launch_dispatch(
        rt,
        x=torch.empty(0, plan.hidden, dtype=plan.dtype, device=rt.device),
        topk_idx=torch.empty(0, 1, dtype=torch.int64, device=rt.device),
        stats=None,
        outputs=outputs,
        round_scale=False,
        ue8m0=False,
        send=True,
        receive=True,
        area=area,
        refused=True,
    )


def run_refused_combine(rt: Runtime, area: int) -> None:
    """This rank's part of a low-latency combine whose inputs its host refused: every flag a
    peer could wait for, with REFUSED and no rows (its stand-in x, a send area, is not read)."""
    plan, device = rt.plan, rt.device
    no_slots = torch.empty(0, 1, dtype=torch.int32, device=device)
    launch_combine(
        rt,
        x=combine_buffer(rt, plan.low_latency.tokens, area),
        topk_idx=no_slots,
        topk_weights=no_slots.float(),
        token_slots=no_slots,
        layout_range=torch.zeros(
            plan.experts_per_rank, rt.world_size, dtype=torch.int64, device=device
        ),
        out=torch.empty(0, plan.hidden, dtype=plan.dtype, device=device),
        call_seq=torch.empty(1, dtype=torch.int64, device=device),
        zero_copy=True,
        send=True,
        receive=True,
        area=area,
        refused=True,
    )


def _check_after_launch(rt: Runtime, received: bool) -> None:
    """CPU ranks' launches are synchronous: raise what the launch recorded now (on GPUs,
    Buffer.check does). A refusal is raised after a launch that ``received``: a send half that
    refused its own topk_idx leaves it to the call's receive half (its hook), which must still
    run, as it frees this call's receive area for the peers' call two calls on."""
    if not rt.on_gpu:
        status.check_low_latency(rt, refusals=received)


def _check_handle(rt: Runtime, handle) -> None:
    """ValueError unless ``handle`` is a low-latency dispatch's handle of this Buffer."""
    if not isinstance(handle, LowLatencyHandle) or (
        handle.src_info.device != rt.device or handle.hidden != rt.plan.hidden
    ):
        raise ValueError(
            f"handle must be a low-latency dispatch's handle of this Buffer, got {describe(handle)}"
        )


# -- the calls, as Buffer makes them ------------------------------------------------------------


class Calls:
    """A Buffer's low-latency calls as its host keeps them: the send area of the next call
    (they alternate, as DeepEP's buffers do), and the last two calls' cells [whether its receive
    hook is yet to be called], oldest first: a bit and two flags rather than a count of calls,
    which torch.compile would guard on and compile again at every call."""

    def __init__(self, rt: Runtime, runtime_id: int, streams, usable):
        self.rt, self.runtime_id, self.streams, self.usable = rt, runtime_id, streams, usable
        self.next_area = 0
        self.last: list[list[bool]] = []

    def start(self, name: str, return_recv_hook: bool) -> tuple[list[bool], int]:
        """This call's cell and send area; ValueError without the mode, or if the receive hook
        of the call two calls back is yet to be called (its receive area is this call's)."""
        self.require()
        if len(self.last) == 2 and self.last[0][0]:
            raise ValueError(
                f"{name}: the receive hook of the low-latency call two calls back was not "
                "called; at most two calls may await their hooks (call them before the next)"
            )
        cell = [return_recv_hook is True]
        self.last = [*self.last[-1:], cell]
        area, self.next_area = self.next_area, 1 - self.next_area
        return cell, area

    def hook(self, cell: list[bool], receive):
        """The receive hook of the call of ``cell``: runs ``receive`` once."""

        def hook() -> None:
            self.usable()
            if not cell[0]:
                raise RuntimeError("this receive hook was called already")
            cell[0] = False
            receive()

        return hook

    def run(self, name: str, args, prepare, refuse, send, receive):
        """The sequence of every low-latency call ``name`` of ``args`` (its arguments' record):
        its cell and send area (``start``); ``prepare(area)``, which checks the arguments and
        returns the tensors the call's launches take, and whose ValueError is raised after
        ``refuse(rt, area)`` has run this rank's part of the call as a refused one's, so that
        no peer waits; then ``send(tensors, area)``, the send half (with the receive half
        unless the call returns a hook), on the stream that args.async_finish and
        args.previous_event ask for; with args.return_recv_hook, a hook that runs
        ``receive(tensors, outputs)``, the receive half. Returns the tensors, send's outputs,
        the event (or None) and the hook (or None)."""
        cell, area = self.start(name, args.return_recv_hook)
        try:
            tensors = prepare(area)
        except ValueError:
            cell[0] = False
            refuse(self.rt, area)
            raise
        outputs, event = self.streams.run(
            lambda: send(tensors, area), tensors, args.previous_event, args.async_finish
        )
        hook = None
        if args.return_recv_hook:
            hook = self.hook(cell, lambda: receive(tensors, outputs))
        return tensors, outputs, event, hook

    def dispatch(self, args: LowLatencyDispatchArguments):
        """Buffer.low_latency_dispatch (its docstring says what is what)."""
        rt, runtime_id = self.rt, self.runtime_id
        scales = dict(round_scale=args.round_scale, ue8m0=args.use_ue8m0)

        def prepare(area: int) -> tuple:
            """x, topk_idx (as the kernels read it: [T, K], rows K apart) and the stats."""
            check_low_latency_dispatch(rt.plan, rt.device, args)
            topk_idx = args.topk_idx.contiguous()
            return args.x, topk_idx, args.cumulative_local_expert_recv_stats

        def send(tensors: tuple, area: int) -> DispatchOutputs:
            return DispatchOutputs(
                *dispatch(
                    runtime_id,
                    *tensors,
                    max_tokens=args.num_max_dispatch_tokens_per_rank,
                    fp8=args.use_fp8,
                    receive=not args.return_recv_hook,
                    area=area,
                    **scales,
                )
            )

        def receive(tensors: tuple, outputs: DispatchOutputs) -> None:
            dispatch_receive(runtime_id, *tensors, *outputs, **scales)

        _, outputs, event, hook = self.run(
            "low_latency_dispatch", args, prepare, run_refused_dispatch, send, receive
        )
        recv_x = outputs.recv_x
        if args.use_fp8:
            recv_x = recv_x, caller_scales(outputs.scale_storage)
        handle = LowLatencyHandle(
            src_info=outputs.src_info,
            layout_range=outputs.layout_range,
            num_max_dispatch_tokens_per_rank=args.num_max_dispatch_tokens_per_rank,
            hidden=rt.plan.hidden,
            num_experts=rt.plan.num_experts,
            token_slots=outputs.token_slots,
        )
        return recv_x, outputs.recv_count, handle, event, hook

    def combine(self, args: LowLatencyCombineArguments):
        """Buffer.low_latency_combine (its docstring says what is what)."""
        rt, runtime_id, handle = self.rt, self.runtime_id, args.handle

        def prepare(area: int) -> tuple:
            """x, topk_idx and topk_weights (contiguous), the handle's token_slots and
            layout_range, and out (allocated where the caller gave none), last."""
            _check_handle(rt, handle)
            buffer = combine_buffer(rt, handle.num_max_dispatch_tokens_per_rank, area)
            check_low_latency_combine(rt.plan, rt.device, args, buffer)
            out = args.out
            if out is None:
                shape = (args.topk_idx.shape[0], rt.plan.hidden)
                out = torch.empty(shape, dtype=rt.plan.dtype, device=rt.device)
            topk_idx, topk_weights = args.topk_idx.contiguous(), args.topk_weights.contiguous()
            return args.x, topk_idx, topk_weights, handle.token_slots, handle.layout_range, out

        def send(tensors: tuple, area: int) -> torch.Tensor:
            return combine(
                runtime_id,
                *tensors,
                zero_copy=args.zero_copy,
                receive=not args.return_recv_hook,
                area=area,
            )

        def receive(tensors: tuple, call_seq: torch.Tensor) -> None:
            combine_receive(runtime_id, *tensors, call_seq)

        tensors, _, event, hook = self.run(
            "low_latency_combine", args, prepare, run_refused_combine, send, receive
        )
        out = tensors[-1]
        return out, event, hook

    def require(self) -> None:
        """ValueError unless the Buffer was built with the mode."""
        if not self.rt.plan.low_latency.tokens:
            raise ValueError(
                "this Buffer has no low-latency mode: build it with low_latency_tokens=M"
            )

    def clean(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Buffer.clean_low_latency_buffer: the arguments against the Buffer's, then a
        dispatch of no tokens (M' = 1), which every rank makes: a barrier of the live ranks."""
        self.require()
        plan, device = self.rt.plan, self.rt.device
        check_int("num_max_dispatch_tokens_per_rank", max_tokens, 1, plan.low_latency.tokens)
        if (hidden, num_experts) != (plan.hidden, plan.num_experts):
            raise ValueError(
                f"hidden and num_experts must be the Buffer's ({plan.hidden}, "
                f"{plan.num_experts}), got ({hidden}, {num_experts})"
            )
        no_tokens = LowLatencyDispatchArguments(
            x=torch.empty(0, hidden, dtype=plan.dtype, device=device),
            topk_idx=torch.empty(0, 1, dtype=torch.int64, device=device),
            num_max_dispatch_tokens_per_rank=1,
            num_experts=num_experts,
            use_fp8=False,
        )
        self.dispatch(no_tokens)

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """Buffer.get_next_low_latency_combine_buffer."""
        self.require()
        return combine_buffer(self.rt, handle.num_max_dispatch_tokens_per_rank, self.next_area)


# -- torch.library operators: the calls as torch.compile traces them -------------------------
#
# The dispatch operator allocates its outputs; the receive halves and combine write into
# tensors they are given (declared mutated), so that a hook launched later fills what the
# send half returned. No autograd: the mode serves inference.


def _dispatch_op(
    runtime_id: int,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    stats: torch.Tensor | None,
    *,
    max_tokens: int,
    fp8: bool,
    round_scale: bool,
    ue8m0: bool,
    receive: bool,
    area: int,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """A dispatch's send half (and with ``receive`` its receive half): the DispatchOutputs."""
    rt = operators.runtime(runtime_id)
    num_tokens, topk = topk_idx.shape
    outputs = allocate_dispatch(rt, num_tokens, topk, max_tokens, fp8=fp8, ue8m0=ue8m0)
    launch_dispatch(
        rt,
        x,
        topk_idx,
        stats,
        outputs,
        round_scale=round_scale,
        ue8m0=ue8m0,
        send=True,
        receive=receive,
        area=area,
    )
    _check_after_launch(rt, received=receive)
    return tuple(outputs)


dispatch = torch.library.custom_op(
    "hybrid_ep::low_latency_dispatch", _dispatch_op, mutates_args=("stats",)
)


@dispatch.register_fake
def _(runtime_id, x, topk_idx, stats, *, max_tokens, fp8, ue8m0, **launch):
    rt = operators.runtime(runtime_id)
    with torch.device("meta"):
        outputs = allocate_dispatch(rt, *topk_idx.shape, max_tokens, fp8=fp8, ue8m0=ue8m0)
    return tuple(torch.empty_like(t, device=x.device) for t in outputs)


def _dispatch_receive_op(
    runtime_id: int,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    stats: torch.Tensor | None,
    recv_x: torch.Tensor,
    scale_storage: torch.Tensor,
    recv_count: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    token_slots: torch.Tensor,
    call_seq: torch.Tensor,
    *,
    round_scale: bool,
    ue8m0: bool,
) -> None:
    """A dispatch's receive half, into the outputs its send half returned."""
    rt = operators.runtime(runtime_id)
    outputs = DispatchOutputs(
        recv_x, scale_storage, recv_count, src_info, layout_range, token_slots, call_seq
    )
    launch_dispatch(
        rt,
        x,
        topk_idx,
        stats,
        outputs,
        round_scale=round_scale,
        ue8m0=ue8m0,
        send=False,
        receive=True,
        area=0,
    )
    _check_after_launch(rt, received=True)


dispatch_receive = torch.library.custom_op(
    "hybrid_ep::low_latency_dispatch_receive",
    _dispatch_receive_op,
    mutates_args=("stats", "recv_x", "scale_storage", "recv_count", "src_info", "layout_range"),
)


def _combine_op(
    runtime_id: int,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    token_slots: torch.Tensor,
    layout_range: torch.Tensor,
    out: torch.Tensor,
    *,
    zero_copy: bool,
    receive: bool,
    area: int,
) -> torch.Tensor:
    """A combine's send half (and with ``receive`` its receive half, into ``out``); returns
    the call's sequence number (int64 [1]) for a receive launched later."""
    rt = operators.runtime(runtime_id)
    call_seq = torch.empty(1, dtype=torch.int64, device=rt.device)
    launch_combine(
        rt,
        x,
        topk_idx,
        topk_weights,
        token_slots,
        layout_range,
        out,
        call_seq,
        zero_copy=zero_copy,
        send=True,
        receive=receive,
        area=area,
    )
    _check_after_launch(rt, received=receive)
    return call_seq


combine = torch.library.custom_op(
    "hybrid_ep::low_latency_combine", _combine_op, mutates_args=("out",)
)


@combine.register_fake
def _(runtime_id, x, *tensors, **launch):
    return x.new_empty(1, dtype=torch.int64)


def _combine_receive_op(
    runtime_id: int,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    token_slots: torch.Tensor,
    layout_range: torch.Tensor,
    out: torch.Tensor,
    call_seq: torch.Tensor,
) -> None:
    """A combine's receive half, into ``out``."""
    rt = operators.runtime(runtime_id)
    launch_combine(
        rt,
        x,
        topk_idx,
        topk_weights,
        token_slots,
        layout_range,
        out,
        call_seq,
        zero_copy=False,
        send=False,
        receive=True,
        area=0,
    )
    _check_after_launch(rt, received=True)


combine_receive = torch.library.custom_op(
    "hybrid_ep::low_latency_combine_receive", _combine_receive_op, mutates_args=("out",)
)
