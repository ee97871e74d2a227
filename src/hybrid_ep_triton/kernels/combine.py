"""Combine: expert outputs back to their tokens' ranks, summed per token.

The mirror of dispatch, one launch in three roles; only the senders are bound to the Buffer's SM
budget, and the three overlap chunk by chunk:

Reducers, programs [0, R), take the other ranks' work items from a queue: each staged row's
expert-major rows of ``y`` (times ``weights`` when given) reduced in fp32 into one partial row,
so a token crosses the link once per rank, not once per expert. Partial rows go to the outbox,
a local buffer laid out like the staging area; each work item raises a local flag when done.

Senders, the next P programs; program p is an independent channel: ready flags as in dispatch,
then for chunk c = p, p + P, ... of every other rank's stream it waits for the reducers, copies
the partial rows from the outbox into that rank's staging area and sets the chunk's flag there.

Finishers, the other programs, take this rank's own chunks from a second queue, twice: first
each token's sum in fp32 of its own expert rows here, rounded into ``out`` as the other ranks
round their partial rows (this needs nothing from a peer, so it overlaps the reduction and the
transfer); then, once a chunk's partial rows from every other rank are in, their sum in fp32
with those own sums, written back to ``out``. Only these light additions are left when the last
partial rows land.

Across nodes (NODES > 1), a sender sends the partial rows of a source on another node to the
rank of that source's local index on its own node (into the staging block of the source's node
and the sender's local index); there the next P programs, network senders, sum in fp32 the
partial rows of each of their node's ranks for every row that rank forwarded in dispatch
(``fwd_rows``), round them into a slot of the network outbox and put the slot into the
source's inbox with a flag: a (token, node) pair crosses the network once. Finishers add those
node sums from the inbox with the partial rows of their own node.

Masked ranks (kernels/peers.py) take no part: handshakes skip them, senders send them nothing
(also along a handle made before they were masked), and finishers add no partial rows from
them: a token's sum is that of its experts on the live ranks. Across nodes, where the rank of a
source's local index on a node (its network sender there) is masked, that node's ranks send
their partial rows to the source themselves (_send_over_network), and its finishers add them
as a node peer's.

Programs wait only for programs that come earlier in the launch order or belong to another rank,
so the launch finishes whichever of its programs run first.

In the code each role is a function, with what it waits for and what it releases in its
docstring: _reduce_role, _send_role, _net_send_role and _finish_role; combine_kernel bundles its
arguments (Rows, CombineHeap, CombineSync, CombineConsts) and _roles picks each program's role.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import (
    DATA_SEQ,
    FIRST_QUEUE,
    SECOND_QUEUE,
    STAGE_COMBINE_DATA,
    STAGE_COMBINE_NET,
    STAGE_COMBINE_READY,
    STATUS,
)
from .peers import await_peer, live, start_channel, wait_landed
from .primitives import (
    SAME_ON_EVERY_RANK,
    finish_launch,
    net_put,
    net_put_rows_signal,
    net_put_signal,
    node_first_rank,
    rail_peer,
    region,
    signal,
    take_work,
    wait_at_least,
)
from .work import column, part_columns, remote_entries, remote_item, slice_width


@triton.jit
def _expert_rows(staged, smask, rows, k):
    """The expert-major rows of y of staged rows ``staged`` [CHUNK] (where ``smask``) as
    [CHUNK, MS_P2] (-1: none), their entry numbers [MS_P2], and how many entries to loop over."""
    entries = tl.arange(0, k.MS_P2)
    expert_rows = tl.load(
        rows.staged_rows_ptr + staged.to(tl.int64)[:, None] * k.MS + entries[None, :],
        mask=smask[:, None] & (entries[None, :] < k.MS),
        other=-1,
    )
    # Rows dropped past max_recv_tokens left holes: loop up to the last kept entry.
    num_copies = tl.max(tl.max(tl.where(expert_rows >= 0, entries[None, :] + 1, 0), axis=1), axis=0)
    return expert_rows, entries, num_copies


@triton.jit
def _gather_expert_rows(acc, expert_rows, entries, num_copies, cols, cmask, rows, k):
    """``acc`` [CHUNK, BLOCK_H] fp32 plus, per row, the sum of its expert rows ``expert_rows``
    of y in columns ``cols`` (times their weights)."""
    # COPY_UNROLL independent gathers in flight per step, not one at a time.
    for i0 in range(0, num_copies, k.COPY_UNROLL):
        for u in tl.static_range(k.COPY_UNROLL):
            row_i = column(expert_rows, entries, i0 + u)
            valid = row_i >= 0
            part = tl.load(
                rows.y_ptr + row_i.to(tl.int64)[:, None] * rows.y_stride + cols[None, :],
                mask=valid[:, None] & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            if k.HAS_WEIGHTS:
                part *= tl.load(rows.weights_ptr + row_i, mask=valid, other=0.0)[:, None]
            acc += part
    return acc


@triton.jit
def _store_expert_sums(dst_ptr, dst_rows, dmask, src_rows, h_first, h_last, rows, k):
    """Columns [h_first, h_last) of rows ``dst_rows`` [CHUNK] of ``dst_ptr`` (where ``dmask``):
    the sum in fp32 of the expert-major rows of y (times their weights) of staged rows
    ``src_rows`` [CHUNK] (-1: none, a zero row), rounded to dst's dtype."""
    expert_rows, entries, num_copies = _expert_rows(src_rows, src_rows >= 0, rows, k)
    for h0 in range(h_first, h_last, k.BLOCK_H):
        cols = h0 + tl.arange(0, k.BLOCK_H)
        cmask = cols < h_last
        acc = tl.zeros([k.CHUNK, k.BLOCK_H], tl.float32)
        acc = _gather_expert_rows(acc, expert_rows, entries, num_copies, cols, cmask, rows, k)
        ptrs = dst_ptr + dst_rows.to(tl.int64)[:, None] * rows.hidden + cols[None, :]
        tl.store(ptrs, acc.to(dst_ptr.dtype.element_ty), mask=dmask[:, None] & cmask[None, :])


