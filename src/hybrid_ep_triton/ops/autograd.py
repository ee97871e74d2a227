"""Autograd for the data-moving steps: each one's backward is the other one along the same handle.

- dispatch (x, topk_weights) -> (recv_x, recv_weights): grad x is the combine of grad recv_x
  (each token sums the gradients of its rows); grad topk_weights[t, k] is grad recv_weights at
  the row that slot (t, k) landed on, sent back to the token's rank.
- combine (y, weights) -> out: grad y is the cached dispatch of grad out times weights; grad
  weights[row] is <y[row], grad out[token of row]> in fp32.
Backward passes reuse the forward's handle (no new layout), work in max_recv_tokens mode, and
are collective like the forward: every rank runs them, in the same order.
"""

import torch
import torch.distributed as dist

from . import Runtime
from .combine import reduce_tokens
from .dispatch import DispatchHandle, move_tokens


def dispatch_tokens(rt: Runtime, x, topk_weights, handle: DispatchHandle):
    """move_tokens, differentiable with respect to x and topk_weights."""
    return _Dispatch.apply(rt, handle, x, topk_weights)


def combine_tokens(rt: Runtime, y, handle: DispatchHandle, weights):
    """reduce_tokens, differentiable with respect to y and weights."""
    return _Combine.apply(rt, handle, y, weights)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rt, handle, x, topk_weights):
        ctx.rt, ctx.handle = rt, handle
        ctx.x_shape = x.shape
        recv_x, recv_weights = move_tokens(rt, x, topk_weights, handle)
        rt.check_status()
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        rt, handle = ctx.rt, ctx.handle
        grad_x = grad_weights = None
        if ctx.needs_input_grad[2]:
            if grad_recv_x is None:  # still a collective: every rank takes part
                grad_recv_x = torch.zeros(handle.num_recv_rows, ctx.x_shape[1], device=rt.device)
            grad_x = reduce_tokens(rt, grad_recv_x.to(rt.plan.dtype).contiguous(), handle, None)
            rt.check_status()
        if ctx.needs_input_grad[3]:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros(handle.num_recv_rows, device=rt.device)
            grad_weights = _slot_gradients(rt, handle, grad_recv_weights.float())
        return None, None, grad_x, grad_weights


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rt, handle, y, weights):
        ctx.rt, ctx.handle = rt, handle
        ctx.save_for_backward(y, weights)
        out = reduce_tokens(rt, y, handle, weights)
        rt.check_status()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rt, handle = ctx.rt, ctx.handle
        y, weights = ctx.saved_tensors
        # Row r of grad_rows is grad_out of the token row r came from (zero on padding).
        grad_rows, _ = move_tokens(rt, grad_out.to(rt.plan.dtype).contiguous(), None, handle)
        rt.check_status()
        grad_y = grad_weights = None
        if ctx.needs_input_grad[2]:
            grad_y = grad_rows if weights is None else grad_rows * weights[:, None].to(y.dtype)
        if ctx.needs_input_grad[3]:
            grad_weights = (y.float() * grad_rows.float()).sum(dim=1)
        return None, None, grad_y, grad_weights


def _slot_gradients(rt: Runtime, handle: DispatchHandle, grad_rows: torch.Tensor) -> torch.Tensor:
    """grad topk_weights [T, K] float32 from grad recv_weights [N]: each receiver looks up the rows
    of its staged tokens' entries, sends them back with one all_to_all, and each source picks the
    entry of every slot."""
    plan, dev = rt.plan, rt.device
    # Receiver: entry (s, j, i) holds the row of the i-th local slot of s's j-th staged token.
    src_tokens = handle.recv_src_tokens.long().clamp(max=plan.max_tokens)
    last_chunk = (src_tokens + plan.config.chunk_tokens - 1) // plan.config.chunk_tokens
    streamed = handle.recv_chunk_start.long().gather(1, last_chunk[:, None])  # [W, 1]
    staged = torch.arange(plan.max_tokens, device=dev)[None, :] < streamed  # [W, T_MAX]
    rows = handle.staged_rows.long()
    rows = torch.where(staged[:, :, None] & (rows >= 0), rows, -1)
    back = torch.where(rows >= 0, grad_rows[rows.clamp(min=0)], 0.0)
    returned = torch.empty_like(back)
    dist.all_to_all_single(returned, back, group=rt.group)  # block d: what rank d looked up
    # Source: slot (t, k) went to rank d as staged token j, entry i = its rank among t's slots
    # on d (the sender packs them in slot order).
    idx = handle.topk_idx.long()
    valid = idx >= 0
    dest = torch.where(valid, idx // plan.experts_per_rank, 0)
    chunk = torch.arange(handle.num_tokens, device=dev) // plan.config.chunk_tokens
    j = handle.send_chunk_start.long()[chunk[:, None], dest] + handle.token_rank_pos.long().gather(
        1, dest
    )
    k = torch.arange(handle.topk, device=dev)
    earlier = (dest[:, None, :] == dest[:, :, None]) & valid[:, None, :] & (k[None, :] < k[:, None])
    entry = earlier.sum(dim=2)
    grad = returned[dest, j.clamp(min=0), entry.clamp(max=plan.meta_stride - 1)]
    return torch.where(valid & (j >= 0), grad, 0.0)
