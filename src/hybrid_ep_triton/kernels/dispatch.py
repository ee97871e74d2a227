"""Dispatch: tokens to the ranks that hold their experts, expanded there into expert-major rows.

One launch after the layout, in two roles, so that only the transfer is bound to the Buffer's SM
budget and the expansion overlaps it:

Senders, the first P programs (the Buffer's SM budget's worth of warps); program p is an
independent channel:
1. it raises its ready flag on every peer (its rank's previous launch has finished with the
   staging area) and waits for program p of every peer to have done the same;
2. for its token chunks c = p, p + P, ... it pushes each token row once to every *other* rank
   that holds one of its experts, into that rank's staging area (stream of this source, row j),
   with the destination rows and weights of the token's slots there, then sets the chunk's flag.
Senders never wait for a program of their own launch.

Across nodes (NODES > 1: nodes of R consecutive ranks), senders push each row over NVLink only
to the other ranks of their node; for every other node that holds one of a chunk's experts they
write the chunk's rows to that node into a slot of their outbox in the symmetric heap (rows in
order, each with its row in this rank's stream to every rank of that node and what a direct
send would record there) and put the slot, with a flag, into the inbox of the rank with their
own local index on that node: each token crosses the network at most once per node. There the
next P programs, forwarders (forwarder f takes work items w = f, f + P, ... of each other
node's rank of its local index), wait for the slot's flag and copy each row into the staging
area of every rank of their node that needs it (block of the source rank, the row of its stream
to that rank), with its metadata, then raise that item's flag there: the staging areas end up as
a direct send would have left them, so expanders are the same for either path.

Expanders, the other programs (the rest of the GPU: the expansion is bound by local memory, not
by the link), take work items from a queue of two kinds, spread evenly among each other: this
rank's own tokens, copied straight from ``x`` to their expert-major rows (own tokens never go
through the staging area), and every other rank's chunks, each as soon as its flag is up, from
the staging area; then they zero the padding rows and the rows past the valid count. Expanders
wait only for senders, which come first in the launch order.

Masked ranks (kernels/peers.py) take no part: handshakes and chunk flags skip them, senders
send them nothing (also along a handle made before they were masked), and an expander whose
item's carrier is masked expands nothing; a cached dispatch zeroes that item's rows instead
(_zero_lost_chunk), as the handle records them. Across nodes, a sender whose forwarder on a
node is masked sends to that node's live ranks itself, over the network (_send_to_node_ranks),
and a forwarder releases the items of a masked source with nothing in them (_wait_staged).

Quantizing (QUANTIZE: rows of the Buffer's dtype in, block-scaled rows out: FP8, MXFP8 or
NVFP4), the first programs come before the senders: quantizers take work items (chunk,
QUANT_GROUPS channel groups) of ``source`` from a queue, quantize them (kernels/quantize.py)
into x / x_scales, and raise the item's flag; senders and the expansion of own rows wait for
the flags of a chunk before they read it, so the transfers start with the first chunks
quantized and only the quantized bytes cross the links. Quantizers wait for nothing and come
first in the launch order, so that every wait is for programs that started earlier (the launch
is then more than one wave of programs: the GPU starts them in order as others finish; on CPU
ranks, where they run one after the other, the quantizers are done before any sender starts).

Block-scaled rows (SCALE_WORDS > 0) are moved bit for bit as int32 words: a staged row is its
values (data_cols words) then its scales (SCALE_WORDS words), padded to ``hidden`` words; only
the copies from x and into recv_x see two parts (row_part, out_part).

In the code each role is a function, with what it waits for and what it releases in its
docstring: _quantize_role, _send_role (its network part _send_to_nodes), _forward_role and
_expand_role; dispatch_kernel bundles its arguments (Tokens, Layout, Outputs, Heap, Sync,
DispatchConsts) and _roles picks each program's role. All of them are inlined.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import (
    DATA_SEQ,
    FIRST_QUEUE,
    HOST_RECORD,
    HOST_RECORD_SEQ,
    INFO_ROWS,
    INFO_SOURCE,
    LOCAL_ID_MASK,
    NET_ROWS,
    SECOND_QUEUE,
    SLOT_SHIFT,
    STAGE_DISPATCH_DATA,
    STAGE_DISPATCH_NET,
    STAGE_DISPATCH_OUTPUTS,
    STAGE_DISPATCH_QUANTIZED,
    STAGE_DISPATCH_READY,
    STATUS,
)
from .peers import await_peer, live, start_channel, tell_mask, wait_landed
from .primitives import (
    ALIGNMENT,
    HOST_RECORD_VALUES,
    SAME_ON_EVERY_RANK,
    UNSPECIALISED,
    finish_launch,
    host_pointer,
    interleaved,
    net_put,
    net_put_rows_signal,
    net_put_signal,
    node_first_rank,
    rail_peer,
    read_uniform,
    record_word,
    region,
    signal,
    take_work,
    wait_at_least,
    wait_host_record,
)
from .quantize import (
    QUANTIZE_FP8,
    QUANTIZE_MXFP8,
    quantize_block,
    quantize_mxfp8_block,
    quantize_nvfp4_block,
)
from .work import column, part_columns, remote_entries, remote_item, slice_width

QUANT_GROUPS = tl.constexpr(8)  # 128-channel groups of a quantizer's work item


@triton.jit
def _store_tile(out_ptr, rows, cols, cmask, tile, hidden):
    """Store ``tile`` [M, BLOCK_H] into columns ``cols`` of output rows ``rows`` [M] (-1: none)
    of ``hidden`` columns."""
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(ptrs, tile, mask=(rows >= 0)[:, None] & cmask[None, :])


# A staged row is one run of columns; where it comes from and goes to may be two: an FP8 row's
# values (part 0) and its scales (part 1), the last SCALE_WORDS of its columns. Each copy loops
# over the parts of its columns, so that every tile has one source and one destination.
@triton.jit
def row_part(
    x_rows, scale_rows, part: tl.constexpr, first, last, data_cols, SCALE_WORDS: tl.constexpr
):
    """The rows' source of part ``part`` of columns [first, last) (``x_rows``, ``scale_rows``
    [M, 1]: pointers to the rows' first value, first scale), as pointers that column c is
    added to, and that part's columns [lo, hi). Columns past the scales (a staged FP8 row's
    padding to 16 words, for aligned rows) are in neither."""
    # One return after a compile-time branch: Triton checks that all returns have one type.
    if part == 0:
        src, lo, hi = x_rows, first, tl.minimum(last, data_cols)
    else:
        src = scale_rows - data_cols
        lo, hi = tl.maximum(first, data_cols), tl.minimum(last, data_cols + SCALE_WORDS)
    return src, lo, hi


@triton.jit
def out_part(out_ptr, out_scales_ptr, part: tl.constexpr, data_cols, SCALE_WORDS: tl.constexpr):
    """The output of part ``part``: (base, row stride, column of its first element)."""
    if part == 0:
        dst, stride, offset = out_ptr, data_cols, 0
    else:
        dst, stride, offset = out_scales_ptr, SCALE_WORDS, data_cols
    return dst, stride, offset


@triton.jit(noinline=True)
def _zero_rows(out, first, last, tok, k):
    """Zero rows [first, last) of the output (FP8 rows: values and scales) and, where they are
    per row (not with TOKEN_ROWS), their weights."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    ROW_WEIGHTS: tl.constexpr = False if k.TOKEN_ROWS else k.HAS_WEIGHTS  # recv_weights is [N]
    x, data_cols = out.recv_x_ptr, tok.data_cols
    for r0 in range(first, last, k.CHUNK):
        rows = r0 + tl.arange(0, k.CHUNK)
        rmask = rows < last
        if ROW_WEIGHTS:
            tl.store(out.recv_weights_ptr + rows, tl.zeros([k.CHUNK], tl.float32), mask=rmask)
        zeros = tl.zeros([k.CHUNK, k.BLOCK_H], x.dtype.element_ty)
        for part in tl.static_range(PARTS):
            _, lo, hi = row_part(x, x, part, 0, data_cols + k.SCALE_WORDS, data_cols, k.SCALE_WORDS)
            dst, stride, offset = out_part(x, out.recv_scales_ptr, part, data_cols, k.SCALE_WORDS)
            for h0 in range(lo, hi, k.BLOCK_H):
                cols = h0 + tl.arange(0, k.BLOCK_H)
                _store_tile(dst, tl.where(rmask, rows, -1), cols - offset, cols < hi, zeros, stride)


@triton.jit
def _clear_slots(first, last, tok, out, k):
    """No slots for token rows [first, last) (at most CHUNK): expert id -1 and source index -1
    (if WRITE_ROWS), weight 0."""
    rows = first + tl.arange(0, k.CHUNK)
    rows = tl.where(rows < last, rows, -1)
    no_slots = tl.zeros([k.CHUNK, k.K_P2], tl.int1)
    no_source = tl.full([k.CHUNK], -1, tl.int32)
    _store_token_slots(rows, no_slots, no_slots.to(tl.int32), 0.0, no_source, tok, out, k)


@triton.jit
def _store_token_slots(token_row, mine, local_ids, weights, src_idx, tok, out, k):
    """Token rows ``token_row`` [CHUNK] (-1: none) get DeepEP's slot positions: slot k's local
    expert id where ``mine`` [CHUNK, K_P2] (else -1) and its weight (else 0), and (if
    WRITE_ROWS) the source token's index ``src_idx`` [CHUNK]."""
    slots = tl.arange(0, k.K_P2)
    offs = token_row.to(tl.int64)[:, None] * tok.topk + slots[None, :]
    mask = (token_row >= 0)[:, None] & (slots[None, :] < tok.topk)
    if k.WRITE_ROWS:
        ids = tl.where(mine, local_ids, -1).to(out.recv_topk_idx_ptr.dtype.element_ty)
        tl.store(out.recv_topk_idx_ptr + offs, ids, mask=mask)
        tl.store(out.recv_src_idx_ptr + token_row, src_idx, mask=token_row >= 0)
    if k.HAS_WEIGHTS:
        tl.store(out.recv_weights_ptr + offs, tl.where(mine, weights, 0.0), mask=mask)