@triton.jit
def _slot_weights_of(staged, rows, k):
    """[CHUNK, K_P2] float32: the topk_weights row of each token row whose staged row is
    ``staged`` [CHUNK] (-1: none, zeros): the row of y in its staged_rows entry 0."""
    slots = tl.arange(0, k.K_P2)
    y_row = tl.load(rows.staged_rows_ptr + staged.to(tl.int64) * k.MS, mask=staged >= 0, other=-1)
    return tl.load(
        rows.topk_weights_ptr + y_row.to(tl.int64)[:, None] * rows.topk + slots[None, :],
        mask=(y_row >= 0)[:, None] & (slots[None, :] < rows.topk),
        other=0.0,
    )


@triton.jit
def _slot_rows(base_ptr, rows_, stride, rows, k):
    """Pointers [CHUNK, K_P2] to the slot weights of rows ``rows_`` [CHUNK] (-1: none) of
    float32 rows ``stride`` apart at ``base_ptr``, and their mask."""
    slots = tl.arange(0, k.K_P2)
    ptrs = base_ptr + rows_.to(tl.int64)[:, None] * stride + slots[None, :]
    return ptrs, (rows_ >= 0)[:, None] & (slots[None, :] < rows.topk)


@triton.jit
def _copy_slot_weights(staged_first, num_rows, dst_ptr, rows, k):
    """The topk_weights rows of the token rows of staged rows [staged_first, + num_rows) (at
    most CHUNK) into rows of SW floats at ``dst_ptr``, as their partial rows go."""
    i = tl.arange(0, k.CHUNK)
    staged = tl.where(i < num_rows, staged_first + i, -1)
    ptrs, mask = _slot_rows(dst_ptr, tl.where(i < num_rows, i, -1), k.SW, rows, k)
    tl.store(ptrs, _slot_weights_of(staged, rows, k), mask=mask)


@triton.jit(noinline=True)
def _reduce_chunk(staged_first, staged_end, h_first, h_last, rows, k):
    """Reduce columns [h_first, h_last) of the expert-major rows of staged rows
    [staged_first, staged_end) into one partial row each, stored as the same rows of the
    outbox."""
    staged = staged_first + tl.arange(0, k.CHUNK)
    jmask = staged < staged_end
    src_rows = tl.where(jmask, staged, -1)
    _store_expert_sums(rows.outbox_ptr, staged, jmask, src_rows, h_first, h_last, rows, k)


@triton.jit
def _stream_rows(c, rows, k):
    """Tokens [CHUNK] of chunk ``c`` of this rank, their mask, and the row of each (token,
    rank) [CHUNK, W_P2] in this rank's stream to that rank (own rank) or in the staging block of
    what that rank sent back (other ranks), or -1 where the token has no expert there."""
    ranks = tl.arange(0, k.W_P2)
    tokens = c * k.CHUNK + tl.arange(0, k.CHUNK)
    tmask = tokens < rows.num_tokens
    rmask = tmask[:, None] & (ranks[None, :] < k.W)
    pos = tl.load(
        rows.token_rank_pos_ptr + tokens[:, None] * k.W + ranks[None, :], mask=rmask, other=-1
    )
    starts = tl.load(rows.send_chunk_start_ptr + c * k.W + ranks, mask=ranks < k.W)
    stream_rows = tl.where(pos >= 0, ranks[None, :] * k.T_MAX + starts[None, :] + pos, -1)
    return tokens, tmask, ranks, stream_rows


@triton.jit(noinline=True)
def _sum_own_rows(c, h_first, h_last, rows, k):
    """Columns [h_first, h_last) of the out rows of chunk ``c``: per token, the sum in fp32 of
    its expert rows on this rank (times their weights), rounded to out's dtype like the partial
    rows the other ranks send (0 for a token with no expert here)."""
    tokens, tmask, ranks, stream_rows = _stream_rows(c, rows, k)
    own_rows = column(stream_rows, ranks, rows.rank)
    _store_expert_sums(rows.out_ptr, tokens, tmask, own_rows, h_first, h_last, rows, k)
    if k.SLOT_WEIGHTS:
        if h_first == 0:  # (the part of column 0 also sums the slot weights)
            tokens = tl.where(tmask, tokens, -1)
            ptrs, mask = _slot_rows(rows.combined_weights_ptr, tokens, rows.topk, rows, k)
            tl.store(ptrs, _slot_weights_of(own_rows, rows, k), mask=mask)


