"""Combine: expert outputs back to their tokens' ranks, summed per token.

The mirror of dispatch, one persistent launch, program p an independent channel:
1. ready flags as in dispatch;
2. expert side: for chunk c = p, p + P, ... of every source's stream it reduces each staged
   row's expert-major rows of ``y`` (times ``weights`` when given) in fp32 into one partial row,
   so a token crosses the link once per rank, not once per expert, and pushes it into the
   source's staging area, then sets the chunk's flag there;
3. token side: for its own chunks c = p, p + P, ... it waits for the flag of chunk c from every
   rank and sums, per token, the partial rows of the ranks it went to, in fp32.
"""

import triton
import triton.language as tl

from .dispatch import column
from .primitives import finish_launch, handshake, region, signal, wait_at_least

STAGE_COMBINE_READY = 4
STAGE_COMBINE_DATA = 5


@triton.jit(noinline=True)
def _reduce_chunk(
    staged_first,
    staged_end,
    dst_first,
    h_first,
    h_last,
    hidden,
    y_ptr,
    y_stride,
    weights_ptr,
    staged_rows_ptr,
    partial_ptr,
    MS: tl.constexpr,
    MS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    COPY_UNROLL: tl.constexpr,
):
    """Reduce columns [h_first, h_last) of the expert-major rows of staged rows
    [staged_first, staged_end) into one fp32 partial row each, stored as rows dst_first... of
    ``partial_ptr`` (the source's staging)."""
    entries = tl.arange(0, MS_P2)
    staged = staged_first + tl.arange(0, CHUNK)
    jmask = staged < staged_end
    rows = tl.load(
        staged_rows_ptr + staged.to(tl.int64)[:, None] * MS + entries[None, :],
        mask=jmask[:, None] & (entries[None, :] < MS),
        other=-1,
    )
    # Rows dropped past max_recv_tokens left holes: loop up to the last kept entry.
    num_copies = tl.max(tl.max(tl.where(rows >= 0, entries[None, :] + 1, 0), axis=1), axis=0)
    dst_rows = (dst_first + tl.arange(0, CHUNK)).to(tl.int64)
    for h0 in range(h_first, h_last, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < h_last
        acc = tl.zeros([CHUNK, BLOCK_H], tl.float32)
        # COPY_UNROLL independent gathers in flight per step, not one at a time.
        for i0 in range(0, num_copies, COPY_UNROLL):
            for u in tl.static_range(COPY_UNROLL):
                row_i = column(rows, entries, i0 + u)
                valid = row_i >= 0
                part = tl.load(
                    y_ptr + row_i.to(tl.int64)[:, None] * y_stride + cols[None, :],
                    mask=valid[:, None] & cmask[None, :],
                    other=0.0,
                ).to(tl.float32)
                if HAS_WEIGHTS:
                    part *= tl.load(weights_ptr + row_i, mask=valid, other=0.0)[:, None]
                acc += part
        ptrs = partial_ptr + dst_rows[:, None] * hidden + cols[None, :]
        tl.store(ptrs, acc.to(partial_ptr.dtype.element_ty), mask=jmask[:, None] & cmask[None, :])


@triton.jit(noinline=True)
def _sum_chunk(
    c,
    h_first,
    h_last,
    num_tokens,
    hidden,
    world_size,
    token_rank_pos_ptr,
    send_chunk_start_ptr,
    partial_ptr,
    out_ptr,
    T_MAX: tl.constexpr,
    W_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Columns [h_first, h_last) of the out rows of chunk ``c``: the sum, in fp32, of each
    token's partial rows from its ranks."""
    ranks = tl.arange(0, W_P2)
    tokens = c * CHUNK + tl.arange(0, CHUNK)
    tmask = tokens < num_tokens
    rmask = tmask[:, None] & (ranks[None, :] < world_size)
    pos = tl.load(
        token_rank_pos_ptr + tokens[:, None] * world_size + ranks[None, :], mask=rmask, other=-1
    )
    starts = tl.load(send_chunk_start_ptr + c * world_size + ranks, mask=ranks < world_size)
    partial_rows = tl.where(pos >= 0, ranks[None, :] * T_MAX + starts[None, :] + pos, -1)
    for h0 in range(h_first, h_last, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < h_last
        acc = tl.zeros([CHUNK, BLOCK_H], tl.float32)
        for q in tl.static_range(W_P2):
            row = column(partial_rows, ranks, q)
            acc += tl.load(
                partial_ptr + row.to(tl.int64)[:, None] * hidden + cols[None, :],
                mask=(row >= 0)[:, None] & cmask[None, :],
                other=0.0,
                cache_modifier=".cg",
            ).to(tl.float32)
        ptrs = out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@triton.jit
def combine_kernel(
    y_ptr,  # [N, H], row stride y_stride
    y_stride,
    weights_ptr,  # [N] float32 (unused unless HAS_WEIGHTS)
    out_ptr,  # out [T, H]
    num_tokens,
    hidden,
    world_size,
    rank,
    token_rank_pos_ptr,  # [T, W] int32
    send_chunk_start_ptr,  # [NC_MAX + 1, W] int32
    recv_chunk_start_ptr,  # [W, NC_MAX + 1] int32
    recv_src_tokens_ptr,  # [W] int32
    staged_rows_ptr,  # [W, T_MAX, MS] int32
    peer_bases_ptr,
    ready_off,
    chunk_flags_off,
    staging_off,
    control_ptr,
    timeout_ns,
    T_MAX: tl.constexpr,
    NC_MAX: tl.constexpr,
    H_SLICES: tl.constexpr,  # column slices per chunk: work items are (chunk, slice)
    P_MAX: tl.constexpr,
    MS: tl.constexpr,
    MS_P2: tl.constexpr,
    W_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    COPY_UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    seq = tl.load(control_ptr) + 1
    status_ptr = control_ptr + 3
    dtype = out_ptr.dtype.element_ty

    stage = 4  # STAGE_COMBINE_READY
    handshake(
        peer_bases_ptr, ready_off, rank, world_size, seq, timeout_ns, status_ptr, stage, P_MAX
    )

    # Work items are (chunk, column slice), numbered as in dispatch.
    slice_cols = tl.cdiv(tl.cdiv(hidden, H_SLICES), BLOCK_H) * BLOCK_H

    # Expert side: one partial row per staged row, pushed back to its source.
    for src in range(0, world_size):
        table = recv_chunk_start_ptr + src * (NC_MAX + 1)
        # Clamped: a garbage handle must not turn into an endless loop.
        src_tokens = tl.minimum(tl.load(recv_src_tokens_ptr + src), T_MAX)
        for w in range(pid, tl.cdiv(src_tokens, CHUNK) * H_SLICES, num_programs):
            start = tl.load(table + w // H_SLICES)
            h_first = (w % H_SLICES) * slice_cols
            _reduce_chunk(
                src * T_MAX + start, src * T_MAX + tl.load(table + w // H_SLICES + 1),
                rank * T_MAX + start, h_first, tl.minimum(h_first + slice_cols, hidden), hidden,
                y_ptr, y_stride, weights_ptr, staged_rows_ptr,
                region(peer_bases_ptr, src, staging_off, dtype), MS, MS_P2, CHUNK, BLOCK_H,
                HAS_WEIGHTS, COPY_UNROLL,
            )  # fmt: skip
            flags = region(peer_bases_ptr, src, chunk_flags_off, tl.int64)
            signal(flags + rank * NC_MAX * H_SLICES + w, seq)

    # Token side: sum the partial rows of every rank a token went to.
    my_flags = region(peer_bases_ptr, rank, chunk_flags_off, tl.int64)
    for w in range(pid, tl.cdiv(num_tokens, CHUNK) * H_SLICES, num_programs):
        for peer in range(0, world_size):
            flag = my_flags + peer * NC_MAX * H_SLICES + w
            wait_at_least(flag, seq, timeout_ns, status_ptr, peer, 5)  # STAGE_COMBINE_DATA
        h_first = (w % H_SLICES) * slice_cols
        _sum_chunk(
            w // H_SLICES, h_first, tl.minimum(h_first + slice_cols, hidden), num_tokens, hidden,
            world_size, token_rank_pos_ptr, send_chunk_start_ptr,
            region(peer_bases_ptr, rank, staging_off, dtype), out_ptr, T_MAX, W_P2, CHUNK, BLOCK_H,
        )  # fmt: skip

    finish_launch(control_ptr, seq, num_programs)