@triton.jit
def _chunk_slots(c, tok, lay, k):
    """The slots of chunk ``c`` of this rank's tokens: tokens [CHUNK] and their mask, slot
    offsets [CHUNK, K_P2] into topk_idx, each slot's destination rank (-1 for an unused slot),
    and what the destination records of the slot: the expert-major row it lands on there, or
    with TOKEN_ROWS its local expert id there."""
    slots = tl.arange(0, k.K_P2)
    tokens = c * k.CHUNK + tl.arange(0, k.CHUNK)
    tmask = tokens < tok.num_tokens
    slot_offs = tokens[:, None] * tok.topk + slots[None, :]
    ids = tl.load(
        tok.topk_idx_ptr + slot_offs, mask=tmask[:, None] & (slots[None, :] < tok.topk), other=-1
    ).to(tl.int32)
    used = ids >= 0
    dest = tl.where(used, ids // tok.experts_per_rank, -1)
    if k.TOKEN_ROWS:
        return tokens, tmask, slot_offs, dest, ids % tok.experts_per_rank
    # Row 0 of chunk_expert_base: the expert's base row; row c + 1: the chunk's offset in it.
    out_row = tl.load(lay.chunk_expert_base_ptr + ids, mask=used, other=0)
    out_row += tl.load(
        lay.chunk_expert_base_ptr + (c + 1) * tok.num_experts + ids, mask=used, other=0
    )
    out_row += tl.load(lay.slot_pos_ptr + slot_offs, mask=used, other=0)
    return tokens, tmask, slot_offs, dest, out_row


@triton.jit
def _store_packed(
    entries_ptr, sel, values, any_sel, num_entries, fill, MS_P2: tl.constexpr, CHUNK: tl.constexpr
):
    """Store ``values`` [CHUNK, K_P2] of the selected slots of each token into its
    ``num_entries`` (<= MS_P2) entries at ``entries_ptr`` [CHUNK] (pointer to entry 0), packed
    in slot order, and ``fill`` in the entries after them for the tokens with ``any_sel``.
    Returns each slot's entry."""
    entries = tl.arange(0, MS_P2)
    sel_i = sel.to(tl.int32)
    entry = tl.cumsum(sel_i, axis=1) - sel_i
    tl.store(entries_ptr[:, None] + entry, values, mask=sel)
    unused = (entries[None, :] >= tl.sum(sel_i, axis=1)[:, None]) & (entries[None, :] < num_entries)
    tl.store(
        entries_ptr[:, None] + entries[None, :],
        tl.full([CHUNK, MS_P2], fill, values.dtype),
        mask=any_sel[:, None] & unused,
    )
    return entry


@triton.jit
def _store_entries(entries_ptr, sel, recorded, sent, tokens, k):
    """A destination's metadata of each token of a chunk, at ``entries_ptr`` [CHUNK] (its entry
    0), for the tokens ``sent`` there: what it records of the slots ``sel`` [CHUNK, K_P2]
    (``recorded``), packed in slot order, then -1; with TOKEN_ROWS each local id with its slot
    (``SLOT_SHIFT``), so that the receiver puts it back in DeepEP's slot position, and the
    token's index ``tokens`` after the slots' entries. Returns each slot's entry."""
    SLOTS: tl.constexpr = k.MS - 1 if k.TOKEN_ROWS else k.MS
    values = recorded
    if k.TOKEN_ROWS:
        values = (tl.arange(0, k.K_P2)[None, :] << SLOT_SHIFT) | recorded
        tl.store(entries_ptr + SLOTS, tokens, mask=sent)
    return _store_packed(entries_ptr, sel, values, sent, SLOTS, -1, k.MS_P2, k.CHUNK)


@triton.jit
def token_rows_first(recv_chunk_start_ptr, recv_src_tokens_ptr, src, T_MAX, NC_MAX, CHUNK):
    """First row of source ``src``'s tokens in a token-major output: the rows of every source
    before it (each source's stream, in source order)."""
    first = 0
    for s in range(0, src):
        chunks = tl.cdiv(tl.minimum(tl.load(recv_src_tokens_ptr + s), T_MAX), CHUNK)
        first += tl.load(recv_chunk_start_ptr + s * (NC_MAX + 1) + chunks)
    return first


@triton.jit(noinline=True)
def _send_chunk(c, h_first, h_last, node_first, tok, lay, heap, sync, k):
    """Push columns [h_first, h_last) of chunk ``c`` of this rank's tokens to every other live
    rank of this node (the R ranks from ``node_first``) that holds one of their experts (a
    handle made before a rank was masked still counts it): each row once per
    rank, with the expert-major rows (or with TOKEN_ROWS the local expert ids) and weights of its
    slots there (every column slice writes these, so the receiver of a slice needs no other)."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    dtype = tok.x_ptr.dtype.element_ty
    locals_ = tl.arange(0, k.R_P2)
    ranks = node_first + locals_
    tokens, tmask, slot_offs, dest, recorded = _chunk_slots(c, tok, lay, k)
    x_rows = tok.x_ptr + tokens.to(tl.int64)[:, None] * tok.x_stride
    scale_rows = tok.x_scales_ptr + tokens.to(tl.int64)[:, None] * tok.x_scales_stride
    if k.HAS_WEIGHTS:
        weight = tl.load(tok.topk_weights_ptr + slot_offs, mask=dest >= 0, other=0.0)
    # Row of each (token, other destination) in that destination's staging area, or -1.
    alive = tl.load(sync.mask_ptr + ranks, mask=locals_ < k.R, other=1, volatile=True) == 0
    rmask = tmask[:, None] & alive[None, :] & (ranks[None, :] != tok.rank)
    pos = tl.load(
        lay.token_rank_pos_ptr + tokens[:, None] * k.W + ranks[None, :], mask=rmask, other=-1
    )
    starts = tl.load(lay.send_chunk_start_ptr + c * k.W + ranks, mask=locals_ < k.R)
    stream_rows = tl.where(pos >= 0, tok.rank * k.T_MAX + starts[None, :] + pos, -1)
    for r in tl.static_range(k.R_P2):
        if r < k.R:
            q = node_first + r
            row = column(stream_rows, locals_, r)
            sel = (dest == q) & (row >= 0)[:, None]
            meta = row.to(tl.int64) * k.MS
            meta_rows = region(heap.peer_bases_ptr, q, heap.meta_rows_off, tl.int32) + meta
            entry = _store_entries(meta_rows, sel, recorded, row >= 0, tokens, k)
            if k.HAS_WEIGHTS:
                meta_weights = region(heap.peer_bases_ptr, q, heap.meta_weights_off, tl.float32)
                tl.store((meta_weights + meta)[:, None] + entry, weight, mask=sel)
    for part in tl.static_range(PARTS):
        src, lo, hi = row_part(
            x_rows, scale_rows, part, h_first, h_last, tok.data_cols, k.SCALE_WORDS
        )
        # STAGES tiles' loads in flight (through shared memory) while one is stored.
        for h0 in tl.range(lo, hi, k.BLOCK_H, num_stages=k.STAGES):
            cols = h0 + tl.arange(0, k.BLOCK_H)
            cmask = cols < hi
            tile = tl.load(src + cols[None, :], mask=tmask[:, None] & cmask[None, :])
            for r in tl.static_range(k.R_P2):
                if r < k.R:
                    row = column(stream_rows, locals_, r)
                    staging = region(heap.peer_bases_ptr, node_first + r, heap.staging_off, dtype)
                    ptrs = staging + row.to(tl.int64)[:, None] * tok.hidden + cols[None, :]
                    tl.store(ptrs, tile, mask=(row >= 0)[:, None] & cmask[None, :])


@triton.jit
def _pack_rows(data, row, tokens, h_first, h_last, tok, k):
    """Columns [h_first, h_last) of the rows of ``tokens`` [CHUNK] (values, then scales) into
    rows ``row`` [CHUNK] (-1: none) of a network slot's ``data``, NET_COLS apart."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    x_rows = tok.x_ptr + tokens.to(tl.int64)[:, None] * tok.x_stride
    scale_rows = tok.x_scales_ptr + tokens.to(tl.int64)[:, None] * tok.x_scales_stride
    for part in tl.static_range(PARTS):
        src, lo, hi = row_part(
            x_rows, scale_rows, part, h_first, h_last, tok.data_cols, k.SCALE_WORDS
        )
        for h0 in tl.range(lo, hi, k.BLOCK_H, num_stages=k.STAGES):
            cols = h0 + tl.arange(0, k.BLOCK_H)
            mask = (row >= 0)[:, None] & (cols < hi)[None, :]
            tile = tl.load(src + cols[None, :], mask=mask)
            tl.store(data + row[:, None] * k.NET_COLS + (cols - h_first)[None, :], tile, mask=mask)


@triton.jit(noinline=True)
def _pack_node_slot(c, node, h_first, h_last, num_rows, slot_ptr, tok, lay, k):
    """Write columns [h_first, h_last) of the tokens of chunk ``c`` that go to node ``node`` into
    the network slot at ``slot_ptr`` (a NetSlot, see the planner): row i is the chunk's i-th
    token to that node (``num_rows`` of them), with, per rank r of that node, the token's row in
    this rank's stream to r and what a direct send would record there. Rows past num_rows get
    no destination, so that what an earlier call left there is never forwarded."""
    locals_ = tl.arange(0, k.R_P2)
    ranks = node * k.R + locals_
    tokens, tmask, slot_offs, dest, recorded = _chunk_slots(c, tok, lay, k)
    row = tl.load(lay.token_node_pos_ptr + tokens * k.NODES + node, mask=tmask, other=-1)
    sent = row >= 0
    meta = slot_ptr.to(tl.pointer_type(tl.int32))
    weights = (slot_ptr + k.CHUNK * k.META_INTS * 4).to(tl.pointer_type(tl.float32))
    if k.HAS_WEIGHTS:
        weight = tl.load(tok.topk_weights_ptr + slot_offs, mask=dest >= 0, other=0.0)
    rmask = sent[:, None] & (locals_[None, :] < k.R)
    pos = tl.load(
        lay.token_rank_pos_ptr + tokens[:, None] * k.W + ranks[None, :], mask=rmask, other=-1
    )
    starts = tl.load(lay.send_chunk_start_ptr + c * k.W + ranks, mask=locals_ < k.R)
    stream_rows = tl.where(pos >= 0, starts[None, :] + pos, -1)
    for r in tl.static_range(k.R_P2):
        if r < k.R:
            row_meta = meta + row * k.META_INTS + r * (1 + k.MS)
            tl.store(row_meta, column(stream_rows, locals_, r), mask=sent)
            sel = (dest == node * k.R + r) & sent[:, None]
            entry = _store_entries(row_meta + 1, sel, recorded, sent, tokens, k)
            if k.HAS_WEIGHTS:
                row_weights = weights + row * k.META_FLOATS + r * k.MS
                tl.store(row_weights[:, None] + entry, weight, mask=sel)
    unused = tl.arange(0, k.CHUNK) >= num_rows
    tl.store(
        meta + tl.arange(0, k.CHUNK)[:, None] * k.META_INTS + locals_[None, :] * (1 + k.MS),
        tl.full([k.CHUNK, k.R_P2], -1, tl.int32),
        mask=unused[:, None] & (locals_[None, :] < k.R),
    )
    data = (slot_ptr + k.DATA_OFF).to(tl.pointer_type(tok.x_ptr.dtype.element_ty))
    _pack_rows(data=data, row=row, tokens=tokens, h_first=h_first, h_last=h_last, tok=tok, k=k)


@triton.jit(noinline=True)
def _forward_slot(
    slot_ptr,
    num_rows,
    src,
    h_first,
    h_last,
    node_first,
    fwd_rows_ptr,
    record,
    tok,
    out,
    heap,
    sync,
    k,
):
    """Forward a network slot that rank ``src`` (of another node) put here: each of its
    ``num_rows`` rows to every live rank of this node that needs it, into that rank's staging area
    (block ``src``, at the row of src's stream to it) with its metadata, as a direct send from
    src would have left it. With ``record`` (and WRITE_ROWS) the rows at each node rank go to
    ``fwd_rows_ptr`` [num_rows, R], which combine reads."""
    dtype = out.recv_x_ptr.dtype.element_ty
    slot_rows = tl.arange(0, k.CHUNK)
    valid = slot_rows < num_rows
    locals_ = tl.arange(0, k.R_P2)
    entries = tl.arange(0, k.MS_P2)
    meta = slot_ptr.to(tl.pointer_type(tl.int32))
    weights = (slot_ptr + k.CHUNK * k.META_INTS * 4).to(tl.pointer_type(tl.float32))
    alive = (
        tl.load(sync.mask_ptr + node_first + locals_, mask=locals_ < k.R, other=1, volatile=True)
        == 0
    )
    lmask = valid[:, None] & (locals_[None, :] < k.R)
    # The slot landed during this launch: loads bypass L1, as for staged rows.
    stream_rows = tl.load(
        meta + slot_rows[:, None] * k.META_INTS + locals_[None, :] * (1 + k.MS),
        mask=lmask,
        other=-1,
        cache_modifier=".cg",
    )
    if k.WRITE_ROWS:
        tl.store(
            fwd_rows_ptr + slot_rows[:, None] * k.R + locals_[None, :],
            stream_rows,
            mask=lmask & record,
        )
    # (a masked rank gets no rows: it may be gone, its memory with it)
    stream_rows = tl.where(alive[None, :], stream_rows, -1)
    for r in tl.static_range(k.R_P2):
        if r < k.R:
            q = node_first + r
            row = column(stream_rows, locals_, r)
            staged = src * k.T_MAX + row.to(tl.int64)
            emask = (row >= 0)[:, None] & (entries[None, :] < k.MS)
            values = tl.load(
                meta + slot_rows[:, None] * k.META_INTS + r * (1 + k.MS) + 1 + entries[None, :],
                mask=emask,
                cache_modifier=".cg",
            )
            meta_rows = region(heap.peer_bases_ptr, q, heap.meta_rows_off, tl.int32)
            tl.store(meta_rows + staged[:, None] * k.MS + entries[None, :], values, mask=emask)
            if k.HAS_WEIGHTS:
                values = tl.load(
                    weights + slot_rows[:, None] * k.META_FLOATS + r * k.MS + entries[None, :],
                    mask=emask,
                    cache_modifier=".cg",
                )
                meta_weights = region(heap.peer_bases_ptr, q, heap.meta_weights_off, tl.float32)
                tl.store(
                    meta_weights + staged[:, None] * k.MS + entries[None, :], values, mask=emask
                )
    data = (slot_ptr + k.DATA_OFF).to(tl.pointer_type(dtype))
    for h0 in range(h_first, h_last, k.BLOCK_H):
        cols = h0 + tl.arange(0, k.BLOCK_H)
        cmask = cols < h_last
        tile = tl.load(
            data + slot_rows[:, None] * k.NET_COLS + (cols - h_first)[None, :],
            mask=valid[:, None] & cmask[None, :],
            cache_modifier=".cg",
        )
        for r in tl.static_range(k.R_P2):
            if r < k.R:
                row = column(stream_rows, locals_, r)
                staging = region(heap.peer_bases_ptr, node_first + r, heap.staging_off, dtype)
                ptrs = (
                    staging
                    + (src * k.T_MAX + row.to(tl.int64))[:, None] * tok.hidden
                    + cols[None, :]
                )
                tl.store(ptrs, tile, mask=(row >= 0)[:, None] & cmask[None, :])


@triton.jit(noinline=True)
def _expand_chunk(
    staged_first,
    staged_end,
    h_first,
    h_last,
    part,
    token_row_offset,
    meta_rows_ptr,
    meta_weights_ptr,
    staging_ptr,
    tok,
    out,
    k,
):
    """Copy columns [h_first, h_last) of staged rows [staged_first, staged_end) to their rows of
    recv_x: the expert-major rows in their metadata, or with TOKEN_ROWS the one row
    ``staged + token_row_offset``. Column ``part`` 0 of a staged chunk also records those rows
    in staged_rows (if WRITE_ROWS) and copies the rows' weights (and with TOKEN_ROWS their
    local expert ids into recv_topk_idx)."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    entries = tl.arange(0, k.MS_P2)
    staged = staged_first + tl.arange(0, k.CHUNK)
    jmask = staged < staged_end
    emask = jmask[:, None] & (entries[None, :] < k.MS)
    meta = staged.to(tl.int64)[:, None] * k.MS + entries[None, :]
    # Entries whose row and weight this part records: all in part 0, none in the others (a
    # bound, not a scalar flag, so that every mask stays a tensor of the entries' shape).
    recorded = emask & (entries[None, :] < tl.where(part == 0, k.MS, 0))
    if k.TOKEN_ROWS:
        token_row = staged + token_row_offset
        token_row = tl.where(jmask & (token_row < out.num_out_rows), token_row, -1)
        rows = tl.where(entries[None, :] == 0, token_row[:, None], -1)
        num_copies = 1
        _expand_token_slots(staged, token_row, part, meta_rows_ptr, meta_weights_ptr, tok, out, k)
    else:
        rows = tl.load(meta_rows_ptr + meta, mask=emask, other=-1, cache_modifier=".cg")
        # Entries are packed: the copies of the token with the most of them, drops included.
        num_copies = tl.max(tl.sum((rows >= 0).to(tl.int32), axis=1), axis=0)
        rows = tl.where(rows < out.num_out_rows, rows, -1)  # past max_recv_tokens: dropped
        if k.HAS_WEIGHTS:
            weights = tl.load(meta_weights_ptr + meta, mask=recorded, cache_modifier=".cg")
            tl.store(out.recv_weights_ptr + rows, weights, mask=recorded & (rows >= 0))
    if k.WRITE_ROWS:
        tl.store(out.staged_rows_ptr + meta, rows, mask=recorded)
    src_rows = staging_ptr + staged.to(tl.int64)[:, None] * tok.hidden
    for p in tl.static_range(PARTS):
        _, lo, hi = row_part(src_rows, src_rows, p, h_first, h_last, tok.data_cols, k.SCALE_WORDS)
        dst, stride, offset = out_part(
            out.recv_x_ptr, out.recv_scales_ptr, p, tok.data_cols, k.SCALE_WORDS
        )
        cols = lo + tl.arange(0, k.BLOCK_H)
        tile = tl.load(
            src_rows + cols[None, :],
            mask=jmask[:, None] & (cols[None, :] < hi),
            cache_modifier=".cg",
        )
        for h0 in range(lo, hi, k.BLOCK_H):
            cols = h0 + tl.arange(0, k.BLOCK_H)
            cmask = cols < hi
            next_cols = cols + k.BLOCK_H
            next_tile = tl.load(
                src_rows + next_cols[None, :],
                mask=jmask[:, None] & (next_cols[None, :] < hi),
                cache_modifier=".cg",
            )
            for i in range(0, num_copies):
                _store_tile(dst, column(rows, entries, i), cols - offset, cmask, tile, stride)
            tile = next_tile


@triton.jit
def _expand_token_slots(staged, token_row, part, meta_rows_ptr, meta_weights_ptr, tok, out, k):
    """Column part 0 of staged token rows ``staged`` [CHUNK] (their rows of recv_x
    ``token_row``, -1: none): each slot's local expert id and weight back in its slot position,
    which its entry names (_store_entries), and the source token's index."""
    SLOTS: tl.constexpr = k.MS - 1
    slots = tl.arange(0, k.K_P2)
    meta = staged.to(tl.int64) * k.MS
    valid = token_row >= 0
    mine = tl.zeros([k.CHUNK, k.K_P2], tl.int1)
    local_ids = tl.zeros([k.CHUNK, k.K_P2], tl.int32)
    weights = tl.zeros([k.CHUNK, k.K_P2], tl.float32)
    # Entries are packed: at most min(K, L) of them name a slot. The other parts write nothing
    # (a bound, not a branch on the part).
    for e in range(0, tl.where(part == 0, tl.minimum(tok.topk, SLOTS), 0)):
        coded = tl.load(meta_rows_ptr + meta + e, mask=valid, other=-1, cache_modifier=".cg")
        hit = (coded >= 0)[:, None] & ((coded >> SLOT_SHIFT)[:, None] == slots[None, :])
        mine = mine | hit
        local_ids = tl.where(hit, (coded & LOCAL_ID_MASK)[:, None], local_ids)
        if k.HAS_WEIGHTS:
            weight = tl.load(
                meta_weights_ptr + meta + e, mask=valid, other=0.0, cache_modifier=".cg"
            )
            weights = tl.where(hit, weight[:, None], weights)
    src_idx = tl.load(meta_rows_ptr + meta + SLOTS, mask=valid, other=-1, cache_modifier=".cg")
    token_row = tl.where(part == 0, token_row, -1)
    _store_token_slots(token_row, mine, local_ids, weights, src_idx, tok, out, k)


@triton.jit(noinline=True)
def _expand_own_chunk(c, h_first, h_last, own_stream_first, own_token_rows_first, tok, lay, out, k):
    """Copy columns [h_first, h_last) of this rank's tokens of chunk ``c`` straight from ``x``
    to the expert-major rows of their local experts (with TOKEN_ROWS: to one row per token,
    from row ``own_token_rows_first`` on, with its slots' local expert ids and weights in
    DeepEP's slot positions and its index in recv_src_idx), and (if WRITE_ROWS) record those
    rows in staged_rows as the rows of the token's place in its stream to this rank, which
    starts at row ``own_stream_first``, packed in slot order as a sender packs them."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    slots = tl.arange(0, k.K_P2)
    tokens, tmask, slot_offs, dest, recorded = _chunk_slots(c, tok, lay, k)
    mine = dest == tok.rank
    any_mine = tl.max(mine.to(tl.int32), axis=1) > 0
    stream_pos = tl.load(lay.token_rank_pos_ptr + tokens * k.W + tok.rank, mask=tmask)
    weight = 0.0
    if k.HAS_WEIGHTS:
        weight = tl.load(tok.topk_weights_ptr + slot_offs, mask=mine)
    if k.TOKEN_ROWS:
        token_row = own_token_rows_first + stream_pos
        token_row = tl.where(any_mine & (token_row < out.num_out_rows), token_row, -1)
        out_row = tl.where(slots[None, :] == 0, token_row[:, None], -1)
        packed = (slots[None, :] == 0) & any_mine[:, None]  # one staged_rows entry per token
        _store_token_slots(token_row, mine, recorded, weight, tokens, tok, out, k)
    else:
        out_row = tl.where(
            mine & (recorded < out.num_out_rows), recorded, -1
        )  # past max_recv_tokens
        packed = mine
        if k.HAS_WEIGHTS:
            tl.store(out.recv_weights_ptr + out_row, weight, mask=out_row >= 0)
    if k.WRITE_ROWS:
        meta = out.staged_rows_ptr + (own_stream_first + stream_pos).to(tl.int64) * k.MS
        _store_packed(meta, packed, out_row, any_mine, k.MS, -1, k.MS_P2, k.CHUNK)
    x_rows = tok.x_ptr + tokens.to(tl.int64)[:, None] * tok.x_stride
    scale_rows = tok.x_scales_ptr + tokens.to(tl.int64)[:, None] * tok.x_scales_stride
    wanted = tl.max(out_row, axis=1) >= 0
    for p in tl.static_range(PARTS):
        src, lo, hi = row_part(x_rows, scale_rows, p, h_first, h_last, tok.data_cols, k.SCALE_WORDS)
        dst, stride, offset = out_part(
            out.recv_x_ptr, out.recv_scales_ptr, p, tok.data_cols, k.SCALE_WORDS
        )
        for h0 in tl.range(lo, hi, k.BLOCK_H, num_stages=k.STAGES):
            cols = h0 + tl.arange(0, k.BLOCK_H)
            cmask = cols < hi
            tile = tl.load(src + cols[None, :], mask=wanted[:, None] & cmask[None, :])
            if k.TOKEN_ROWS:  # one row per token, in entry 0
                _store_tile(dst, column(out_row, slots, 0), cols - offset, cmask, tile, stride)
            else:
                for slot in tl.static_range(k.K_P2):
                    _store_tile(
                        dst, column(out_row, slots, slot), cols - offset, cmask, tile, stride
                    )


@triton.jit
def _wait_quantized(c, rank, sync, k):
    """Wait until the quantizers have put chunk ``c`` into x, all its items."""
    QUANT_SLICES: tl.constexpr = (k.CHANNEL_GROUPS + QUANT_GROUPS - 1) // QUANT_GROUPS
    for s in tl.static_range(QUANT_SLICES):
        flag = sync.quantized_flags_ptr + c * QUANT_SLICES + s
        wait_at_least(
            flag, sync.seq, sync.timeout_ns, sync.status_ptr, rank, STAGE_DISPATCH_QUANTIZED
        )


@triton.jit
def _output_pointer(word_ptr, like):
    """The output address at ``word_ptr`` as a pointer of ``like``'s type (16-byte aligned:
    the caching allocator's blocks are)."""
    return tl.multiple_of(tl.load(word_ptr, volatile=True).to(like.dtype), ALIGNMENT)


# Each program of a launch has one role (module docstring); a role is a function that takes the
# kernel's arguments in bundles (kernels/__init__.py): namedtuples of runtime values, and ``k``,
# the DispatchConsts. The roles are inlined: the machine code is that of one kernel body.
Tokens = namedtuple(
    "Tokens",
    "rank x_ptr x_stride x_scales_ptr x_scales_stride topk_idx_ptr topk_weights_ptr num_tokens "
    "topk hidden data_cols num_experts experts_per_rank source_ptr source_stride",
)
Layout = namedtuple(
    "Layout",
    "slot_pos_ptr token_rank_pos_ptr send_chunk_start_ptr chunk_expert_base_ptr "
    "recv_chunk_start_ptr recv_src_tokens_ptr expert_layout_ptr info_ptr token_node_pos_ptr "
    "send_chunk_node_start_ptr recv_net_chunk_start_ptr",
)
Outputs = namedtuple(
    "Outputs",
    "num_out_rows staged_rows_ptr recv_x_ptr recv_scales_ptr recv_weights_ptr recv_topk_idx_ptr "
    "recv_src_idx_ptr fwd_rows_ptr",
)
Heap = namedtuple(
    "Heap",
    "peer_bases_ptr ready_off chunk_flags_off meta_rows_off meta_weights_off staging_off "
    "net_bases_ptr net_flags_off net_inbox_off net_outbox_off heap_bytes",
)
Sync = namedtuple(
    "Sync",
    "control_ptr status_ptr seq timeout_ns aborted num_quantizers num_senders expand_slices "
    "staged_parts quantized_flags_ptr outputs_addr outputs_tag rank mask_ptr bases_ptr "
    "net_bases_ptr mask_off",
)
DispatchConsts = namedtuple(
    "DispatchConsts",
    "W T_MAX NC_MAX H_SLICES P_MAX MS MS_P2 K_P2 CHUNK BLOCK_H HAS_WEIGHTS WRITE_ROWS TOKEN_ROWS "
    "STAGES R R_P2 NODES META_INTS META_FLOATS NET_COLS DATA_OFF SLOT_BYTES SCALE_WORDS QUANTIZE "
    "CHANNEL_GROUPS OUTPUTS_FROM_HOST",
)


@triton.jit
def _quantize_role(tok, sync, k):
    """Quantizers (QUANTIZE: the programs before the senders). Wait for nothing. Take work items
    (chunk, QUANT_GROUPS channel groups) of ``source`` from the second queue, quantize each into
    x / x_scales and release it by its flag in quantized_flags, for the senders and the
    expansion of own rows, which read x."""
    if k.QUANTIZE:
        QUANT_SLICES: tl.constexpr = (k.CHANNEL_GROUPS + QUANT_GROUPS - 1) // QUANT_GROUPS
        items = tl.where(sync.aborted, 0, tl.cdiv(tok.num_tokens, k.CHUNK) * QUANT_SLICES)
        item = take_work(sync.control_ptr + SECOND_QUEUE)
        while item < items:
            first_group = (item % QUANT_SLICES) * QUANT_GROUPS
            first_row = item // QUANT_SLICES * k.CHUNK
            last_group = tl.minimum(first_group + QUANT_GROUPS, k.CHANNEL_GROUPS)
            values = tok.x_ptr.to(tl.pointer_type(tl.uint8))  # x and x_scales: int32 words
            if k.QUANTIZE == QUANTIZE_FP8:
                quantize_block(
                    src_ptr=tok.source_ptr,
                    src_stride=tok.source_stride,
                    values_ptr=values,
                    values_stride=tok.x_stride * 4,
                    scales_ptr=tok.x_scales_ptr.to(tl.pointer_type(tl.float32)),
                    scales_stride=tok.x_scales_stride,
                    first_row=first_row,
                    num_rows=tok.num_tokens,
                    first_group=first_group,
                    last_group=last_group,
                    ROWS=k.CHUNK,
                )
            elif k.QUANTIZE == QUANTIZE_MXFP8:
                quantize_mxfp8_block(
                    src_ptr=tok.source_ptr,
                    src_stride=tok.source_stride,
                    values_ptr=values,
                    values_stride=tok.x_stride * 4,
                    scales_ptr=tok.x_scales_ptr.to(tl.pointer_type(tl.uint8)),
                    scales_stride=tok.x_scales_stride * 4,
                    first_row=first_row,
                    num_rows=tok.num_tokens,
                    first_group=first_group,
                    last_group=last_group,
                    ROWS=k.CHUNK,
                )
            else:  # NVFP4, without a per-tensor scale (a row's scales are all it carries)
                quantize_nvfp4_block(
                    src_ptr=tok.source_ptr,
                    src_stride=tok.source_stride,
                    values_ptr=values,
                    values_stride=tok.x_stride * 4,
                    scales_ptr=tok.x_scales_ptr.to(tl.pointer_type(tl.uint8)),
                    scales_stride=tok.x_scales_stride * 4,
                    per_tensor_scale_ptr=sync.quantized_flags_ptr,
                    first_row=first_row,
                    num_rows=tok.num_tokens,
                    first_group=first_group,
                    last_group=last_group,
                    ROWS=k.CHUNK,
                    PER_TENSOR_SCALE=False,
                )
            signal(sync.quantized_flags_ptr + item, sync.seq)
            item = take_work(sync.control_ptr + SECOND_QUEUE)


@triton.jit
def _send_role(sender, send_cols, node_first, tok, lay, heap, sync, k):
    """Sender ``sender`` (< P), an independent channel. Waits for program ``sender`` of every
    peer to have started this launch (handshake: their earlier launches are done with the staging
    areas this one writes), and with QUANTIZE for the quantizers' flags of each chunk. Sends its
    work items w = sender, sender + P, ...: across nodes first into the network (_send_to_nodes),
    then to the other ranks of its node, and releases each item by its flag in every peer's
    chunk flags, for their expanders (and forwarders)."""
    ITEMS: tl.constexpr = k.NC_MAX * k.H_SLICES
    rank = tok.rank
    start_channel(channel=sender, rank=rank, stage=STAGE_DISPATCH_READY, heap=heap, sync=sync, k=k)
    items = tl.where(sync.aborted, 0, tl.cdiv(tok.num_tokens, k.CHUNK) * k.H_SLICES)
    if k.W == 1:  # no other rank: a sender would read x for nothing
        items = 0
    for w in range(sender, items, sync.num_senders):
        c = w // k.H_SLICES
        h_first = (w % k.H_SLICES) * send_cols
        h_last = tl.minimum(h_first + send_cols, tok.hidden)
        if k.QUANTIZE:
            _wait_quantized(c, rank, sync, k)
        if k.NODES > 1:
            _send_to_nodes(
                w=w,
                c=c,
                h_first=h_first,
                h_last=h_last,
                tok=tok,
                lay=lay,
                heap=heap,
                sync=sync,
                k=k,
            )
        _send_chunk(
            c=c,
            h_first=h_first,
            h_last=h_last,
            node_first=node_first,
            tok=tok,
            lay=lay,
            heap=heap,
            sync=sync,
            k=k,
        )
        for peer in range(node_first, node_first + k.R):
            if (peer != rank) & live(sync, peer):
                flags = region(heap.peer_bases_ptr, peer, heap.chunk_flags_off, tl.int64)
                signal(flags + rank * ITEMS + w, sync.seq)


@triton.jit
def _send_to_nodes(w, c, h_first, h_last, tok, lay, heap, sync, k):
    """A sender's work item ``w`` (chunk ``c``, columns [h_first, h_last)) to every other node
    that holds one of its tokens' experts, first: the network is the slower path. Packs the
    item's rows to that node into a slot of this rank's outbox and puts it, with its flag, into
    the inbox of the rank of this rank's local index there, whose forwarder waits for it. Each
    token crosses the network at most once per node. Where that rank is masked, to each live
    rank of that node itself (_send_to_node_ranks)."""
    ITEMS: tl.constexpr = k.NC_MAX * k.H_SLICES
    rank = tok.rank
    dtype = tok.x_ptr.dtype.element_ty
    my_node = rank // k.R
    for node in range(0, k.NODES):
        if (node != my_node) & ~live(sync, rail_peer(node, rank, k.R)):
            _send_to_node_ranks(w, c, node, h_first, h_last, tok, lay, heap, sync, k)
        elif node != my_node:
            first = tl.load(lay.send_chunk_node_start_ptr + c * k.NODES + node)
            num_rows = tl.load(lay.send_chunk_node_start_ptr + (c + 1) * k.NODES + node) - first
            slot_off = heap.net_outbox_off + (node * ITEMS + w) * k.SLOT_BYTES
            slot = region(heap.peer_bases_ptr, rank, slot_off, tl.uint8)
            _pack_node_slot(
                c=c,
                node=node,
                h_first=h_first,
                h_last=h_last,
                num_rows=num_rows,
                slot_ptr=slot,
                tok=tok,
                lay=lay,
                k=k,
            )
            there = my_node * ITEMS + w
            net_put_signal(
                net_bases_ptr=heap.net_bases_ptr,
                rank=rank,
                pe=rail_peer(node, rank, k.R),
                dst_off=heap.net_inbox_off + there * k.SLOT_BYTES,
                src=slot,
                nbytes=k.DATA_OFF + num_rows * (k.NET_COLS * dtype.primitive_bitwidth // 8),
                flag_off=heap.net_flags_off + there * 8,
                value=sync.seq,
                heap_bytes=heap.heap_bytes,
            )
            if w % k.H_SLICES == 0:  # rows that crossed the network, for the stats
                tl.atomic_add(sync.control_ptr + NET_ROWS, num_rows.to(tl.int64))


@triton.jit
def _send_to_node_ranks(w, c, node, h_first, h_last, tok, lay, heap, sync, k):
    """Work item ``w`` (chunk ``c``, columns [h_first, h_last)) to every live rank of node
    ``node``, whose rank of this rank's local index (its forwarder) is masked: over the
    network, into each one's staging area as a direct send leaves it (block of this rank, rows
    of its stream), through this rank's outbox slot of the item (free: no slot goes to a
    masked rank), then the item's flag there, after the rows (net_fence). A token crosses the
    network once per rank of that node, not once per node: the price of a lost forwarder."""
    ITEMS: tl.constexpr = k.NC_MAX * k.H_SLICES
    EBYTES: tl.constexpr = tok.x_ptr.dtype.element_ty.primitive_bitwidth // 8
    rank = tok.rank
    slot_off = heap.net_outbox_off + (node * ITEMS + w) * k.SLOT_BYTES
    slot = region(heap.peer_bases_ptr, rank, slot_off, tl.uint8)
    for q in range(node * k.R, node * k.R + k.R):
        if live(sync, q):
            start = tl.load(lay.send_chunk_start_ptr + c * k.W + q)
            num_rows = tl.load(lay.send_chunk_start_ptr + (c + 1) * k.W + q) - start
            _pack_rank_slot(
                c=c, q=q, h_first=h_first, h_last=h_last, slot_ptr=slot, tok=tok, lay=lay, k=k
            )
            first = (rank * k.T_MAX + start).to(tl.int64)
            meta_bytes = num_rows * k.MS * 4
            net_put(
                heap.net_bases_ptr,
                rank,
                q,
                heap.meta_rows_off + first * k.MS * 4,
                slot,
                meta_bytes,
                heap.heap_bytes,
            )
            if k.HAS_WEIGHTS:
                net_put(
                    heap.net_bases_ptr,
                    rank,
                    q,
                    heap.meta_weights_off + first * k.MS * 4,
                    slot + k.CHUNK * k.META_INTS * 4,
                    meta_bytes,
                    heap.heap_bytes,
                )
            net_put_rows_signal(
                heap.net_bases_ptr,
                rank,
                q,
                heap.staging_off + (first * tok.hidden + h_first) * EBYTES,
                tok.hidden * EBYTES,
                slot + k.DATA_OFF,
                k.NET_COLS * EBYTES,
                num_rows,
                (h_last - h_first) * EBYTES,
                heap.chunk_flags_off + (rank * ITEMS + w) * 8,
                sync.seq,
                heap.heap_bytes,
            )


@triton.jit(noinline=True)
def _pack_rank_slot(c, q, h_first, h_last, slot_ptr, tok, lay, k):
    """Write columns [h_first, h_last) of the tokens of chunk ``c`` that go to rank ``q`` into
    the network slot at ``slot_ptr`` as q's staging area holds them: row i is the chunk's i-th
    row of this rank's stream to q, its metadata (MS int32 entries, what a direct send records)
    from the slot's start, its weights (MS float32) after the slot's metadata, its columns at
    DATA_OFF (NET_COLS apart)."""
    tokens, tmask, slot_offs, dest, recorded = _chunk_slots(c, tok, lay, k)
    row = tl.load(lay.token_rank_pos_ptr + tokens * k.W + q, mask=tmask, other=-1)
    sent = row >= 0
    meta = slot_ptr.to(tl.pointer_type(tl.int32)) + row * k.MS
    sel = (dest == q) & sent[:, None]
    entry = _store_packed(meta, sel, recorded, sent, k.MS, -1, k.MS_P2, k.CHUNK)
    if k.HAS_WEIGHTS:
        weights = (slot_ptr + k.CHUNK * k.META_INTS * 4).to(tl.pointer_type(tl.float32))
        weight = tl.load(tok.topk_weights_ptr + slot_offs, mask=dest >= 0, other=0.0)
        tl.store((weights + row * k.MS)[:, None] + entry, weight, mask=sel)
    data = (slot_ptr + k.DATA_OFF).to(tl.pointer_type(tok.x_ptr.dtype.element_ty))
    _pack_rows(data=data, row=row, tokens=tokens, h_first=h_first, h_last=h_last, tok=tok, k=k)


@triton.jit
def _forward_role(forwarder, send_cols, node_first, my_ready, tok, lay, out, heap, sync, k):
    """Forwarder ``forwarder`` (across nodes: the P programs after the senders). Waits for
    program ``forwarder`` of every rank of its node to have started this launch (their earlier
    launches are done with their staging areas), then for each network slot that the rank of
    its local index on another node put here (work items w = forwarder, forwarder + P, ...).
    Copies each slot's rows into the staging area of every rank of this node that needs them, as
    a direct send would have left them, and releases the item by its flag in each of those
    ranks' chunk flags, for their expanders."""
    ITEMS: tl.constexpr = k.NC_MAX * k.H_SLICES
    rank = tok.rank
    # This node's live ranks started this launch (their earlier launches are done with their
    # staging areas): their sender `forwarder` said so.
    for peer in range(node_first, node_first + k.R):
        ready = my_ready + peer * k.P_MAX + forwarder
        await_peer(ready, sync.seq, peer, STAGE_DISPATCH_READY, sync, k.W, k.NODES)
    my_node = rank // k.R
    net_flags = region(heap.peer_bases_ptr, rank, heap.net_flags_off, tl.int64)
    for node in range(0, k.NODES):
        if node != my_node:
            src = rail_peer(node, rank, k.R)
            src_tokens = tl.minimum(tl.load(lay.recv_src_tokens_ptr + src), k.T_MAX)
            items = tl.where(sync.aborted, 0, tl.cdiv(src_tokens, k.CHUNK) * k.H_SLICES)
            table = lay.recv_net_chunk_start_ptr + node * (k.NC_MAX + 1)
            for w in range(forwarder, items, sync.num_senders):
                landed = wait_landed(
                    my_ready=my_ready,
                    carrier=src,
                    rank=rank,
                    channel=w % sync.num_senders,
                    flag_ptr=net_flags + node * ITEMS + w,
                    ready_stage=STAGE_DISPATCH_READY,
                    data_stage=STAGE_DISPATCH_NET,
                    sync=sync,
                    k=k,
                )
                if landed:
                    c = w // k.H_SLICES
                    first = tl.load(table + c)
                    h_first = (w % k.H_SLICES) * send_cols
                    slot_off = heap.net_inbox_off + (node * ITEMS + w) * k.SLOT_BYTES
                    _forward_slot(
                        slot_ptr=region(heap.peer_bases_ptr, rank, slot_off, tl.uint8),
                        num_rows=tl.load(table + c + 1) - first,
                        src=src,
                        h_first=h_first,
                        h_last=tl.minimum(h_first + send_cols, tok.hidden),
                        node_first=node_first,
                        fwd_rows_ptr=out.fwd_rows_ptr + (node * k.T_MAX + first).to(tl.int64) * k.R,
                        record=w % k.H_SLICES == 0,
                        tok=tok,
                        out=out,
                        heap=heap,
                        sync=sync,
                        k=k,
                    )
                elif ~live(sync, src):
                    # (a handle made before it was masked still counts its items) This node's
                    # expanders wait for them through this rank: tell them first, then release
                    # the item with nothing in it.
                    tell_mask(src, sync, k.W, k.NODES)
                for peer in range(node_first, node_first + k.R):
                    if live(sync, peer):
                        flags = region(heap.peer_bases_ptr, peer, heap.chunk_flags_off, tl.int64)
                        signal(flags + src * ITEMS + w, sync.seq)


@triton.jit
def _outputs_from_host(expander, out, sync, aborted, rank):
    """Exact mode (OUTPUTS_FROM_HOST): the launch came before the host knew the row count, which
    it then writes with the outputs it allocated into its record [tag, N, recv_x, recv_scales,
    recv_weights, recv_topk_idx, recv_src_idx, check] (N < 0: no outputs, an error on the
    host); meanwhile the senders are sending already. Expander 0 waits for the record and
    copies it into control[HOST_RECORD:], releasing the other expanders by
    control[HOST_RECORD_SEQ] = seq, which every expander waits for. Returns N, aborted (also
    when N < 0 or the launch failed) and the outputs, typed as the pointer arguments."""
    if expander == 0:
        record = wait_host_record(
            record_ptr=host_pointer(sync.outputs_addr, tl.int64),
            tag=sync.outputs_tag,
            timeout_ns=sync.timeout_ns,
            status_ptr=sync.status_ptr,
            peer=rank,
            stage=STAGE_DISPATCH_OUTPUTS,
        )
        for i in tl.static_range(HOST_RECORD_VALUES):
            tl.store(sync.control_ptr + HOST_RECORD + i, record_word(record, 1 + i))
        signal(sync.control_ptr + HOST_RECORD_SEQ, sync.seq)
    wait_at_least(
        sync.control_ptr + HOST_RECORD_SEQ,
        sync.seq,
        sync.timeout_ns,
        sync.status_ptr,
        rank,
        STAGE_DISPATCH_OUTPUTS,
    )
    num_out_rows = tl.load(sync.control_ptr + HOST_RECORD, volatile=True).to(tl.int32)
    if read_uniform(sync.status_ptr) != 0:
        num_out_rows = -1
    aborted = aborted | (num_out_rows < 0)
    # The record's values: N, then the outputs' addresses in this order.
    control = sync.control_ptr
    recv_x_ptr = _output_pointer(control + HOST_RECORD + 1, out.recv_x_ptr)
    recv_scales_ptr = _output_pointer(control + HOST_RECORD + 2, out.recv_scales_ptr)
    recv_weights_ptr = _output_pointer(control + HOST_RECORD + 3, out.recv_weights_ptr)
    recv_topk_idx_ptr = _output_pointer(control + HOST_RECORD + 4, out.recv_topk_idx_ptr)
    recv_src_idx_ptr = _output_pointer(control + HOST_RECORD + 5, out.recv_src_idx_ptr)
    outputs = Outputs(
        num_out_rows,
        out.staged_rows_ptr,
        recv_x_ptr,
        recv_scales_ptr,
        recv_weights_ptr,
        recv_topk_idx_ptr,
        recv_src_idx_ptr,
        out.fwd_rows_ptr,
    )
    return outputs, aborted


@triton.jit
def _expand_role(
    expander, num_expanders, send_cols, node_first, my_ready, tok, lay, out, heap, sync, k
):
    """Expander ``expander`` of ``num_expanders`` (the programs after the senders and
    forwarders). Waits only for senders and forwarders, which come first in the launch order:
    for each other rank's work item, its flag in this rank's chunk flags (and first for its
    carrier's program to have started the launch), and with QUANTIZE for the quantizers' flags
    of an own chunk. Takes from the first queue, spread evenly among each other, own work items
    (_expand_own_chunk: straight from x, in finer column slices) and every other rank's
    (_expand_chunk: from the staging area, in `staged_parts` column parts, in the order senders
    send them, so that the last items to land are each expanded by several programs at once).
    Own items all first would fill HBM at the start, and the senders' stores landing on the peer
    (busy likewise) would slow down by half until they are done. Then zeroes the padding rows
    and the rows past the valid count (_zero_tail). Releases nothing: the launch's end does."""
    rank = tok.rank
    aborted = sync.aborted
    if k.OUTPUTS_FROM_HOST:
        out, aborted = _outputs_from_host(expander, out, sync, aborted, rank)
    own_cols = slice_width(tok.hidden, sync.expand_slices, k.BLOCK_H)
    own_items = tl.where(aborted, 0, tl.cdiv(tok.num_tokens, k.CHUNK) * sync.expand_slices)
    remote = remote_entries(lay.recv_src_tokens_ptr, rank, k.W, k.T_MAX, k.CHUNK, k.H_SLICES)
    remote = tl.where(aborted, 0, remote)
    my_flags = region(heap.peer_bases_ptr, rank, heap.chunk_flags_off, tl.int64)
    part_cols = slice_width(send_cols, sync.staged_parts, k.BLOCK_H)
    remote_items = remote * sync.staged_parts
    own_token_rows_first = 0
    if k.TOKEN_ROWS:
        own_token_rows_first = token_rows_first(
            lay.recv_chunk_start_ptr, lay.recv_src_tokens_ptr, rank, k.T_MAX, k.NC_MAX, k.CHUNK
        )
    item = take_work(sync.control_ptr + FIRST_QUEUE)
    while item < own_items + remote_items:
        is_own, index = interleaved(item, own_items, remote_items)
        if is_own:
            c = index // sync.expand_slices
            h_first = (index % sync.expand_slices) * own_cols
            if k.QUANTIZE:
                _wait_quantized(c, rank, sync, k)
            h_last = tl.minimum(h_first + own_cols, tok.hidden)
            _expand_own(c, h_first, h_last, own_token_rows_first, tok, lay, out, k)
        else:
            part = index % sync.staged_parts
            w, src = remote_item(index // sync.staged_parts, rank, k.W)
            src_tokens = tl.minimum(tl.load(lay.recv_src_tokens_ptr + src), k.T_MAX)
            if w < tl.cdiv(src_tokens, k.CHUNK) * k.H_SLICES:
                landed = _wait_staged(src, w, node_first, my_ready, my_flags, rank, sync, k)
                # Where src or its carrier is masked nothing came: a cached dispatch zeroes its
                # rows (the handle records them), one with a new layout leaves them.
                lost = ~landed
                if k.WRITE_ROWS:
                    lost = lost & landed
                if landed | lost:
                    table = lay.recv_chunk_start_ptr + src * (k.NC_MAX + 1)
                    c = w // k.H_SLICES
                    h_first, h_last = part_columns(
                        w, part, send_cols, part_cols, tok.hidden, k.H_SLICES
                    )
                    _expand_staged(
                        table, c, src, h_first, h_last, part, lost, tok, lay, out, heap, k
                    )
        item = take_work(sync.control_ptr + FIRST_QUEUE)
    _zero_tail(expander, num_expanders, aborted, tok, lay, out, k)


@triton.jit
def _wait_staged(src, w, node_first, my_ready, my_flags, rank, sync, k):
    """Whether work item ``w`` of rank ``src`` landed in this rank's staging area: from src
    itself, or from another node through this node's rank of src's local index (its
    forwarder) or, where that one is masked, from src itself (_send_to_node_ranks). False where
    src is masked, or its carrier is."""
    ITEMS: tl.constexpr = k.NC_MAX * k.H_SLICES
    carrier = src
    if k.NODES > 1:
        carrier = tl.where(src // k.R == rank // k.R, src, node_first + src % k.R)
    landed = wait_landed(
        my_ready=my_ready,
        carrier=carrier,
        rank=rank,
        channel=w % sync.num_senders,
        flag_ptr=my_flags + src * ITEMS + w,
        ready_stage=STAGE_DISPATCH_READY,
        data_stage=STAGE_DISPATCH_DATA,
        sync=sync,
        k=k,
    )
    if k.NODES > 1:
        if (carrier != src) & ~landed & live(sync, src):
            landed = wait_landed(
                my_ready=my_ready,
                carrier=src,
                rank=rank,
                channel=w % sync.num_senders,
                flag_ptr=my_flags + src * ITEMS + w,
                ready_stage=STAGE_DISPATCH_READY,
                data_stage=STAGE_DISPATCH_DATA,
                sync=sync,
                k=k,
            )
        # (a forwarder releases the items of a masked src with nothing in them)
        landed = landed & live(sync, src)
    return landed


@triton.jit
def _expand_own(c, h_first, h_last, own_token_rows_first, tok, lay, out, k):
    """An expander's own work item: columns [h_first, h_last) of this rank's chunk ``c``."""
    chunk_first = tl.load(lay.send_chunk_start_ptr + c * k.W + tok.rank)  # in the own stream
    _expand_own_chunk(
        c=c,
        h_first=h_first,
        h_last=h_last,
        own_stream_first=tok.rank * k.T_MAX + chunk_first,
        own_token_rows_first=own_token_rows_first + chunk_first,
        tok=tok,
        lay=lay,
        out=out,
        k=k,
    )


@triton.jit
def _expand_staged(table, c, src, h_first, h_last, part, lost, tok, lay, out, heap, k):
    """An expander's remote work item: columns [h_first, h_last) (column part ``part``) of chunk
    ``c`` of source ``src``, whose stream's chunk table is ``table``, from this rank's staging
    area; ``lost``: nothing came (_zero_lost_chunk)."""
    rank = tok.rank
    dtype = out.recv_x_ptr.dtype.element_ty
    token_row_offset = 0
    if k.TOKEN_ROWS:
        token_row_offset = (
            token_rows_first(
                lay.recv_chunk_start_ptr, lay.recv_src_tokens_ptr, src, k.T_MAX, k.NC_MAX, k.CHUNK
            )
            - src * k.T_MAX
        )
    staged_first = src * k.T_MAX + tl.load(table + c)
    staged_end = src * k.T_MAX + tl.load(table + c + 1)
    if lost:
        _zero_lost_chunk(
            staged_first, staged_end, h_first, h_last, part, token_row_offset, tok, out, k
        )
    else:
        _expand_chunk(
            staged_first=staged_first,
            staged_end=staged_end,
            h_first=h_first,
            h_last=h_last,
            part=part,
            token_row_offset=token_row_offset,
            meta_rows_ptr=region(heap.peer_bases_ptr, rank, heap.meta_rows_off, tl.int32),
            meta_weights_ptr=region(heap.peer_bases_ptr, rank, heap.meta_weights_off, tl.float32),
            staging_ptr=region(heap.peer_bases_ptr, rank, heap.staging_off, dtype),
            tok=tok,
            out=out,
            k=k,
        )


@triton.jit(noinline=True)
def _zero_lost_chunk(
    staged_first, staged_end, h_first, h_last, part, token_row_offset, tok, out, k
):
    """A cached dispatch's staged rows [staged_first, staged_end) from a rank masked since its
    handle was made (nothing came): zero columns [h_first, h_last) of the rows of recv_x that
    the handle records for them (staged_rows; with TOKEN_ROWS row ``staged +
    token_row_offset``) and, in column part 0, their weights: as if the rank held no tokens."""
    PARTS: tl.constexpr = 2 if k.SCALE_WORDS > 0 else 1
    entries = tl.arange(0, k.MS_P2)
    staged = staged_first + tl.arange(0, k.CHUNK)
    jmask = staged < staged_end
    # Weights are zeroed by part 0 (a bound, not a scalar flag, so that every mask stays a
    # tensor: _expand_chunk).
    if k.TOKEN_ROWS:
        token_row = staged + token_row_offset
        token_row = tl.where(jmask & (token_row < out.num_out_rows), token_row, -1)
        rows = tl.where(entries[None, :] == 0, token_row[:, None], -1)
        num_copies = 1
        if k.HAS_WEIGHTS:
            slots = tl.arange(0, k.K_P2)
            out_slots = token_row.to(tl.int64)[:, None] * tok.topk + slots[None, :]
            first = slots[None, :] < tl.where(part == 0, tok.topk, 0)
            weights = tl.zeros([k.CHUNK, k.K_P2], tl.float32)
            tl.store(
                out.recv_weights_ptr + out_slots, weights, mask=(token_row >= 0)[:, None] & first
            )
    else:
        meta = staged.to(tl.int64)[:, None] * k.MS + entries[None, :]
        emask = jmask[:, None] & (entries[None, :] < k.MS)
        rows = tl.load(out.staged_rows_ptr + meta, mask=emask, other=-1)
        num_copies = tl.max(tl.sum((rows >= 0).to(tl.int32), axis=1), axis=0)
        if k.HAS_WEIGHTS:
            first_part = entries[None, :] < tl.where(part == 0, k.MS, 0)
            tl.store(
                out.recv_weights_ptr + rows,
                tl.zeros([k.CHUNK, k.MS_P2], tl.float32),
                mask=(rows >= 0) & first_part,
            )
    x = out.recv_x_ptr
    zeros = tl.zeros([k.CHUNK, k.BLOCK_H], x.dtype.element_ty)
    for p in tl.static_range(PARTS):
        _, lo, hi = row_part(x, x, p, h_first, h_last, tok.data_cols, k.SCALE_WORDS)
        dst, stride, offset = out_part(x, out.recv_scales_ptr, p, tok.data_cols, k.SCALE_WORDS)
        for h0 in range(lo, hi, k.BLOCK_H):
            cols = h0 + tl.arange(0, k.BLOCK_H)
            for i in range(0, num_copies):
                _store_tile(dst, column(rows, entries, i), cols - offset, cols < hi, zeros, stride)


@triton.jit
def _zero_tail(expander, num_expanders, aborted, tok, lay, out, k):
    """The expanders' last step: zero the padding rows of each local expert's segment (token
    rows have none: pad_multiple pads their counts only) and the rows past the valid count
    (max_recv_tokens mode), with TOKEN_ROWS also those rows' slots."""
    epr = tok.experts_per_rank
    num_out_rows = out.num_out_rows
    if not k.TOKEN_ROWS:
        for e in range(expander, tl.where(aborted, 0, epr), num_expanders):
            seg = tl.load(lay.expert_layout_ptr + e)
            first = seg + tl.load(lay.expert_layout_ptr + epr + e)
            last = tl.minimum(seg + tl.load(lay.expert_layout_ptr + 2 * epr + e), num_out_rows)
            _zero_rows(out, first, last, tok, k)
    valid_rows = tl.where(
        aborted, 0, tl.minimum(tl.load(lay.info_ptr + INFO_ROWS), num_out_rows)
    ).to(tl.int32)
    for b in range(expander, tl.cdiv(num_out_rows - valid_rows, k.CHUNK), num_expanders):
        first = valid_rows + b * k.CHUNK
        last = tl.minimum(first + k.CHUNK, num_out_rows)
        _zero_rows(out, first, last, tok, k)
        if k.TOKEN_ROWS:
            _clear_slots(first, last, tok, out, k)


@triton.jit
def _roles(pid, tok, lay, out, heap, sync, num_programs, k):
    """Program ``pid``'s role (``pid`` counts from the first sender: quantizers are < 0)."""
    # Work item w of a source = (chunk c, column slice s) of its tokens: sender program p takes
    # w = p, p + P, ... and raises the item's flag on the destination.
    send_cols = slice_width(tok.hidden, k.H_SLICES, k.BLOCK_H)
    node_first = node_first_rank(tok.rank, k.R, k.NODES)
    my_ready = region(heap.peer_bases_ptr, tok.rank, heap.ready_off, tl.int64)
    # Across nodes the programs after the senders forward what the ranks of this rank's local
    # index on other nodes put here.
    num_forwarders = 0
    is_forwarder = False
    if k.NODES > 1:
        num_forwarders = sync.num_senders
        is_forwarder = (pid >= sync.num_senders) & (pid < 2 * sync.num_senders)
    if pid < 0:
        _quantize_role(tok=tok, sync=sync, k=k)
    elif pid < sync.num_senders:
        _send_role(
            sender=pid,
            send_cols=send_cols,
            node_first=node_first,
            tok=tok,
            lay=lay,
            heap=heap,
            sync=sync,
            k=k,
        )
    elif is_forwarder:
        _forward_role(
            forwarder=pid - sync.num_senders,
            send_cols=send_cols,
            node_first=node_first,
            my_ready=my_ready,
            tok=tok,
            lay=lay,
            out=out,
            heap=heap,
            sync=sync,
            k=k,
        )
    else:
        _expand_role(
            expander=pid - sync.num_senders - num_forwarders,
            num_expanders=num_programs - sync.num_quantizers - sync.num_senders - num_forwarders,
            send_cols=send_cols,
            node_first=node_first,
            my_ready=my_ready,
            tok=tok,
            lay=lay,
            out=out,
            heap=heap,
            sync=sync,
            k=k,
        )


# The signature is laid out by hand, a group of arguments a line (ruff leaves it so): one argument
# a line would make it most of the function.
@triton.jit(do_not_specialize=UNSPECIALISED + SAME_ON_EVERY_RANK)
def dispatch_kernel(
    # Tokens: this rank's rows and their routing. x [T, H], row stride x_stride (FP8 rows:
    # [T, H / 4] int32 words of e4m3 values); FP8 rows' x_scales [T, SCALE_WORDS] float32 as int32
    # words, row stride x_scales_stride; topk_idx [T, K] int32/int64; topk_weights [T, K] float32
    # (unused unless HAS_WEIGHTS); hidden: columns of a staged row (FP8 rows: words, values then
    # scales, then padding); data_cols: columns of a row of recv_x (hidden; FP8 rows: H / 4 words)
    x_ptr, x_stride, x_scales_ptr, x_scales_stride, topk_idx_ptr, topk_weights_ptr, num_tokens,
    topk, hidden, data_cols, num_experts, experts_per_rank, rank,
    # Outputs' size, and the split of the launch into roles: N rows of recv_x; the first P
    # programs send, the others expand; column slices of an own chunk and column parts of a
    # staged work item in the expansion
    num_out_rows, num_senders, expand_slices, staged_parts,
    # Layout: the layout kernel's tables (kernels/route.py), int32: slot_pos [T, K],
    # token_rank_pos [T, W], send_chunk_start [NC_MAX + 1, W], chunk_expert_base [NC + 1, E],
    # recv_chunk_start [W, NC_MAX + 1], recv_src_tokens [W], expert_layout [3, L]; info [4] int64
    slot_pos_ptr, token_rank_pos_ptr, send_chunk_start_ptr, chunk_expert_base_ptr,
    recv_chunk_start_ptr, recv_src_tokens_ptr, expert_layout_ptr, info_ptr,
    # Outputs
    staged_rows_ptr,  # [W, T_MAX, MS] int32: expert-major rows of each staged row, or -1
    recv_x_ptr,  # [N, H] (FP8 rows: [N, H / 4] int32 words)
    recv_scales_ptr,  # FP8 rows: [N, SCALE_WORDS] float32 as int32 words; else unused
    recv_weights_ptr,  # [N] float32, with TOKEN_ROWS [N, K] (unused unless HAS_WEIGHTS)
    recv_topk_idx_ptr,  # [N, K] of topk_idx's dtype with TOKEN_ROWS and WRITE_ROWS, else unused
    recv_src_idx_ptr,  # [N] int32 with TOKEN_ROWS and WRITE_ROWS, else unused
    # Heap: peers' bases and the regions' offsets in the symmetric heap
    peer_bases_ptr, ready_off, chunk_flags_off, meta_rows_off, meta_weights_off, staging_off,
    # Sync: the control block, the bound of every wait, the mask (kernels/peers.py)
    control_ptr, timeout_ns, mask_off,
    # Across nodes: layout tables (int32: token_node_pos [T, N], send_chunk_node_start
    # [NC_MAX + 1, N], recv_net_chunk_start [N, NC_MAX + 1]), the forwarded rows (out: fwd_rows
    # [N, T_MAX, R] int32, the rows of each forwarded row at every node rank), network regions
    token_node_pos_ptr, send_chunk_node_start_ptr, recv_net_chunk_start_ptr, fwd_rows_ptr,
    net_bases_ptr, net_flags_off, net_inbox_off, net_outbox_off, heap_bytes,
    # Quantizing (QUANTIZE): the rows to quantize ([T, H] of the Buffer's dtype), their flags
    # (int64 [NC_MAX, QUANT_SLICES]: seq once the item is in x), the quantizers (the first
    # programs; else 0)
    source_ptr, source_stride, quantized_flags_ptr, num_quantizers,
    # Exact mode (OUTPUTS_FROM_HOST): the host's record of the outputs, int64 [8] in its pinned
    # memory as an address, and the tag of the record it writes there (else -1)
    outputs_addr, outputs_tag,
    # Meta-parameters (the glossary in kernels/__init__.py)
    W: tl.constexpr, T_MAX: tl.constexpr, NC_MAX: tl.constexpr,
    H_SLICES: tl.constexpr,  # column slices per chunk sent: work items are (chunk, slice)
    P_MAX: tl.constexpr, MS: tl.constexpr, MS_P2: tl.constexpr, K_P2: tl.constexpr,
    W_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    WRITE_ROWS: tl.constexpr,  # False for a cached dispatch: its handle has them already
    TOKEN_ROWS: tl.constexpr,  # one output row per (token, this rank), not per (token, expert)
    STAGES: tl.constexpr,  # tile loads in flight in the copies from x (shared-memory pipeline)
    R: tl.constexpr, R_P2: tl.constexpr,  # ranks per node
    NODES: tl.constexpr,  # 1: every transfer over NVLink; else senders and forwarders
    # The NetSlot's shape (see the planner)
    META_INTS: tl.constexpr, META_FLOATS: tl.constexpr, NET_COLS: tl.constexpr,
    DATA_OFF: tl.constexpr, SLOT_BYTES: tl.constexpr,
    SCALE_WORDS: tl.constexpr,  # 0; block-scaled rows: the scale words after a row's data words
    QUANTIZE: tl.constexpr,  # the quantizer (kernels/quantize.py) of rows this launch quantizes
    # from source into x, x_scales as it sends them; NO_QUANTIZER: x holds the rows
    CHANNEL_GROUPS: tl.constexpr,  # QUANTIZE: 128-channel groups of a row (H / 128)
    OUTPUTS_FROM_HOST: tl.constexpr,  # N and the output pointers come from a host record
):  # fmt: skip
    pid = tl.program_id(0) - num_quantizers  # quantizers < 0 <= senders
    num_programs = tl.num_programs(0)
    seq = tl.load(control_ptr + DATA_SEQ) + 1
    status_ptr = control_ptr + STATUS
    # Invalid routing on any rank: every rank saw it in the layout exchange and moves nothing.
    aborted = tl.load(info_ptr + INFO_SOURCE) >= 0
    # The arguments in bundles for the roles, in the order of their fields (a group a line).
    tok = Tokens(
        *(rank, x_ptr, x_stride, x_scales_ptr, x_scales_stride, topk_idx_ptr, topk_weights_ptr),
        *(num_tokens, topk, hidden, data_cols, num_experts, experts_per_rank),
        *(source_ptr, source_stride),
    )
    lay = Layout(
        *(slot_pos_ptr, token_rank_pos_ptr, send_chunk_start_ptr, chunk_expert_base_ptr),
        *(recv_chunk_start_ptr, recv_src_tokens_ptr, expert_layout_ptr, info_ptr),
        *(token_node_pos_ptr, send_chunk_node_start_ptr, recv_net_chunk_start_ptr),
    )
    out = Outputs(
        *(num_out_rows, staged_rows_ptr, recv_x_ptr, recv_scales_ptr, recv_weights_ptr),
        *(recv_topk_idx_ptr, recv_src_idx_ptr, fwd_rows_ptr),
    )
    heap = Heap(
        *(peer_bases_ptr, ready_off, chunk_flags_off, meta_rows_off, meta_weights_off),
        *(staging_off, net_bases_ptr, net_flags_off, net_inbox_off, net_outbox_off, heap_bytes),
    )
    sync = Sync(
        *(control_ptr, status_ptr, seq, timeout_ns, aborted, num_quantizers, num_senders),
        *(expand_slices, staged_parts, quantized_flags_ptr, outputs_addr, outputs_tag, rank),
        *(region(peer_bases_ptr, rank, mask_off, tl.int64), peer_bases_ptr, net_bases_ptr),
        mask_off,
    )
    k: tl.constexpr = DispatchConsts(
        *(W, T_MAX, NC_MAX, H_SLICES, P_MAX, MS, MS_P2, K_P2, CHUNK, BLOCK_H, HAS_WEIGHTS),
        *(WRITE_ROWS, TOKEN_ROWS, STAGES, R, R_P2, NODES, META_INTS, META_FLOATS, NET_COLS),
        *(DATA_OFF, SLOT_BYTES, SCALE_WORDS, QUANTIZE, CHANNEL_GROUPS, OUTPUTS_FROM_HOST),
    )
    _roles(pid=pid, tok=tok, lay=lay, out=out, heap=heap, sync=sync, num_programs=num_programs, k=k)
    finish_launch(control_ptr, seq, num_programs)
