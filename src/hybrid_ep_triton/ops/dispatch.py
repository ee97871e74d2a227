"""Dispatch launches: the layout (one kernel), then the data move (one kernel whose first
programs, the senders, push rows to the other ranks and whose others, on the rest of the GPU,
expand into expert-major rows; with quantize=True, quantizers come before the senders)."""

import functools

import torch

from ..kernels.control import INFO_WORDS
from ..kernels.dispatch import QUANT_GROUPS, dispatch_kernel
from ..kernels.quantize import NO_QUANTIZER, QUANTIZE_FP8, QUANTIZE_MXFP8, QUANTIZE_NVFP4
from ..kernels.route import layout_kernel
from ..runtime.planner import (
    FP8_GROUP,
    Plan,
    ScaledRows,
    ceil_div,
    next_power_of_2,
)
from .geometry import (
    channel_programs,
    data_move_arguments,
    local_parts,
    programs_beside_senders,
    topology_constants,
)
from .handle import DispatchHandle, make_handle, state_layout
from .launch import KernelLauncher
from .runtime import Runtime

# Slots per side of the layout kernel's [PAIRS, PAIRS] tiles of slot pairs.
_PAIRS = 128
# Most elements of one tile of the layout exchange's prefix sums: each tile is a round trip to
# memory, in a single program.
_EXCHANGE_TILE = 8192
# The dispatch kernel's quantizer of each block-scaled format (its QUANTIZE).
QUANTIZERS = {
    "fp8": QUANTIZE_FP8.value,
    "mxfp8": QUANTIZE_MXFP8.value,
    "nvfp4": QUANTIZE_NVFP4.value,
}


def compute_layout(
    rt: Runtime,
    topk_idx: torch.Tensor,
    pad_multiple: int,
    max_recv_tokens: int | None,
    report_tag: int = 0,
    refused: int = 0,
) -> DispatchHandle:
    """Launch the layout kernel for ``topk_idx`` [T, K] (contiguous); collective.

    With ``max_recv_tokens`` the handle's ``num_recv_rows`` is set to it; without, it is left
    at -1 for the caller to set once it has read the row count (with ``report_tag``, the kernel
    writes it into ``rt.report`` under that tag). ``refused``: 0, or the refusal code of this
    rank's input (``refusal_code``; no tokens then), which every rank's layout reports.
    """
    plan = rt.plan
    num_tokens, topk = topk_idx.shape
    # One allocation for the whole handle: a dispatch is latency-bound at small batches, and
    # every allocator call costs host time.
    size, parts = state_layout(plan, num_tokens, topk)
    state = torch.empty(size, dtype=torch.int64, device=rt.device)
    handle = make_handle(
        plan,
        topk_idx,
        state,
        -1 if max_recv_tokens is None else max_recv_tokens,
        max_recv_tokens,
        parts,
    )
    # A repeated call changes these arguments only (the others are fixed by the key).
    key = ("layout", num_tokens, topk, pad_multiple, max_recv_tokens, refused)
    address = state.data_ptr()
    relaunch = rt.relaunches.get(key)
    if relaunch is not None and relaunch(
        topk_idx, report_tag, address + 8 * INFO_WORDS, address, address
    ):
        return handle
    num_chunks = ceil_div(num_tokens, plan.config.chunk_tokens)
    rt.relaunches[key] = rt.launcher(_layout_launcher)(
        (max(num_chunks, 1),),
        specialized=dict(
            topk_idx_ptr=topk_idx,
            num_tokens=num_tokens,
            num_chunks=num_chunks,
            topk=topk,
            pad_multiple=pad_multiple,
            report_tag=report_tag,
            refused=refused,
            max_rows=2**31 - 1 if max_recv_tokens is None else max_recv_tokens,
            K_P2=next_power_of_2(topk),
            PAIRS=min(plan.config.chunk_tokens * next_power_of_2(topk), _PAIRS),
        ),
        aligned=dict(
            tokens_per_expert_ptr=handle.tokens_per_expert,
            info_ptr=state,
            **handle.args(*_LAYOUT_PARTS),
        ),
        changing=("topk_idx_ptr", "report_tag", "tokens_per_expert_ptr", "info_ptr"),
        views_of=handle.ints,
    )
    return handle


