"""Low-latency mode: dispatch and combine for decode, one launch each (two with a receive hook),
no count exchange before data moves, fixed output shapes (DeepEP V1's low-latency calls).

Every call has a sequence number ``seq`` (dispatch and combine count together, in the control
block's LL_SEQ) and uses the receive area of its parity in every heap (runtime/planner.py,
LowLatencyLayout). Flags only grow: a flag holds (seq << LL_SEQ_SHIFT) | rows (control.py), so
an old flag never satisfies a newer wait, and nothing is ever cleaned. A row is moved in S
column slices, each by its own program and released by its own flag; a block from another node
moves whole (one put-with-signal from this rank's send area, as a NIC reads only registered
memory) and its slice 0 flag releases it all.

Dispatch. Token role, program (token t, chunk c): chunk c of t's row (GROUPS 128-channel
groups), read once; FP8: quantized, each token once. Its rows to this rank's experts go straight
into the outputs at their positions in the experts' lists (the entries before them that name the
expert): own rows come first among an expert's rows, so their place needs nobody's counts.
Where t has a slot on another rank, an FP8 chunk is also staged in this rank's send area
behind its flag. Count role, program (COUNTED local experts): counts their lists (the entries
of this rank's topk_idx that name an expert, in token order) and releases the counts. Send
role, program (expert e of another rank, slice s): e's list's rows (x's, or the staged FP8 rows) go
- into the receive block (e, this rank) of e's rank, each row behind a 16-byte header holding
  its token index; then the slice's flag, which carries the list's length: the count travels
  behind the rows;
- or to another node whole, by slice 0, through this rank's send area.
Receive role, program (local expert e, source position q >= 1): the sources of an expert's
rows in order are this rank, then the others by rank. Wait for the lengths of the sources up
to q, which place q's rows, then for q's slices; copy them, with src_info, layout_range and,
for the last source, recv_count.

Combine. Send role, program (local expert e, other rank j, slice s): e's rows from j
(layout_range) go back into j's receive block of expert e, at the positions they had in j's
list, then the slice's flag. Receive role, program (token t, slice s): t's weighted sum in
fp32 of its expert rows' slice, its own experts' rows read straight from the input, the
others' from the receive blocks once their flags are up.

A sender of call seq overwrites what call seq - 2 received: it first waits until the
destination's receive of seq - 2 is over (``ll_freed``, which each rank's last receiving
program pushes to every other rank). Every wait is bounded by timeout_ns, as in normal mode.
A rank whose host refused a call's inputs still runs it, with no rows and REFUSED in its flags:
no peer waits, every peer records the rank in LL_REFUSED (Buffer.check raises it). A dispatch
whose topk_idx holds an expert id outside [-1, E) is refused on the device alike: its count and
send programs scan the whole of topk_idx anyway, so each sees it there (a compare per entry) and
sends no rows and REFUSED flags, and the count programs record this rank itself in LL_REFUSED.
A receiver marks a refusing source LL_REFUSED_RANGE in layout_range, and a combine along that
handle sends such a source its flags all the same, with no rows: its topk_idx names experts it
sent no rows to, whose flags its combine waits for. A masked rank (kernels/peers.py:
Buffer.update_mask, or a wait on it that ran out with mask_failed_ranks) is neither sent to
nor waited for: it counts as a source of no rows, and its experts add nothing to another
rank's combine. A mask this rank sets (a wait that ran out, or by
hand) is MASKED_HERE until program 0 of its next launch tells every other rank (sets the mask
in theirs, and 1 in its own), so that their waits on that rank end too.

A launch ends with no program waiting on another: a sending launch's programs take tickets as
they start (``_start``), and the last of them publishes the call's number as it ends; only a
launch that receives from other ranks counts its programs out, to free its receive area.

In the code each role is a function taking the kernel's arguments in bundles (DispatchRows,
Received, CombineRows, LowLatencyHeap, LowLatencySync, and the meta-parameters of each kernel,
LowLatencyDispatchConsts or LowLatencyCombineConsts); the kernels pick each program's role
between ``_start`` and ``_finish``.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import (
    LL_DONE,
    LL_MAX_ROWS,
    LL_RANGE_ROWS,
    LL_RANGE_SHIFT,
    LL_REFUSED,
    LL_REFUSED_RANGE,
    LL_SEQ,
    LL_SEQ_SHIFT,
    LL_TICKET,
    MASKS_NEW,
    STAGE_LL_COMBINE,
    STAGE_LL_DISPATCH,
    STAGE_LL_FREED,
    STATUS,
)
from .peers import await_peer, await_peers, live, signal_peer, tell_new_masks
from .primitives import (
    ALIGNMENT,
    SAME_ON_EVERY_RANK,
    net_put_signal,
    net_signal,
    read_uniform,
    region,
    signal,
    wait_all_at_least,
    wait_at_least,
)
from .quantize import (
    E4M3_MAX,
    F32_BIAS,
    F32_EXPONENT_MASK,
    F32_MANTISSA_BITS,
    F32_MANTISSA_MASK,
    GROUP_CHANNELS,
    e4m3_bits,
)

# A flag's rows field (below LL_SEQ_SHIFT) with this bit: the source's host refused the call.
REFUSED = tl.constexpr(LL_MAX_ROWS.value + 1)
ROWS_MASK = LL_MAX_ROWS
ROWS_FIELD = tl.constexpr((1 << LL_SEQ_SHIFT.value) - 1)
# DeepEP's low-latency FP8 cast: amax floored at 1e-4, a scale as a product with
# float32(1 / 448) (kFP8Margin, kFinfoAmaxInvE4M3 in its legacy utils.cuh).
AMAX_MARGIN = tl.constexpr(1e-4)
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)
# Bytes in front of a staged dispatch row: its source token index (int32), then padding.
HEADER = tl.constexpr(16)
# Bytes of a 32-bit word: FP8 rows move as words of 4 e4m3 values, and a word holds the UE8M0
# scales of 4 groups.
WORD_BYTES = tl.constexpr(4)
# Local experts whose lists one program of a dispatch's count role counts.
COUNTED = tl.constexpr(8)
# The kernels' arguments in bundles: namedtuples of runtime values, and a constexpr of each
# kernel's meta-parameters (kernels/__init__.py).
DispatchRows = namedtuple(
    "DispatchRows", "rank x_ptr x_stride topk_ptr slots_ptr num_tokens hidden scratch_ptr"
)
Received = namedtuple(
    "Received",
    "recv_ptr scales_ptr src_info_ptr layout_range_ptr recv_count_ptr stats_ptr rows row_bytes "
    "scale_plane scale_row_step scale_step",
)
CombineRows = namedtuple(
    "CombineRows",
    "rank x_ptr x_plane x_row topk_ptr slots_ptr weights_ptr num_tokens hidden layout_range_ptr "
    "out_ptr rows",
)
LowLatencyHeap = namedtuple(
    "LowLatencyHeap",
    "peer_bases_ptr net_bases_ptr heap_bytes freed_off mask_off flags_off own_off quantized_off "
    "staging_off send_off",
)
LowLatencySync = namedtuple(
    "LowLatencySync",
    "rank control_ptr status_ptr timeout_ns seq_ptr refused mask_ptr bases_ptr "
    "net_bases_ptr mask_off",
)
# Each kernel's meta-parameters, in the order of its signature.
LowLatencyDispatchConsts = namedtuple(
    "LowLatencyDispatchConsts",
    "W L B M S QC_P2 K K_P2 SCAN ROWS BLOCK_H STAGES GROUPS G_P2 ROW_BYTES FP8 ROUND UE8M0 "
    "ALIGNED HAS_STATS NODES SEND RECEIVE",
)
LowLatencyCombineConsts = namedtuple(
    "LowLatencyCombineConsts",
    "W L B M S K K_P2 ROW_BYTES ROWS BLOCK_H STAGES PARTS ALIGNED ZERO_COPY NODES SEND RECEIVE",
)


# -- flags ---------------------------------------------------------------------------------


@triton.jit
def _flag_value(seq, rows):
    """A block flag: (seq << LL_SEQ_SHIFT) | rows."""
    return (seq.to(tl.int64) << LL_SEQ_SHIFT) | rows


@triton.jit
def _wait_flag(flag_ptr, seq, peer, stage, heap, sync, k):
    """Wait for the flag of call ``seq`` at ``flag_ptr`` from ``peer``, unless the peer is
    masked (``await_peer``): (whether it arrived, its rows field, the REFUSED bit included)."""
    arrived = await_peer(flag_ptr, _flag_value(seq, 0), peer, stage, sync, k.W, k.NODES)
    return arrived, _flag_rows(flag_ptr)


@triton.jit
def _flag_rows(flag_ptr):
    """The rows field of the flag at ``flag_ptr`` (REFUSED included), read with acquire."""
    flag = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    return (flag & ROWS_FIELD).to(tl.int32)


@triton.jit
def _rows_sent(rows, source, rank, sync):
    """The rows a flag's ``rows`` field says ``source`` sent: 0 where it refused the call
    (``_note_refusal``)."""
    refused = (rows & REFUSED) != 0
    if refused & (source != rank):
        _note_refusal(source, sync)
    return tl.where(refused, 0, rows & ROWS_MASK)


@triton.jit
def _note_refusal(source, sync):
    """Record in LL_REFUSED (the first one: source + 1) that ``source`` refused a call: another
    rank, or this one where its dispatch's topk_idx holds an expert id outside [-1, E) (a
    rank's host raises its own refusals)."""
    tl.atomic_cas(sync.control_ptr + LL_REFUSED, tl.zeros([], tl.int64), source.to(tl.int64) + 1)


