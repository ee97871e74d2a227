"""torch.library operators for dispatch and combine: fake implementations and autograd.

The operators take a Buffer's runtime by its registry id (an int) and a handle as its tensors
(``topk_idx``, ``state``), so torch.compile traces a model that calls them without
graph breaks: in max_recv_tokens mode every output shape is static; in exact mode the received
row count is a data-dependent size.

Autograd: each data move's backward is the other one along the same handle.
- dispatch (x, topk_weights) -> (recv_x, recv_weights): grad x is the combine of grad recv_x
  (each token sums the gradients of its rows); grad topk_weights[t, k] is grad recv_weights at
  the row (with token rows: the row and entry) that slot (t, k) landed on, sent back to the
  token's rank.
- combine (y, weights) -> out: grad y is the cached dispatch of grad out times weights; grad
  weights[row] is <y[row], grad out[token of row]> in fp32.
- a quantizing dispatch of rows x that require grad (``run_quantized_dispatch``) has
  dispatch's gradients, straight through the quantization: its values are a ``ScaledValues``
  (ops/scaled_rows.py), whose gradient has x's dtype; its scales have none. It is an
  autograd.Function for eager mode (torch.compile traces the other entry points only).
Backward passes reuse the forward's handle (no new layout), work in max_recv_tokens mode, and
are collective like the forward: every rank runs them, in the same order.
"""

import itertools
import weakref

import torch

# An operator's first call imports torch._dynamo, which takes seconds: import it with the
# library instead, so that no rank's first collective call is late by that much.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch import Tensor

from ..runtime.planner import SCALED_FORMATS
from . import status
from .combine import reduce_tokens
from .dispatch import PreparedMove, compute_layout
from .handle import DispatchHandle, handle_size, make_handle, refusal_code
from .runtime import Runtime
from .scaled_rows import ScaledValues

# Weak: a Buffer dropped without destroy() is freed as before (its runtime with it).
_runtimes: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()
_ids = itertools.count()


def register(rt: Runtime) -> int:
    """Make ``rt`` reachable by the operators; returns its id."""
    runtime_id = next(_ids)
    _runtimes[runtime_id] = rt
    return runtime_id


def unregister(runtime_id: int) -> None:
    _runtimes.pop(runtime_id, None)


def runtime(runtime_id: int) -> Runtime:
    rt = _runtimes.get(runtime_id)
    if rt is None:
        raise RuntimeError(f"hybrid_ep: no live Buffer has id {runtime_id} (destroyed?)")
    return rt


def _handle(rt: Runtime, topk_idx, state, num_recv_rows: int) -> DispatchHandle:
    return make_handle(rt.plan, topk_idx, state, num_recv_rows, None)


# -- operators ------------------------------------------------------------------------------


def _dispatch_with_handle(
    rt: Runtime,
    x: Tensor,
    x_scales: Tensor | None,
    topk_idx: Tensor,
    topk_weights: Tensor | None,
    pad_multiple: int,
    max_recv_tokens: int | None,
    scaled: str | None = None,
    refused: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None, DispatchHandle]:
    """Layout and data move; max_recv_tokens None: exact mode (the host waits for the count);
    ``scaled``: the block-scaled format that recv_x is a pair of (see PreparedMove); ``refused``:
    see compute_layout. Returns recv_x (rows [N, H], or a format's values), recv_scales (a
    format's scales, else None), recv_weights [N] float32 (None without topk_weights), the
    handle."""
    if max_recv_tokens is None and rt.on_gpu:
        # The host waits for the row count, which a capture never produces: say so at once.
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "an exact-mode dispatch (max_recv_tokens=None) waits for its row count on the "
                "host and cannot be captured in a CUDA graph: pass max_recv_tokens"
            )
    tag = rt.next_report_tag() if max_recv_tokens is None else 0
    handle = compute_layout(rt, topk_idx, pad_multiple, max_recv_tokens, tag, refused)
    move = PreparedMove(rt, x, x_scales, topk_weights, handle, False, scaled)  # while it runs
    if max_recv_tokens is None:
        recv_x, recv_scales, recv_weights = _exact_move(rt, handle, move, tag)
    else:
        recv_x, recv_scales, recv_weights = move(max_recv_tokens)
    status.check_after_launch(rt)
    if not rt.on_gpu:  # launches are synchronous: report routing errors now
        status.read_report(rt, handle)
    return recv_x, recv_scales, recv_weights, handle


