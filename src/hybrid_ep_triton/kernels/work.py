"""Work items that dispatch and combine share: a work item's column slices and parts, the queue
of other ranks' items, and the columns of a tile of row numbers."""

import triton
import triton.language as tl


@triton.jit
def slice_width(cols, slices, BLOCK: tl.constexpr):
    """Columns of each of ``slices`` slices of ``cols`` columns, in whole tiles of BLOCK (the
    last slice may be narrower)."""
    return tl.cdiv(tl.cdiv(cols, slices), BLOCK) * BLOCK


@triton.jit
def part_columns(w, part, slice_cols, part_cols, hidden, H_SLICES: tl.constexpr):
    """Columns [first, last) of column part ``part`` of work item ``w`` (empty past its end)."""
    slice_first = (w % H_SLICES) * slice_cols
    first = slice_first + part * part_cols
    return first, tl.minimum(tl.minimum(first + part_cols, slice_first + slice_cols), hidden)


@triton.jit
def remote_entries(recv_src_tokens_ptr, rank, W: tl.constexpr, T_MAX, CHUNK, H_SLICES):
    """Entries of a work queue that takes item w of every other rank, then item w + 1: the work
    items of the largest stream from another rank, times the other ranks (entries past a
    smaller stream's end are skipped)."""
    rounds = 0
    for src in range(0, W):
        # Clamped: a garbage handle must not turn into an endless loop.
        src_tokens = tl.minimum(tl.load(recv_src_tokens_ptr + src), T_MAX)
        src_items = tl.where(src == rank, 0, tl.cdiv(src_tokens, CHUNK) * H_SLICES)
        rounds = tl.maximum(rounds, src_items)
    return rounds * tl.maximum(W - 1, 1)


@triton.jit
def remote_item(index, rank, W: tl.constexpr):
    """(w, source) of the ``index``-th remote entry of such a work queue: item w of every other
    rank, starting at the next one, then item w + 1 (the order senders send them)."""
    sources = tl.maximum(W - 1, 1)
    return index // sources, (rank + 1 + index % sources) % W


@triton.jit
def column(tile, index, i):
    """Column ``i`` of a [M, N] tile of row numbers (entries >= -1), as [M]; -1 where ``index``
    has no ``i``. A register-only select: no memory round trip inside the copy loops."""
    return tl.max(tl.where(index[None, :] == i, tile, -1), axis=1)
