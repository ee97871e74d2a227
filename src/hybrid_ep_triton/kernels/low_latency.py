"""Low-latency mode: dispatch and combine for decode, one launch each (two with a receive hook),
no count exchange before data moves, fixed output shapes (DeepEP V1's low-latency calls).

Every call has a sequence number ``seq`` (dispatch and combine count together, in the control
block's LL_SEQ) and uses the receive area of its parity in every heap (runtime/planner.py,
LowLatencyLayout). Flags only grow: a block's flag holds (seq << 32) | rows, so an old flag
never satisfies a newer wait, and nothing is ever cleaned.

Dispatch, send role, program (global expert e, block c): scan this rank's topk_idx for e. The
entries that name e, in token order, are e's list; rows [c * RB, (c + 1) * RB) of it go
- when e is local, straight into this rank's outputs with their source token indices: own rows
  come first among an expert's rows, so their place needs nobody's counts;
- else into the receive block (e, this rank) of e's rank, each row behind a 16-byte header
  holding its token index: peer stores within a node, one put-with-signal per block across
  nodes (from this rank's send area, as a NIC reads only registered memory). Then the block's
  flag, which carries the list's length: the count travels behind the rows.
FP8 rows are quantized as they are sent (DeepEP's low-latency cast, ``_fp8_scales``).

Dispatch, receive role, program (local expert e, source position q): the sources of an
expert's rows in order are this rank, then the others by rank. Wait for the lengths of the
sources up to q, which place q's rows; copy q's blocks as their flags come; write src_info,
layout_range and, for the last source, recv_count.

Combine, send role, program (local expert e, other rank j, block c): e's rows from j
(layout_range) go back into j's receive block of expert e, at the positions they had in j's
list, then the block's flag. Combine, receive role, program (token, column slice): the token's
weighted sum in fp32 of its expert rows, its own experts' read straight from the input, the
others' from the receive blocks once their flags are up.

A sender of call seq overwrites what call seq - 2 received: it first waits until the
destination's receive of seq - 2 is over (``ll_freed``, which each rank's last receiving
program pushes to every other rank). Every wait is bounded by timeout_ns, as in normal mode.
A rank whose host refused a call's inputs still runs it, with no rows and REFUSED in its flags:
no peer waits, every peer records the rank in LL_REFUSED (Buffer.check raises it).

In the code each role is a function taking the kernel's arguments in bundles (Tokens, Outputs,
LowLatencyHeap, LowLatencySync, LowLatencyConsts); ``_roles`` picks each program's role, and
``_finish`` ends a launch.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import (
    LL_REFUSED,
    LL_SEQ,
    LL_TICKET,
    STAGE_LL_COMBINE,
    STAGE_LL_DISPATCH,
    STAGE_LL_FREED,
    STATUS,
)
from .primitives import (
    SAME_ON_EVERY_RANK,
    net_put_signal,
    net_signal,
    region,
    signal,
    wait_at_least,
)
from .quantize import E4M3_MAX, to_e4m3_bits

# A flag's rows field (its low 32 bits) with this bit: the source's host refused the call.
REFUSED = tl.constexpr(1 << 30)
ROWS_MASK = tl.constexpr((1 << 30) - 1)
# DeepEP's low-latency FP8 cast: amax floored at 1e-4, a scale as a product with
# float32(1 / 448) (kFP8Margin, kFinfoAmaxInvE4M3 in its legacy utils.cuh).
AMAX_MARGIN = tl.constexpr(1e-4)
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)
# Bytes in front of a staged dispatch row: its source token index (int32), then padding.
HEADER = tl.constexpr(16)

# The kernels' arguments in bundles (as in kernels/combine.py: namedtuples of runtime values,
# LowLatencyConsts built in the call that passes it).
DispatchRows = namedtuple(
    "DispatchRows", "rank x_ptr x_stride topk_ptr slots_ptr num_tokens hidden"
)
Received = namedtuple(
    "Received",
    "recv_ptr scales_ptr src_info_ptr layout_range_ptr recv_count_ptr stats_ptr rows row_bytes "
    "scale_plane scale_row_step scale_step",
)
CombineRows = namedtuple(
    "CombineRows",
    "rank x_ptr x_plane x_row topk_ptr slots_ptr weights_ptr num_tokens hidden layout_range_ptr "
    "out_ptr rows slices",
)
LowLatencyHeap = namedtuple(
    "LowLatencyHeap",
    "peer_bases_ptr net_bases_ptr heap_bytes freed_off flags_off own_off staging_off send_off",
)
LowLatencySync = namedtuple(
    "LowLatencySync", "control_ptr status_ptr timeout_ns scratch_ptr seq_ptr refused"
)
LowLatencyConsts = namedtuple(
    "LowLatencyConsts",
    "W L B M C RB K K_P2 SCAN ROWS BLOCK_H GROUPS G_P2 ROW_BYTES FP8 ROUND UE8M0 ALIGNED "
    "HAS_STATS ZERO_COPY NODES",
)


# -- flags ---------------------------------------------------------------------------------


@triton.jit
def _flag_value(seq, rows):
    """A block flag: (seq << 32) | rows."""
    return (seq.to(tl.int64) << 32) | rows


@triton.jit
def _wait_flag(flag_ptr, seq, sync, peer, stage):
    """Wait for the flag of call ``seq`` at ``flag_ptr``; returns its rows field (the REFUSED
    bit included)."""
    wait_at_least(flag_ptr, seq.to(tl.int64) << 32, sync.timeout_ns, sync.status_ptr, peer,
                  stage)  # fmt: skip
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    return (value & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _rows_sent(rows, source, rank, sync):
    """The rows a flag's ``rows`` field says ``source`` sent: 0 where it refused the call,
    which LL_REFUSED then records for a source that is not this ``rank`` (the first such
    source + 1; a rank's host raises its own refusal)."""
    refused = (rows & REFUSED) != 0
    if refused & (source != rank):
        tl.atomic_cas(sync.control_ptr + LL_REFUSED, tl.zeros([], tl.int64),
                      source.to(tl.int64) + 1)  # fmt: skip
    return tl.where(refused, 0, rows & ROWS_MASK)


@triton.jit
def _wait_freed(peer, seq, rank, heap, sync):
    """Before writing into ``peer``'s receive area for call ``seq``: wait until its receive of
    call seq - 2, which used the same area, is over."""
    my_freed = region(heap.peer_bases_ptr, rank, heap.freed_off, tl.int64)
    wait_at_least(my_freed + peer, seq - 2, sync.timeout_ns, sync.status_ptr, peer,
                  STAGE_LL_FREED)  # fmt: skip


@triton.jit
def _heap_address(heap, rank, offset):
    """The address (int64) of byte ``offset`` of ``rank``'s heap, 0 on another node."""
    return tl.load(heap.peer_bases_ptr + rank) + offset


@triton.jit
def _dispatch_block(expert_local, source, owner, k):
    """Dispatch: the receive block of (local expert, source != owner) on ``owner``."""
    return expert_local * (k.W - 1) + source - (source > owner).to(tl.int32)


@triton.jit
def _combine_block(expert, receiver, k):
    """Combine: the receive block of global ``expert`` (not ``receiver``'s) on ``receiver``."""
    return expert - k.L * (expert >= receiver * k.L).to(tl.int32)


@triton.jit
def _source_in_order(q, rank):
    """The source at position q of a local expert's rows: this rank, then the others by rank."""
    other = q - 1
    return tl.where(q == 0, rank, other + (other >= rank).to(tl.int32))


# -- moving rows ---------------------------------------------------------------------------


@triton.jit
def _copy_rows(src, dst, rmask, num_cols, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Copy ``num_cols`` elements of each row from ``src`` to ``dst`` (pointers [ROWS], the
    rows' first elements) where ``rmask``; ALIGNED: every row starts 16-byte aligned."""
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    for c0 in range(0, num_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < num_cols)[None, :]
        tile = tl.load(src[:, None] + cols[None, :], mask=mask, cache_modifier=".cg")
        tl.store(dst[:, None] + cols[None, :], tile, mask=mask)


@triton.jit
def _fp8_scales(amax, ROUND: tl.constexpr):
    """DeepEP's low-latency cast of 128-channel blocks whose largest magnitudes are ``amax``
    (fp32): (the factor into e4m3's range, the scale stored). ROUND: both powers of two, the
    scale 2^ceil(log2(a / 448))."""
    a = tl.maximum(amax, AMAX_MARGIN)
    scale = a * INV_E4M3_MAX
    if ROUND:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        factor = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        scale = ((127 + exponent) << 23).to(tl.float32, bitcast=True)
    else:
        factor = tl.math.div_rn(tl.full(a.shape, E4M3_MAX, tl.float32), a)
    return factor, scale


@triton.jit
def _store_scales(scale_rows, groups, scales, mask, step, UE8M0: tl.constexpr):
    """Store ``scales`` [ROWS, G] (float32) of 128-channel ``groups`` [G]: at scale_rows[:,
    None] + groups * step (float32 pointers), or with UE8M0 their exponent bytes, four groups
    to a 32-bit word, at scale_rows[:, None] + groups // 4 * step + groups % 4 (uint8)."""
    if UE8M0:
        exponent = (scales.to(tl.int32, bitcast=True) >> 23) & 0xFF
        where = scale_rows[:, None] + (groups // 4 * step + groups % 4)[None, :]
        tl.store(where, exponent.to(tl.uint8), mask=mask)
    else:
        tl.store(scale_rows[:, None] + (groups * step)[None, :], scales, mask=mask)


@triton.jit
def _quantize_rows(src, values, scale_rows, rmask, hidden, scale_step, ROUND: tl.constexpr,
                   UE8M0: tl.constexpr, GROUPS: tl.constexpr):  # fmt: skip
    """FP8 rows: the rows at ``src`` (pointers [ROWS]) as e4m3 bits at ``values`` (uint8
    pointers [ROWS]) and their scales from ``scale_rows`` (``_store_scales``), GROUPS
    128-channel groups at a time."""
    channels = tl.arange(0, 128)
    for g0 in range(0, hidden // 128, GROUPS):
        groups = g0 + tl.arange(0, GROUPS)
        gmask = rmask[:, None] & (groups < hidden // 128)[None, :]
        cols = groups[:, None] * 128 + channels[None, :]
        x = tl.load(src[:, None, None] + cols[None, :, :], mask=gmask[:, :, None], other=0.0)
        x = x.to(tl.float32)
        factor, scales = _fp8_scales(tl.max(tl.abs(x), axis=2), ROUND)
        bits = to_e4m3_bits(x * factor[:, :, None]).to(tl.uint8)
        tl.store(values[:, None, None] + cols[None, :, :], bits, mask=gmask[:, :, None])
        _store_scales(scale_rows, groups, scales, gmask, scale_step, UE8M0)


@triton.jit
def _send_token_rows(src, dst, scale_rows, rmask, hidden, scale_step, UE8M0: tl.constexpr, k):
    """Token rows ``src`` (pointers into x) to ``dst`` (uint8 pointers [ROWS]): as they are, or
    with k.FP8 quantized, their scales from ``scale_rows`` (float32 pointers, or uint8 with
    UE8M0)."""
    if k.FP8:
        _quantize_rows(src, dst, scale_rows, rmask, hidden, scale_step, k.ROUND, UE8M0, k.GROUPS)
    else:
        dst = dst.to(tl.pointer_type(src.dtype.element_ty), bitcast=True)
        _copy_rows(src, dst, rmask, hidden, k.ALIGNED, k.BLOCK_H)


@triton.jit
def _output_rows(out, expert_local, position):
    """Rows ``position`` [ROWS] of local expert ``expert_local`` of recv_x: (their first bytes,
    their first scales)."""
    row = expert_local.to(tl.int64) * out.rows + position
    scale_row = (out.scales_ptr + expert_local.to(tl.int64) * out.scale_plane
                 + position * out.scale_row_step)  # fmt: skip
    return out.recv_ptr + row * out.row_bytes, scale_row


# -- dispatch ------------------------------------------------------------------------------


@triton.jit
def _list_rows(tokens, expert, first, scratch, k):
    """Scan this rank's topk_idx for ``expert``: its list is the entries (t, slot) that name
    it, in token order. Writes the entries i = t * K + slot of list rows [first, first + RB) to
    ``scratch`` [RB] and their positions in the list to token_slots[i]; returns the list's
    length."""
    entries = tokens.num_tokens * k.K
    length = 0
    for i0 in range(0, entries, k.SCAN):
        i = i0 + tl.arange(0, k.SCAN)
        named = tl.load(tokens.topk_ptr + i, mask=i < entries, other=-1) == expert
        position = length + tl.cumsum(named.to(tl.int32), axis=0) - 1
        mine = named & (position >= first) & (position < first + k.RB)
        tl.store(scratch + position - first, i, mask=mine)
        tl.store(tokens.slots_ptr + i, position, mask=mine)
        length += tl.sum(named.to(tl.int32), axis=0)
    tl.debug_barrier()  # the scratch rows, written by other threads, are read next
    return length


@triton.jit
def _dispatch_send_role(program, seq, tokens, out, heap, sync, k):
    """Program (expert e, block c). Waits, before writing into another rank's receive area,
    for that rank's receive of call seq - 2 to be over. Releases the block's flag (for a local
    expert's block 0, its own count) with the list's length."""
    blocks = tl.cdiv(tl.maximum(tokens.num_tokens, 1), k.RB)
    expert = program // blocks
    c = program % blocks
    owner = expert // k.L
    expert_local = expert % k.L
    rank = tokens.rank
    scratch = sync.scratch_ptr + program * k.RB
    length = _list_rows(tokens, expert, c * k.RB, scratch, k)
    block_rows = tl.minimum(tl.maximum(length - c * k.RB, 0), k.RB)
    flag = _flag_value(seq, length | tl.where(sync.refused != 0, REFUSED, 0))
    parity = seq % 2
    if owner == rank:
        # Own rows: straight into the outputs, at the head of the expert's rows.
        for r0 in range(0, block_rows, k.ROWS):
            position = c * k.RB + r0 + tl.arange(0, k.ROWS)
            rmask = (position < c * k.RB + block_rows) & (position < out.rows)
            token = tl.load(scratch + position - c * k.RB, mask=rmask, other=0) // k.K
            tl.store(out.src_info_ptr + expert_local * out.rows + position, token, mask=rmask)
            values, scale_rows = _output_rows(out, expert_local, position)
            _send_token_rows(tokens.x_ptr + token.to(tl.int64) * tokens.x_stride, values,
                             scale_rows, rmask, tokens.hidden, out.scale_step, k.UE8M0,
                             k)  # fmt: skip
        if c == 0:
            own = region(heap.peer_bases_ptr, rank, heap.own_off, tl.int64)
            signal(own + parity * k.L + expert_local, flag)
    elif (c == 0) | (block_rows > 0):
        _wait_freed(owner, seq, rank, heap, sync)
        b = _dispatch_block(expert_local, rank, owner, k)
        block_off = heap.staging_off + ((parity * k.B + b) * k.M + c * k.RB) * k.ROW_BYTES
        flag_off = heap.flags_off + ((parity * k.B + b) * k.C + c) * 8
        on_node = tl.load(heap.peer_bases_ptr + owner) != 0
        if on_node:
            block = _heap_address(heap, owner, block_off)
        else:  # through this rank's send area, rows by (expert, position)
            block = _heap_address(heap, rank, heap.send_off + (expert * k.M + c * k.RB)
                                  * k.ROW_BYTES)  # fmt: skip
        for r0 in range(0, block_rows, k.ROWS):
            r = r0 + tl.arange(0, k.ROWS)
            rmask = r < block_rows
            token = tl.load(scratch + r, mask=rmask, other=0) // k.K
            row = (block + r.to(tl.int64) * k.ROW_BYTES).to(tl.pointer_type(tl.uint8))
            tl.store(row.to(tl.pointer_type(tl.int32), bitcast=True), token, mask=rmask)
            payload = tl.multiple_of(row + HEADER, 16)
            _send_token_rows(
                tokens.x_ptr + token.to(tl.int64) * tokens.x_stride, payload,
                (payload + tokens.hidden).to(tl.pointer_type(tl.float32), bitcast=True), rmask,
                tokens.hidden, 1, False, k,
            )  # fmt: skip
        if on_node:
            signal(_heap_address(heap, owner, flag_off).to(tl.pointer_type(tl.int64)), flag)
        elif k.NODES > 1:
            if block_rows > 0:
                net_put_signal(heap.net_bases_ptr, rank, owner, block_off, block,
                               block_rows * k.ROW_BYTES, flag_off, flag,
                               heap.heap_bytes)  # fmt: skip
            else:
                net_signal(heap.net_bases_ptr, owner, flag_off, flag)


@triton.jit
def _copy_staged_rows(staged, values, scale_rows, rmask, hidden, scale_step, dtype: tl.constexpr,
                      k):  # fmt: skip
    """Staged dispatch payloads (uint8 pointers [ROWS]) into output rows ``values`` (uint8
    pointers): rows of ``dtype``, or FP8 values (moved as words) with their float32 scales
    stored as the output's (``_store_scales``)."""
    if k.FP8:
        words = tl.multiple_of(staged.to(tl.pointer_type(tl.int32), bitcast=True), 16)
        _copy_rows(words, values.to(tl.pointer_type(tl.int32), bitcast=True), rmask,
                   hidden // 4, True, k.BLOCK_H)  # fmt: skip
        groups = tl.arange(0, k.G_P2)
        gmask = rmask[:, None] & (groups < hidden // 128)[None, :]
        staged_scales = (staged + hidden).to(tl.pointer_type(tl.float32), bitcast=True)
        scales = tl.load(staged_scales[:, None] + groups[None, :], mask=gmask)
        _store_scales(scale_rows, groups, scales, gmask, scale_step, k.UE8M0)
    else:
        _copy_rows(staged.to(tl.pointer_type(dtype), bitcast=True),
                   values.to(tl.pointer_type(dtype), bitcast=True), rmask, hidden, k.ALIGNED,
                   k.BLOCK_H)  # fmt: skip


@triton.jit
def _dispatch_receive_role(program, seq, tokens, out, heap, sync, k):
    """Program (local expert e, source position q). Waits for the lengths of the sources at
    positions 0..q (position 0: this rank's own count), then for each block of q's rows.
    Releases nothing: writes q's rows of recv_x with their src_info, its layout_range entry,
    and after the last source recv_count (and adds it into the statistics)."""
    expert_local = program // k.W
    q = program % k.W
    rank = tokens.rank
    parity = seq % 2
    first = 0
    length = 0
    for place in range(0, q + 1):
        source = _source_in_order(place, rank)
        if place == 0:
            flag_off = heap.own_off + (parity * k.L + expert_local) * 8
        else:
            b = _dispatch_block(expert_local, source, rank, k)
            flag_off = heap.flags_off + (parity * k.B + b) * k.C * 8
        flag = _heap_address(heap, rank, flag_off).to(tl.pointer_type(tl.int64))
        first += length
        sent = _wait_flag(flag, seq, sync, source, STAGE_LL_DISPATCH)
        length = _rows_sent(sent, source, rank, sync)
    source = _source_in_order(q, rank)
    if q > 0:
        b = _dispatch_block(expert_local, source, rank, k)
        for c in range(0, tl.cdiv(length, k.RB)):
            if c > 0:
                flag_off = heap.flags_off + ((parity * k.B + b) * k.C + c) * 8
                flag = _heap_address(heap, rank, flag_off).to(tl.pointer_type(tl.int64))
                _wait_flag(flag, seq, sync, source, STAGE_LL_DISPATCH)
            block_off = heap.staging_off + ((parity * k.B + b) * k.M + c * k.RB) * k.ROW_BYTES
            block = _heap_address(heap, rank, block_off)
            for r0 in range(0, tl.minimum(length - c * k.RB, k.RB), k.ROWS):
                r = c * k.RB + r0 + tl.arange(0, k.ROWS)
                position = first + r
                rmask = (r < length) & (position < out.rows)
                staged = (block + (r - c * k.RB).to(tl.int64) * k.ROW_BYTES).to(
                    tl.pointer_type(tl.uint8)
                )
                token = tl.load(staged.to(tl.pointer_type(tl.int32), bitcast=True), mask=rmask)
                tl.store(out.src_info_ptr + expert_local * out.rows + position, token, mask=rmask)
                values, scale_rows = _output_rows(out, expert_local, position)
                _copy_staged_rows(tl.multiple_of(staged + HEADER, 16), values, scale_rows, rmask,
                                  tokens.hidden, out.scale_step,
                                  tokens.x_ptr.dtype.element_ty, k)  # fmt: skip
    tl.store(out.layout_range_ptr + expert_local * k.W + source,
             (first.to(tl.int64) << 32) | length)  # fmt: skip
    if q == k.W - 1:
        received = tl.minimum(first + length, out.rows)
        tl.store(out.recv_count_ptr + expert_local, received)
        if k.HAS_STATS:
            tl.atomic_add(out.stats_ptr + expert_local, received)


# -- combine -------------------------------------------------------------------------------


@triton.jit
def _combine_send_role(program, seq, rows, heap, sync, k):
    """Program (local expert e, other rank j, block c): the rows of e from j (layout_range) go
    back into j's receive block of e, at the positions they had in j's list (a refused call:
    no rows, every block a peer could wait for). Waits for j's receive of call seq - 2 to be
    over. Releases the block's flag."""
    blocks = tl.cdiv(rows.rows // k.W, k.RB)
    c = program % blocks
    expert_local = program // blocks // (k.W - 1)
    rank = rows.rank
    j = program // blocks % (k.W - 1)
    j += (j >= rank).to(tl.int32)
    span = tl.load(rows.layout_range_ptr + expert_local * k.W + j, mask=sync.refused == 0,
                   other=0)  # fmt: skip
    first = (span >> 32).to(tl.int32)
    length = tl.where(sync.refused != 0, blocks * k.RB, (span & 0xFFFFFFFF).to(tl.int32))
    if c * k.RB < length:
        block_rows = tl.where(sync.refused != 0, 0, tl.minimum(length - c * k.RB, k.RB))
        _wait_freed(j, seq, rank, heap, sync)
        parity = seq % 2
        b = _combine_block(rank * k.L + expert_local, j, k)
        dtype = rows.x_ptr.dtype.element_ty
        row_size = rows.hidden * (dtype.primitive_bitwidth // 8)
        block_off = (heap.staging_off + (parity * k.B + b) * k.M * k.ROW_BYTES
                     + c * k.RB * row_size)  # fmt: skip
        flag_off = heap.flags_off + ((parity * k.B + b) * k.C + c) * 8
        flag = _flag_value(seq, tl.where(sync.refused != 0, REFUSED, 0))
        src = (rows.x_ptr + expert_local.to(tl.int64) * rows.x_plane
               + (first + c * k.RB).to(tl.int64) * rows.x_row)  # fmt: skip
        if tl.load(heap.peer_bases_ptr + j) != 0:
            dst = _heap_address(heap, j, block_off).to(tl.pointer_type(dtype))
            _copy_block(src, rows.x_row, dst, rows.hidden, block_rows, rows.hidden, k)
            signal(_heap_address(heap, j, flag_off).to(tl.pointer_type(tl.int64)), flag)
        elif k.NODES > 1:
            # A put's source is this rank's send area, the buffer [L, rows, H] that
            # get_next_low_latency_combine_buffer hands out (with ZERO_COPY, x itself).
            area = _heap_address(heap, rank, heap.send_off).to(tl.pointer_type(dtype))
            first_row = area + (expert_local.to(tl.int64) * rows.rows + first + c * k.RB) * (
                rows.hidden
            )
            if not k.ZERO_COPY:
                _copy_block(src, rows.x_row, first_row, rows.hidden, block_rows, rows.hidden, k)
            if block_rows > 0:
                net_put_signal(heap.net_bases_ptr, rank, j, block_off, first_row,
                               block_rows * row_size, flag_off, flag,
                               heap.heap_bytes)  # fmt: skip
            else:
                net_signal(heap.net_bases_ptr, j, flag_off, flag)


@triton.jit
def _copy_block(src, src_stride, dst, dst_stride, num_rows, num_cols, k):
    """Copy ``num_rows`` rows of ``num_cols`` elements from ``src`` (the first row's first
    element; rows ``src_stride`` apart) to ``dst`` (rows ``dst_stride`` apart), k.ROWS at a
    time."""
    for r0 in range(0, num_rows, k.ROWS):
        r = (r0 + tl.arange(0, k.ROWS)).to(tl.int64)
        _copy_rows(src + r * src_stride, dst + r * dst_stride, r < num_rows, num_cols,
                   k.ALIGNED, k.BLOCK_H)  # fmt: skip


@triton.jit
def _combine_receive_role(program, seq, rows, heap, sync, k):
    """Program (token t, column slice s): out[t] over the slice's columns, the sum in fp32 of
    weight * expert row over t's valid slots: rows of this rank's experts straight from x, the
    others' from the receive blocks. Waits for each of those blocks' flags (a refused one's
    rows count as absent). Releases nothing."""
    t = program // rows.slices
    s = program % rows.slices
    rank = rows.rank
    parity = seq % 2
    dtype = rows.x_ptr.dtype.element_ty
    refused = 0
    for slot in range(0, k.K):
        expert = tl.load(rows.topk_ptr + t * k.K + slot).to(tl.int32)
        owner = expert // k.L
        if (expert >= 0) & (owner != rank):
            position = tl.load(rows.slots_ptr + t * k.K + slot)
            b = _combine_block(expert, rank, k)
            flag_off = heap.flags_off + ((parity * k.B + b) * k.C + position // k.RB) * 8
            flag = _heap_address(heap, rank, flag_off).to(tl.pointer_type(tl.int64))
            sent = _wait_flag(flag, seq, sync, owner, STAGE_LL_COMBINE)
            if (sent & REFUSED) != 0:
                _rows_sent(sent, owner, rank, sync)
                refused |= 1 << slot
    slots = tl.arange(0, k.K_P2)
    entry = t * k.K + slots
    expert = tl.load(rows.topk_ptr + entry, mask=slots < k.K, other=-1).to(tl.int32)
    valid = (expert >= 0) & (((refused >> slots) & 1) == 0)
    expert = tl.where(valid, expert, 0)
    position = tl.load(rows.slots_ptr + entry, mask=valid, other=0).to(tl.int64)
    weight = tl.load(rows.weights_ptr + entry, mask=valid, other=0.0)
    own = expert // k.L == rank
    own_row = rows.x_ptr + (expert % k.L).to(tl.int64) * rows.x_plane + position * rows.x_row
    b = _combine_block(expert, rank, k)
    staged = _heap_address(heap, rank, heap.staging_off + (parity * k.B + b).to(tl.int64)
                           * k.M * k.ROW_BYTES).to(tl.pointer_type(dtype))  # fmt: skip
    src = tl.where(own, own_row, staged + position * rows.hidden)
    part = tl.cdiv(tl.cdiv(rows.hidden, rows.slices), k.BLOCK_H) * k.BLOCK_H
    for c0 in range(s * part, tl.minimum((s + 1) * part, rows.hidden), k.BLOCK_H):
        cols = c0 + tl.arange(0, k.BLOCK_H)
        cmask = cols < rows.hidden
        tile = tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :],
                       other=0.0)  # fmt: skip
        total = tl.sum(tile.to(tl.float32) * weight[:, None], axis=0)
        tl.store(rows.out_ptr + t.to(tl.int64) * rows.hidden + cols, total.to(dtype), mask=cmask)


# -- launches ------------------------------------------------------------------------------


@triton.jit
def _call_seq(sync, SEND: tl.constexpr):
    """The call's sequence number: a launch that sends starts the next call (and its first
    program writes the number where a later receive launch of the call reads it)."""
    if SEND:
        seq = tl.load(sync.control_ptr + LL_SEQ) + 1
        if tl.program_id(0) == 0:
            tl.store(sync.seq_ptr, seq)
    else:
        seq = tl.load(sync.seq_ptr)
    return seq


@triton.jit
def _finish(seq, rank, heap, sync, k, SEND: tl.constexpr, RECEIVE: tl.constexpr):
    """Each program takes a ticket; the last one resets the tickets, and where the launch sent
    publishes ``seq`` as the last call's number, where it received tells every other rank
    that its receive of call ``seq`` is over (ll_freed)."""
    ticket = tl.atomic_add(sync.control_ptr + LL_TICKET, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.store(sync.control_ptr + LL_TICKET, 0)
        if SEND:
            tl.store(sync.control_ptr + LL_SEQ, seq)
        if RECEIVE:
            for peer in range(0, k.W):
                if peer != rank:
                    if tl.load(heap.peer_bases_ptr + peer) != 0:
                        freed = region(heap.peer_bases_ptr, peer, heap.freed_off, tl.int64)
                        signal(freed + rank, seq)
                    elif k.NODES > 1:
                        net_signal(heap.net_bases_ptr, peer, heap.freed_off + rank * 8, seq)


@triton.jit(do_not_specialize=SAME_ON_EVERY_RANK)
def low_latency_dispatch_kernel(
    # Tokens: x [T, H] (row stride x_stride), topk_idx [T, K]; out: token_slots [T, K] int32
    x_ptr, x_stride, topk_ptr, slots_ptr, num_tokens, hidden, rank,
    # Outputs, rows = W * M' per local expert: recv_x [L, rows, H] as bytes (row_bytes a row),
    # its scales (float32, or uint8 with UE8M0: see Received), src_info [L, rows] int32,
    # layout_range [L, W] int64, recv_count [L] int32, statistics [L] int32, call_seq [1]
    recv_ptr, scales_ptr, src_info_ptr, layout_range_ptr, recv_count_ptr, stats_ptr, seq_ptr,
    rows, row_bytes, scale_plane, scale_row_step, scale_step,
    # Heap: every rank's base, byte offsets of the low-latency regions (send_off: the send area
    # of this call, by the host's parity)
    peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, flags_off, own_off, staging_off,
    send_off,
    # Sync: control block, bound of every wait, the send role's scratch [programs, RB] int32,
    # whether this rank's host refused the call
    control_ptr, timeout_ns, scratch_ptr, refused,
    # Meta-parameters (the glossary in kernels/__init__.py)
    W: tl.constexpr, L: tl.constexpr, B: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
    RB: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, SCAN: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, GROUPS: tl.constexpr, G_P2: tl.constexpr,
    ROW_BYTES: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr, UE8M0: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_STATS: tl.constexpr, NODES: tl.constexpr, SEND: tl.constexpr,
    RECEIVE: tl.constexpr,
):  # fmt: skip
    """Programs [0, E * blocks) send where SEND (blocks = ceil(max(T, 1) / RB)), the next
    L * W receive where RECEIVE; a launch of neither kind's programs has one, which finishes."""
    program = tl.program_id(0)
    sync = LowLatencySync(control_ptr, control_ptr + STATUS, timeout_ns, scratch_ptr, seq_ptr,
                          refused)  # fmt: skip
    seq = _call_seq(sync, SEND)
    tokens = DispatchRows(rank, x_ptr, x_stride, topk_ptr, slots_ptr, num_tokens, hidden)
    out = Received(recv_ptr, scales_ptr, src_info_ptr, layout_range_ptr, recv_count_ptr,
                   stats_ptr, rows, row_bytes, scale_plane, scale_row_step,
                   scale_step)  # fmt: skip
    heap = LowLatencyHeap(peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, flags_off,
                          own_off, staging_off, send_off)  # fmt: skip
    senders = 0
    if SEND:
        senders = W * L * tl.cdiv(tl.maximum(num_tokens, 1), RB)
    if program < senders:
        _dispatch_send_role(
            program, seq, tokens, out, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, SCAN, ROWS, BLOCK_H, GROUPS, G_P2,
                             ROW_BYTES, FP8, ROUND, UE8M0, ALIGNED, HAS_STATS, False, NODES),
        )  # fmt: skip
    elif RECEIVE and program - senders < L * W:
        _dispatch_receive_role(
            program - senders, seq, tokens, out, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, SCAN, ROWS, BLOCK_H, GROUPS, G_P2,
                             ROW_BYTES, FP8, ROUND, UE8M0, ALIGNED, HAS_STATS, False, NODES),
        )  # fmt: skip
    _finish(seq, rank, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, SCAN, ROWS, BLOCK_H, GROUPS, G_P2,
                             ROW_BYTES, FP8, ROUND, UE8M0, ALIGNED, HAS_STATS, False, NODES),
            SEND, RECEIVE)  # fmt: skip


@triton.jit(do_not_specialize=SAME_ON_EVERY_RANK)
def low_latency_combine_kernel(
    # Rows: x [L, rows, H] (strides x_plane, x_row) in recv_x's order, topk_idx [T, K],
    # token_slots [T, K] int32 (the dispatch's), topk_weights [T, K] float32
    x_ptr, x_plane, x_row, topk_ptr, slots_ptr, weights_ptr, num_tokens, hidden, rank,
    # The dispatch's layout_range [L, W] int64; out [T, H]; call_seq [1] int64; rows = W * M';
    # column slices of a token in the receive role
    layout_range_ptr, out_ptr, seq_ptr, rows, slices,
    # Heap, as for dispatch (send_off: the buffer of get_next_low_latency_combine_buffer)
    peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, flags_off, own_off, staging_off,
    send_off,
    # Sync, as for dispatch
    control_ptr, timeout_ns, refused,
    # Meta-parameters
    W: tl.constexpr, L: tl.constexpr, B: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
    RB: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, ROW_BYTES: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr, ZERO_COPY: tl.constexpr,
    NODES: tl.constexpr,
    SEND: tl.constexpr, RECEIVE: tl.constexpr,
):  # fmt: skip
    """Programs [0, L * (W - 1) * ceil(M' / RB)) send where SEND, the next T * slices receive
    where RECEIVE; a launch of neither kind's programs has one, which finishes."""
    program = tl.program_id(0)
    sync = LowLatencySync(control_ptr, control_ptr + STATUS, timeout_ns, control_ptr, seq_ptr,
                          refused)  # fmt: skip
    seq = _call_seq(sync, SEND)
    combined = CombineRows(rank, x_ptr, x_plane, x_row, topk_ptr, slots_ptr, weights_ptr,
                           num_tokens, hidden, layout_range_ptr, out_ptr, rows,
                           slices)  # fmt: skip
    heap = LowLatencyHeap(peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, flags_off,
                          own_off, staging_off, send_off)  # fmt: skip
    senders = 0
    if SEND:
        senders = L * (W - 1) * tl.cdiv(rows // W, RB)
    if program < senders:
        _combine_send_role(
            program, seq, combined, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, 0, ROWS, BLOCK_H, 0, 0, ROW_BYTES,
                             False, False, False, ALIGNED, False, ZERO_COPY, NODES),
        )  # fmt: skip
    elif RECEIVE and program - senders < num_tokens * slices:
        _combine_receive_role(
            program - senders, seq, combined, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, 0, ROWS, BLOCK_H, 0, 0, ROW_BYTES,
                             False, False, False, ALIGNED, False, ZERO_COPY, NODES),
        )  # fmt: skip
    _finish(seq, rank, heap, sync,
            LowLatencyConsts(W, L, B, M, C, RB, K, K_P2, 0, ROWS, BLOCK_H, 0, 0, ROW_BYTES,
                             False, False, False, ALIGNED, False, ZERO_COPY, NODES),
            SEND, RECEIVE)  # fmt: skip