@triton.jit(noinline=True)
def _add_partial_rows(
    c, h_first, h_last, node_slots_ptr, slice_first, node_flags_ptr, rows, here, sync, k
):
    """Add, in fp32, the partial rows from the other live ranks of this node (a masked rank's
    did not come) in this rank's staging area and, across nodes, the partial
    sums of every other node (``node_slots_ptr``: this item's NetSlot data from node 0 in the
    inbox, a node's slots apart, whose columns start at ``slice_first``) to columns
    [h_first, h_last) of the out rows of chunk ``c`` that hold the own sums. A node whose sums
    did not come (its flag at ``node_flags_ptr``, a node's flags apart, is down: its network
    sender is masked) sent its ranks' partial rows into the staging area instead. With
    SLOT_WEIGHTS the part of column 0 adds the slot weights that came with them likewise."""
    # A NetSlot of each node's work items after another (the inbox), as elements of out's dtype.
    EBYTES: tl.constexpr = rows.out_ptr.dtype.element_ty.primitive_bitwidth // 8
    NODE_STRIDE: tl.constexpr = k.NC_MAX * k.H_SLICES * k.SLOT_BYTES // EBYTES
    tokens, tmask, ranks, stream_rows = _stream_rows(c, rows, k)
    alive = tl.load(sync.mask_ptr + ranks, mask=ranks < k.W, other=1, volatile=True) == 0
    partial_rows = tl.where((ranks[None, :] != rows.rank) & alive[None, :], stream_rows, -1)
    if k.NODES > 1:  # ranks of other nodes sent theirs through their node, or themselves
        nodes = tl.arange(0, k.N_P2)
        flag_ptrs = node_flags_ptr + nodes * (k.NC_MAX * k.H_SLICES)
        node_flags = tl.load(flag_ptrs, mask=nodes < k.NODES, other=0, volatile=True)
        direct = (node_flags < sync.seq) & (nodes != rows.rank // k.R)
        of_direct_node = (ranks[:, None] // k.R == nodes[None, :]) & direct[None, :]
        near = (ranks // k.R == rows.rank // k.R) | (tl.max(of_direct_node.to(tl.int32), 1) > 0)
        partial_rows = tl.where(near[None, :], partial_rows, -1)
        node_rows = tl.load(
            rows.token_node_pos_ptr + tokens[:, None] * k.NODES + nodes[None, :],
            mask=tmask[:, None] & (nodes[None, :] < k.NODES) & ~direct[None, :],
            other=-1,
        )
    # Tokens without an expert on another rank are final already.
    remote = tmask & (tl.max(partial_rows, axis=1) >= 0)
    if k.NODES > 1:
        remote = remote | (tmask & (tl.max(node_rows, axis=1) >= 0))
    out_rows = rows.out_ptr + tokens.to(tl.int64)[:, None] * rows.hidden
    for h0 in range(h_first, h_last, k.BLOCK_H):
        cols = h0 + tl.arange(0, k.BLOCK_H)
        mask = remote[:, None] & (cols[None, :] < h_last)
        # Another program of this launch wrote the own sums: bypass L1.
        acc = tl.load(out_rows + cols[None, :], mask=mask, cache_modifier=".cg").to(tl.float32)
        for q in tl.static_range(k.W_P2):
            row = column(partial_rows, ranks, q)
            acc += tl.load(
                here.staging + row.to(tl.int64)[:, None] * rows.hidden + cols[None, :],
                mask=(row >= 0)[:, None] & mask,
                other=0.0,
                cache_modifier=".cg",
            ).to(tl.float32)
        if k.NODES > 1:
            for node in tl.static_range(k.NODES):
                row = column(node_rows, nodes, node)
                acc += tl.load(
                    node_slots_ptr
                    + node * NODE_STRIDE
                    + row[:, None] * k.NET_COLS
                    + (cols - slice_first)[None, :],
                    mask=(row >= 0)[:, None] & mask,
                    other=0.0,
                    cache_modifier=".cg",
                ).to(tl.float32)
        tl.store(out_rows + cols[None, :], acc.to(rows.out_ptr.dtype.element_ty), mask=mask)
    if k.SLOT_WEIGHTS:
        if h_first == 0:
            # (a NetSlot's slot weights, where dispatch has its metadata: at the slot's start)
            node_weights = (node_slots_ptr - k.DATA_OFF // EBYTES).to(tl.pointer_type(tl.float32))
            acc_ptrs, acc_mask = _slot_rows(
                rows.combined_weights_ptr, tl.where(remote, tokens, -1), rows.topk, rows, k
            )
            acc = tl.load(acc_ptrs, mask=acc_mask, cache_modifier=".cg")
            for q in tl.static_range(k.W_P2):
                row = column(partial_rows, ranks, q)
                ptrs, mask = _slot_rows(here.slot_weights, row, k.SW, rows, k)
                acc += tl.load(ptrs, mask=mask & acc_mask, other=0.0, cache_modifier=".cg")
            if k.NODES > 1:
                for node in tl.static_range(k.NODES):
                    row = column(node_rows, nodes, node)
                    node_ptr = node_weights + node * (NODE_STRIDE * EBYTES // 4)
                    ptrs, mask = _slot_rows(node_ptr, row, k.SW, rows, k)
                    acc += tl.load(ptrs, mask=mask & acc_mask, other=0.0, cache_modifier=".cg")
            tl.store(acc_ptrs, acc, mask=acc_mask)


@triton.jit(noinline=True)
def _sum_node_partials(
    data_ptr, num_rows, h_first, h_last, first_block, fwd_rows_ptr, flags_ptr, seq, rows, here, k
):
    """The partial sums of this node for ``num_rows`` rows of a network slot: per row, the sum
    in fp32 of node rank r's partial row (staging block ``first_block + r``, at the row
    ``fwd_rows_ptr`` [num_rows, R] recorded when dispatch forwarded it) where it came (its
    flag at ``flags_ptr``, a block's flags apart, reached ``seq``: a masked rank's did not),
    rounded to the staging dtype, into columns [h_first, h_last) of the slot's data at
    ``data_ptr``; with SLOT_WEIGHTS the part of column 0 also sums their slot weights, into
    rows of SW floats at the slot's start (``data_ptr`` - DATA_OFF)."""
    slot_rows = tl.arange(0, k.CHUNK)
    valid = slot_rows < num_rows
    locals_ = tl.arange(0, k.R_P2)
    flags = tl.load(
        flags_ptr + locals_ * (k.NC_MAX * k.H_SLICES), mask=locals_ < k.R, other=0, volatile=True
    )
    stream_rows = tl.load(
        fwd_rows_ptr + slot_rows[:, None] * k.R + locals_[None, :],
        mask=valid[:, None] & (locals_[None, :] < k.R) & (flags[None, :] >= seq),
        other=-1,
    )
    for h0 in range(h_first, h_last, k.BLOCK_H):
        cols = h0 + tl.arange(0, k.BLOCK_H)
        cmask = cols < h_last
        acc = tl.zeros([k.CHUNK, k.BLOCK_H], tl.float32)
        for r in tl.static_range(k.R_P2):
            if r < k.R:
                row = column(stream_rows, locals_, r)
                staged = (first_block + r) * k.T_MAX + row.to(tl.int64)
                acc += tl.load(
                    here.staging + staged[:, None] * rows.hidden + cols[None, :],
                    mask=(row >= 0)[:, None] & cmask[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                ).to(tl.float32)
        ptrs = data_ptr + slot_rows[:, None] * k.NET_COLS + (cols - h_first)[None, :]
        tl.store(ptrs, acc.to(data_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])
    if k.SLOT_WEIGHTS:
        if h_first == 0:
            EBYTES: tl.constexpr = data_ptr.dtype.element_ty.primitive_bitwidth // 8
            weights = (data_ptr - k.DATA_OFF // EBYTES).to(tl.pointer_type(tl.float32))
            acc_ptrs, acc_mask = _slot_rows(weights, tl.where(valid, slot_rows, -1), k.SW, rows, k)
            acc = tl.zeros([k.CHUNK, k.K_P2], tl.float32)
            for r in tl.static_range(k.R_P2):
                if r < k.R:
                    row = column(stream_rows, locals_, r)
                    staged = tl.where(row >= 0, (first_block + r) * k.T_MAX + row, -1)
                    ptrs, mask = _slot_rows(here.slot_weights, staged, k.SW, rows, k)
                    acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(acc_ptrs, acc, mask=acc_mask)


@triton.jit(noinline=True)
def _copy_rows(src_ptr, dst_ptr, num_rows, h_first, h_last, rows, k):
    """Copy columns [h_first, h_last) of rows [0, num_rows), num_rows <= CHUNK, from ``src_ptr``
    to ``dst_ptr`` (both rows of ``hidden`` elements), STAGES tiles' loads in flight (through
    shared memory) while one is stored. Loads bypass L1: other programs of the launch wrote
    ``src_ptr``."""
    chunk_rows = tl.arange(0, k.CHUNK)
    rmask = chunk_rows < num_rows
    offs = chunk_rows.to(tl.int64)[:, None] * rows.hidden
    for h0 in tl.range(h_first, h_last, k.COPY_BLOCK_H, num_stages=k.STAGES):
        cols = h0 + tl.arange(0, k.COPY_BLOCK_H)
        mask = rmask[:, None] & (cols[None, :] < h_last)
        tile = tl.load(src_ptr + offs + cols[None, :], mask=mask, cache_modifier=".cg")
        tl.store(dst_ptr + offs + cols[None, :], tile, mask=mask)


# Each program of a launch has one role (module docstring); a role is a function that takes the
# kernel's arguments in bundles, as in dispatch: namedtuples of runtime values, and ``k``, the
# CombineConsts. The roles are inlined.
Rows = namedtuple(
    "Rows",
    "rank y_ptr y_stride weights_ptr outbox_ptr out_ptr num_tokens hidden token_rank_pos_ptr "
    "send_chunk_start_ptr recv_chunk_start_ptr recv_src_tokens_ptr staged_rows_ptr "
    "token_node_pos_ptr recv_net_chunk_start_ptr fwd_rows_ptr topk_weights_ptr "
    "combined_weights_ptr topk",
)
CombineHeap = namedtuple(
    "CombineHeap",
    "peer_bases_ptr ready_off chunk_flags_off reduced_flags_off staging_off slot_weights_off "
    "net_bases_ptr net_flags_off net_inbox_off net_outbox_off heap_bytes",
)
CombineSync = namedtuple(
    "CombineSync",
    "control_ptr status_ptr seq timeout_ns num_reducers num_senders local_parts rank mask_ptr "
    "bases_ptr net_bases_ptr mask_off",
)
# This rank's regions of the heap and the work items' columns, the same for every role.
Here = namedtuple(
    "Here", "staging my_flags my_ready reduced_flags slice_cols part_cols net_flags slot_weights"
)
CombineConsts = namedtuple(
    "CombineConsts",
    "W T_MAX NC_MAX H_SLICES P_MAX MS MS_P2 W_P2 CHUNK BLOCK_H COPY_BLOCK_H HAS_WEIGHTS "
    "COPY_UNROLL LP_MAX STAGES R R_P2 NODES N_P2 NET_COLS DATA_OFF SLOT_BYTES SLOT_WEIGHTS K_P2 SW",
)


@triton.jit
def _reduce_role(rows, here, sync, k):
    """Reducers (programs [0, R)). Wait for nothing. Take the other ranks' work items from the
    first queue, item w of every other source, then item w + 1, as senders send them, each in
    ``local_parts`` column parts: each staged row's expert-major rows of y (times the weights)
    reduced into one partial row of the outbox, laid out like the staging area (same row
    numbers). Release each part by its flag in reduced_flags, for this rank's senders."""
    items_of_src = k.NC_MAX * k.H_SLICES
    rank = rows.rank
    remote = remote_entries(rows.recv_src_tokens_ptr, rank, k.W, k.T_MAX, k.CHUNK, k.H_SLICES)
    item = take_work(sync.control_ptr + FIRST_QUEUE)
    while item < remote * sync.local_parts:
        part = item % sync.local_parts
        w, src = remote_item(item // sync.local_parts, rank, k.W)
        # Clamped: a garbage handle must not turn into an endless loop.
        src_tokens = tl.minimum(tl.load(rows.recv_src_tokens_ptr + src), k.T_MAX)
        if w < tl.cdiv(src_tokens, k.CHUNK) * k.H_SLICES:
            table = rows.recv_chunk_start_ptr + src * (k.NC_MAX + 1)
            c = w // k.H_SLICES
            h_first, h_last = part_columns(
                w, part, here.slice_cols, here.part_cols, rows.hidden, k.H_SLICES
            )
            _reduce_chunk(
                staged_first=src * k.T_MAX + tl.load(table + c),
                staged_end=src * k.T_MAX + tl.load(table + c + 1),
                h_first=h_first,
                h_last=h_last,
                rows=rows,
                k=k,
            )
            signal(here.reduced_flags + (src * items_of_src + w) * k.LP_MAX + part, sync.seq)
        item = take_work(sync.control_ptr + FIRST_QUEUE)


@triton.jit
def _send_role(sender, node_first, rows, heap, here, sync, k):
    """Sender ``sender`` (< P), an independent channel. Waits for program ``sender`` of every
    peer to have started this launch (handshake), then for each of its work items (chunk
    c = sender, sender + P, ... of every other rank's stream) for this rank's reducers, which
    never wait. Copies the item's partial rows from the outbox into the staging area of the
    stream's source (across nodes, of a source on another node: of the rank of the source's
    local index on this node, into the block of the source's node and this rank's local index)
    and releases the item by its flag there, for that rank's finishers (or network senders)."""
    items_of_src = k.NC_MAX * k.H_SLICES
    rank = rows.rank
    dtype = rows.out_ptr.dtype.element_ty
    start_channel(channel=sender, rank=rank, stage=STAGE_COMBINE_READY, heap=heap, sync=sync, k=k)
    for src in range(0, k.W):
        # The partial rows go to src; across nodes, those of a source on another node go to
        # the rank of src's local index on this node, which sums the node's and puts them
        # (where that rank is masked, straight to src: _send_over_network).
        dst = src
        block = rank
        direct = False
        if k.NODES > 1:
            dst = node_first + src % k.R
            block = rail_peer(src // k.R, rank, k.R)
            direct = (src // k.R != rank // k.R) & ~live(sync, dst)
        table = rows.recv_chunk_start_ptr + src * (k.NC_MAX + 1)
        src_tokens = tl.minimum(tl.load(rows.recv_src_tokens_ptr + src), k.T_MAX)
        # (none to a masked rank: a handle made before it was masked still counts its tokens)
        gone = ~live(sync, dst)
        if k.NODES > 1:
            gone = ~live(sync, src) | (gone & ~direct)
        src_items = tl.where((src == rank) | gone, 0, tl.cdiv(src_tokens, k.CHUNK) * k.H_SLICES)
        for w in range(sender, src_items, sync.num_senders):
            # Reducers of this launch: they never wait, so this rank names itself.
            for part in range(0, sync.local_parts):
                reduced = here.reduced_flags + (src * items_of_src + w) * k.LP_MAX + part
                wait_at_least(
                    reduced, sync.seq, sync.timeout_ns, sync.status_ptr, rank, STAGE_COMBINE_DATA
                )
            start = tl.load(table + w // k.H_SLICES)
            num_rows = tl.load(table + w // k.H_SLICES + 1) - start
            h_first = (w % k.H_SLICES) * here.slice_cols
            if direct:
                _send_over_network(
                    src=src,
                    w=w,
                    start=start,
                    num_rows=num_rows,
                    h_first=h_first,
                    h_last=tl.minimum(h_first + here.slice_cols, rows.hidden),
                    outbox_rows=rows.outbox_ptr
                    + (src * k.T_MAX + start).to(tl.int64) * rows.hidden,
                    rows=rows,
                    heap=heap,
                    sync=sync,
                    k=k,
                )
            else:
                _copy_rows(
                    src_ptr=rows.outbox_ptr + (src * k.T_MAX + start).to(tl.int64) * rows.hidden,
                    dst_ptr=region(heap.peer_bases_ptr, dst, heap.staging_off, dtype)
                    + (block * k.T_MAX + start).to(tl.int64) * rows.hidden,
                    num_rows=num_rows,
                    h_first=h_first,
                    h_last=tl.minimum(h_first + here.slice_cols, rows.hidden),
                    rows=rows,
                    k=k,
                )
                if k.SLOT_WEIGHTS:
                    if h_first == 0:  # the slot weights go with the first slice of the rows
                        weights = region(
                            heap.peer_bases_ptr, dst, heap.slot_weights_off, tl.float32
                        )
                        _copy_slot_weights(
                            staged_first=src * k.T_MAX + start,
                            num_rows=num_rows,
                            dst_ptr=weights + (block * k.T_MAX + start).to(tl.int64) * k.SW,
                            rows=rows,
                            k=k,
                        )
                flags = region(heap.peer_bases_ptr, dst, heap.chunk_flags_off, tl.int64)
                signal(flags + block * items_of_src + w, sync.seq)


@triton.jit
def _send_over_network(src, w, start, num_rows, h_first, h_last, outbox_rows, rows, heap, sync, k):
    """Work item ``w`` of ``src`` (a rank of another node, whose rank of src's local index on
    this node, the aggregator, is masked): its partial rows (``outbox_rows``, ``num_rows`` of
    them from row ``start`` of src's stream here) straight to src over the network, into the
    block of this rank in src's staging area, as a sender of src's node leaves them there,
    through this rank's network outbox slot of the item on its own node (no network sender
    uses it), then the item's flag there, after the rows (net_fence); with SLOT_WEIGHTS the
    first slice's slot weights first, into src's slot_weights, through the slot's start."""
    items_of_src: tl.constexpr = k.NC_MAX * k.H_SLICES
    dtype = rows.out_ptr.dtype.element_ty
    EBYTES: tl.constexpr = dtype.primitive_bitwidth // 8
    rank = rows.rank
    slot_start = heap.net_outbox_off + ((rank // k.R) * items_of_src + w) * k.SLOT_BYTES
    slot = region(heap.peer_bases_ptr, rank, slot_start + k.DATA_OFF, dtype)
    if k.SLOT_WEIGHTS:
        if h_first == 0:  # the slot weights first, through the slot's start
            weights = region(heap.peer_bases_ptr, rank, slot_start, tl.float32)
            _copy_slot_weights(src * k.T_MAX + start, num_rows, weights, rows, k)
            net_put(
                heap.net_bases_ptr,
                rank,
                src,
                heap.slot_weights_off + (rank * k.T_MAX + start).to(tl.int64) * k.SW * 4,
                weights,
                num_rows * k.SW * 4,
                heap.heap_bytes,
            )
    chunk_rows = tl.arange(0, k.CHUNK)
    for h0 in range(h_first, h_last, k.COPY_BLOCK_H):
        cols = h0 + tl.arange(0, k.COPY_BLOCK_H)
        mask = (chunk_rows < num_rows)[:, None] & (cols < h_last)[None, :]
        tile = tl.load(
            outbox_rows + chunk_rows.to(tl.int64)[:, None] * rows.hidden + cols[None, :],
            mask=mask,
            cache_modifier=".cg",
        )
        slot_cols = chunk_rows[:, None] * k.NET_COLS + (cols - h_first)[None, :]
        tl.store(slot + slot_cols, tile, mask=mask)
    first = (rank * k.T_MAX + start).to(tl.int64)
    net_put_rows_signal(
        heap.net_bases_ptr,
        rank,
        src,
        heap.staging_off + (first * rows.hidden + h_first) * EBYTES,
        rows.hidden * EBYTES,
        slot,
        k.NET_COLS * EBYTES,
        num_rows,
        (h_last - h_first) * EBYTES,
        heap.chunk_flags_off + (rank * items_of_src + w) * 8,
        sync.seq,
        heap.heap_bytes,
    )


@triton.jit
def _net_send_role(sender, node_first, rows, heap, here, sync, k):
    """Network sender ``sender`` (across nodes: the P programs after the senders). For each work
    item w = sender, sender + P, ... of the rank of this rank's local index on every other node,
    waits for the partial rows of every rank of this node (their senders' flags here), sums
    them in fp32 for every row that rank forwarded in dispatch, into a slot of the network
    outbox; then waits for that rank to have started this launch (its inbox is free) and puts
    the slot with its flag into its inbox, for its finishers. A (token, node) pair crosses the
    network once."""
    items_of_src = k.NC_MAX * k.H_SLICES
    rank = rows.rank
    dtype = rows.out_ptr.dtype.element_ty
    DATA_ELEM: tl.constexpr = k.DATA_OFF * 8 // dtype.primitive_bitwidth
    my_node = rank // k.R
    for node in range(0, k.NODES):
        if node != my_node:
            src = rail_peer(node, rank, k.R)
            src_tokens = tl.minimum(tl.load(rows.recv_src_tokens_ptr + src), k.T_MAX)
            # (none for a masked src: a handle made before it was masked still counts them)
            src_items = tl.where(live(sync, src), tl.cdiv(src_tokens, k.CHUNK) * k.H_SLICES, 0)
            table = rows.recv_net_chunk_start_ptr + node * (k.NC_MAX + 1)
            for w in range(sender, src_items, sync.num_senders):
                # Every live rank of this node sent its partial rows of the item here.
                for peer in range(node_first, node_first + k.R):
                    block = node * k.R + peer - node_first
                    wait_landed(
                        my_ready=here.my_ready,
                        carrier=peer,
                        rank=rank,
                        channel=w % sync.num_senders,
                        flag_ptr=here.my_flags + block * items_of_src + w,
                        ready_stage=STAGE_COMBINE_READY,
                        data_stage=STAGE_COMBINE_DATA,
                        sync=sync,
                        k=k,
                    )
                c = w // k.H_SLICES
                first = tl.load(table + c)
                num_rows = tl.load(table + c + 1) - first
                h_first = (w % k.H_SLICES) * here.slice_cols
                slot_off = heap.net_outbox_off + (node * items_of_src + w) * k.SLOT_BYTES
                slot = region(heap.peer_bases_ptr, rank, slot_off, dtype)
                h_last = tl.minimum(h_first + here.slice_cols, rows.hidden)
                _sum_node_partials(
                    data_ptr=slot + DATA_ELEM,
                    num_rows=num_rows,
                    h_first=h_first,
                    h_last=h_last,
                    first_block=node * k.R,
                    fwd_rows_ptr=rows.fwd_rows_ptr + (node * k.T_MAX + first) * k.R,
                    flags_ptr=here.my_flags + node * k.R * items_of_src + w,
                    seq=sync.seq,
                    rows=rows,
                    here=here,
                    k=k,
                )
                # src started this launch: its inbox is free (unless it got masked).
                ready = here.my_ready + src * k.P_MAX + sender
                started = await_peer(ready, sync.seq, src, STAGE_COMBINE_READY, sync, k.W, k.NODES)
                there = my_node * items_of_src + w
                # The first slice's slot weights lie before its data (SLOT_WEIGHTS): put both.
                skipped = k.DATA_OFF
                if k.SLOT_WEIGHTS:
                    skipped = tl.where(h_first == 0, 0, k.DATA_OFF)
                if started:
                    net_put_signal(
                        net_bases_ptr=heap.net_bases_ptr,
                        rank=rank,
                        pe=src,
                        dst_off=heap.net_inbox_off + there * k.SLOT_BYTES + skipped,
                        src=(slot + skipped // (dtype.primitive_bitwidth // 8)),
                        nbytes=k.DATA_OFF
                        - skipped
                        + num_rows * (k.NET_COLS * dtype.primitive_bitwidth // 8),
                        flag_off=heap.net_flags_off + there * 8,
                        value=sync.seq,
                        heap_bytes=heap.heap_bytes,
                    )


@triton.jit
def _finish_role(node_first, rows, heap, here, sync, k):
    """Finishers (the other programs). Take this rank's own work items from the second queue,
    each in ``local_parts`` column parts, twice: first each token's sum of its own expert rows
    here, rounded into ``out`` (_sum_own_rows: nothing to wait for, so this overlaps the
    reduction and the transfer), releasing the part by its flag in this rank's block of
    reduced_flags, which the reducers do not use; then, waiting for that flag (a finisher that
    took the item earlier and waits for nothing), for the partial rows of every other rank of
    this node and, across nodes, for every other node's sums in the inbox, their sum with the
    own sums into the same out rows (_add_partial_rows). Only those light additions are left
    when the last partial rows land."""
    items_of_src = k.NC_MAX * k.H_SLICES
    rank = rows.rank
    dtype = rows.out_ptr.dtype.element_ty
    DATA_ELEM: tl.constexpr = k.DATA_OFF * 8 // dtype.primitive_bitwidth
    own_items = tl.cdiv(rows.num_tokens, k.CHUNK) * k.H_SLICES * sync.local_parts
    item = take_work(sync.control_ptr + SECOND_QUEUE)
    while item < own_items * tl.minimum(k.W, 2):
        w = (item % own_items) // sync.local_parts
        part = item % sync.local_parts
        h_first, h_last = part_columns(
            w, part, here.slice_cols, here.part_cols, rows.hidden, k.H_SLICES
        )
        summed = here.reduced_flags + (rank * items_of_src + w) * k.LP_MAX + part
        if item < own_items:
            _sum_own_rows(c=w // k.H_SLICES, h_first=h_first, h_last=h_last, rows=rows, k=k)
            signal(summed, sync.seq)
        else:
            wait_at_least(
                summed, sync.seq, sync.timeout_ns, sync.status_ptr, rank, STAGE_COMBINE_DATA
            )
            _wait_partials(w=w, node_first=node_first, rank=rank, here=here, sync=sync, k=k)
            inbox = region(heap.peer_bases_ptr, rank, heap.net_inbox_off + w * k.SLOT_BYTES, dtype)
            _add_partial_rows(
                c=w // k.H_SLICES,
                h_first=h_first,
                h_last=h_last,
                node_slots_ptr=inbox + DATA_ELEM,
                slice_first=(w % k.H_SLICES) * here.slice_cols,
                node_flags_ptr=here.net_flags + w,
                rows=rows,
                here=here,
                sync=sync,
                k=k,
            )
        item = take_work(sync.control_ptr + SECOND_QUEUE)


@triton.jit
def _wait_partials(w, node_first, rank, here, sync, k):
    """A finisher's wait for own work item ``w``'s partial rows: from every other rank of this
    node (their senders' flags here) and, across nodes, every other node's sums (the flags of
    this rank's inbox, set by the network senders there); not a masked rank's. Where the
    rank of this rank's local index on a node (its network sender) is masked, for the partial
    rows that node's live ranks send here themselves (_send_over_network)."""
    items_of_src = k.NC_MAX * k.H_SLICES
    _wait_node_ranks(w=w, node_first=node_first, rank=rank, here=here, sync=sync, k=k)
    if k.NODES > 1:
        for node in range(0, k.NODES):
            if node * k.R != node_first:
                carrier = rail_peer(node, rank, k.R)
                landed = wait_landed(
                    my_ready=here.my_ready,
                    carrier=carrier,
                    rank=rank,
                    channel=w % sync.num_senders,
                    flag_ptr=here.net_flags + node * items_of_src + w,
                    ready_stage=STAGE_COMBINE_READY,
                    data_stage=STAGE_COMBINE_NET,
                    sync=sync,
                    k=k,
                )
                if ~landed & ~live(sync, carrier):
                    _wait_node_ranks(
                        w=w, node_first=node * k.R, rank=rank, here=here, sync=sync, k=k
                    )


@triton.jit
def _wait_node_ranks(w, node_first, rank, here, sync, k):
    """Wait for the partial rows of work item ``w`` that the ranks of the node starting at
    ``node_first`` (this rank excepted) put into this rank's staging themselves."""
    for peer in range(node_first, node_first + k.R):
        if peer != rank:
            wait_landed(
                my_ready=here.my_ready,
                carrier=peer,
                rank=rank,
                channel=w % sync.num_senders,
                flag_ptr=here.my_flags + peer * (k.NC_MAX * k.H_SLICES) + w,
                ready_stage=STAGE_COMBINE_READY,
                data_stage=STAGE_COMBINE_DATA,
                sync=sync,
                k=k,
            )


@triton.jit
def _roles(pid, rows, heap, sync, k):
    """Program ``pid``'s role: reducer, sender, network sender (across nodes) or finisher."""
    dtype = rows.out_ptr.dtype.element_ty
    staging = region(heap.peer_bases_ptr, rows.rank, heap.staging_off, dtype)
    my_flags = region(heap.peer_bases_ptr, rows.rank, heap.chunk_flags_off, tl.int64)
    my_ready = region(heap.peer_bases_ptr, rows.rank, heap.ready_off, tl.int64)
    reduced_flags = region(heap.peer_bases_ptr, rows.rank, heap.reduced_flags_off, tl.int64)
    # Work item w of a stream = (chunk c, column slice s) of its source's tokens, as in dispatch.
    slice_cols = slice_width(rows.hidden, k.H_SLICES, k.BLOCK_H)
    # Reducers and finishers split each item into column parts, so that the first items to be
    # sent and the last to land are each worked on by several programs at once. (Written out:
    # through slice_width, the EP2 combine compiles to other sm_90 code.)
    part_cols = tl.cdiv(tl.cdiv(slice_cols, sync.local_parts), k.BLOCK_H) * k.BLOCK_H
    node_first = node_first_rank(rows.rank, k.R, k.NODES)
    net_flags = region(heap.peer_bases_ptr, rows.rank, heap.net_flags_off, tl.int64)
    slot_weights = region(heap.peer_bases_ptr, rows.rank, heap.slot_weights_off, tl.float32)
    here = Here(
        staging, my_flags, my_ready, reduced_flags, slice_cols, part_cols, net_flags, slot_weights
    )
    # Across nodes the P programs after the senders sum this node's partial rows of the tokens of
    # the ranks of this rank's local index on other nodes and put them there.
    is_net_sender = False
    if k.NODES > 1:
        first_net_sender = sync.num_reducers + sync.num_senders
        is_net_sender = (pid >= first_net_sender) & (pid < first_net_sender + sync.num_senders)
    if pid < sync.num_reducers:
        _reduce_role(rows=rows, here=here, sync=sync, k=k)
    elif pid < sync.num_reducers + sync.num_senders:
        _send_role(
            sender=pid - sync.num_reducers,
            node_first=node_first,
            rows=rows,
            heap=heap,
            here=here,
            sync=sync,
            k=k,
        )
    elif is_net_sender:
        _net_send_role(
            sender=pid - sync.num_reducers - sync.num_senders,
            node_first=node_first,
            rows=rows,
            heap=heap,
            here=here,
            sync=sync,
            k=k,
        )
    else:
        _finish_role(node_first=node_first, rows=rows, heap=heap, here=here, sync=sync, k=k)


@triton.jit(do_not_specialize=SAME_ON_EVERY_RANK)
def combine_kernel(
    # Rows: the expert outputs, their weights, the outbox, the summed rows
    y_ptr,  # [N, H], row stride y_stride
    y_stride,
    weights_ptr,  # [N] float32 (unused unless HAS_WEIGHTS)
    outbox_ptr,  # [W, T_MAX, H]: partial rows for the other ranks
    out_ptr,  # out [T, H]
    num_tokens,
    hidden,
    rank,
    # The split of the launch into roles (the programs after these finish this rank's tokens)
    num_reducers,  # programs [0, num_reducers) reduce
    num_senders,  # P: the next P programs send (across nodes, the P after them over the network)
    local_parts,  # column parts of a work item for reducers and finishers (<= LP_MAX)
    # Layout: the dispatch handle's tables
    token_rank_pos_ptr,  # [T, W] int32
    send_chunk_start_ptr,  # [NC_MAX + 1, W] int32
    recv_chunk_start_ptr,  # [W, NC_MAX + 1] int32
    recv_src_tokens_ptr,  # [W] int32
    staged_rows_ptr,  # [W, T_MAX, MS] int32
    # Slot weights (SLOT_WEIGHTS, token rows): each row's values summed back per token and slot
    topk_weights_ptr,  # [N, K] float32
    combined_weights_ptr,  # out [T, K] float32
    topk,  # K
    # Heap: peers' bases and the regions' offsets in the symmetric heap
    peer_bases_ptr,
    ready_off,
    chunk_flags_off,
    reduced_flags_off,
    staging_off,
    slot_weights_off,  # [W, T_MAX, SW] float32: the slot weights that came with partial rows
    # Sync: the control block, the bound of every wait, the mask (kernels/peers.py)
    control_ptr,
    timeout_ns,
    mask_off,
    # Across nodes: layout tables, the forwarded rows, network heap regions
    token_node_pos_ptr,  # [T, N] int32
    recv_net_chunk_start_ptr,  # [N, NC_MAX + 1] int32
    fwd_rows_ptr,  # [N, T_MAX, R] int32
    net_bases_ptr,
    net_flags_off,
    net_inbox_off,
    net_outbox_off,
    heap_bytes,
    # Meta-parameters (the glossary in kernels/__init__.py)
    W: tl.constexpr,
    T_MAX: tl.constexpr,
    NC_MAX: tl.constexpr,
    H_SLICES: tl.constexpr,  # column slices per chunk: work items are (chunk, slice)
    P_MAX: tl.constexpr,
    MS: tl.constexpr,
    MS_P2: tl.constexpr,
    W_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COPY_BLOCK_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    COPY_UNROLL: tl.constexpr,
    LP_MAX: tl.constexpr,
    STAGES: tl.constexpr,  # tile loads in flight in the senders' copies
    R: tl.constexpr,  # ranks per node
    R_P2: tl.constexpr,
    NODES: tl.constexpr,
    N_P2: tl.constexpr,
    NET_COLS: tl.constexpr,  # the NetSlot's shape (see the planner)
    DATA_OFF: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    SLOT_WEIGHTS: tl.constexpr,  # token rows: sum topk_weights back too (combined_weights)
    K_P2: tl.constexpr,
    SW: tl.constexpr,  # floats of a row of slot weights in the heap and in a NetSlot
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    seq = tl.load(control_ptr + DATA_SEQ) + 1
    status_ptr = control_ptr + STATUS
    # The arguments in bundles for the roles, in the order of their fields (a group a line).
    rows = Rows(
        *(rank, y_ptr, y_stride, weights_ptr, outbox_ptr, out_ptr, num_tokens, hidden),
        *(token_rank_pos_ptr, send_chunk_start_ptr, recv_chunk_start_ptr, recv_src_tokens_ptr),
        *(staged_rows_ptr, token_node_pos_ptr, recv_net_chunk_start_ptr, fwd_rows_ptr),
        *(topk_weights_ptr, combined_weights_ptr, topk),
    )
    heap = CombineHeap(
        *(peer_bases_ptr, ready_off, chunk_flags_off, reduced_flags_off, staging_off),
        *(slot_weights_off, net_bases_ptr, net_flags_off, net_inbox_off, net_outbox_off),
        heap_bytes,
    )
    sync = CombineSync(
        *(control_ptr, status_ptr, seq, timeout_ns, num_reducers, num_senders, local_parts),
        *(rank, region(peer_bases_ptr, rank, mask_off, tl.int64), peer_bases_ptr, net_bases_ptr),
        mask_off,
    )
    k: tl.constexpr = CombineConsts(
        *(W, T_MAX, NC_MAX, H_SLICES, P_MAX, MS, MS_P2, W_P2, CHUNK, BLOCK_H, COPY_BLOCK_H),
        *(HAS_WEIGHTS, COPY_UNROLL, LP_MAX, STAGES, R, R_P2, NODES, N_P2, NET_COLS, DATA_OFF),
        *(SLOT_BYTES, SLOT_WEIGHTS, K_P2, SW),
    )
    _roles(pid=pid, rows=rows, heap=heap, sync=sync, k=k)
    finish_launch(control_ptr, seq, num_programs)