def run_refused_dispatch(rt: Runtime, argument: str, max_recv_tokens: int | None) -> None:
    """This rank's part of a dispatch whose ``argument`` its host refused, so that no peer
    waits for it and every rank learns why: a layout of no tokens that publishes the refusal
    code, which every rank's layout then reports (an exact-mode dispatch raises it at once,
    check() in max_recv_tokens mode), and the data move, which moves nothing on any rank, as
    for invalid routing. ``max_recv_tokens``: the call's mode (None: exact). The report of this
    rank's own refusal is left to the caller, which raises the host's message instead."""
    x = torch.empty(0, rt.plan.hidden, dtype=rt.outbox.dtype, device=rt.device)
    no_routing = torch.empty(0, 1, dtype=torch.int64, device=rt.device)
    try:
        _dispatch_with_handle(
            rt, x, None, no_routing, None, 1, max_recv_tokens, refused=refusal_code(argument)
        )
    except ValueError:  # the layout's report of this refusal (or of a peer's at the same time)
        pass


def run_refused_call_along(rt: Runtime, handle: DispatchHandle, call: str) -> None:
    """This rank's part of a ``call`` ("combine", or "dispatch": a cached one) along ``handle``
    whose input its host refused, so that no peer waits for it: the same launch with zero rows
    (a cached dispatch's x [T, H], a combine's y [N, H], of the Buffer's dtype, no weights,
    whatever format the peers move), its outputs dropped. The peers' outputs of the call are
    then not valid, which this rank's next dispatch with a new layout tells them (Buffer)."""
    rows = handle.num_recv_rows if call == "combine" else handle.num_tokens
    zeros = torch.zeros(rows, rt.plan.hidden, dtype=rt.plan.dtype, device=rt.device)
    if call == "combine":
        _combine_with_handle(rt, zeros, None, handle)
    else:
        _move_cached(rt, zeros, None, None, handle)


def _exact_move(rt: Runtime, handle: DispatchHandle, move: PreparedMove, tag: int):
    """The data move of an exact-mode dispatch, whose layout launch wrote its row count into
    the host report under ``tag``; sets handle.num_recv_rows. On GPUs it is launched before
    the count is known and its outputs are delivered once the host has read it, so that
    neither the launch nor the host's wait comes between the layout kernel and the senders.
    CPU ranks, whose launches are synchronous, read the count and deliver first."""
    if not rt.on_gpu:
        try:
            handle.num_recv_rows = status.read_report(rt, handle, tag)
        except ValueError:  # the layout aborted the dispatch on every rank: its move, which
            move.cancel(tag)  # moves nothing, still runs, as on GPUs and in max_recv_tokens
            move.launch_awaiting_outputs(tag)  # mode (the ranks' modes may differ)
            raise
        handle.reported_tokens_per_expert = status.reported_tokens_per_expert(rt, tag)
        moved = move.deliver(handle.num_recv_rows, tag)
        move.launch_awaiting_outputs(tag)
        return moved
    move.launch_awaiting_outputs(tag)
    try:
        handle.num_recv_rows = status.read_report(rt, handle, tag)
        handle.reported_tokens_per_expert = status.reported_tokens_per_expert(rt, tag)
        return move.deliver(handle.num_recv_rows, tag)
    except BaseException:  # its expansion waits for the record: say there is none
        move.cancel(tag)
        raise