@triton.jit
def _outside(ids, k):
    """Whether each of the expert ids ``ids`` lies outside [-1, E), compared in the ids' own
    width (an int64 id must not wrap into int32 first)."""
    return (ids < -1) | (ids >= k.W * k.L)


@triton.jit
def _wait_freed(peer, seq, heap, sync, k):
    """Before writing into ``peer``'s receive area for call ``seq``: wait until its receive of
    call seq - 2, which used the same area, is over; False if ``peer`` is (or got) masked."""
    my_freed = region(heap.peer_bases_ptr, sync.rank, heap.freed_off, tl.int64)
    return await_peer(my_freed + peer, seq - 2, peer, STAGE_LL_FREED, sync, k.W, k.NODES)


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


@triton.jit
def _flag(heap, rank, block, s, seq, k):
    """Pointer to the flag of slice ``s`` of receive block ``block`` of call ``seq``'s area in
    ``rank``'s heap."""
    offset = heap.flags_off + (((seq % 2) * k.B + block) * k.S + s) * 8
    return _heap_address(heap, rank, offset).to(tl.pointer_type(tl.int64))


@triton.jit
def _block_row(heap, rank, block, seq, k):
    """The first row (a uint8 pointer, 16-byte aligned) of receive block ``block`` of call
    ``seq``'s area in ``rank``'s heap."""
    first = ((seq % 2) * k.B + block) * k.M * k.ROW_BYTES
    # (region says the alignment, so that the rows' copies move 16 bytes at a time)
    return region(heap.peer_bases_ptr, rank, heap.staging_off + first, tl.uint8)


# -- moving rows ---------------------------------------------------------------------------


@triton.jit
def _slice(num_cols, s, k):
    """Columns [first, last) of slice ``s`` of a row of ``num_cols`` elements (slices of a
    multiple of ALIGNMENT elements, each as aligned as the row, the last one shorter)."""
    width = tl.cdiv(tl.cdiv(num_cols, k.S), ALIGNMENT) * ALIGNMENT
    return s * width, tl.minimum((s + 1) * width, num_cols)