# The handle parts the layout kernel writes.
_LAYOUT_PARTS = (
    "slot_pos",
    "token_rank_pos",
    "chunk_expert_base",
    "send_chunk_start",
    "recv_chunk_start",
    "recv_src_tokens",
    "recv_rank_prefix",
    "expert_layout",
    "token_node_pos",
    "send_chunk_node_start",
    "recv_net_chunk_start",
)


def _layout_launcher(rt: Runtime) -> KernelLauncher:
    """layout_kernel with the arguments that stay the same for a Buffer."""
    plan, heap = rt.plan, rt.plan.heap
    e_p2, w_p2 = next_power_of_2(plan.num_experts), next_power_of_2(rt.world_size)
    return KernelLauncher(
        layout_kernel,
        on_compile=rt.on_compile,
        num_experts=plan.num_experts,
        experts_per_rank=plan.experts_per_rank,
        rank=rt.rank,
        world_size=rt.world_size,
        peer_bases_ptr=rt.heap.peer_bases,
        control_ptr=rt.control,
        count_flags_off=heap.count_flags,
        layout_in_off=heap.layout_in,
        timeout_ns=rt.timeout_ns,
        mask_off=heap.mask,
        net_bases_ptr=rt.heap.net_bases,
        layout_out_off=heap.layout_out,
        heap_bytes=heap.total_bytes,
        report_addr=rt.report.data_ptr(),
        CHUNK=plan.config.chunk_tokens,
        W_P2=w_p2,
        E_P2=e_p2,
        L_P2=next_power_of_2(plan.experts_per_rank),
        NC_MAX=plan.max_chunks,
        ROW=plan.counts_row,
        LR=plan.layout_row,
        C_BLOCK=max(1, _EXCHANGE_TILE // e_p2),
        TABLE_BLOCK=min(next_power_of_2(plan.max_chunks + 1), _EXCHANGE_TILE // w_p2),
        TOKEN_ROWS=plan.token_rows,
        **rt.compile_options,
        **topology_constants(plan, "R", "NODES", "N_P2"),
    )


def _own_slices(rt: Runtime, expanders: int, cols: int, block: int) -> int:
    """Column slices of an own chunk of rows of ``cols`` columns in the expansion: about two
    work items per expander at max_tokens, at most one tile of ``block`` columns per slice."""
    return max(1, min(ceil_div(cols, block), ceil_div(2 * expanders, rt.plan.max_chunks)))


def _move_launcher(rt: Runtime) -> KernelLauncher:
    """dispatch_kernel for rows of the Buffer's dtype, with the arguments that stay the same
    for a Buffer (the unused scale pointers: any tensor)."""
    plan = rt.plan
    return _data_move_launcher(
        rt,
        plan.hidden,
        plan.hidden,
        plan.config.block_h,
        plan.net_slot.cols,
        scale_words=0,
        x_scales_ptr=rt.control,
        x_scales_stride=0,
        recv_scales_ptr=rt.control,
        **_no_quantizers(rt),
    )


def _pair_move_launcher(rt: Runtime, name: str) -> KernelLauncher:
    """dispatch_kernel for block-scaled rows of format ``name`` given as a pair, moved as int32
    words (see planner.ScaledRows)."""
    rows = rt.plan.scaled_rows(name)
    return _data_move_launcher(
        rt,
        rows.words,
        rows.data_words,
        rows.block,
        rows.net_cols,
        rows.scale_words,
        **_no_quantizers(rt),
    )


def _no_quantizers(rt: Runtime) -> dict:
    """The quantizers' arguments of a launch that has none (the unused pointers: any tensor)."""
    return dict(
        QUANTIZE=NO_QUANTIZER.value,
        CHANNEL_GROUPS=0,
        source_ptr=rt.control,
        source_stride=0,
        quantized_flags_ptr=rt.control,
    )


def _quantizing_move_launcher(rt: Runtime, name: str) -> KernelLauncher:
    """dispatch_kernel for rows of the Buffer's dtype that it quantizes into rows of format
    ``name`` as it sends them (kernels/dispatch.py): into a pair of the Buffer's lifetime, of
    [T_MAX, data_words] and [T_MAX, scale_words] words, with a flag per quantizer item, which
    the launcher keeps."""
    plan, rows = rt.plan, rt.plan.scaled_rows(name)
    words = functools.partial(torch.empty, plan.max_tokens, dtype=torch.int32, device=rt.device)
    items = plan.max_chunks * _quantizer_slices(plan)
    return _data_move_launcher(
        rt,
        rows.words,
        rows.data_words,
        rows.block,
        rows.net_cols,
        rows.scale_words,
        QUANTIZE=QUANTIZERS[name],
        CHANNEL_GROUPS=_channel_groups(plan),
        x_ptr=words(rows.data_words),
        x_stride=rows.data_words,
        x_scales_ptr=words(rows.scale_words),
        x_scales_stride=rows.scale_words,
        quantized_flags_ptr=torch.zeros(items, dtype=torch.int64, device=rt.device),
    )


def _quantizers(rt: Runtime, num_tokens: int) -> int:
    """Programs of a quantizing move that quantize: the room beside the senders (the expanders
    start as they finish; half of it takes 117 µs instead of 93 for quantizing then moving S1
    token rows at one rank, as both halves are bound by their SMs), at most one per work
    item."""
    items = ceil_div(num_tokens, rt.plan.config.chunk_tokens) * _quantizer_slices(rt.plan)
    return max(1, min(programs_beside_senders(rt), items))


def _channel_groups(plan: Plan) -> int:
    """128-channel groups of a row, which the quantizers take QUANT_GROUPS at a time."""
    return plan.hidden // FP8_GROUP


def _quantizer_slices(plan: Plan) -> int:
    """Quantizer work items per chunk of tokens: column slices of QUANT_GROUPS 128-channel
    groups (the kernel's QUANT_SLICES)."""
    return ceil_div(_channel_groups(plan), QUANT_GROUPS.value)


def _data_move_launcher(
    rt: Runtime, cols: int, data_cols: int, block: int, net_cols: int, scale_words: int, **bound
) -> KernelLauncher:
    """dispatch_kernel for staged rows of ``cols`` elements (``data_cols`` of them in recv_x's
    rows, then ``scale_words`` of an FP8 row's scales) in tiles of ``block``, ``net_cols`` per
    network slot row."""
    plan, heap = rt.plan, rt.plan.heap
    slot = plan.net_slot
    return KernelLauncher(
        dispatch_kernel,
        hidden=cols,
        data_cols=data_cols,
        num_experts=plan.num_experts,
        experts_per_rank=plan.experts_per_rank,
        expand_slices=_own_slices(rt, programs_beside_senders(rt), cols, block),
        staged_parts=local_parts(plan, block, cols),
        ready_off=heap.dispatch_ready,
        meta_rows_off=heap.meta_rows,
        meta_weights_off=heap.meta_weights,
        BLOCK_H=block,
        TOKEN_ROWS=plan.token_rows,
        outputs_addr=rt.outputs_record.data_ptr(),
        META_INTS=slot.meta_ints,
        META_FLOATS=slot.meta_floats,
        NET_COLS=net_cols,
        SCALE_WORDS=scale_words,
        **data_move_arguments(rt),
        **bound,
    )


Moved = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class PreparedMove:
    """The data move for ``x`` [T, H] along ``handle``, prepared up to what depends on the row
    count N; collective. ``cached``: the handle's staged_rows (and recv_topk_idx) were filled
    by an earlier move and stay as they are; otherwise a token-row plan's move sets
    handle.recv_topk_idx.

    ``scaled``: None for rows of the Buffer's dtype (x_scales None); else the name of a
    block-scaled format (planner.SCALED_FORMATS) that recv_x is a pair of: with ``x_scales``,
    x and x_scales are such a pair (rows whose row stride and start are multiples of 4 bytes,
    see as_words; scales of any stride); without, ``x`` has the Buffer's dtype and the launch
    quantizes it as it sends.

    ``move(N)`` allocates the outputs and launches. An exact-mode dispatch instead launches
    with ``launch_awaiting_outputs(tag)`` before it knows N, so that the senders start as soon
    as the layout kernel is done, and ``deliver(N, tag)`` allocates the outputs and writes N
    and their addresses into the host record the launch waits for (``cancel(tag)`` where the
    host has none to give). ``move(N)`` and ``deliver`` return recv_x (rows: [N, H] of x's
    dtype; a format's values, planner.ScaledFormat.values_shape), recv_scales (a format's
    scales, else None) and recv_weights (None without topk_weights): [N] float32, with token
    rows [N, K]; a token-row move that is not cached also sets handle.recv_topk_idx [N, K] (of
    topk_idx's dtype) and handle.source_index [N] int32.
    """

    __slots__ = (
        "rt",
        "handle",
        "cached",
        "has_weights",
        "rows",
        "scaled",
        "dtype",
        "topk_weights",
        "inputs",
        "key",
    )

    def __init__(
        self,
        rt: Runtime,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        handle: DispatchHandle,
        cached: bool,
        scaled: str | None = None,
    ):
        self.rt, self.handle, self.cached = rt, handle, cached
        self.has_weights = topk_weights is not None
        self.scaled = None if scaled is None else rt.plan.scaled_rows(scaled)
        self.rows = "rows" if scaled is None else "pair" if x_scales is not None else "quantize"
        self.dtype = x.dtype if self.scaled is None else self.scaled.format.values_dtype
        self.topk_weights = topk_weights.contiguous() if self.has_weights else None
        # The arguments from the caller, as _move_changing names them: pairs move as words.
        if self.rows == "pair":
            scales = scale_words(x_scales, self.scaled)
            self.inputs = (as_words(x), x.stride(0) // 4, scales, scales.stride(0))
        else:
            self.inputs = (x, x.stride(0))
        self.key = (
            "move",
            self.rows,
            scaled,
            self.has_weights,
            cached,
            handle.num_tokens,
            handle.topk,
        )

    def __call__(self, num_rows: int) -> Moved:
        outputs = self._allocate(num_rows)
        self._launch(num_rows, -1, *self._arguments(outputs))
        return outputs[:3]

    def launch_awaiting_outputs(self, tag: int) -> None:
        """Launch before N is known: the expansion waits for the host record ``tag`` (> 0)."""
        # Stand-ins of the outputs' types, so that the launch takes move(N)'s kernel.
        placeholder = self.rt.placeholder
        scaled = self.scaled is not None
        slots = self.rt.plan.token_rows and not self.cached
        outputs = (
            placeholder(torch.int32 if scaled else self.dtype),
            placeholder(torch.int32) if scaled else None,
            placeholder(torch.float32) if self.has_weights else None,
            placeholder(self.handle.topk_idx.dtype) if slots else None,
            placeholder(torch.int32) if slots else None,
        )
        self._launch(0, tag, *self._arguments(outputs, outputs_are_words=True))

    def deliver(self, num_rows: int, tag: int) -> Moved:
        """The outputs of a launch_awaiting_outputs(tag) launch, for N = ``num_rows``."""
        outputs = self._allocate(num_rows)
        addresses = [t.data_ptr() if t is not None else 0 for t in outputs]
        write_host_record(self.rt.outputs_record_words, tag, (num_rows, *addresses))
        return outputs[:3]

    def cancel(self, tag: int) -> None:
        """No outputs for the launch_awaiting_outputs(tag) launch: it moves nothing here."""
        write_host_record(self.rt.outputs_record_words, tag, (-1, 0, 0, 0, 0, 0))

    def _allocate(self, num_rows: int) -> tuple:
        """recv_x, recv_scales, recv_weights (None without weights), the recv_topk_idx and
        recv_src_idx the launch writes (None unless a token-row move sets the handle's)."""
        plan, dev = self.rt.plan, self.rt.device
        recv_scales = None
        if self.scaled is None:
            recv_x = torch.empty(num_rows, plan.hidden, dtype=self.dtype, device=dev)
        else:
            fmt = self.scaled.format
            shape = fmt.values_shape(num_rows, plan.hidden)
            recv_x = torch.empty(shape, dtype=torch.uint8, device=dev).view(fmt.values_dtype)
            # Scales in whole words a row; the caller sees a row's first scales (all of them
            # unless planner.ScaledRows.padded_scales).
            words = torch.empty(num_rows, self.scaled.scale_words, dtype=torch.int32, device=dev)
            recv_scales = words.view(fmt.scale_dtype)[:, : fmt.scales_shape(0, plan.hidden)[1]]
        recv_weights = recv_topk_idx = recv_src_idx = None
        handle = self.handle
        if self.has_weights:
            shape = (num_rows, handle.topk) if plan.token_rows else (num_rows,)
            recv_weights = torch.empty(shape, dtype=torch.float32, device=dev)
        if plan.token_rows and not self.cached:
            recv_topk_idx = torch.empty(
                num_rows, handle.topk, dtype=handle.topk_idx.dtype, device=dev
            )
            recv_src_idx = torch.empty(num_rows, dtype=torch.int32, device=dev)
            handle.recv_topk_idx, handle.source_index = recv_topk_idx, recv_src_idx
        return recv_x, recv_scales, recv_weights, recv_topk_idx, recv_src_idx

    def _arguments(self, outputs: tuple, outputs_are_words: bool = False) -> tuple:
        """The launch's output arguments (unused ones: any tensor of their type) and, without
        weights, the unused topk_weights: (topk_weights, recv_x, [recv_scales,] recv_weights,
        recv_topk_idx, recv_src_idx); a pair's outputs as words (placeholders are words
        already)."""
        recv_x, recv_scales, recv_weights, recv_topk_idx, recv_src_idx = outputs
        if recv_weights is None:  # no weights: both weight pointers unused
            recv_weights = self.rt.placeholder(torch.float32)
        topk_weights = self.topk_weights if self.has_weights else recv_weights
        if recv_topk_idx is None:  # no slots to write: both pointers unused
            recv_topk_idx = recv_src_idx = self.rt.placeholder(torch.int32)
        rows = (recv_x,)
        if self.scaled is not None:
            rows = (recv_x, recv_scales)
            if not outputs_are_words:  # (the scales' words: the rows recv_scales is a view of)
                rows = (as_words(recv_x), _whole_words(recv_scales, self.scaled))
        return topk_weights, *rows, recv_weights, recv_topk_idx, recv_src_idx

    def _launch(self, num_rows: int, tag: int, topk_weights, *outputs) -> None:
        rt, handle = self.rt, self.handle
        state = handle.state  # (which starts with the handle's info)
        values = (*self.inputs, handle.topk_idx, topk_weights, num_rows, tag, state, *outputs)
        key = (*self.key, tag > 0)
        relaunch = rt.relaunches.get(key)
        if relaunch is None or not relaunch(*values, state.data_ptr()):
            rt.relaunches[key] = _launch_move(
                rt, handle, self.rows, self.scaled, self.has_weights, self.cached, values
            )


def write_host_record(words, tag: int, values: tuple[int, ...]) -> None:
    """Write the host record ``tag`` of ``values`` into ``words`` (int64 items of pinned
    memory, a numpy array or a memoryview): the values, the check, the tag last
    (kernels/primitives.wait_host_record)."""
    check = tag
    for i, value in enumerate(values, 1):
        words[i] = value
        check += (2 * i + 1) * value
    words[len(values) + 1] = check
    words[0] = tag


# The handle parts the data move reads (and, for a new handle, writes: staged_rows, fwd_rows).
_MOVE_PARTS = (
    "slot_pos",
    "token_rank_pos",
    "send_chunk_start",
    "chunk_expert_base",
    "recv_chunk_start",
    "recv_src_tokens",
    "expert_layout",
    "staged_rows",
    "token_node_pos",
    "send_chunk_node_start",
    "recv_net_chunk_start",
    "fwd_rows",
)
# The data move's arguments from the caller or its layout (Triton specialises on them), then
# the outputs and the handle's info, which this library allocates.
_MOVE_SPECIALIZED = ("topk_idx_ptr", "topk_weights_ptr", "num_out_rows", "outputs_tag")
_MOVE_ALIGNED = (
    "info_ptr",
    "recv_x_ptr",
    "recv_weights_ptr",
    "recv_topk_idx_ptr",
    "recv_src_idx_ptr",
)
# By the rows moved (PreparedMove's ``rows``): the caller's rows (x, or what a quantizing
# move reads) and the launcher that moves them.
_MOVE_INPUTS = {
    "rows": ("x_ptr", "x_stride"),
    "pair": ("x_ptr", "x_stride", "x_scales_ptr", "x_scales_stride"),
    "quantize": ("source_ptr", "source_stride"),
}
# The launcher makers of each (rows, format): made once, so that Runtime.launcher finds them.
_MOVE_LAUNCHERS = {("rows", None): _move_launcher} | {
    (rows, name): functools.partial(make, name=name)
    for rows, make in (("pair", _pair_move_launcher), ("quantize", _quantizing_move_launcher))
    for name in QUANTIZERS
}


def _move_changing(rows: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(specialized, aligned) names of the data move's arguments that change between calls
    besides the handle's parts, in a Relaunch's order (block-scaled rows: the scales' pointers
    beside the rows')."""
    aligned = _MOVE_ALIGNED
    if rows != "rows":
        aligned = (*_MOVE_ALIGNED[:2], "recv_scales_ptr", *_MOVE_ALIGNED[2:])
    return (*_MOVE_INPUTS[rows], *_MOVE_SPECIALIZED), aligned


def _launch_move(
    rt: Runtime,
    handle: DispatchHandle,
    rows: str,
    scaled: ScaledRows | None,
    has_weights: bool,
    cached: bool,
    values,
):
    """The data move through its KernelLauncher, ``values`` in _move_changing's order; returns
    its Relaunch."""
    specialized, aligned = _move_changing(rows)
    named = dict(zip(specialized, values, strict=False))
    quantizers = _quantizers(rt, handle.num_tokens) if rows == "quantize" else 0
    launch = rt.launcher(_MOVE_LAUNCHERS[rows, scaled and scaled.format.name])
    return launch(
        (quantizers + channel_programs(rt.plan) + programs_beside_senders(rt),),
        specialized=dict(
            named,
            num_tokens=handle.num_tokens,
            topk=handle.topk,
            K_P2=next_power_of_2(handle.topk),
            HAS_WEIGHTS=has_weights,
            WRITE_ROWS=not cached,
            num_quantizers=quantizers,
            OUTPUTS_FROM_HOST=named["outputs_tag"] > 0,
        ),
        aligned=dict(
            zip(aligned, values[len(specialized) :], strict=True), **handle.args(*_MOVE_PARTS)
        ),
        changing=(*specialized, *aligned),
        views_of=handle.ints,
    )


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A pair's values [T, C] (rows contiguous, row stride and start multiples of 4 bytes) as
    int32 words: the kernels move block-scaled rows bit for bit as words."""
    return t.view(torch.int32)


def scale_words(scales: torch.Tensor, rows: ScaledRows) -> torch.Tensor:
    """A pair's scales [T, S] (rows contiguous) as int32 words [T, >= rows.scale_words]: a
    view where each row starts on a word and fills whole words; else (padded_scales, or
    strides torch made for a slice) a copy into whole words, zero past the scales."""
    nbytes = scales.element_size()
    # (torch.compile cannot trace storage_offset(): a traced call copies 1-byte scales.)
    offset = 0 if nbytes == 4 else 1 if torch.compiler.is_compiling() else scales.storage_offset()
    if not rows.padded_scales and (scales.stride(0) * nbytes) % 4 == 0 and offset % 4 == 0:
        return scales.view(torch.int32)
    words = scales.new_zeros(scales.shape[0], rows.scale_words, dtype=torch.int32)
    words.view(torch.uint8)[:, : rows.scale_bytes] = scales.view(torch.uint8)
    return words


def _whole_words(recv_scales: torch.Tensor, rows: ScaledRows) -> torch.Tensor:
    """The int32 words [N, rows.scale_words] that recv_scales (see PreparedMove._allocate) is
    the first scales of."""
    return (
        recv_scales.view(torch.uint8)
        .as_strided((recv_scales.shape[0], rows.scale_words * 4), (rows.scale_words * 4, 1))
        .view(torch.int32)
    )
