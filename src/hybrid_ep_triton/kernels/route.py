"""Dispatch layout: where every (token, expert) slot lands, computed on the device in one launch,
with no host round trip.

Every program counts one chunk of CHUNK tokens: the slots per expert and the tokens per
destination rank, and every slot's and every (token, rank) pair's position among the chunk's
slots of the same expert / tokens of the same rank. It also checks the routing: ids outside
[-1, E) and duplicate ids in a row.

The last program to finish counting (a ticket, so no program waits for another and the launch
needs no co-resident programs) then exchanges the layout with the peers: it turns the chunk
counts into prefix sums, publishes this rank's per-expert totals and per-rank chunk offsets into
every peer's heap (across nodes by a network put to the ranks of other nodes, with the chunk
offsets of this rank's stream to their node), waits for every peer's, and derives from the full
[world, E] count matrix
- as a receiver: the padded segment of each local expert in the expert-major output;
- as a sender: the base row, on the destination, of each expert's slots from this rank.
A sender's slot of chunk c then lands on row
``chunk_expert_base[0, e] + chunk_expert_base[c + 1, e] + slot_pos`` of the destination.
"""

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
    REPORT_BAD_ROW,
    REPORT_CAUSE,
    REPORT_ROWS,
    REPORT_SOURCE,
    REPORT_STATUS,
    REPORT_TAG,
    STAGE_LAYOUT,
    STATUS,
    STATUS_WORDS,
)
from .primitives import (
    fence_system,
    net_put_signal,
    node_first_rank,
    region,
    signal,
    wait_at_least,
)

# The first invalid row of a launch is recorded in a control word as 2**62 - row (an atomic max
# keeps the first; 0, the word's resting value, means none) and reported in info[2] as the row,
# or 2**62 when none. The kernels write 2**62 as the literal 4611686018427387904.