@triton.jit
def _copy_rows(
    src, dst, rmask, first, last, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr
):
    """Copy columns [first, last) of each row from ``src`` to ``dst`` (pointers [ROWS] to the
    rows' first elements) where ``rmask``, BLOCK at a time, STAGES tiles in flight; ALIGNED:
    every row starts 16-byte aligned."""
    if ALIGNED:
        src = tl.multiple_of(src, ALIGNMENT)
        dst = tl.multiple_of(dst, ALIGNMENT)
    for c0 in tl.range(first, last, BLOCK, num_stages=STAGES):
        cols = c0 + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < last)[None, :]
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
        biased = (bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK
        exponent = biased - F32_BIAS + ((bits & F32_MANTISSA_MASK) != 0).to(tl.int32)
        factor = ((F32_BIAS.value - exponent) << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)
        scale = ((F32_BIAS.value + exponent) << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)
    else:
        factor = tl.math.div_rn(tl.full(a.shape, E4M3_MAX, tl.float32), a)
    return factor, scale


@triton.jit
def _store_scales(scale_rows, groups, scales, mask, step, UE8M0: tl.constexpr):
    """Store ``scales`` [ROWS, G] (float32) of 128-channel ``groups`` [G]: at scale_rows[:,
    None] + groups * step (float32 pointers), or with UE8M0 their exponent bytes, four groups
    to a 32-bit word, at scale_rows[:, None] + groups // 4 * step + groups % 4 (uint8)."""
    if UE8M0:
        exponent = (scales.to(tl.int32, bitcast=True) >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK
        where = scale_rows[:, None] + (groups // WORD_BYTES * step + groups % WORD_BYTES)[None, :]
        tl.store(where, exponent.to(tl.uint8), mask=mask)
    else:
        tl.store(scale_rows[:, None] + (groups * step)[None, :], scales, mask=mask)


@triton.jit
def _staged(rows):
    """Staged rows (uint8 pointers [ROWS] to their headers): (their token indices' pointers,
    their payloads as uint8 pointers)."""
    token_ptr = rows.to(tl.pointer_type(tl.int32), bitcast=True)
    return token_ptr, tl.multiple_of(rows + HEADER, ALIGNMENT)


@triton.jit
def _copy_payloads(
    src,
    dst,
    scale_rows,
    rmask,
    hidden,
    first,
    last,
    scale_step,
    UE8M0: tl.constexpr,
    COPY_SCALES: tl.constexpr,
    dtype: tl.constexpr,
    k,
):
    """Payload columns [first, last) of rows ``src`` to ``dst`` (uint8 pointers [ROWS]): rows of
    ``dtype`` (columns are elements); or with k.FP8 staged FP8 rows (columns are 32-bit words
    of the values), and with COPY_SCALES their float32 scales, stored from ``scale_rows`` as
    ``_store_scales`` does."""
    if k.FP8:
        # (words: tiles of as many bytes as the Buffer's dtype's)
        words = src.to(tl.pointer_type(tl.int32), bitcast=True)
        _copy_rows(
            words,
            dst.to(tl.pointer_type(tl.int32), bitcast=True),
            rmask,
            first,
            last,
            k.BLOCK_H // 2,
            True,
            k.STAGES,
        )
        if COPY_SCALES:
            groups = tl.arange(0, k.G_P2)
            gmask = rmask[:, None] & (groups < hidden // GROUP_CHANNELS)[None, :]
            staged_scales = (src + hidden).to(tl.pointer_type(tl.float32), bitcast=True)
            scales = tl.load(staged_scales[:, None] + groups[None, :], mask=gmask)
            _store_scales(scale_rows, groups, scales, gmask, scale_step, UE8M0)
    else:
        _copy_rows(
            src.to(tl.pointer_type(dtype), bitcast=True),
            dst.to(tl.pointer_type(dtype), bitcast=True),
            rmask,
            first,
            last,
            k.BLOCK_H,
            k.ALIGNED,
            k.STAGES,
        )


# -- dispatch ------------------------------------------------------------------------------


@triton.jit
def _token_role(program, seq, tokens, out, heap, sync, k):
    """Program (token t, chunk c): columns of GROUPS 128-channel groups of t's row, read once.
    Its rows to this rank's experts go straight into the outputs, once per slot, at their
    positions in the experts' lists (the entries before t's that name the expert), which need
    nobody's counts: own rows come first among an expert's rows. With FP8 the chunk is
    quantized first, and where t has a slot on another rank it is also staged (header, e4m3
    values, float32 scales) in this rank's send area, after the rows by (expert, position),
    for the send role to copy, behind the chunk's flag in ll_quantized (read on this GPU
    only). Chunk 0 writes t's token_slots and src_info. Waits for nothing."""
    chunks = _token_chunks(tokens.hidden, k)
    t = program // chunks
    chunk = program % chunks
    # The row first (and with FP8 its cast), so that its read overlaps the scan of the routing.
    groups = chunk * k.GROUPS + tl.arange(0, k.GROUPS)
    cols = groups[:, None] * GROUP_CHANNELS + tl.arange(0, GROUP_CHANNELS)[None, :]
    cmask = cols < tokens.hidden
    x = tl.load(tokens.x_ptr + t.to(tl.int64) * tokens.x_stride + cols, mask=cmask, other=0.0)
    if k.FP8:
        factor, scales = _fp8_scales(tl.max(tl.abs(x.to(tl.float32)), axis=1), k.ROUND)
        values = e4m3_bits(x.to(tl.float32) * factor[:, None]).to(tl.uint8)
    slots = tl.arange(0, k.K_P2)
    expert, position = _slot_positions(tokens, t, k)
    own = (expert >= 0) & (expert // k.L == tokens.rank) & (position < out.rows)
    expert_local = expert % k.L
    if chunk == 0:
        tl.store(tokens.slots_ptr + t * k.K + slots, position, mask=expert >= 0)
        tl.store(out.src_info_ptr + expert_local * out.rows + position, t, mask=own)
    # (addresses from the picked expert and position rather than picked addresses, so that
    # the compiler sees the rows' alignment, row_bytes', and stores them 16 bytes at a time)
    if k.FP8:
        gmask = groups < tokens.hidden // GROUP_CHANNELS
        for j in tl.static_range(k.K):
            if _pick(own, slots, j):
                row, scale_row = _output_rows(
                    out, _pick(expert_local, slots, j), _pick(position, slots, j)
                )
                tl.store(row + cols, values, mask=cmask)
                _store_scales(
                    scale_row + tl.zeros([1], tl.int32),
                    groups,
                    scales[None, :],
                    gmask[None, :],
                    out.scale_step,
                    k.UE8M0,
                )
        if k.W > 1:
            if tl.max(((expert >= 0) & (expert // k.L != tokens.rank)).to(tl.int32), axis=0):
                _stage_quantized(
                    t, chunk, groups, cols, cmask, values, scales, seq, tokens, heap, k
                )
    else:
        dtype = tokens.x_ptr.dtype.element_ty
        for j in tl.static_range(k.K):
            if _pick(own, slots, j):
                row, _ = _output_rows(out, _pick(expert_local, slots, j), _pick(position, slots, j))
                tl.store(row.to(tl.pointer_type(dtype), bitcast=True) + cols, x, mask=cmask)


@triton.jit
def _pick(values, slots, j):
    """Element ``j`` of ``values`` [K_P2] (a scalar: what static slot loops branch on)."""
    return tl.sum(tl.where(slots == j, values, 0), axis=0)


@triton.jit
def _slot_positions(tokens, t, k):
    """Token t's slots: (their experts [K_P2] int32, -1 where none; each slot's position in its
    expert's list: the entries before it, t's earlier slots included, that name the expert)."""
    slots = tl.arange(0, k.K_P2)
    expert = tl.load(tokens.topk_ptr + t * k.K + slots, mask=slots < k.K, other=-1).to(tl.int32)
    earlier = (expert[None, :] == expert[:, None]) & (slots[None, :] < slots[:, None])
    position = tl.sum(earlier.to(tl.int32), axis=1)
    for i0 in range(0, t * k.K, k.SCAN):
        i = i0 + tl.arange(0, k.SCAN)
        named = tl.load(tokens.topk_ptr + i, mask=i < t * k.K, other=-1).to(tl.int32)
        position += tl.sum((named[None, :] == expert[:, None]).to(tl.int32), axis=1)
    return expert, position


@triton.jit
def _stage_quantized(t, chunk, groups, cols, cmask, values, scales, seq, tokens, heap, k):
    """Chunk ``chunk`` of token t's quantized row (``values`` [GROUPS, 128] e4m3 bits,
    ``scales`` [GROUPS]) into t's staged row in this rank's send area, then the chunk's flag."""
    row = _heap_address(heap, tokens.rank, heap.send_off + ((k.B + k.L) * k.M + t) * k.ROW_BYTES)
    token_ptr, payload = _staged(row.to(tl.pointer_type(tl.uint8)))
    if chunk == 0:
        tl.store(token_ptr, t)
    tl.store(payload + cols, values, mask=cmask)
    scale_row = (payload + tokens.hidden).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_row + groups, scales, mask=groups < tokens.hidden // GROUP_CHANNELS)
    quantized = region(heap.peer_bases_ptr, tokens.rank, heap.quantized_off, tl.int64)
    tl.debug_barrier()  # every thread's stores, then the flag
    tl.atomic_xchg(
        quantized + t * _token_chunks(tokens.hidden, k) + chunk, seq, sem="release", scope="gpu"
    )


@triton.jit
def _token_chunks(hidden, k):
    """Chunks of GROUPS 128-channel groups of a row of ``hidden`` channels."""
    return tl.cdiv(tl.cdiv(hidden, GROUP_CHANNELS), k.GROUPS)


@triton.jit
def _list_rows(tokens, expert, scratch, k):
    """Scan this rank's topk_idx for ``expert``: its list is the entries (t, slot) that name it,
    in token order. Writes each entry i = t * K + slot to ``scratch`` [M] at its position in the
    list; returns the list's length and whether topk_idx holds an expert id outside [-1, E)."""
    entries = tokens.num_tokens * k.K
    length = 0
    outside = tl.zeros([k.SCAN], tl.int1)
    for i0 in range(0, entries, k.SCAN):
        i = i0 + tl.arange(0, k.SCAN)
        ids = tl.load(tokens.topk_ptr + i, mask=i < entries, other=-1)
        outside |= _outside(ids, k)
        named = ids == expert
        position = length + tl.cumsum(named.to(tl.int32), axis=0) - 1
        tl.store(scratch + position, i, mask=named)
        length += tl.sum(named.to(tl.int32), axis=0)
    tl.debug_barrier()  # the scratch, written by other threads, is read next
    return length, tl.max(outside.to(tl.int32), axis=0) != 0


@triton.jit
def _token_rows(tokens, token, rmask, seq, heap, sync, k):
    """The rows of ``token`` [ROWS] to send (uint8 pointers): x's rows, or with FP8 their staged
    quantized rows' payloads, once their quantize program's flag is up."""
    if k.FP8:
        quantized = region(heap.peer_bases_ptr, tokens.rank, heap.quantized_off, tl.int64)
        chunks = _token_chunks(tokens.hidden, k)
        chunk = tl.arange(0, k.QC_P2)
        flags = quantized + token[:, None] * chunks + chunk[None, :]
        mask = rmask[:, None] & (chunk < chunks)[None, :]
        wait_all_at_least(
            tl.reshape(flags, [k.ROWS * k.QC_P2]),
            seq,
            tl.reshape(mask, [k.ROWS * k.QC_P2]),
            sync.timeout_ns,
            sync.status_ptr,
            tokens.rank,
            STAGE_LL_DISPATCH,
        )
        rows = _heap_address(
            heap,
            tokens.rank,
            heap.send_off + ((k.B + k.L) * k.M + token.to(tl.int64)) * k.ROW_BYTES,
        )
        return tl.multiple_of(rows.to(tl.pointer_type(tl.uint8)) + HEADER, ALIGNMENT)
    rows = tokens.x_ptr + token.to(tl.int64) * tokens.x_stride
    return rows.to(tl.pointer_type(tl.uint8), bitcast=True)


@triton.jit
def _count_role(program, seq, tokens, out, heap, sync, k):
    """Program (COUNTED local experts): the length of each one's list (the token role moves their
    rows), released alone in ll_own (the own rows are not read in this launch: no release
    needed); their layout_range entries, and in a group of one recv_count (and the
    statistics). A topk_idx with an expert id outside [-1, E) refuses the call: no rows, and
    this rank in LL_REFUSED. Waits for nothing."""
    rank = tokens.rank
    expert_local = program * COUNTED + tl.arange(0, COUNTED)
    emask = expert_local < k.L
    length, outside = _count_lists(tokens, rank * k.L + expert_local, k)
    if outside:
        _note_refusal(rank, sync)
    refused = (sync.refused != 0) | outside
    length = tl.where(refused, 0, length)
    span = tl.where(refused, LL_REFUSED_RANGE, length.to(tl.int64))
    tl.store(out.layout_range_ptr + expert_local * k.W + rank, span, mask=emask)
    if k.W == 1:
        received = tl.minimum(length, out.rows)
        tl.store(out.recv_count_ptr + expert_local, received, mask=emask)
        if k.HAS_STATS:
            tl.atomic_add(out.stats_ptr + expert_local, received, mask=emask)
    own = region(heap.peer_bases_ptr, rank, heap.own_off, tl.int64)
    flags = _flag_value(seq, length | tl.where(refused, REFUSED, 0))
    tl.atomic_xchg(own + (seq % 2) * k.L + expert_local, flags, mask=emask, sem="relaxed")


@triton.jit
def _count_lists(tokens, expert, k):
    """The lengths of the lists of ``expert`` [COUNTED] (the entries of this rank's topk_idx
    that name each), and whether topk_idx holds an expert id outside [-1, E)."""
    entries = tokens.num_tokens * k.K
    length = tl.zeros([COUNTED], tl.int32)
    outside = tl.zeros([k.SCAN], tl.int1)
    for i0 in range(0, entries, k.SCAN):
        i = i0 + tl.arange(0, k.SCAN)
        ids = tl.load(tokens.topk_ptr + i, mask=i < entries, other=-1)
        outside |= _outside(ids, k)
        named = ids.to(tl.int32)
        length += tl.sum((named[None, :] == expert[:, None]).to(tl.int32), axis=1)
    return length, tl.max(outside.to(tl.int32), axis=0) != 0


@triton.jit
def _send_role(program, seq, tokens, heap, sync, k):
    """Program (expert e of another rank, by its place among them; slice s): e's list goes into
    e's receive block on its rank, each row behind a header with its token index, or to another
    node whole, by slice 0, through this rank's send area. Waits for its tokens' quantization
    (FP8) and for that rank's receive of call seq - 2 to be over. Releases the slice's flag with
    the list's length (a refused call, or a topk_idx with an expert id outside [-1, E): none,
    and REFUSED)."""
    s = program % k.S
    expert = program // k.S
    expert += k.L * (expert >= tokens.rank * k.L).to(tl.int32)
    owner = expert // k.L
    if ((tl.load(heap.peer_bases_ptr + owner) != 0) | (s == 0)) & live(sync, owner):
        _send_rows(program, expert, s, seq, tokens, heap, sync, k)


@triton.jit
def _send_rows(program, expert, s, seq, tokens, heap, sync, k):
    """``_send_role``'s moves, for slice ``s`` of ``expert``'s list."""
    owner = expert // k.L
    rank = tokens.rank
    dtype = tokens.x_ptr.dtype.element_ty
    length, outside = _list_rows(tokens, expert, tokens.scratch_ptr + program * k.M, k)
    refused = (sync.refused != 0) | outside
    length = tl.where(refused, 0, length)  # (a refused call sends no rows)
    flag = _flag_value(seq, length | tl.where(refused, REFUSED, 0))
    cols = tokens.hidden // WORD_BYTES if k.FP8 else tokens.hidden
    first, last = _slice(cols, s, k)
    on_node = tl.load(heap.peer_bases_ptr + owner) != 0
    if _wait_freed(owner, seq, heap, sync, k):  # (else masked: nothing to send)
        b = _dispatch_block(expert % k.L, rank, owner, k)
        block_off = heap.staging_off + ((seq % 2) * k.B + b) * k.M * k.ROW_BYTES
        if not on_node:  # through this rank's send area, rows by (expert, position)
            first, last = 0, tl.cdiv(k.ROW_BYTES - HEADER, WORD_BYTES) if k.FP8 else cols
            block = _heap_address(heap, rank, heap.send_off + expert * k.M * k.ROW_BYTES)
        else:
            block = _heap_address(heap, owner, block_off)
        for r0 in range(0, length, k.ROWS):
            position = r0 + tl.arange(0, k.ROWS)
            rmask = position < length
            token = tl.load(tokens.scratch_ptr + program * k.M + position, mask=rmask) // k.K
            row = block + position.to(tl.int64) * k.ROW_BYTES
            token_ptr, payload = _staged(row.to(tl.pointer_type(tl.uint8)))
            if s == 0:
                tl.store(token_ptr, token, mask=rmask)
            _copy_payloads(
                _token_rows(tokens, token, rmask, seq, heap, sync, k),
                payload,
                (payload + tokens.hidden).to(tl.pointer_type(tl.float32), bitcast=True),
                rmask,
                tokens.hidden,
                first,
                last,
                1,
                False,
                s == 0 and on_node,
                dtype,
                k,
            )
        if on_node:
            signal(_flag(heap, owner, b, s, seq, k), flag)
        elif k.NODES > 1:
            flag_off = heap.flags_off + ((seq % 2) * k.B + b) * k.S * 8
            if length > 0:
                net_put_signal(
                    heap.net_bases_ptr,
                    rank,
                    owner,
                    block_off,
                    block,
                    length * k.ROW_BYTES,
                    flag_off,
                    flag,
                    heap.heap_bytes,
                )
            else:
                net_signal(heap.net_bases_ptr, owner, flag_off, flag)


@triton.jit
def _dispatch_receive_role(program, seq, tokens, out, heap, sync, k):
    """Program (local expert e, source position q >= 1). Waits for the lengths of the sources
    at positions 0..q (``_place``), then for q's slices (a source on another node: its whole
    block). Releases nothing: writes q's rows of recv_x with their src_info, its layout_range
    entry, and after the last source recv_count (and adds it into the statistics)."""
    expert_local = program // (k.W - 1)
    q = program % (k.W - 1) + 1
    rank = tokens.rank
    first, length, refusal, own_refusal = _place(expert_local, q, seq, heap, sync, k)
    source = _source_in_order(q, rank)
    b = _dispatch_block(expert_local, source, rank, k)
    if (tl.load(heap.peer_bases_ptr + source) != 0) & (length > 0):
        for s in range(1, k.S):
            _wait_flag(
                _flag(heap, rank, b, s, seq, k), seq, source, STAGE_LL_DISPATCH, heap, sync, k
            )
    block = _block_row(heap, rank, b, seq, k)
    cols = tokens.hidden // WORD_BYTES if k.FP8 else tokens.hidden
    for r0 in range(0, length, k.ROWS):
        r = r0 + tl.arange(0, k.ROWS)
        position = first + r
        rmask = (r < length) & (position < out.rows)
        token_ptr, payload = _staged(block + r.to(tl.int64) * k.ROW_BYTES)
        tl.store(
            out.src_info_ptr + expert_local * out.rows + position,
            tl.load(token_ptr, mask=rmask),
            mask=rmask,
        )
        values, scale_rows = _output_rows(out, expert_local, position)
        _copy_payloads(
            payload,
            values,
            scale_rows,
            rmask,
            tokens.hidden,
            0,
            cols,
            out.scale_step,
            k.UE8M0,
            True,
            tokens.x_ptr.dtype.element_ty,
            k,
        )
    _store_counts(out, expert_local, q, source, first, length, refusal, own_refusal, k)


@triton.jit
def _place(expert_local, q, seq, heap, sync, k):
    """Where the rows of the source at position q >= 1 of local expert ``expert_local`` go, once
    the lengths of the sources at positions 0..q are up (position 0: this rank's own count):
    (their first row, their number, the REFUSED bit of that source's flag, and of this
    rank's own)."""
    rank = sync.rank
    own = region(heap.peer_bases_ptr, rank, heap.own_off, tl.int64)
    own_flag = own + (seq % 2) * k.L + expert_local
    wait_at_least(
        own_flag, _flag_value(seq, 0), sync.timeout_ns, sync.status_ptr, rank, STAGE_LL_DISPATCH
    )
    own_sent = _flag_rows(own_flag)
    first = _rows_sent(own_sent, rank, rank, sync)
    length = 0
    refusal = 0
    for place in range(1, q + 1):
        source = _source_in_order(place, rank)
        b = _dispatch_block(expert_local, source, rank, k)
        first += length
        arrived, sent = _wait_flag(
            _flag(heap, rank, b, 0, seq, k), seq, source, STAGE_LL_DISPATCH, heap, sync, k
        )
        length = 0  # (a masked source sends none)
        refusal = 0
        if arrived:
            length = _rows_sent(sent, source, rank, sync)
            refusal = sent & REFUSED
    return first, length, refusal, own_sent & REFUSED


@triton.jit
def _store_counts(out, expert_local, q, source, first, length, refusal, own_refusal, k):
    """The layout_range entry of the rows of local expert ``expert_local`` from ``source``, at
    position q (LL_REFUSED_RANGE where it refused the call: ``refusal``), and after the last
    source recv_count, which the statistics add unless this rank refused the call."""
    span = tl.where(refusal != 0, LL_REFUSED_RANGE, (first.to(tl.int64) << LL_RANGE_SHIFT) | length)
    tl.store(out.layout_range_ptr + expert_local * k.W + source, span)
    if q == k.W - 1:
        received = tl.minimum(first + length, out.rows)
        tl.store(out.recv_count_ptr + expert_local, received)
        if k.HAS_STATS:
            tl.atomic_add(out.stats_ptr + expert_local, received, mask=own_refusal == 0)


@triton.jit
def _output_rows(out, expert_local, position):
    """Rows ``position`` (a scalar, or [ROWS]) of local expert ``expert_local`` of recv_x: (their
    first bytes, their first scales)."""
    row = expert_local.to(tl.int64) * out.rows + position
    scale_row = (
        out.scales_ptr + expert_local.to(tl.int64) * out.scale_plane + position * out.scale_row_step
    )
    return out.recv_ptr + row * out.row_bytes, scale_row


# -- combine -------------------------------------------------------------------------------


@triton.jit
def _combine_send_role(program, seq, rows, heap, sync, k):
    """Program (local expert e, other rank j, slice s): the rows of e from j (layout_range) go
    back into j's receive block of e, at the positions they had in j's list (to another node
    whole, by slice 0; a refused call, or a dispatch that j refused: no rows, every flag j
    could wait for). Waits for j's receive of call seq - 2 to be over. Releases the slice's
    flag."""
    s = program % k.S
    expert_local = program // k.S // (k.W - 1)
    j = program // k.S % (k.W - 1)
    rank = rows.rank
    j += (j >= rank).to(tl.int32)
    span = tl.load(rows.layout_range_ptr + expert_local * k.W + j, mask=sync.refused == 0, other=0)
    echo = span == LL_REFUSED_RANGE  # (j refused the dispatch: no rows, but the flags)
    span = tl.where(echo, 0, span)
    first = (span >> LL_RANGE_SHIFT).to(tl.int32)
    length = (span & LL_RANGE_ROWS).to(tl.int32)
    on_node = tl.load(heap.peer_bases_ptr + j) != 0
    sending = ((length > 0) | (sync.refused != 0) | echo) & (on_node | (s == 0)) & live(sync, j)
    if sending:
        sending = _wait_freed(j, seq, heap, sync, k)  # (False: masked meanwhile)
    if sending:
        b = _combine_block(rank * k.L + expert_local, j, k)
        flag = _flag_value(seq, tl.where(sync.refused != 0, REFUSED, 0))
        src = (
            rows.x_ptr
            + expert_local.to(tl.int64) * rows.x_plane
            + first.to(tl.int64) * (rows.x_row)
        )
        if on_node:
            dst = _block_row(heap, j, b, seq, k).to(
                tl.pointer_type(rows.x_ptr.dtype.element_ty), bitcast=True
            )
            col_first, col_last = _slice(rows.hidden, s, k)
            _copy_block(src, rows.x_row, dst, rows.hidden, length, col_first, col_last, k)
            signal(_flag(heap, j, b, s, seq, k), flag)
        elif k.NODES > 1:
            _put_combine_rows(src, expert_local, first, length, j, b, flag, seq, rows, heap, k)


@triton.jit
def _put_combine_rows(src, expert_local, first, length, j, b, flag, seq, rows, heap, k):
    """Rows [first, first + length) of local expert ``expert_local`` (at ``src`` in x) to rank
    ``j`` on another node: from this rank's send area, the buffer [L, rows, H] of
    get_next_low_latency_combine_buffer (with ZERO_COPY, x itself), one put-with-signal."""
    dtype = rows.x_ptr.dtype.element_ty
    area = region(heap.peer_bases_ptr, rows.rank, heap.send_off, dtype)
    first_row = area + (expert_local.to(tl.int64) * rows.rows + first) * rows.hidden
    if not k.ZERO_COPY:
        _copy_block(src, rows.x_row, first_row, rows.hidden, length, 0, rows.hidden, k)
    block_off = heap.staging_off + ((seq % 2) * k.B + b) * k.M * k.ROW_BYTES
    flag_off = heap.flags_off + ((seq % 2) * k.B + b) * k.S * 8
    if length > 0:
        net_put_signal(
            heap.net_bases_ptr,
            rows.rank,
            j,
            block_off,
            first_row,
            length * rows.hidden * (dtype.primitive_bitwidth // 8),
            flag_off,
            flag,
            heap.heap_bytes,
        )
    else:
        net_signal(heap.net_bases_ptr, j, flag_off, flag)


@triton.jit
def _copy_block(src, src_stride, dst, dst_stride, num_rows, first, last, k):
    """Copy columns [first, last) of ``num_rows`` rows from ``src`` (the first row's first
    element; rows ``src_stride`` apart) to ``dst`` (rows ``dst_stride`` apart), k.ROWS rows at
    a time."""
    for r0 in range(0, num_rows, k.ROWS):
        r = (r0 + tl.arange(0, k.ROWS)).to(tl.int64)
        _copy_rows(
            src + r * src_stride,
            dst + r * dst_stride,
            r < num_rows,
            first,
            last,
            k.BLOCK_H,
            k.ALIGNED,
            k.STAGES,
        )


@triton.jit
def _combine_receive_role(program, seq, rows, heap, sync, k):
    """Program (token t, slice s, part p): out[t] over part p of the slice's columns (of
    PARTS), the sum in fp32 of weight * expert row over t's valid slots: rows of this rank's
    experts straight from x, the others' from the receive blocks. Waits for each of those
    blocks' slice flags (a block from another node: its slice 0's; a refused one's rows count
    as absent). Releases nothing."""
    t = program // (k.S * k.PARTS)
    s = program // k.PARTS % k.S
    rank = rows.rank
    dtype = rows.x_ptr.dtype.element_ty
    slots = tl.arange(0, k.K_P2)
    entry = t * k.K + slots
    ids = tl.load(rows.topk_ptr + entry, mask=slots < k.K, other=-1)
    # (read beside the experts rather than after them: an invalid slot's are not used)
    position = tl.load(rows.slots_ptr + entry, mask=slots < k.K, other=0).to(tl.int64)
    weight = tl.load(rows.weights_ptr + entry, mask=slots < k.K, other=0.0)
    # (an id outside [-1, E), which made the dispatch refuse the call, names no expert; compared
    # in the ids' own width, as ``_outside``)
    valid = (ids >= 0) & (ids < k.W * k.L)
    expert = tl.where(valid, ids, 0).to(tl.int32)
    owner = expert // k.L
    own = owner == rank
    remote = valid & ~own
    if tl.max(remote.to(tl.int32), axis=0) > 0:
        remote &= live(sync, owner)  # (a masked rank's experts add nothing)
        # A block from another node lands whole, with its slice 0's flag.
        on_node = tl.load(heap.peer_bases_ptr + owner, mask=remote, other=0) != 0
        flags = _flag(heap, rank, _combine_block(expert, rank, k), tl.where(on_node, s, 0), seq, k)
        first_owner = tl.min(tl.where(remote, owner, k.W), axis=0)
        wanted = _flag_value(seq, 0)
        arrived = await_peers(
            flags, wanted, remote, owner, first_owner, STAGE_LL_COMBINE, sync, k.W, k.NODES
        )
        remote &= arrived  # (an owner masked meanwhile adds nothing)
        sent = tl.atomic_add(flags, 0, mask=remote, sem="acquire", scope="sys")
        refused = remote & ((sent & REFUSED) != 0)
        if tl.max(refused.to(tl.int32), axis=0) > 0:
            _note_refusal(tl.min(tl.where(refused, owner, k.W), axis=0), sync)
        remote &= ~refused
    # (own rows need no flag and no look at the mask: nothing waits before their reads)
    valid = (valid & own) | remote
    weight = tl.where(valid, weight, 0.0)
    own_row = rows.x_ptr + (expert % k.L).to(tl.int64) * rows.x_plane + position * rows.x_row
    staged = _block_row(heap, rank, _combine_block(expert, rank, k), seq, k).to(
        tl.pointer_type(dtype), bitcast=True
    )
    src = tl.where(own, own_row, staged + position * rows.hidden)
    if k.ALIGNED:  # (said: the compiler does not see it through the choice of rows)
        src = tl.multiple_of(src, ALIGNMENT)
    first, last = _slice(rows.hidden, s, k)
    part = tl.cdiv(tl.cdiv(last - first, k.PARTS), ALIGNMENT) * ALIGNMENT
    first += program % k.PARTS * part
    last = tl.minimum(first + part, last)
    for c0 in tl.range(first, last, k.BLOCK_H, num_stages=k.STAGES):
        cols = c0 + tl.arange(0, k.BLOCK_H)
        cmask = cols < last
        tile = tl.load(
            src[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0
        )
        total = tl.sum(tile.to(tl.float32) * weight[:, None], axis=0)
        tl.store(rows.out_ptr + t.to(tl.int64) * rows.hidden + cols, total.to(dtype), mask=cmask)


# -- launches ------------------------------------------------------------------------------


@triton.jit
def _start(sync, k):
    """(The call's sequence number, whether this program is the last of the launch to start,
    whether this rank masked a rank that this launch tells of: program 0 tells.) A
    launch that sends starts the next call (its first program writes the number where a later
    receive launch of the call reads it), and each of its programs takes a ticket once it has
    read the number: the last one publishes it when it ends (``_finish``). Taken as the program
    starts, the ticket's round trip overlaps the program's work."""
    program = tl.program_id(0)
    # Words other programs write meanwhile: read once for every warp (read_uniform). A warp
    # that read LL_SEQ itself, late, could see the number this launch's last program has
    # published already, and wait for the next call's flags in a parity of its own.
    news = read_uniform(sync.control_ptr + MASKS_NEW, program == 0, 0)
    if k.SEND:
        seq = read_uniform(sync.control_ptr + LL_SEQ) + 1
        if program == 0:
            tl.store(sync.seq_ptr, seq)
        # (1 + (seq >> 62), which is 1: an operand that depends on seq, so that the ticket is
        # taken after seq is read and no program reads the number its launch publishes)
        ticket = tl.atomic_add(sync.control_ptr + LL_TICKET, 1 + (seq >> 62), sem="relaxed")
        last = ticket == tl.num_programs(0) - 1
    else:
        seq = tl.load(sync.seq_ptr)
        last = program < 0
    return seq, last, news


@triton.jit
def _finish(seq, last, news, heap, sync, k):
    """The end of each program (``last``, ``news``: ``_start``'s). The launch's last program
    to start resets the tickets and publishes ``seq`` as the last call's number; program 0
    tells the other ranks of the masks this rank set (MASKED_HERE) since it last told. Where
    the launch receives from other ranks, each program takes a ticket as it ends; the last one
    resets them and tells every other live rank that its receive of call ``seq`` is over
    (ll_freed)."""
    if last:
        tl.store(sync.control_ptr + LL_TICKET, 0)
        if k.SEND:
            tl.store(sync.control_ptr + LL_SEQ, seq)
    if news != 0:
        tell_new_masks(sync, k.W, k.NODES)
    if k.RECEIVE and k.W > 1:
        # Relaxed: a receiving program has used every value it read of the receive area (its
        # stores depend on them) when it takes its ticket.
        done = tl.atomic_add(sync.control_ptr + LL_DONE, 1, sem="relaxed")
        if done == tl.num_programs(0) - 1:
            tl.store(sync.control_ptr + LL_DONE, 0)
            for peer in range(0, k.W):
                if (peer != sync.rank) & live(sync, peer):
                    signal_peer(
                        heap.peer_bases_ptr,
                        heap.net_bases_ptr,
                        peer,
                        heap.freed_off,
                        sync.rank,
                        seq,
                        k.NODES,
                    )


# The signature is laid out by hand, a group of arguments a line (ruff leaves it so): one argument
# a line would make it most of the function.
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
    peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, mask_off, flags_off, own_off,
    quantized_off, staging_off, send_off,
    # Sync: control block, bound of every wait; the send role's scratch [B * S, M] int32 (in
    # DispatchRows); whether this rank's host refused the call
    control_ptr, timeout_ns, scratch_ptr, refused,
    # Meta-parameters (the glossary in kernels/__init__.py)
    W: tl.constexpr, L: tl.constexpr, B: tl.constexpr, M: tl.constexpr, S: tl.constexpr,
    QC_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, SCAN: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr, GROUPS: tl.constexpr,
    G_P2: tl.constexpr, ROW_BYTES: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr,
    UE8M0: tl.constexpr, ALIGNED: tl.constexpr, HAS_STATS: tl.constexpr, NODES: tl.constexpr,
    SEND: tl.constexpr, RECEIVE: tl.constexpr,
):  # fmt: skip
    """Where SEND, programs [0, T * QC) take the tokens' chunks, the next L / COUNTED count the
    local experts' lists, the next B * S send; where RECEIVE, the next L * (W - 1) receive; a
    launch of none of them has one program, which finishes."""
    program = tl.program_id(0)
    # The arguments in bundles for the roles, in the order of their fields (a group a line).
    k: tl.constexpr = LowLatencyDispatchConsts(
        *(W, L, B, M, S, QC_P2, K, K_P2, SCAN, ROWS, BLOCK_H, STAGES, GROUPS, G_P2, ROW_BYTES),
        *(FP8, ROUND, UE8M0, ALIGNED, HAS_STATS, NODES, SEND, RECEIVE),
    )
    mask = region(peer_bases_ptr, rank, mask_off, tl.int64)
    sync = LowLatencySync(
        *(rank, control_ptr, control_ptr + STATUS, timeout_ns, seq_ptr, refused, mask),
        *(peer_bases_ptr, net_bases_ptr, mask_off),
    )
    seq, last, news = _start(sync, k)
    tokens = DispatchRows(
        rank, x_ptr, x_stride, topk_ptr, slots_ptr, num_tokens, hidden, scratch_ptr
    )
    out = Received(
        *(recv_ptr, scales_ptr, src_info_ptr, layout_range_ptr, recv_count_ptr, stats_ptr),
        *(rows, row_bytes, scale_plane, scale_row_step, scale_step),
    )
    heap = LowLatencyHeap(
        *(peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, mask_off, flags_off, own_off),
        *(quantized_off, staging_off, send_off),
    )
    # Each program's role, in the launch's order (picked here rather than in a helper, whose
    # inlined scope gives the FP8 build at EP8 other sm_90 code).
    token_programs = num_tokens * tl.cdiv(tl.cdiv(hidden, GROUP_CHANNELS), GROUPS) if SEND else 0
    counters = tl.cdiv(L, COUNTED) if SEND else 0
    senders = B * S if SEND else 0
    if program < token_programs:
        _token_role(program, seq, tokens, out, heap, sync, k)
    elif program - token_programs < counters:
        _count_role(program - token_programs, seq, tokens, out, heap, sync, k)
    elif program - token_programs - counters < senders:
        _send_role(program - token_programs - counters, seq, tokens, heap, sync, k)
    elif RECEIVE and program - token_programs - counters - senders < L * (W - 1):
        receiver = program - token_programs - counters - senders
        _dispatch_receive_role(receiver, seq, tokens, out, heap, sync, k)
    _finish(seq, last, news, heap, sync, k)


@triton.jit(do_not_specialize=SAME_ON_EVERY_RANK)
def low_latency_combine_kernel(
    # Rows: x [L, rows, H] (strides x_plane, x_row) in recv_x's order, topk_idx [T, K],
    # token_slots [T, K] int32 (the dispatch's), topk_weights [T, K] float32
    x_ptr,
    x_plane,
    x_row,
    topk_ptr,
    slots_ptr,
    weights_ptr,
    num_tokens,
    hidden,
    rank,
    # The dispatch's layout_range [L, W] int64; out [T, H]; call_seq [1] int64; rows = W * M'
    layout_range_ptr,
    out_ptr,
    seq_ptr,
    rows,
    # Heap, as for dispatch (send_off: the buffer of get_next_low_latency_combine_buffer)
    peer_bases_ptr,
    net_bases_ptr,
    heap_bytes,
    freed_off,
    mask_off,
    flags_off,
    own_off,
    quantized_off,
    staging_off,
    send_off,
    # Sync, as for dispatch
    control_ptr,
    timeout_ns,
    refused,
    # Meta-parameters
    W: tl.constexpr,
    L: tl.constexpr,
    B: tl.constexpr,
    M: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STAGES: tl.constexpr,
    PARTS: tl.constexpr,
    ALIGNED: tl.constexpr,
    ZERO_COPY: tl.constexpr,
    NODES: tl.constexpr,
    SEND: tl.constexpr,
    RECEIVE: tl.constexpr,
):
    """Programs [0, L * (W - 1) * S) send where SEND, the next T * S * PARTS receive where
    RECEIVE; a launch of neither kind's programs has one program, which finishes."""
    program = tl.program_id(0)
    # The arguments in bundles for the roles, in the order of their fields (a group a line).
    k: tl.constexpr = LowLatencyCombineConsts(
        *(W, L, B, M, S, K, K_P2, ROW_BYTES, ROWS, BLOCK_H, STAGES, PARTS, ALIGNED, ZERO_COPY),
        *(NODES, SEND, RECEIVE),
    )
    mask = region(peer_bases_ptr, rank, mask_off, tl.int64)
    sync = LowLatencySync(
        *(rank, control_ptr, control_ptr + STATUS, timeout_ns, seq_ptr, refused, mask),
        *(peer_bases_ptr, net_bases_ptr, mask_off),
    )
    seq, last, news = _start(sync, k)
    combined = CombineRows(
        *(rank, x_ptr, x_plane, x_row, topk_ptr, slots_ptr, weights_ptr, num_tokens, hidden),
        *(layout_range_ptr, out_ptr, rows),
    )
    heap = LowLatencyHeap(
        *(peer_bases_ptr, net_bases_ptr, heap_bytes, freed_off, mask_off, flags_off, own_off),
        *(quantized_off, staging_off, send_off),
    )
    # Each program's role, in the launch's order.
    senders = L * (W - 1) * S if SEND else 0
    if program < senders:
        _combine_send_role(program, seq, combined, heap, sync, k)
    elif RECEIVE and program - senders < num_tokens * S * PARTS:
        _combine_receive_role(program - senders, seq, combined, heap, sync, k)
    _finish(seq, last, news, heap, sync, k)