def _dispatch(
    runtime_id: int,
    x: Tensor,
    x_scales: Tensor | None,
    topk_idx: Tensor,
    topk_weights: Tensor | None,
    pad_multiple: int,
    max_recv_tokens: int,
    scaled: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The operator: max_recv_tokens < 0 is exact mode; ``scaled``: "" or the block-scaled
    format of recv_x (x_scales given: x is a pair of it; else x is quantized). Returns recv_x
    [N, H] (or the format's values), recv_scales (the format's scales, else [0]),
    recv_weights float32 ([N], with token rows [N, K]; [0] without topk_weights),
    recv_topk_idx ([N, K] of topk_idx's dtype with token rows, else [0]), recv_src_idx ([N]
    int32 with token rows, else [0]) and the handle's state (see DispatchHandle)."""
    rt = runtime(runtime_id)
    exact = max_recv_tokens < 0
    recv_x, recv_scales, recv_weights, handle = _dispatch_with_handle(
        rt,
        x,
        x_scales,
        topk_idx,
        topk_weights,
        pad_multiple,
        None if exact else max_recv_tokens,
        scaled or None,
    )
    return (
        recv_x,
        _or_empty(recv_scales, rt),
        _or_empty(recv_weights, rt),
        _or_empty(handle.recv_topk_idx, rt, topk_idx.dtype),
        _or_empty(handle.source_index, rt, torch.int32),
        handle.state,
    )


dispatch = torch.library.custom_op("hybrid_ep::dispatch", _dispatch, mutates_args=())


@dispatch.register_fake
def _(runtime_id, x, x_scales, topk_idx, topk_weights, pad_multiple, max_recv_tokens, scaled):
    rt = runtime(runtime_id)
    if max_recv_tokens >= 0:
        rows = max_recv_tokens
    else:
        rows = torch.library.get_ctx().new_dynamic_size()
    num_state = handle_size(rt.plan, *topk_idx.shape)
    slots = _slots_shape(rt, rows, topk_idx.shape[1])
    token_rows = rt.plan.token_rows
    return (
        *_fake_rows(x, rt.plan.hidden, rows, scaled),
        x.new_empty(slots if topk_weights is not None else 0, dtype=torch.float32),
        x.new_empty(slots if token_rows else 0, dtype=topk_idx.dtype),
        x.new_empty(rows if token_rows else 0, dtype=torch.int32),
        x.new_empty(num_state, dtype=torch.int64),
    )


def _fake_rows(x: Tensor, hidden: int, rows, scaled: str) -> tuple[Tensor, Tensor]:
    """recv_x and recv_scales of a fake dispatch: [rows, H] of x's dtype and [0], or the
    values and scales of the block-scaled format ``scaled``."""
    if not scaled:
        return x.new_empty(rows, hidden, dtype=x.dtype), x.new_empty(0, dtype=torch.float32)
    fmt = SCALED_FORMATS[scaled]
    return (
        x.new_empty(fmt.values_shape(rows, hidden), dtype=fmt.values_dtype),
        x.new_empty(fmt.scales_shape(rows, hidden), dtype=fmt.scale_dtype),
    )


def _slots_shape(rt: Runtime, rows, topk: int) -> tuple:
    """Shape of recv_weights: a weight per row, or with token rows per (row, entry)."""
    return (rows, topk) if rt.plan.token_rows else (rows,)


def _dispatch_cached(
    runtime_id: int,
    x: Tensor,
    x_scales: Tensor | None,
    topk_weights: Tensor | None,
    topk_idx: Tensor,
    state: Tensor,
    num_recv_rows: int,
    scaled: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Data move along an earlier dispatch's handle: recv_x, recv_scales or [0] (as for the
    dispatch operator), recv_weights [N] or [0]."""
    rt = runtime(runtime_id)
    handle = _handle(rt, topk_idx, state, num_recv_rows)
    recv_x, recv_scales, recv_weights = _move_cached(
        rt, x, x_scales, topk_weights, handle, scaled or None
    )
    return recv_x, _or_empty(recv_scales, rt), _or_empty(recv_weights, rt)


def _move_cached(
    rt: Runtime,
    x: Tensor,
    x_scales: Tensor | None,
    topk_weights: Tensor | None,
    handle: DispatchHandle,
    scaled: str | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    moved = PreparedMove(rt, x, x_scales, topk_weights, handle, True, scaled)(handle.num_recv_rows)
    status.check_after_launch(rt)
    return moved


dispatch_cached = torch.library.custom_op(
    "hybrid_ep::dispatch_cached", _dispatch_cached, mutates_args=()
)


@dispatch_cached.register_fake
def _(runtime_id, x, x_scales, topk_weights, topk_idx, state, num_recv_rows, scaled):
    rt = runtime(runtime_id)
    slots = _slots_shape(rt, num_recv_rows, topk_idx.shape[1])
    weights = x.new_empty(slots if topk_weights is not None else 0, dtype=torch.float32)
    return *_fake_rows(x, rt.plan.hidden, num_recv_rows, scaled), weights


def _combine(
    runtime_id: int,
    y: Tensor,
    weights: Tensor | None,
    topk_weights: Tensor | None,
    topk_idx: Tensor,
    state: Tensor,
) -> tuple[Tensor, Tensor]:
    """out [T, H] in y's dtype: the (weighted) sum of each token's rows of y [N, H]; and
    with token rows' topk_weights [N, K] float32 each token's sum of them, [T, K] float32
    (else [0])."""
    rt = runtime(runtime_id)
    handle = _handle(rt, topk_idx, state, y.shape[0])
    out, combined = _combine_with_handle(rt, y, weights, handle, topk_weights)
    return out, _or_empty(combined, rt)


def _combine_with_handle(
    rt: Runtime,
    y: Tensor,
    weights: Tensor | None,
    handle: DispatchHandle,
    topk_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    moved = reduce_tokens(rt, y, handle, weights, topk_weights)
    status.check_after_launch(rt)
    return moved


combine = torch.library.custom_op("hybrid_ep::combine", _combine, mutates_args=())


@combine.register_fake
def _(runtime_id, y, weights, topk_weights, topk_idx, state):
    slots = topk_idx.shape if topk_weights is not None else 0
    return y.new_empty(topk_idx.shape[0], y.shape[1]), y.new_empty(slots, dtype=torch.float32)


def _slot_gradients_op(
    runtime_id: int, grad_recv_weights: Tensor, topk_idx: Tensor, state: Tensor
) -> Tensor:
    """grad topk_weights [T, K] float32 from grad recv_weights float32 ([N], with token rows
    [N, K])."""
    rt = runtime(runtime_id)
    handle = _handle(rt, topk_idx, state, grad_recv_weights.shape[0])
    return _slot_gradients(rt, handle, grad_recv_weights)


slot_gradients = torch.library.custom_op(
    "hybrid_ep::slot_gradients", _slot_gradients_op, mutates_args=()
)


@slot_gradients.register_fake
def _(runtime_id, grad_recv_weights, topk_idx, state):
    return grad_recv_weights.new_empty(topk_idx.shape)


# -- entry points of Buffer -----------------------------------------------------------------
# Each runs its operator through torch's dispatcher where torch must see it (while
# torch.compile traces, or for autograd when an input requires grad), else the implementation
# directly with the handle object: that skips the dispatcher and rebuilding the handle's views,
# together about half the host time of a call on a slow CPU.


def _through_torch(*tensors) -> bool:
    if torch.compiler.is_compiling():
        return True
    if torch.is_grad_enabled():
        for t in tensors:  # (a loop, not any() of a generator: this is on every call's path)
            if t is not None and t.requires_grad:
                return True
    return False


def run_any_dispatch(
    rt: Runtime,
    runtime_id: int,
    x: Tensor,
    x_scales: Tensor | None,
    topk_idx: Tensor | None,
    topk_weights: Tensor | None,
    pad_multiple: int,
    max_recv_tokens: int | None,
    handle: DispatchHandle | None,
    scaled: str | None,
    expert_recv_stats: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, DispatchHandle]:
    """Buffer.dispatch's data move, by its kind: rows quantized as they are sent whose
    gradient goes straight through (run_quantized_dispatch), a new layout (run_dispatch) or
    along ``handle`` (run_dispatch_cached). Returns recv_x, recv_scales or None, recv_weights or
    None, the handle; a new layout adds its tokens routed to each local expert (the handle's
    valid rows per expert) into ``expert_recv_stats`` when given."""
    if scaled and x_scales is None and x.requires_grad and torch.is_grad_enabled():
        outputs = run_quantized_dispatch(
            rt,
            runtime_id,
            x,
            topk_weights,
            topk_idx,
            pad_multiple,
            max_recv_tokens,
            handle,
            scaled,
        )
    elif handle is None:
        outputs = run_dispatch(
            rt,
            runtime_id,
            x,
            x_scales,
            topk_idx,
            topk_weights,
            pad_multiple,
            max_recv_tokens,
            scaled,
        )
    else:
        return (
            *run_dispatch_cached(rt, runtime_id, x, x_scales, topk_weights, handle, scaled),
            handle,
        )
    if handle is None and expert_recv_stats is not None:
        expert_recv_stats.add_(outputs[-1].expert_layout[1])
    return outputs


def run_dispatch(
    rt: Runtime,
    runtime_id: int,
    x: Tensor,
    x_scales: Tensor | None,
    topk_idx: Tensor,
    topk_weights: Tensor | None,
    pad_multiple: int,
    max_recv_tokens: int | None,
    scaled: str | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, DispatchHandle]:
    """Layout and data move: recv_x, recv_scales (None for rows of the Buffer's dtype; see
    _dispatch_with_handle), recv_weights [N] float32 (None without topk_weights), the handle.
    max_recv_tokens None: exact mode. ``scaled``: the block-scaled format of recv_x (x_scales
    None: x of the Buffer's dtype, that does not require grad, see run_quantized_dispatch, is
    quantized). ``runtime_id``: ``rt``'s registry id, the operators' handle on it."""
    if not _through_torch(x, topk_weights):
        return _dispatch_with_handle(
            rt, x, x_scales, topk_idx, topk_weights, pad_multiple, max_recv_tokens, scaled
        )
    recv_x, recv_scales, recv_weights, recv_topk_idx, recv_src_idx, state = dispatch(
        runtime_id,
        x,
        x_scales,
        topk_idx,
        topk_weights,
        pad_multiple,
        -1 if max_recv_tokens is None else max_recv_tokens,
        scaled or "",
    )
    handle = make_handle(rt.plan, topk_idx, state, recv_x.shape[0], max_recv_tokens)
    if rt.plan.token_rows:
        handle.recv_topk_idx, handle.source_index = recv_topk_idx, recv_src_idx
    return (
        recv_x,
        recv_scales if scaled else None,
        recv_weights if topk_weights is not None else None,
        handle,
    )


def run_dispatch_cached(
    rt: Runtime,
    runtime_id: int,
    x: Tensor,
    x_scales: Tensor | None,
    topk_weights: Tensor | None,
    handle: DispatchHandle,
    scaled: str | None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Data move along ``handle``: recv_x, recv_scales or None, recv_weights [N] float32 or
    None; ``scaled`` as in run_dispatch."""
    if not _through_torch(x, topk_weights):
        return _move_cached(rt, x, x_scales, topk_weights, handle, scaled)
    recv_x, recv_scales, recv_weights = dispatch_cached(
        runtime_id,
        x,
        x_scales,
        topk_weights,
        handle.topk_idx,
        handle.state,
        handle.num_recv_rows,
        scaled or "",
    )
    return (
        recv_x,
        recv_scales if scaled else None,
        recv_weights if topk_weights is not None else None,
    )


def run_combine(
    rt: Runtime,
    runtime_id: int,
    y: Tensor,
    weights: Tensor | None,
    handle: DispatchHandle,
    topk_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """out [T, H]: the (weighted) sum of each token's rows of y [N, H]; with token rows'
    topk_weights [N, K] float32 (no gradient) each token's sum of them, [T, K] float32 (else
    None)."""
    if not _through_torch(y, weights):
        return _combine_with_handle(rt, y, weights, handle, topk_weights)
    out, combined = combine(runtime_id, y, weights, topk_weights, handle.topk_idx, handle.state)
    return out, combined if topk_weights is not None else None


def run_quantized_dispatch(
    rt: Runtime,
    runtime_id: int,
    x: Tensor,
    topk_weights: Tensor | None,
    topk_idx: Tensor | None,
    pad_multiple: int,
    max_recv_tokens: int | None,
    handle: DispatchHandle | None,
    scaled: str,
) -> tuple[ScaledValues, Tensor, Tensor | None, DispatchHandle]:
    """x [T, H] quantized to rows of the block-scaled format ``scaled`` and dispatched,
    differentiable with respect to x and topk_weights: along ``handle``, or (handle None) with
    a new layout from topk_idx, pad_multiple and max_recv_tokens (None: exact mode). Returns
    recv_values (a ScaledValues [N, H] of x's dtype), recv_scales (no gradient), recv_weights
    (as run_dispatch's), the handle (``handle`` itself when given)."""
    return _QuantizedDispatch.apply(
        x, topk_weights, rt, runtime_id, topk_idx, pad_multiple, max_recv_tokens, handle, scaled
    )


def _or_empty(recv: Tensor | None, rt: Runtime, dtype: torch.dtype = torch.float32) -> Tensor:
    # An operator returns tensors only: no weights (or scales) is an empty one.
    if recv is None:
        return torch.empty(0, dtype=dtype, device=rt.device)
    return recv


# -- autograd -------------------------------------------------------------------------------


def _save_handle(ctx, runtime_id, x, num_recv_rows, *tensors) -> None:
    """Keep what a backward needs: the handle's tensors (topk_idx, state) and others."""
    ctx.runtime_id, ctx.num_recv_rows = runtime_id, num_recv_rows
    ctx.dtype, ctx.hidden = x.dtype, x.shape[1]
    ctx.save_for_backward(*tensors)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_weights, x_index: int, weights_index: int):
    """Gradients of a data move's inputs: combine for x, slot_gradients for topk_weights."""
    topk_idx, state = ctx.saved_tensors
    grads = [None] * ctx.num_inputs
    if ctx.needs_input_grad[x_index]:
        if grad_recv_x is None:  # still a collective: every rank takes part
            grad_recv_x = topk_idx.new_zeros(ctx.num_recv_rows, ctx.hidden, dtype=ctx.dtype)
        grad_rows = grad_recv_x.to(ctx.dtype).contiguous()
        grads[x_index] = combine(ctx.runtime_id, grad_rows, None, None, topk_idx, state)[0]
    if ctx.needs_input_grad[weights_index]:
        if grad_recv_weights is None:
            shape = _slots_shape(runtime(ctx.runtime_id), ctx.num_recv_rows, topk_idx.shape[1])
            grad_recv_weights = topk_idx.new_zeros(shape, dtype=torch.float32)
        grads[weights_index] = slot_gradients(
            ctx.runtime_id, grad_recv_weights.float().contiguous(), topk_idx, state
        )
    return tuple(grads)


def _dispatch_setup(ctx, inputs, output):
    runtime_id, x, _, topk_idx = inputs[:4]
    _save_handle(ctx, runtime_id, x, output[0].shape[0], topk_idx, output[-1])
    ctx.num_inputs = len(inputs)


def _dispatch_grads(ctx, grad_recv_x, _grad_scales, grad_recv_weights, *_grad_handle):
    return _dispatch_backward(ctx, grad_recv_x, grad_recv_weights, x_index=1, weights_index=4)


def _dispatch_cached_setup(ctx, inputs, output):
    runtime_id, x, _, _, topk_idx, state, num_recv_rows, _ = inputs
    _save_handle(ctx, runtime_id, x, num_recv_rows, topk_idx, state)
    ctx.num_inputs = len(inputs)


def _dispatch_cached_grads(ctx, grad_recv_x, _grad_scales, grad_recv_weights):
    return _dispatch_backward(ctx, grad_recv_x, grad_recv_weights, x_index=1, weights_index=3)


def _combine_setup(ctx, inputs, output):
    runtime_id, y, weights, _, topk_idx, state = inputs
    _save_handle(ctx, runtime_id, y, y.shape[0], topk_idx, state, y, weights)


def _combine_grads(ctx, grad_out, _grad_combined_weights):
    topk_idx, state, y, weights = ctx.saved_tensors
    # Row r of grad_rows is grad_out of the token row r came from (zero on padding).
    grad_rows, _, _ = dispatch_cached(
        ctx.runtime_id,
        grad_out.to(ctx.dtype).contiguous(),
        None,
        None,
        topk_idx,
        state,
        ctx.num_recv_rows,
        "",
    )
    grad_y = grad_weights = None
    if ctx.needs_input_grad[1]:
        grad_y = grad_rows if weights is None else grad_rows * weights[:, None].to(y.dtype)
    if ctx.needs_input_grad[2]:
        grad_weights = (y.float() * grad_rows.float()).sum(dim=1)
    return None, grad_y, grad_weights, None, None, None


class _QuantizedDispatch(torch.autograd.Function):
    """``run_quantized_dispatch``: the inputs that can have a gradient first (x, topk_weights),
    then how to route."""

    @staticmethod
    def forward(
        ctx,
        x,
        topk_weights,
        rt,
        runtime_id,
        topk_idx,
        pad_multiple,
        max_recv_tokens,
        handle,
        scaled,
    ):
        if handle is None:
            recv_values, recv_scales, recv_weights, handle = _dispatch_with_handle(
                rt, x, None, topk_idx, topk_weights, pad_multiple, max_recv_tokens, scaled
            )
        else:
            recv_values, recv_scales, recv_weights = _move_cached(
                rt, x, None, topk_weights, handle, scaled
            )
        _save_handle(ctx, runtime_id, x, handle.num_recv_rows, handle.topk_idx, handle.state)
        ctx.num_inputs = len(ctx.needs_input_grad)
        # Unused outputs get None (_dispatch_backward makes the zeros it needs).
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(recv_scales)
        values = ScaledValues(recv_values, recv_scales, SCALED_FORMATS[scaled], x.dtype)
        return values, recv_scales, recv_weights, handle

    @staticmethod
    def backward(ctx, grad_values, _grad_scales, grad_recv_weights, _grad_handle):
        return _dispatch_backward(ctx, grad_values, grad_recv_weights, x_index=0, weights_index=1)


dispatch.register_autograd(_dispatch_grads, setup_context=_dispatch_setup)
dispatch_cached.register_autograd(_dispatch_cached_grads, setup_context=_dispatch_cached_setup)
combine.register_autograd(_combine_grads, setup_context=_combine_setup)


def _slot_gradients(rt: Runtime, handle: DispatchHandle, grad_weights: Tensor) -> Tensor:
    """grad topk_weights [T, K] float32 from grad recv_weights ([N], with token rows [N, K]):
    each receiver looks up the weights of its staged tokens' entries, sends them back with one
    all_to_all, and each source picks the entry of every slot."""
    plan, dev = rt.plan, rt.device
    # Receiver: entry (s, j, i) is the i-th local slot of s's j-th staged token, whose weight is
    # grad_weights' element: the row in staged_rows' entry i; with token rows, whose weights
    # are in DeepEP's slot positions, entry i is slot i of the row in its entry 0.
    src_tokens = handle.recv_src_tokens.long().clamp(max=plan.max_tokens)
    last_chunk = (src_tokens + plan.config.chunk_tokens - 1) // plan.config.chunk_tokens
    streamed = handle.recv_chunk_start.long().gather(1, last_chunk[:, None])  # [W, 1]
    staged = torch.arange(plan.max_tokens, device=dev)[None, :] < streamed  # [W, T_MAX]
    rows = handle.staged_rows.long()
    if plan.token_rows:
        token_row = rows[:, :, :1]
        slots = torch.arange(handle.topk, device=dev)
        rows = torch.where(token_row >= 0, token_row * handle.topk + slots, -1)
    rows = torch.where(staged[:, :, None] & (rows >= 0), rows, -1)
    # Element -1 (none) reads the zero appended at the end, also when N == 0.
    flat = grad_weights.flatten()
    back = torch.cat([flat, flat.new_zeros(1)])[rows]
    returned = torch.empty_like(back)
    if rt.on_gpu and torch.cuda.is_current_stream_capturing():
        if dist.get_backend(rt.group) != "nccl":  # (gloo waits for the tensor on the host)
            raise RuntimeError(
                "topk_weights' gradient goes back through an all_to_all of the Buffer's group, "
                f"which a {dist.get_backend(rt.group)} group cannot run in a CUDA graph capture: "
                "capture with an NCCL group, or with topk_weights that need no gradient"
            )
    dist.all_to_all_single(returned, back, group=rt.group)  # block d: what rank d looked up
    # Source: slot (t, k) went to rank d as staged token j, entry i = its rank among t's slots
    # on d (the sender packs them in slot order), or with token rows k itself.
    idx = handle.topk_idx.long()
    valid = idx >= 0
    dest = torch.where(valid, idx // plan.experts_per_rank, 0)
    chunk = torch.arange(handle.num_tokens, device=dev) // plan.config.chunk_tokens
    j = handle.send_chunk_start.long()[chunk[:, None], dest] + handle.token_rank_pos.long().gather(
        1, dest
    )
    k = torch.arange(handle.topk, device=dev)
    if plan.token_rows:
        entry = k.expand_as(idx)
    else:
        earlier = dest[:, None, :] == dest[:, :, None]
        earlier &= valid[:, None, :] & (k[None, :] < k[:, None])
        entry = earlier.sum(dim=2)
    grad = returned[dest, j.clamp(min=0), entry.clamp(max=returned.shape[2] - 1)]
    return torch.where(valid & (j >= 0), grad, 0.0)
