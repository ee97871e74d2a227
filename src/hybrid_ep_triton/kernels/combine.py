"""Combine: expert outputs back to their tokens' ranks, summed per token.

The mirror of dispatch, three launches, only the transfer bound to the Buffer's SM budget:

``reduce_kernel``, a local grid over all SMs: it reduces each staged row's expert-major rows of
``y`` (times ``weights`` when given) in fp32 into one partial row, so a token crosses the link once
per rank, not once per expert. Partial rows for this rank's own tokens go straight to its own
staging area; the others to the outbox, a local buffer laid out like the staging area.

``return_kernel``, persistent, P programs (``num_sms``); program p is an independent channel:
1. ready flags as in dispatch;
2. for chunk c = p, p + P, ... of every other rank's stream it copies the partial rows from the
   outbox into that rank's staging area and sets the chunk's flag there;
3. it waits for the flags of its own chunks c = p, p + P, ... from every other rank.

``sum_kernel``, a local grid: per token, the sum in fp32 of the partial rows of the ranks it went
to.
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
    [staged_first, staged_end) into one fp32 partial row each, stored as the same rows of
    ``partial_ptr``."""
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
        ptrs = partial_ptr + staged.to(tl.int64)[:, None] * hidden + cols[None, :]
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


@triton.jit(noinline=True)
def _copy_rows(
    src_ptr, dst_ptr, num_rows, h_first, h_last, hidden, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Copy columns [h_first, h_last) of rows [0, num_rows), num_rows <= CHUNK, from ``src_ptr``
    to ``dst_ptr`` (both rows of ``hidden`` elements); the next tile's load is in flight while
    this one is stored."""
    rows = tl.arange(0, CHUNK)
    rmask = rows < num_rows
    offs = rows.to(tl.int64)[:, None] * hidden
    cols = h_first + tl.arange(0, BLOCK_H)
    tile = tl.load(src_ptr + offs + cols[None, :], mask=rmask[:, None] & (cols[None, :] < h_last))
    for h0 in range(h_first, h_last, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        next_cols = cols + BLOCK_H
        next_tile = tl.load(
            src_ptr + offs + next_cols[None, :], mask=rmask[:, None] & (next_cols[None, :] < h_last)
        )
        cmask = cols < h_last
        tl.store(dst_ptr + offs + cols[None, :], tile, mask=rmask[:, None] & cmask[None, :])
        tile = next_tile


@triton.jit
def reduce_kernel(
    y_ptr,  # [N, H], row stride y_stride
    y_stride,
    weights_ptr,  # [N] float32 (unused unless HAS_WEIGHTS)
    outbox_ptr,  # out [W, T_MAX, H]: partial rows for the other ranks
    hidden,
    rank,
    num_slices,  # column slices per chunk: work items are (source, chunk, slice)
    recv_chunk_start_ptr,  # [W, NC_MAX + 1] int32
    recv_src_tokens_ptr,  # [W] int32
    staged_rows_ptr,  # [W, T_MAX, MS] int32
    peer_bases_ptr,
    staging_off,
    W: tl.constexpr,
    T_MAX: tl.constexpr,
    NC_MAX: tl.constexpr,
    MS: tl.constexpr,
    MS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    COPY_UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    staging = region(peer_bases_ptr, rank, staging_off, outbox_ptr.dtype.element_ty)
    slice_cols = tl.cdiv(tl.cdiv(hidden, num_slices), BLOCK_H) * BLOCK_H
    for src in range(0, W):
        table = recv_chunk_start_ptr + src * (NC_MAX + 1)
        # Clamped: a garbage handle must not turn into an endless loop.
        src_tokens = tl.minimum(tl.load(recv_src_tokens_ptr + src), T_MAX)
        for w in range(pid, tl.cdiv(src_tokens, CHUNK) * num_slices, num_programs):
            first = src * T_MAX + tl.load(table + w // num_slices)
            end = src * T_MAX + tl.load(table + w // num_slices + 1)
            h_first = (w % num_slices) * slice_cols
            h_last = tl.minimum(h_first + slice_cols, hidden)
            # The outbox is laid out like the staging area: same row numbers in both.
            if src == rank:
                partial_ptr = staging
            else:
                partial_ptr = outbox_ptr
            _reduce_chunk(
                first, end, h_first, h_last, hidden, y_ptr, y_stride, weights_ptr,
                staged_rows_ptr, partial_ptr, MS, MS_P2, CHUNK, BLOCK_H, HAS_WEIGHTS, COPY_UNROLL,
            )  # fmt: skip


@triton.jit
def return_kernel(
    outbox_ptr,  # [W, T_MAX, H]
    num_tokens,
    hidden,
    world_size,
    rank,
    recv_chunk_start_ptr,  # [W, NC_MAX + 1] int32
    recv_src_tokens_ptr,  # [W] int32
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
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    seq = tl.load(control_ptr) + 1
    status_ptr = control_ptr + 3
    dtype = outbox_ptr.dtype.element_ty

    stage = 4  # STAGE_COMBINE_READY
    handshake(
        peer_bases_ptr, ready_off, rank, world_size, seq, timeout_ns, status_ptr, stage, P_MAX
    )

    # Work items are (chunk, column slice), numbered as in dispatch.
    slice_cols = tl.cdiv(tl.cdiv(hidden, H_SLICES), BLOCK_H) * BLOCK_H
    for src in range(0, world_size):
        table = recv_chunk_start_ptr + src * (NC_MAX + 1)
        # Clamped: a garbage handle must not turn into an endless loop.
        src_tokens = tl.minimum(tl.load(recv_src_tokens_ptr + src), T_MAX)
        src_items = tl.where(src == rank, 0, tl.cdiv(src_tokens, CHUNK) * H_SLICES)
        for w in range(pid, src_items, num_programs):
            start = tl.load(table + w // H_SLICES)
            h_first = (w % H_SLICES) * slice_cols
            _copy_rows(
                outbox_ptr + (src * T_MAX + start).to(tl.int64) * hidden,
                region(peer_bases_ptr, src, staging_off, dtype)
                + (rank * T_MAX + start).to(tl.int64) * hidden,
                tl.load(table + w // H_SLICES + 1) - start, h_first,
                tl.minimum(h_first + slice_cols, hidden), hidden, CHUNK, BLOCK_H,
            )  # fmt: skip
            flags = region(peer_bases_ptr, src, chunk_flags_off, tl.int64)
            signal(flags + rank * NC_MAX * H_SLICES + w, seq)

    # The partial rows of this rank's own chunks have landed before the launch ends.
    my_flags = region(peer_bases_ptr, rank, chunk_flags_off, tl.int64)
    for w in range(pid, tl.cdiv(num_tokens, CHUNK) * H_SLICES, num_programs):
        for peer in range(0, world_size):
            if peer != rank:
                flag = my_flags + peer * NC_MAX * H_SLICES + w
                wait_at_least(flag, seq, timeout_ns, status_ptr, peer, 5)  # STAGE_COMBINE_DATA

    finish_launch(control_ptr, seq, num_programs)


@triton.jit
def sum_kernel(
    out_ptr,  # out [T, H]
    num_tokens,
    hidden,
    world_size,
    rank,
    num_slices,  # column slices per chunk: work items are (chunk, slice)
    token_rank_pos_ptr,  # [T, W] int32
    send_chunk_start_ptr,  # [NC_MAX + 1, W] int32
    peer_bases_ptr,
    staging_off,
    T_MAX: tl.constexpr,
    W_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    staging = region(peer_bases_ptr, rank, staging_off, out_ptr.dtype.element_ty)
    slice_cols = tl.cdiv(tl.cdiv(hidden, num_slices), BLOCK_H) * BLOCK_H
    for w in range(pid, tl.cdiv(num_tokens, CHUNK) * num_slices, num_programs):
        h_first = (w % num_slices) * slice_cols
        _sum_chunk(
            w // num_slices, h_first, tl.minimum(h_first + slice_cols, hidden), num_tokens,
            hidden, world_size, token_rank_pos_ptr, send_chunk_start_ptr, staging, out_ptr, T_MAX,
            W_P2, CHUNK, BLOCK_H,
        )  # fmt: skip
