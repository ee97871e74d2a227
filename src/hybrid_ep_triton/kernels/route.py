"""Dispatch layout: where every (token, expert) slot lands, computed on the device in one launch,
with no host round trip. One launch in two roles:

Counters: program c counts chunk c of CHUNK tokens (a launch without tokens has one program,
which counts nothing): the slots per expert and the tokens per destination rank, and every
slot's and every (token, rank) pair's position among the chunk's slots of the same expert /
tokens of the same rank. It also checks the routing: ids outside [-1, E) and duplicate ids in a
row. Then it takes a ticket.

The exchanger, the program that takes the last ticket (so no program waits for another and the
launch needs no co-resident programs), exchanges the layout with the peers:
1. it turns the chunk counts into prefix sums over the chunks;
2. it publishes this rank's layout row into every live peer's heap: its per-expert totals,
   tokens, whether its dispatch can go ahead and pad_multiple, then the offsets of its chunks in
   its stream to that peer and, across nodes, in its stream to that peer's node (peers of its
   own node by stores, the ranks of other nodes by a network put), each with this rank's flag;
3. it waits for every live peer's row (a peer that runs out of time is masked where the Buffer
   masks failed ranks); then, where it does, it tells every live rank of the masks it set and
   raises its flag again, and waits for every live rank's second flag: each rank lays out with
   every other's masks, so their layouts agree on who is masked (kernels/peers.py);
4. it reads the received streams from the live ranks (a masked rank counts as one with no
   tokens and no experts, and this rank's tokens go to it no more): every source's tokens and
   chunk offsets, and the first source whose dispatch cannot go ahead;
5. it derives from the live ranks' [world, E] count matrix
   - as a sender: the base row, on the destination, of each expert's slots from this rank;
   - as a receiver: the padded segment of each local expert in the expert-major output.
A sender's slot of chunk c then lands on row
``chunk_expert_base[0, e] + chunk_expert_base[c + 1, e] + slot_pos`` of the destination.

In the code each role is a function, with what it waits for and what it releases in its
docstring: _count_role (_count_slots, _count_tokens) and _exchange_role, whose steps are
_expert_prefix_sums, _publish_rows (_node_chunk_starts, _send_row, _write_row), _wait_rows,
_agree_on_masks, _live_sources, _drop_masked_destinations, _read_sources,
_destination_segments, _own_segments and _report; layout_kernel bundles its arguments (Routing,
HandleParts, LayoutHeap, LayoutSync, LayoutConsts; kernels/peers.py's Masking) and _roles picks
each program's role.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import (
    BAD_ROW,
    INFO_BAD_ROW,
    INFO_CAUSE,
    INFO_ROWS,
    INFO_SOURCE,
    LAYOUT_SEQ,
    LAYOUT_TICKET,
    MASK_FAILED,
    MASKS_NEW,
    REPORT_BAD_ROW,
    REPORT_CAUSE,
    REPORT_EXPERTS,
    REPORT_ROWS,
    REPORT_SOURCE,
    REPORT_STATUS,
    REPORT_TAG,
    STAGE_LAYOUT,
    STATUS,
    STATUS_WORDS,
)
from .peers import Masking, await_peer, live, signal_peer, tell_new_masks
from .primitives import (
    SAME_ON_EVERY_RANK,
    UNSPECIALISED,
    fence_system,
    host_pointer,
    net_put_signal,
    node_first_rank,
    read_uniform,
    region,
    signal,
)

# The first invalid row of a launch is recorded in a control word as 2**62 - row (an atomic max
# keeps the first; 0, the word's resting value, means none) and reported in info[2] as the row,
# or 2**62 (NO_BAD_ROW) when none. (Before a tensor in an operation, the kernels take its .value:
# under TRITON_INTERPRET the result would stay a tl.constexpr.)
NO_BAD_ROW = tl.constexpr(2**62)


@triton.jit
def _first_bad_row(bad):
    """The first invalid row, from its control word ``bad``: the row, or 2**62 for none."""
    return tl.where(bad > 0, NO_BAD_ROW.value - bad, NO_BAD_ROW)


@triton.jit
def _flat_slots(
    topk_idx_ptr,
    chunk,
    first,
    num_tokens,
    topk,
    num_experts,
    n: tl.constexpr,
    CHUNK: tl.constexpr,
    K_P2: tl.constexpr,
):
    """Slots [first, first + n) of the chunk, flat (slot i is entry i % K_P2 of the chunk's token
    i // K_P2): token, offset into topk_idx, inside the chunk, expert id (-1 for none or one out
    of range)."""
    flat = first + tl.arange(0, n)
    token = chunk * CHUNK + flat // K_P2
    in_chunk = (token < num_tokens) & (flat % K_P2 < topk)
    offs = token * topk + flat % K_P2
    ids = tl.load(topk_idx_ptr + offs, mask=in_chunk, other=-1)
    return token, offs, in_chunk, tl.where((ids < 0) | (ids >= num_experts), -1, ids).to(tl.int32)


@triton.jit
def _store_positions(to, tokens, token_ok, targets, num_targets, pos_ptr, count_ptr):
    """From ``to`` [CHUNK, X]: which of the chunk's ``tokens`` go to which of ``targets`` [X]
    (ranks or nodes), store each token's position among the chunk's tokens to each target (or
    -1) into ``pos_ptr`` [T, num_targets], and the tokens per target into ``count_ptr``."""
    sent = to.to(tl.int32)
    before = tl.cumsum(sent, axis=0) - sent
    tl.store(
        pos_ptr + tokens[:, None] * num_targets + targets[None, :],
        tl.where(to, before, -1),
        mask=token_ok[:, None] & (targets[None, :] < num_targets),
    )
    tl.store(count_ptr + targets, tl.sum(sent, axis=0), mask=targets < num_targets)


# Each program of a launch has one role (module docstring); a role is a function that takes the
# kernel's arguments in bundles, as in dispatch and combine: namedtuples of runtime values, and
# ``k``, the LayoutConsts. Everything is inlined: the machine code is that of one kernel body,
# which evaluates the expressions in the order of the calls.
Routing = namedtuple(
    "Routing",
    "topk_idx_ptr num_tokens num_chunks topk num_experts experts_per_rank rank world_size "
    "pad_multiple max_rows refused",
)
HandleParts = namedtuple(
    "HandleParts",
    "slot_pos_ptr token_rank_pos_ptr chunk_expert_base_ptr send_chunk_start_ptr "
    "recv_chunk_start_ptr recv_src_tokens_ptr recv_rank_prefix_ptr expert_layout_ptr "
    "tokens_per_expert_ptr info_ptr token_node_pos_ptr send_chunk_node_start_ptr "
    "recv_net_chunk_start_ptr",
)
LayoutHeap = namedtuple(
    "LayoutHeap",
    "peer_bases_ptr count_flags_off layout_in_off net_bases_ptr layout_out_off heap_bytes",
)
LayoutSync = namedtuple("LayoutSync", "control_ptr timeout_ns report_addr report_tag")
LayoutConsts = namedtuple(
    "LayoutConsts",
    "CHUNK K_P2 W_P2 E_P2 L_P2 PAIRS NC_MAX ROW C_BLOCK TABLE_BLOCK TOKEN_ROWS LR R NODES N_P2",
)


@triton.jit
def _count_role(chunk, bad_row_ptr, rt, out, k):
    """Counter of chunk ``chunk`` (< num_chunks). Waits for nothing. Writes slot_pos (unless
    TOKEN_ROWS: token rows need none), token_rank_pos, token_node_pos and the first invalid row
    (into ``bad_row_ptr``), and its counts where their prefix sums will be: rows c + 1 of
    chunk_expert_base, rows c of send_chunk_start and send_chunk_node_start. Releases them to
    the exchanger by its ticket (_roles)."""
    expert_count_ptr = out.chunk_expert_base_ptr + (chunk + 1) * rt.num_experts
    rank_count_ptr = out.send_chunk_start_ptr + chunk * rt.world_size
    node_count_ptr = out.send_chunk_node_start_ptr + chunk * k.NODES
    _count_slots(chunk=chunk, expert_count_ptr=expert_count_ptr, rt=rt, out=out, k=k)
    _count_tokens(
        chunk=chunk,
        rank_count_ptr=rank_count_ptr,
        bad_row_ptr=bad_row_ptr,
        node_count_ptr=node_count_ptr,
        rt=rt,
        out=out,
        k=k,
    )


@triton.jit
def _count_slots(chunk, expert_count_ptr, rt, out, k):
    """The chunk's slots per expert (``expert_count_ptr`` [E]) and, unless TOKEN_ROWS, each
    slot's position among the chunk's slots of the same expert (slot_pos, -1 for none)."""
    # Per slot: its position among the chunk's slots of the same expert, the number of pairs of
    # slots with that expert whose other slot belongs to an earlier token (tiles of pairs).
    expert_count = tl.zeros([k.E_P2], tl.int32)
    for i0 in range(0, k.CHUNK * k.K_P2, k.PAIRS):
        token, offs, in_chunk, ids = _flat_slots(
            rt.topk_idx_ptr,
            chunk,
            i0,
            rt.num_tokens,
            rt.topk,
            rt.num_experts,
            k.PAIRS,
            k.CHUNK,
            k.K_P2,
        )
        if not k.TOKEN_ROWS:
            pos = tl.zeros([k.PAIRS], tl.int32)
            for j0 in range(0, k.CHUNK * k.K_P2, k.PAIRS):
                other_token, _, _, other_ids = _flat_slots(
                    rt.topk_idx_ptr,
                    chunk,
                    j0,
                    rt.num_tokens,
                    rt.topk,
                    rt.num_experts,
                    k.PAIRS,
                    k.CHUNK,
                    k.K_P2,
                )
                earlier = (ids[:, None] == other_ids[None, :]) & (
                    other_token[None, :] < token[:, None]
                )
                pos += tl.sum(earlier.to(tl.int32), axis=1)
            tl.store(out.slot_pos_ptr + offs, tl.where(ids >= 0, pos, -1), mask=in_chunk)
        expert_count += tl.histogram(tl.where(ids >= 0, ids, 0), k.E_P2, mask=ids >= 0)
    experts = tl.arange(0, k.E_P2)
    tl.store(expert_count_ptr + experts, expert_count, mask=experts < rt.num_experts)


@triton.jit
def _count_tokens(chunk, rank_count_ptr, bad_row_ptr, node_count_ptr, rt, out, k):
    """Check the chunk's routing (the first invalid row into ``bad_row_ptr``, as 2**62 - row);
    its tokens per rank (``rank_count_ptr`` [W]) and token_rank_pos; across nodes also
    token_node_pos (the token's position among the chunk's tokens to each other node, or -1)
    and the tokens per node (``node_count_ptr`` [N]; 0 for this rank's own node, whose tokens go
    over NVLink)."""
    # Per token: validation (ids in range, in the ids' own width: int64 ids must not wrap into
    # int32; no id twice), and a token goes once to each rank holding any of its experts.
    tokens = chunk * k.CHUNK + tl.arange(0, k.CHUNK)
    slots = tl.arange(0, k.K_P2)
    token_ok = tokens < rt.num_tokens
    slot_mask = token_ok[:, None] & (slots[None, :] < rt.topk)
    raw_ids = tl.load(
        rt.topk_idx_ptr + tokens[:, None] * rt.topk + slots[None, :], mask=slot_mask, other=-1
    )
    out_of_range = slot_mask & ((raw_ids < -1) | (raw_ids >= rt.num_experts))
    slot_ids = tl.where(out_of_range, -1, raw_ids).to(tl.int32)
    same = (slot_ids[:, :, None] == slot_ids[:, None, :]) & (slot_ids >= 0)[:, :, None]
    same = same & (slots[None, :, None] != slots[None, None, :])
    bad_row = (
        tl.sum(out_of_range.to(tl.int32), axis=1) + tl.sum(tl.sum(same.to(tl.int32), 2), 1)
    ) > 0
    first_bad = tl.min(tl.where(bad_row, tokens, 2147483647), axis=0)
    if first_bad < 2147483647:
        tl.atomic_max(bad_row_ptr, NO_BAD_ROW.value - first_bad.to(tl.int64))
    dest = tl.where(slot_ids >= 0, slot_ids // rt.experts_per_rank, -1)
    ranks = tl.arange(0, k.W_P2)
    to_rank = tl.sum((dest[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1) > 0
    _store_positions(
        to_rank, tokens, token_ok, ranks, rt.world_size, out.token_rank_pos_ptr, rank_count_ptr
    )
    if k.NODES > 1:
        nodes = tl.arange(0, k.N_P2)
        # Unused slots (dest -1) select no node: integer division truncates towards zero.
        in_node = (dest[:, :, None] >= 0) & (dest[:, :, None] // k.R == nodes[None, None, :])
        to_node = (tl.sum(in_node.to(tl.int32), axis=1) > 0) & (nodes[None, :] != rt.rank // k.R)
        _store_positions(
            to_node, tokens, token_ok, nodes, k.NODES, out.token_node_pos_ptr, node_count_ptr
        )


@triton.jit
def _exchange_role(rt, out, heap, sync, m, k):
    """The exchanger: the program that takes the launch's last ticket. Waits for every
    counter's counts (the ticket, _roles) and, in _wait_rows, for every live peer's layout row
    (its flag in this rank's count flags), then, where the Buffer masks failed ranks, for every
    live peer's word that it has told the others of its masks (_agree_on_masks). Releases this
    rank's layout row to every live peer by this rank's flag in their count flags
    (_publish_rows); the handle's parts and LAYOUT_SEQ to the launches that follow on the
    stream; in exact mode the report to the host, REPORT_TAG last (_report). A masked rank
    counts as one with no tokens and no experts (_live_sources)."""
    seq = tl.load(sync.control_ptr + LAYOUT_SEQ) + 1
    status_ptr = sync.control_ptr + STATUS
    # Masks set by hand or in earlier calls reach every rank before its rows do.
    if read_uniform(sync.control_ptr + MASKS_NEW) != 0:
        tell_new_masks(m, rt.world_size, k.NODES)
    agreeing = tl.load(sync.control_ptr + MASK_FAILED)
    # Written by the launch's other programs. Reset for the next launch.
    bad = read_uniform(sync.control_ptr + BAD_ROW)
    tl.store(sync.control_ptr + BAD_ROW, 0)
    tl.store(out.info_ptr + INFO_BAD_ROW, _first_bad_row(bad))
    totals = _expert_prefix_sums(rt=rt, out=out, k=k)
    # A row's flag: 2 seq - 1, then 2 seq once its masks are told (at once where none are).
    _publish_rows(seq, 2 * seq - agreeing, bad, totals, rt, out, heap, m, k)
    counts = _wait_rows(seq=seq, rt=rt, heap=heap, m=m, k=k)
    if agreeing != 0:
        _agree_on_masks(seq=seq, rt=rt, heap=heap, m=m, k=k)
    live = _live_sources(rt=rt, m=m, k=k)
    if tl.min(live.to(tl.int32), axis=0) == 0:
        _drop_masked_destinations(live=live, rt=rt, out=out, k=k)
    first_invalid, first_cause = _read_sources(counts=counts, live=live, rt=rt, out=out, k=k)
    seg_start, padded, total = _destination_segments(counts=counts, live=live, rt=rt, out=out, k=k)
    needed, per_expert = _own_segments(
        counts=counts,
        live=live,
        seg_start=seg_start,
        padded=padded,
        total=total,
        rt=rt,
        out=out,
        k=k,
    )
    tl.store(out.info_ptr + INFO_ROWS, needed)
    tl.store(sync.control_ptr + LAYOUT_SEQ, seq)
    if sync.report_tag != 0:
        _report(
            needed=needed,
            per_expert=per_expert,
            first_invalid=first_invalid,
            bad=bad,
            status_ptr=status_ptr,
            first_cause=first_cause,
            rt=rt,
            sync=sync,
            k=k,
        )


@triton.jit
def _expert_prefix_sums(rt, out, k):
    """Step 1: per expert, the exclusive prefix over chunks of the counts, in place in rows
    c + 1 of chunk_expert_base (the offset of chunk c's first slot among this rank's slots of
    each expert); returns this rank's per-expert totals [E_P2]."""
    experts = tl.arange(0, k.E_P2)
    emask = experts < rt.num_experts
    totals = tl.zeros([k.E_P2], tl.int32)
    for c0 in range(0, rt.num_chunks, k.C_BLOCK):
        chunks = c0 + tl.arange(0, k.C_BLOCK)
        m = (chunks[:, None] < rt.num_chunks) & emask[None, :]
        ptrs = out.chunk_expert_base_ptr + (chunks[:, None] + 1) * rt.num_experts + experts[None, :]
        # Written by the counters: loads bypass L1.
        cnt = tl.load(ptrs, mask=m, other=0, cache_modifier=".cg")
        tl.store(ptrs, totals[None, :] + tl.cumsum(cnt, 0) - cnt, mask=m)
        totals += tl.sum(cnt, axis=0)
    return totals


@triton.jit
def _publish_rows(seq, flag, bad, totals, rt, out, heap, m, k):
    """Step 2: to every live peer its layout row ``rank`` at the parity of the exchange
    (_write_row), and this rank's flag in the peer's count flags set to ``flag``: peers of this
    node get the row by stores and the flag by a signal; the ranks of other nodes get both by a
    network put from this rank's layout_out."""
    # Why this rank's dispatch cannot go ahead (0: it can; 1: invalid routing; above: the host's
    # refusal code): every rank learns it, and all of them then move nothing.
    invalid = tl.maximum(rt.refused, (bad > 0).to(tl.int32))
    node_first = node_first_rank(rt.rank, k.R, k.NODES)
    if k.NODES > 1:
        _node_chunk_starts(rt=rt, out=out, k=k)
    # Bytes from layout_in to this rank's row at the parity of seq: layout_in holds two sets of
    # rows, so that a peer already in the next exchange does not overwrite a row not yet read.
    row_off = ((seq % 2) * rt.world_size + rt.rank) * (k.LR * 4)
    for peer in range(0, rt.world_size):
        if (peer == rt.rank) | live(m, peer):  # (a masked rank's memory may be gone)
            _send_row(peer, row_off, flag, totals, invalid, node_first, rt, out, heap, k)


@triton.jit
def _send_row(peer, row_off, flag, totals, invalid, node_first, rt, out, heap, k):
    """_publish_rows' row and flag for ``peer``."""
    near = (peer >= node_first) & (peer < node_first + k.R)
    row = region(heap.peer_bases_ptr, peer, heap.layout_in_off, tl.int32) + row_off // 4
    if k.NODES > 1:
        if not near:
            # Staged in this rank's heap: a network put reads only registered memory.
            row = region(heap.peer_bases_ptr, rt.rank, heap.layout_out_off, tl.int32) + (
                peer * k.LR
            )
    _write_row(row=row, peer=peer, totals=totals, invalid=invalid, rt=rt, out=out, k=k)
    flag_ptr = region(heap.peer_bases_ptr, peer, heap.count_flags_off, tl.int64) + rt.rank
    if k.NODES > 1:
        if near:
            signal(flag_ptr, flag)
        else:
            net_put_signal(
                heap.net_bases_ptr,
                rt.rank,
                peer,
                heap.layout_in_off + row_off,
                row,
                k.LR * 4,
                heap.count_flags_off + rt.rank * 8,
                flag,
                heap.heap_bytes,
            )
    else:
        signal(flag_ptr, flag)


@triton.jit
def _chunk_starts_in_place(ptrs, chunks, num_chunks, carry):
    """One block of an exclusive prefix over chunks, in place: the counts at ``ptrs`` of the
    ``chunks`` below num_chunks become their starts after ``carry`` (chunk num_chunks: the
    total). Returns the starts and the counts (their sum carries to the next block: the caller
    adds it after its own stores, which come first in the machine code)."""
    cnt = tl.load(ptrs, mask=chunks < num_chunks, other=0, cache_modifier=".cg")
    start = carry + tl.cumsum(cnt, 0) - cnt
    tl.store(ptrs, start, mask=chunks <= num_chunks)
    return start, cnt


@triton.jit
def _node_chunk_starts(rt, out, k):
    """Across nodes: per node, the exclusive prefix over chunks of this rank's tokens to it, in
    place in send_chunk_node_start (the offsets of this rank's chunks in its stream to the
    node, for the layout rows and the senders)."""
    for node in range(0, k.NODES):
        carry = tl.zeros([], tl.int32)
        for c0 in range(0, rt.num_chunks + 1, k.TABLE_BLOCK):
            chunks = c0 + tl.arange(0, k.TABLE_BLOCK)
            ptrs = out.send_chunk_node_start_ptr + chunks * k.NODES + node
            _, cnt = _chunk_starts_in_place(ptrs, chunks, rt.num_chunks, carry)
            carry += tl.sum(cnt, axis=0)


@triton.jit
def _write_row(row, peer, totals, invalid, rt, out, k):
    """The layout row for ``peer`` at ``row``: this rank's per-expert totals, tokens, ``invalid``
    and pad_multiple (the counts row, ROW words), then the offsets of this rank's chunks in its
    stream to ``peer`` (also into column ``peer`` of send_chunk_start, in place, for the
    senders) and, across nodes, in its stream to the node of ``peer``."""
    experts = tl.arange(0, k.E_P2)
    tl.store(row + experts, totals, mask=experts < rt.num_experts)
    tl.store(row + rt.num_experts + 0, rt.num_tokens)
    tl.store(row + rt.num_experts + 1, invalid)
    tl.store(row + rt.num_experts + 2, rt.pad_multiple)
    carry = tl.zeros([], tl.int32)
    for c0 in range(0, rt.num_chunks + 1, k.TABLE_BLOCK):
        chunks = c0 + tl.arange(0, k.TABLE_BLOCK)
        ptrs = out.send_chunk_start_ptr + chunks * rt.world_size + peer
        start, cnt = _chunk_starts_in_place(ptrs, chunks, rt.num_chunks, carry)
        tl.store(row + k.ROW + chunks, start, mask=chunks <= rt.num_chunks)
        if k.NODES > 1:
            node_starts = tl.load(
                out.send_chunk_node_start_ptr + chunks * k.NODES + peer // k.R,
                mask=chunks <= rt.num_chunks,
                cache_modifier=".cg",
            )
            tl.store(row + k.ROW + k.NC_MAX + 1 + chunks, node_starts, mask=chunks <= rt.num_chunks)
        carry += tl.sum(cnt, axis=0)


@triton.jit
def _wait_rows(seq, rt, heap, m, k):
    """Step 3: wait for every live peer's layout row (its flag in this rank's count flags
    reaching 2 seq - 1; a peer that runs out of time is masked where the Buffer says so, else
    the timeout is recorded at STAGE_LAYOUT); returns the [W, LR] rows at the parity of seq."""
    my_flags = region(heap.peer_bases_ptr, rt.rank, heap.count_flags_off, tl.int64)
    for peer in range(0, rt.world_size):
        await_peer(my_flags + peer, 2 * seq - 1, peer, STAGE_LAYOUT, m, rt.world_size, k.NODES)
    layout_in = region(heap.peer_bases_ptr, rt.rank, heap.layout_in_off, tl.int32)
    return layout_in + (seq % 2) * rt.world_size * k.LR


@triton.jit
def _agree_on_masks(seq, rt, heap, m, k):
    """Step 3, where the Buffer masks failed ranks: tell every live rank of the masks this rank
    set while it waited, then raise this rank's flag in theirs to 2 seq and wait for theirs.
    Every live rank tells before it raises, so each has every other's masks of the rows' wait
    when its own wait here ends: a peer slow for one rank and not for another is masked by all
    of them, and their layouts agree (a rank lost in this step itself is masked here too, where
    a rank that heard it first has counted it)."""
    if read_uniform(m.control_ptr + MASKS_NEW) != 0:
        tell_new_masks(m, rt.world_size, k.NODES)
    for peer in range(0, rt.world_size):
        if (peer != rt.rank) & live(m, peer):
            signal_peer(
                heap.peer_bases_ptr,
                heap.net_bases_ptr,
                peer,
                heap.count_flags_off,
                rt.rank,
                2 * seq,
                k.NODES,
            )
    my_flags = region(heap.peer_bases_ptr, rt.rank, heap.count_flags_off, tl.int64)
    for peer in range(0, rt.world_size):
        if peer != rt.rank:
            await_peer(my_flags + peer, 2 * seq, peer, STAGE_LAYOUT, m, rt.world_size, k.NODES)
    if read_uniform(m.control_ptr + MASKS_NEW) != 0:
        tell_new_masks(m, rt.world_size, k.NODES)


@triton.jit
def _live_sources(rt, m, k):
    """[W_P2], whether each rank takes part in the layout (not masked here; this rank always):
    a masked rank's row counts as no tokens and no experts."""
    srcs = tl.arange(0, k.W_P2)
    masked = tl.load(m.mask_ptr + srcs, mask=(srcs < rt.world_size) & (srcs != rt.rank), other=0)
    return (srcs < rt.world_size) & (masked == 0)


@triton.jit
def _drop_masked_destinations(live, rt, out, k):
    """Where a rank is masked: this rank's tokens go to it no more (its column of
    token_rank_pos -1), so that neither dispatch nor combine moves rows to or from it."""
    ranks = tl.arange(0, k.W_P2)
    dead = (ranks < rt.world_size) & ~live
    for t0 in range(0, rt.num_tokens, k.CHUNK):
        tokens = t0 + tl.arange(0, k.CHUNK)
        ptrs = out.token_rank_pos_ptr + tokens[:, None] * rt.world_size + ranks[None, :]
        tl.store(ptrs, -1, mask=(tokens < rt.num_tokens)[:, None] & dead[None, :])


@triton.jit
def _first_source(first_invalid, W_P2: tl.constexpr):
    """The first source whose dispatch cannot go ahead, from ``first_invalid`` (W_P2: none), or
    -1."""
    return tl.where(first_invalid < W_P2, first_invalid, -1).to(tl.int64)


@triton.jit
def _read_sources(counts, live, rt, out, k):
    """Step 4, the received streams: every ``live`` source's tokens and chunk offsets (across
    nodes also those of each node's stream to this node; a masked source has none), and the
    first source whose dispatch cannot go ahead with its cause, into info. Returns (first
    invalid source or W_P2, its cause)."""
    table = counts + k.ROW
    srcs = tl.arange(0, k.W_P2)
    smask = live
    extra = counts + srcs * k.LR + rt.num_experts
    tokens = tl.load(extra + 0, mask=smask, other=0)
    tl.store(out.recv_src_tokens_ptr + srcs, tokens, mask=srcs < rt.world_size)
    causes = tl.load(extra + 1, mask=smask, other=0)
    first_invalid = tl.min(tl.where(causes != 0, srcs, k.W_P2), axis=0)
    first_cause = tl.sum(tl.where(srcs == first_invalid, causes, 0), axis=0).to(tl.int64)
    tl.store(out.info_ptr + INFO_SOURCE, _first_source(first_invalid, k.W_P2))
    tl.store(out.info_ptr + INFO_CAUSE, first_cause)
    for c0 in range(0, k.NC_MAX + 1, k.TABLE_BLOCK):
        chunks = c0 + tl.arange(0, k.TABLE_BLOCK)
        m = smask[:, None] & (chunks[None, :] <= k.NC_MAX)
        tl.store(
            out.recv_chunk_start_ptr + srcs[:, None] * (k.NC_MAX + 1) + chunks[None, :],
            tl.load(table + srcs[:, None] * k.LR + chunks[None, :], mask=m),
            mask=m,
        )
        if k.NODES > 1:
            # From each node's rank of this rank's local index: its stream to this node.
            nodes = tl.arange(0, k.N_P2)
            nm = (nodes[:, None] < k.NODES) & (chunks[None, :] <= k.NC_MAX)
            rail = nodes[:, None] * k.R + rt.rank % k.R
            tl.store(
                out.recv_net_chunk_start_ptr + nodes[:, None] * (k.NC_MAX + 1) + chunks[None, :],
                tl.load(table + rail * k.LR + k.NC_MAX + 1 + chunks[None, :], mask=nm),
                mask=nm,
            )
    return first_invalid, first_cause


@triton.jit
def _destination_segments(counts, live, rt, out, k):
    """Step 5, as a sender: the padded segments of every destination's local experts,
    [destination, local expert], from the rows of the ``live`` sources, and this rank's offset
    inside them, stored as row 0 of chunk_expert_base (the base row of each expert's slots from
    this rank). Returns the segments' starts, padded rows and valid rows, [W_P2, L_P2]."""
    srcs = tl.arange(0, k.W_P2)
    smask = live
    dsts = tl.arange(0, k.W_P2)
    local = tl.arange(0, k.L_P2)
    dl_mask = (dsts[:, None] < rt.world_size) & (local[None, :] < rt.experts_per_rank)
    cmat = tl.load(
        counts
        + srcs[:, None, None] * k.LR
        + (dsts[:, None] * rt.experts_per_rank + local[None, :]),
        mask=smask[:, None, None] & dl_mask[None, :, :],
        other=0,
    )
    total = tl.sum(cmat, axis=0)
    # Each destination pads its segments to its own pad_multiple, from its row.
    dst_pad = tl.load(counts + dsts * k.LR + rt.num_experts + 2, mask=live, other=1)
    padded = (total + dst_pad[:, None] - 1) // dst_pad[:, None] * dst_pad[:, None]
    seg_start = tl.cumsum(padded, 1) - padded
    # Sources fill a segment in rank order.
    my_offset = tl.sum(tl.where(srcs[:, None, None] < rt.rank, cmat, 0), axis=0)
    tl.store(
        out.chunk_expert_base_ptr + dsts[:, None] * rt.experts_per_rank + local[None, :],
        seg_start + my_offset,
        mask=dl_mask,
    )
    return seg_start, padded, total


@triton.jit
def _own_segments(counts, live, seg_start, padded, total, rt, out, k):
    """Step 5, as a receiver: this rank's own segments into expert_layout, tokens_per_expert,
    from the ``live`` sources' rows. Returns the rows its output needs and tokens_per_expert
    ([L_P2] int64)."""
    dsts = tl.arange(0, k.W_P2)
    local = tl.arange(0, k.L_P2)
    mine = dsts[:, None] == rt.rank
    my_start = tl.sum(tl.where(mine, seg_start, 0), axis=0)
    my_padded = tl.sum(tl.where(mine, padded, 0), axis=0)
    lmask = local < rt.experts_per_rank
    tl.store(out.expert_layout_ptr + local, my_start, mask=lmask)
    tl.store(
        out.expert_layout_ptr + rt.experts_per_rank + local,
        tl.sum(tl.where(mine, total, 0), 0),
        mask=lmask,
    )
    tl.store(out.expert_layout_ptr + 2 * rt.experts_per_rank + local, my_padded, mask=lmask)
    if k.TOKEN_ROWS:
        # One row per received token: every source's stream to this rank.
        srcs = tl.arange(0, k.W_P2)
        smask = live
        src_tokens = tl.load(counts + srcs * k.LR + rt.num_experts + 0, mask=smask, other=0)
        streamed = tl.load(
            counts + k.ROW + srcs * k.LR + tl.cdiv(src_tokens, k.CHUNK), mask=smask, other=0
        )
        per_expert = my_padded.to(tl.int64)
        tl.store(out.recv_rank_prefix_ptr + srcs, tl.cumsum(streamed, 0), mask=srcs < rt.world_size)
        needed = tl.sum(streamed, axis=0).to(tl.int64)
    else:
        # Rows past max_rows are dropped: tokens_per_expert counts those in the output.
        present = tl.minimum(my_start + my_padded, rt.max_rows) - my_start
        per_expert = tl.maximum(present, 0).to(tl.int64)
        needed = tl.sum(my_padded, axis=0).to(tl.int64)
    tl.store(out.tokens_per_expert_ptr + local, per_expert, mask=lmask)
    return needed, per_expert


@triton.jit
def _report(needed, per_expert, first_invalid, bad, status_ptr, first_cause, rt, sync, k):
    """Exact mode: what the host waits for, straight into its pinned memory, the tag last, so
    that the host polls host memory instead of synchronising with the stream; tokens_per_expert
    (``per_expert``) too, which the host then has with no copy from the device."""
    report = host_pointer(sync.report_addr, tl.int64)
    tl.store(report + REPORT_ROWS, needed)
    local = tl.arange(0, k.L_P2)
    tl.store(report + REPORT_EXPERTS + local, per_expert, mask=local < rt.experts_per_rank)
    tl.store(report + REPORT_SOURCE, _first_source(first_invalid, k.W_P2))
    tl.store(report + REPORT_BAD_ROW, _first_bad_row(bad))
    for i in tl.static_range(STATUS_WORDS):
        tl.store(report + REPORT_STATUS + i, tl.load(status_ptr + i, volatile=True))
    tl.store(report + REPORT_CAUSE, first_cause)
    # The words above reach the host before the tag that says they are there.
    fence_system()
    tl.store(report + REPORT_TAG, sync.report_tag + tl.zeros([], tl.int64))


@triton.jit
def _roles(chunk, rt, out, heap, sync, m, k):
    """Program ``chunk``'s roles: counter of its chunk (if any), then, for the program that
    takes the last ticket, the exchanger."""
    bad_row_ptr = sync.control_ptr + BAD_ROW
    if chunk < rt.num_chunks:
        _count_role(chunk=chunk, bad_row_ptr=bad_row_ptr, rt=rt, out=out, k=k)
    # Every thread's counts are stored before the program's ticket is taken; the ticket's
    # acq_rel publishes them to the program that takes the last one, and the barrier after it
    # lets every thread of that program see what the ticket acquired.
    tl.debug_barrier()
    ticket = tl.atomic_add(sync.control_ptr + LAYOUT_TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()
        # Every ticket is taken: reset for the next launch.
        tl.store(sync.control_ptr + LAYOUT_TICKET, 0)
        _exchange_role(rt=rt, out=out, heap=heap, sync=sync, m=m, k=k)


@triton.jit(do_not_specialize=UNSPECIALISED + SAME_ON_EVERY_RANK)
def layout_kernel(
    # Routing: this rank's tokens' experts and the group's sizes
    topk_idx_ptr,  # in [T, K] int32 or int64
    num_tokens,
    num_chunks,
    topk,
    num_experts,
    experts_per_rank,
    rank,
    world_size,
    pad_multiple,
    max_rows,  # rows of this rank's output: tokens_per_expert is clipped to them
    # Outputs: the handle's tables
    slot_pos_ptr,  # out [T, K] int32: position among the chunk's slots of the same expert, or -1
    token_rank_pos_ptr,  # out [T, W] int32: position among the chunk's tokens to that rank, or -1
    chunk_expert_base_ptr,  # out [NC + 1, E] int32: row 0 the destination row of each expert's
    # first slot from this rank; row c + 1 the offset of chunk c's first slot among them
    send_chunk_start_ptr,  # out [NC_MAX + 1, W] int32: offset of each chunk in the stream to W
    recv_chunk_start_ptr,  # out [W, NC_MAX + 1] int32: chunk offsets of each source's stream
    recv_src_tokens_ptr,  # out [W] int32: tokens of each source
    recv_rank_prefix_ptr,  # out [W] int32, with TOKEN_ROWS: rows received from sources 0..s
    expert_layout_ptr,  # out [3, L] int32: segment start, valid rows, padded rows
    tokens_per_expert_ptr,  # out [L] int64: padded rows per local expert inside the output;
    # with TOKEN_ROWS the (token, expert) pairs per local expert, of all received tokens
    info_ptr,  # out int64 [4]: rows needed, first source whose dispatch cannot go ahead (or -1),
    # first invalid row of this rank (or 2**62), that source's cause (1: invalid routing; above:
    # the host's refusal code)
    # Heap and sync: peers' bases, the control block, regions, the bound of every wait
    peer_bases_ptr,
    control_ptr,  # int64 [CONTROL_WORDS] (kernels/control.py): LAYOUT_SEQ, STATUS, LAYOUT_TICKET,
    # BAD_ROW
    count_flags_off,
    layout_in_off,
    timeout_ns,
    mask_off,  # the mask (kernels/peers.py)
    # Across nodes: the tables of the streams through other nodes, network heap
    token_node_pos_ptr,  # out [T, N] int32: position among the chunk's tokens to that node, or -1
    send_chunk_node_start_ptr,  # out [NC_MAX + 1, N] int32: offset of each chunk in the stream to
    # node N (its rank of this rank's local index forwards it)
    recv_net_chunk_start_ptr,  # out [N, NC_MAX + 1] int32: chunk offsets of the stream to this
    # node from each node's rank of this rank's local index
    net_bases_ptr,  # int64 [W]: addresses for network puts (see primitives)
    layout_out_off,
    heap_bytes,
    # The host's report, and this rank's refusal
    report_addr,  # int64 [REPORT_WORDS] in the host's pinned memory, as an address
    report_tag,  # 0, or: write the REPORT_* words (kernels/control.py) there, REPORT_TAG last
    refused,  # int32: 0, or the code of this rank's refused argument (no tokens then): every
    # rank's layout reports it as invalid routing is reported
    # Meta-parameters (the glossary in kernels/__init__.py)
    CHUNK: tl.constexpr,
    K_P2: tl.constexpr,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    L_P2: tl.constexpr,
    PAIRS: tl.constexpr,  # slots per side of a tile of slot pairs
    NC_MAX: tl.constexpr,
    ROW: tl.constexpr,  # int32 words of a counts row
    C_BLOCK: tl.constexpr,  # chunks per tile of the per-expert prefix sums
    TABLE_BLOCK: tl.constexpr,  # chunks per tile of the per-rank prefix sums and chunk tables
    TOKEN_ROWS: tl.constexpr,  # the output has a row per received token, not per (token, expert)
    LR: tl.constexpr,  # int32 words of a layout row: counts row, then two chunk tables
    R: tl.constexpr,  # ranks per node
    NODES: tl.constexpr,
    N_P2: tl.constexpr,
):
    chunk = tl.program_id(0)
    # The arguments in bundles for the roles, in the order of their fields (a group a line).
    rt = Routing(
        *(topk_idx_ptr, num_tokens, num_chunks, topk, num_experts, experts_per_rank, rank),
        *(world_size, pad_multiple, max_rows, refused),
    )
    out = HandleParts(
        *(slot_pos_ptr, token_rank_pos_ptr, chunk_expert_base_ptr, send_chunk_start_ptr),
        *(recv_chunk_start_ptr, recv_src_tokens_ptr, recv_rank_prefix_ptr, expert_layout_ptr),
        *(tokens_per_expert_ptr, info_ptr, token_node_pos_ptr, send_chunk_node_start_ptr),
        recv_net_chunk_start_ptr,
    )
    heap = LayoutHeap(
        peer_bases_ptr, count_flags_off, layout_in_off, net_bases_ptr, layout_out_off, heap_bytes
    )
    sync = LayoutSync(control_ptr, timeout_ns, report_addr, report_tag)
    k: tl.constexpr = LayoutConsts(
        *(CHUNK, K_P2, W_P2, E_P2, L_P2, PAIRS, NC_MAX, ROW, C_BLOCK, TABLE_BLOCK, TOKEN_ROWS),
        *(LR, R, NODES, N_P2),
    )
    m = Masking(
        *(rank, control_ptr, control_ptr + STATUS, timeout_ns),
        *(region(peer_bases_ptr, rank, mask_off, tl.int64), peer_bases_ptr, net_bases_ptr),
        mask_off,
    )
    _roles(chunk=chunk, rt=rt, out=out, heap=heap, sync=sync, m=m, k=k)