@triton.jit
def _flat_slots(topk_idx_ptr, chunk, first, num_tokens, topk, num_experts, n: tl.constexpr,
                CHUNK: tl.constexpr, K_P2: tl.constexpr):  # fmt: skip
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
def _count_chunk(
    chunk,
    topk_idx_ptr,
    num_tokens,
    topk,
    num_experts,
    experts_per_rank,
    world_size,
    slot_pos_ptr,
    token_rank_pos_ptr,
    expert_count_ptr,
    rank_count_ptr,
    bad_row_ptr,
    rank,
    token_node_pos_ptr,
    node_count_ptr,
    CHUNK: tl.constexpr,
    K_P2: tl.constexpr,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    PAIRS: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    R: tl.constexpr,
    NODES: tl.constexpr,
    N_P2: tl.constexpr,
):
    """Count chunk ``chunk``: slot_pos (unless TOKEN_ROWS: token rows need none) and
    token_rank_pos of its tokens, its slots per expert (``expert_count_ptr`` [E]) and tokens per
    rank (``rank_count_ptr`` [W]); the first invalid row goes into ``bad_row_ptr`` (as
    2**62 - row). Across nodes also token_node_pos (the token's position among the chunk's
    tokens to each other node, or -1) and the tokens per node (``node_count_ptr`` [N]; 0 for
    this rank's own node, whose tokens go over NVLink)."""
    # Per slot: its position among the chunk's slots of the same expert, the number of pairs of
    # slots with that expert whose other slot belongs to an earlier token (tiles of pairs).
    expert_count = tl.zeros([E_P2], tl.int32)
    for i0 in range(0, CHUNK * K_P2, PAIRS):
        token, offs, in_chunk, ids = _flat_slots(
            topk_idx_ptr, chunk, i0, num_tokens, topk, num_experts, PAIRS, CHUNK, K_P2
        )
        if not TOKEN_ROWS:
            pos = tl.zeros([PAIRS], tl.int32)
            for j0 in range(0, CHUNK * K_P2, PAIRS):
                other_token, _, _, other_ids = _flat_slots(
                    topk_idx_ptr, chunk, j0, num_tokens, topk, num_experts, PAIRS, CHUNK, K_P2
                )
                earlier = (ids[:, None] == other_ids[None, :]) & (
                    other_token[None, :] < token[:, None]
                )
                pos += tl.sum(earlier.to(tl.int32), axis=1)
            tl.store(slot_pos_ptr + offs, tl.where(ids >= 0, pos, -1), mask=in_chunk)
        expert_count += tl.histogram(tl.where(ids >= 0, ids, 0), E_P2, mask=ids >= 0)
    experts = tl.arange(0, E_P2)
    tl.store(expert_count_ptr + experts, expert_count, mask=experts < num_experts)

    # Per token: validation (ids in range, in the ids' own width: int64 ids must not wrap into
    # int32; no id twice), and a token goes once to each rank holding any of its experts.
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)
    slots = tl.arange(0, K_P2)
    token_ok = tokens < num_tokens
    slot_mask = token_ok[:, None] & (slots[None, :] < topk)
    raw_ids = tl.load(
        topk_idx_ptr + tokens[:, None] * topk + slots[None, :], mask=slot_mask, other=-1
    )
    out_of_range = slot_mask & ((raw_ids < -1) | (raw_ids >= num_experts))
    slot_ids = tl.where(out_of_range, -1, raw_ids).to(tl.int32)
    same = (slot_ids[:, :, None] == slot_ids[:, None, :]) & (slot_ids >= 0)[:, :, None]
    same = same & (slots[None, :, None] != slots[None, None, :])
    bad_row = (
        tl.sum(out_of_range.to(tl.int32), axis=1) + tl.sum(tl.sum(same.to(tl.int32), 2), 1)
    ) > 0
    first_bad = tl.min(tl.where(bad_row, tokens, 2147483647), axis=0)
    if first_bad < 2147483647:
        tl.atomic_max(bad_row_ptr, 4611686018427387904 - first_bad.to(tl.int64))
    dest = tl.where(slot_ids >= 0, slot_ids // experts_per_rank, -1)
    ranks = tl.arange(0, W_P2)
    to_rank = tl.sum((dest[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1) > 0
    _store_positions(
        to_rank, tokens, token_ok, ranks, world_size, token_rank_pos_ptr, rank_count_ptr
    )
    if NODES > 1:
        nodes = tl.arange(0, N_P2)
        # Unused slots (dest -1) select no node: integer division truncates towards zero.
        in_node = (dest[:, :, None] >= 0) & (dest[:, :, None] // R == nodes[None, None, :])
        to_node = (tl.sum(in_node.to(tl.int32), axis=1) > 0) & (nodes[None, :] != rank // R)
        _store_positions(
            to_node, tokens, token_ok, nodes, NODES, token_node_pos_ptr, node_count_ptr
        )


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


@triton.jit
def _exchange(
    rank,
    world_size,
    num_tokens,
    num_chunks,
    num_experts,
    experts_per_rank,
    pad_multiple,
    max_rows,
    chunk_expert_base_ptr,
    send_chunk_start_ptr,
    recv_chunk_start_ptr,
    recv_src_tokens_ptr,
    expert_layout_ptr,
    tokens_per_expert_ptr,
    info_ptr,
    peer_bases_ptr,
    control_ptr,
    count_flags_off,
    layout_in_off,
    timeout_ns,
    send_chunk_node_start_ptr,
    recv_net_chunk_start_ptr,
    net_bases_ptr,
    layout_out_off,
    heap_bytes,
    report_addr,
    report_tag,
    refused,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    L_P2: tl.constexpr,
    NC_MAX: tl.constexpr,
    ROW: tl.constexpr,
    LR: tl.constexpr,
    C_BLOCK: tl.constexpr,
    TABLE_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    R: tl.constexpr,
    NODES: tl.constexpr,
    N_P2: tl.constexpr,
):
    """The layout exchange, run by the launch's last program once every chunk is counted."""
    seq = tl.load(control_ptr + LAYOUT_SEQ) + 1
    status_ptr = control_ptr + STATUS
    # Written by the launch's other programs: loads bypass L1.
    bad = tl.load(control_ptr + BAD_ROW, volatile=True)
    tl.store(control_ptr + BAD_ROW, 0)
    tl.store(info_ptr + INFO_BAD_ROW,
             tl.where(bad > 0, 4611686018427387904 - bad, 4611686018427387904))  # fmt: skip

    # 1. Per expert, exclusive prefix over chunks of the counts (in place), and the totals.
    experts = tl.arange(0, E_P2)
    emask = experts < num_experts
    totals = tl.zeros([E_P2], tl.int32)
    for c0 in range(0, num_chunks, C_BLOCK):
        chunks = c0 + tl.arange(0, C_BLOCK)
        m = (chunks[:, None] < num_chunks) & emask[None, :]
        ptrs = chunk_expert_base_ptr + (chunks[:, None] + 1) * num_experts + experts[None, :]
        cnt = tl.load(ptrs, mask=m, other=0, cache_modifier=".cg")
        tl.store(ptrs, totals[None, :] + tl.cumsum(cnt, 0) - cnt, mask=m)
        totals += tl.sum(cnt, axis=0)

    # 2. To every peer, its layout row `rank` (at the parity of seq): the totals (per-expert
    # totals, then tokens, why this rank's dispatch cannot go ahead (0: it can; 1: invalid
    # routing; above: the host's refusal code), pad_multiple), the offsets of this rank's chunks in
    # the stream to it (and column `peer` of send_chunk_start, in place) and, across nodes, in
    # the stream to its node. Peers of this node get the row by peer stores; the others by a
    # network put from this rank's layout_out.
    invalid = tl.maximum(refused, (bad > 0).to(tl.int32))
    node_first = node_first_rank(rank, R, NODES)
    if NODES > 1:
        for node in range(0, NODES):
            carry = tl.zeros([], tl.int32)
            for c0 in range(0, num_chunks + 1, TABLE_BLOCK):
                chunks = c0 + tl.arange(0, TABLE_BLOCK)
                ptrs = send_chunk_node_start_ptr + chunks * NODES + node
                cnt = tl.load(ptrs, mask=chunks < num_chunks, other=0, cache_modifier=".cg")
                tl.store(ptrs, carry + tl.cumsum(cnt, 0) - cnt, mask=chunks <= num_chunks)
                carry += tl.sum(cnt, axis=0)
    # Bytes from layout_in to this rank's row at the parity of seq.
    row_off = ((seq % 2) * world_size + rank) * (LR * 4)
    for peer in range(0, world_size):
        near = (peer >= node_first) & (peer < node_first + R)
        row = region(peer_bases_ptr, peer, layout_in_off, tl.int32) + row_off // 4
        if NODES > 1:
            if not near:
                row = region(peer_bases_ptr, rank, layout_out_off, tl.int32) + peer * LR
        tl.store(row + experts, totals, mask=emask)
        tl.store(row + num_experts + 0, num_tokens)
        tl.store(row + num_experts + 1, invalid)
        tl.store(row + num_experts + 2, pad_multiple)
        carry = tl.zeros([], tl.int32)
        for c0 in range(0, num_chunks + 1, TABLE_BLOCK):
            chunks = c0 + tl.arange(0, TABLE_BLOCK)
            ptrs = send_chunk_start_ptr + chunks * world_size + peer
            cnt = tl.load(ptrs, mask=chunks < num_chunks, other=0, cache_modifier=".cg")
            start = carry + tl.cumsum(cnt, 0) - cnt
            tl.store(ptrs, start, mask=chunks <= num_chunks)
            tl.store(row + ROW + chunks, start, mask=chunks <= num_chunks)
            if NODES > 1:
                node_starts = tl.load(send_chunk_node_start_ptr + chunks * NODES + peer // R,
                                      mask=chunks <= num_chunks, cache_modifier=".cg")  # fmt: skip
                tl.store(row + ROW + NC_MAX + 1 + chunks, node_starts, mask=chunks <= num_chunks)
            carry += tl.sum(cnt, axis=0)
        flag = region(peer_bases_ptr, peer, count_flags_off, tl.int64) + rank
        if NODES > 1:
            if near:
                signal(flag, seq)
            else:
                net_put_signal(
                    net_bases_ptr, rank, peer, layout_in_off + row_off, row, LR * 4,
                    count_flags_off + rank * 8, seq, heap_bytes,
                )  # fmt: skip
        else:
            signal(flag, seq)

    # 3. Wait for every peer's row.
    my_flags = region(peer_bases_ptr, rank, count_flags_off, tl.int64)
    for peer in range(0, world_size):
        wait_at_least(my_flags + peer, seq, timeout_ns, status_ptr, peer, STAGE_LAYOUT)
    counts = region(peer_bases_ptr, rank, layout_in_off, tl.int32) + (seq % 2) * world_size * LR
    table = counts + ROW

    # 4. Received streams: chunk offsets and token counts of every source; abort on bad routing.
    srcs = tl.arange(0, W_P2)
    smask = srcs < world_size
    extra = counts + srcs * LR + num_experts
    tl.store(recv_src_tokens_ptr + srcs, tl.load(extra + 0, mask=smask), mask=smask)
    causes = tl.load(extra + 1, mask=smask, other=0)
    first_invalid = tl.min(tl.where(causes != 0, srcs, W_P2), axis=0)
    first_cause = tl.sum(tl.where(srcs == first_invalid, causes, 0), axis=0).to(tl.int64)
    tl.store(info_ptr + INFO_SOURCE,
             tl.where(first_invalid < W_P2, first_invalid, -1).to(tl.int64))  # fmt: skip
    tl.store(info_ptr + INFO_CAUSE, first_cause)
    for c0 in range(0, NC_MAX + 1, TABLE_BLOCK):
        chunks = c0 + tl.arange(0, TABLE_BLOCK)
        m = smask[:, None] & (chunks[None, :] <= NC_MAX)
        tl.store(recv_chunk_start_ptr + srcs[:, None] * (NC_MAX + 1) + chunks[None, :],
                 tl.load(table + srcs[:, None] * LR + chunks[None, :], mask=m), mask=m)  # fmt: skip
        if NODES > 1:
            # From each node's rank of this rank's local index: its stream to this node.
            nodes = tl.arange(0, N_P2)
            nm = (nodes[:, None] < NODES) & (chunks[None, :] <= NC_MAX)
            rail = nodes[:, None] * R + rank % R
            tl.store(recv_net_chunk_start_ptr + nodes[:, None] * (NC_MAX + 1) + chunks[None, :],
                     tl.load(table + rail * LR + NC_MAX + 1 + chunks[None, :], mask=nm),
                     mask=nm)  # fmt: skip

    # 5. Segments of every destination's local experts, [destination, local expert]; this
    # rank's offset inside them, as the base row of each expert's slots from this rank.
    dsts = tl.arange(0, W_P2)
    local = tl.arange(0, L_P2)
    dl_mask = (dsts[:, None] < world_size) & (local[None, :] < experts_per_rank)
    cmat = tl.load(
        counts + srcs[:, None, None] * LR + (dsts[:, None] * experts_per_rank + local[None, :]),
        mask=smask[:, None, None] & dl_mask[None, :, :],
        other=0,
    )
    total = tl.sum(cmat, axis=0)
    dst_pad = tl.load(counts + dsts * LR + num_experts + 2, mask=dsts < world_size, other=1)
    padded = (total + dst_pad[:, None] - 1) // dst_pad[:, None] * dst_pad[:, None]
    seg_start = tl.cumsum(padded, 1) - padded
    my_offset = tl.sum(tl.where(srcs[:, None, None] < rank, cmat, 0), axis=0)
    tl.store(
        chunk_expert_base_ptr + dsts[:, None] * experts_per_rank + local[None, :],
        seg_start + my_offset,
        mask=dl_mask,
    )
    # This rank's own segments.
    mine = dsts[:, None] == rank
    my_start = tl.sum(tl.where(mine, seg_start, 0), axis=0)
    my_padded = tl.sum(tl.where(mine, padded, 0), axis=0)
    lmask = local < experts_per_rank
    tl.store(expert_layout_ptr + local, my_start, mask=lmask)
    tl.store(expert_layout_ptr + experts_per_rank + local, tl.sum(tl.where(mine, total, 0), 0),
             mask=lmask)  # fmt: skip
    tl.store(expert_layout_ptr + 2 * experts_per_rank + local, my_padded, mask=lmask)
    if TOKEN_ROWS:
        # One row per received token: every source's stream to this rank.
        src_tokens = tl.load(extra + 0, mask=smask, other=0)
        streamed = tl.load(table + srcs * LR + tl.cdiv(src_tokens, CHUNK), mask=smask, other=0)
        tl.store(tokens_per_expert_ptr + local, my_padded.to(tl.int64), mask=lmask)
        needed = tl.sum(streamed, axis=0).to(tl.int64)
    else:
        present = tl.minimum(my_start + my_padded, max_rows) - my_start
        tl.store(tokens_per_expert_ptr + local, tl.maximum(present, 0).to(tl.int64), mask=lmask)
        needed = tl.sum(my_padded, axis=0).to(tl.int64)
    tl.store(info_ptr + INFO_ROWS, needed)
    tl.store(control_ptr + LAYOUT_SEQ, seq)
    if report_tag != 0:
        # Exact mode: what the host waits for, straight into its pinned memory, the tag last,
        # so that the host polls host memory instead of synchronising with the stream.
        report = report_addr.to(tl.pointer_type(tl.int64))
        tl.store(report + REPORT_ROWS, needed)
        tl.store(report + REPORT_SOURCE,
                 tl.where(first_invalid < W_P2, first_invalid, -1).to(tl.int64))  # fmt: skip
        tl.store(report + REPORT_BAD_ROW,
                 tl.where(bad > 0, 4611686018427387904 - bad, 4611686018427387904))  # fmt: skip
        for i in tl.static_range(STATUS_WORDS):
            tl.store(report + REPORT_STATUS + i, tl.load(status_ptr + i, volatile=True))
        tl.store(report + REPORT_CAUSE, first_cause)
        fence_system()
        tl.store(report + REPORT_TAG, report_tag + tl.zeros([], tl.int64))


@triton.jit
def layout_kernel(
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
    slot_pos_ptr,  # out [T, K] int32: position among the chunk's slots of the same expert, or -1
    token_rank_pos_ptr,  # out [T, W] int32: position among the chunk's tokens to that rank, or -1
    chunk_expert_base_ptr,  # out [NC + 1, E] int32: row 0 the destination row of each expert's
    # first slot from this rank; row c + 1 the offset of chunk c's first slot among them
    send_chunk_start_ptr,  # out [NC_MAX + 1, W] int32: offset of each chunk in the stream to W
    recv_chunk_start_ptr,  # out [W, NC_MAX + 1] int32: chunk offsets of each source's stream
    recv_src_tokens_ptr,  # out [W] int32: tokens of each source
    expert_layout_ptr,  # out [3, L] int32: segment start, valid rows, padded rows
    tokens_per_expert_ptr,  # out [L] int64: padded rows per local expert inside the output;
    # with TOKEN_ROWS the (token, expert) pairs per local expert, of all received tokens
    info_ptr,  # out int64 [4]: rows needed, first source whose dispatch cannot go ahead (or -1),
    # first invalid row of this rank (or 2**62), that source's cause (1: invalid routing; above:
    # the host's refusal code)
    peer_bases_ptr,
    control_ptr,  # int64 [CONTROL_WORDS] (kernels/control.py): LAYOUT_SEQ, STATUS, LAYOUT_TICKET,
    # BAD_ROW
    count_flags_off,
    layout_in_off,
    timeout_ns,
    token_node_pos_ptr,  # out [T, N] int32: position among the chunk's tokens to that node, or -1
    send_chunk_node_start_ptr,  # out [NC_MAX + 1, N] int32: offset of each chunk in the stream to
    # node N (its rank of this rank's local index forwards it)
    recv_net_chunk_start_ptr,  # out [N, NC_MAX + 1] int32: chunk offsets of the stream to this
    # node from each node's rank of this rank's local index
    net_bases_ptr,  # int64 [W]: addresses for network puts (see primitives)
    layout_out_off,
    heap_bytes,
    report_addr,  # int64 [REPORT_WORDS] in the host's pinned memory, as an address
    report_tag,  # 0, or: write the REPORT_* words (kernels/control.py) there, REPORT_TAG last
    refused,  # int32: 0, or the code of this rank's refused argument (no tokens then): every
    # rank's layout reports it as invalid routing is reported
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
    bad_row_ptr = control_ptr + BAD_ROW
    # Counts land where their prefix sums will be: rows c + 1 of chunk_expert_base, rows c of
    # send_chunk_start.
    if chunk < num_chunks:
        _count_chunk(
            chunk, topk_idx_ptr, num_tokens, topk, num_experts, experts_per_rank, world_size,
            slot_pos_ptr, token_rank_pos_ptr, chunk_expert_base_ptr + (chunk + 1) * num_experts,
            send_chunk_start_ptr + chunk * world_size, bad_row_ptr, rank, token_node_pos_ptr,
            send_chunk_node_start_ptr + chunk * NODES, CHUNK, K_P2, W_P2, E_P2, PAIRS, TOKEN_ROWS,
            R, NODES, N_P2,
        )  # fmt: skip
    tl.debug_barrier()
    ticket = tl.atomic_add(control_ptr + LAYOUT_TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()
        tl.store(control_ptr + LAYOUT_TICKET, 0)
        _exchange(
            rank, world_size, num_tokens, num_chunks, num_experts, experts_per_rank,
            pad_multiple, max_rows, chunk_expert_base_ptr, send_chunk_start_ptr,
            recv_chunk_start_ptr, recv_src_tokens_ptr, expert_layout_ptr, tokens_per_expert_ptr,
            info_ptr, peer_bases_ptr, control_ptr, count_flags_off, layout_in_off, timeout_ns,
            send_chunk_node_start_ptr, recv_net_chunk_start_ptr, net_bases_ptr, layout_out_off,
            heap_bytes, report_addr, report_tag, refused, W_P2, E_P2, L_P2, NC_MAX, ROW, LR,
            C_BLOCK, TABLE_BLOCK, CHUNK, TOKEN_ROWS, R, NODES, N_P2,
        )  # fmt: skip
