"""Dispatch layout: where every (token, expert) slot lands, computed on the device.

Two launches, no host round trip:

``count_chunk_kernel`` (one program per chunk of CHUNK tokens) counts, inside its chunk, the
slots per expert and the tokens per destination rank, and gives every slot and every
(token, rank) pair its position among the chunk's slots of the same expert / tokens of the same
rank. It also checks the routing: ids outside [-1, E) and duplicate ids in a row.

``exchange_layout_kernel`` (one program) turns the chunk counts into prefix sums, publishes this
rank's per-expert totals and per-rank chunk offsets into every peer's heap, waits for every
peer's, and derives from the full [world, E] count matrix
- as a receiver: the padded segment of each local expert in the expert-major output;
- as a sender: the base row, on the destination, of every (chunk, expert) pair of its tokens.
A sender's slot then lands on row ``chunk_expert_base[chunk, e] + slot_pos`` of the destination.
"""

import triton
import triton.language as tl

from .primitives import region, signal, wait_at_least

STAGE_LAYOUT = 1  # stage number a timed-out wait records (literal inside the kernels)


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
def count_chunk_kernel(
    topk_idx_ptr,
    num_tokens,
    topk,
    num_experts,
    experts_per_rank,
    world_size,
    slot_pos_ptr,  # out [T, K] int32: position among the chunk's slots of the same expert, or -1
    token_rank_pos_ptr,  # out [T, W] int32: position among the chunk's tokens to that rank, or -1
    chunk_expert_count_ptr,  # out [NC, E] int32
    chunk_rank_count_ptr,  # out [NC, W] int32
    invalid_row_ptr,  # out [1] int64: smallest invalid row (atomic min), untouched when valid
    CHUNK: tl.constexpr,
    K_P2: tl.constexpr,
    W_P2: tl.constexpr,
    E_P2: tl.constexpr,
    PAIRS: tl.constexpr,  # slots per side of a tile of slot pairs
):
    chunk = tl.program_id(0)
    # Per slot: its position among the chunk's slots of the same expert, the number of pairs of
    # slots with that expert whose other slot belongs to an earlier token (tiles of pairs).
    expert_count = tl.zeros([E_P2], tl.int32)
    for i0 in range(0, CHUNK * K_P2, PAIRS):
        token, offs, in_chunk, ids = _flat_slots(
            topk_idx_ptr, chunk, i0, num_tokens, topk, num_experts, PAIRS, CHUNK, K_P2
        )
        pos = tl.zeros([PAIRS], tl.int32)
        for j0 in range(0, CHUNK * K_P2, PAIRS):
            other_token, _, _, other_ids = _flat_slots(
                topk_idx_ptr, chunk, j0, num_tokens, topk, num_experts, PAIRS, CHUNK, K_P2
            )
            earlier = (ids[:, None] == other_ids[None, :]) & (other_token[None, :] < token[:, None])
            pos += tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(slot_pos_ptr + offs, tl.where(ids >= 0, pos, -1), mask=in_chunk)
        expert_count += tl.histogram(tl.where(ids >= 0, ids, 0), E_P2, mask=ids >= 0)
    experts = tl.arange(0, E_P2)
    tl.store(
        chunk_expert_count_ptr + chunk * num_experts + experts,
        expert_count,
        mask=experts < num_experts,
    )

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
        tl.atomic_min(invalid_row_ptr, first_bad.to(tl.int64))
    dest = tl.where(slot_ids >= 0, slot_ids // experts_per_rank, -1)
    ranks = tl.arange(0, W_P2)
    to_rank = tl.sum((dest[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1) > 0
    sent = to_rank.to(tl.int32)
    before = tl.cumsum(sent, axis=0) - sent
    tl.store(
        token_rank_pos_ptr + tokens[:, None] * world_size + ranks[None, :],
        tl.where(to_rank, before, -1),
        mask=token_ok[:, None] & (ranks[None, :] < world_size),
    )
    tl.store(
        chunk_rank_count_ptr + chunk * world_size + ranks,
        tl.sum(sent, axis=0),
        mask=ranks < world_size,
    )


@triton.jit
def exchange_layout_kernel(
    peer_bases_ptr,
    rank,
    world_size,
    num_tokens,
    num_chunks,
    num_experts,
    experts_per_rank,
    pad_multiple,
    max_rows,  # rows of this rank's output: tokens_per_expert is clipped to them
    chunk_expert_count_ptr,  # in [NC, E] int32
    chunk_rank_count_ptr,  # in [NC, W] int32
    invalid_row_ptr,  # in [1] int64
    chunk_expert_base_ptr,  # out [NC, E] int32: destination row of the chunk's first slot
    send_chunk_start_ptr,  # out [NC_MAX + 1, W] int32: offset of each chunk in the stream to W
    recv_chunk_start_ptr,  # out [W, NC_MAX + 1] int32: chunk offsets of each source's stream
    recv_src_tokens_ptr,  # out [W] int32: tokens of each source
    expert_layout_ptr,  # out [3, L] int32: segment start, valid rows, padded rows
    tokens_per_expert_ptr,  # out [L] int64: padded rows per local expert inside the output
    info_ptr,  # out int64 [4]: rows needed, first invalid source (or -1), -, -
    control_ptr,  # int64 [6]: [3:6] status
    count_flags_off,
    counts_off,
    chunk_table_off,
    timeout_ns,
    NC_MAX: tl.constexpr,
    ROW: tl.constexpr,
    C_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    W_P2: tl.constexpr,
    L_P2: tl.constexpr,
):
    seq = tl.load(control_ptr + 2) + 1
    status_ptr = control_ptr + 3

    # 1. Prefix over chunks, per expert; totals go to every peer's counts table, row `rank`.
    for e0 in range(0, num_experts, E_BLOCK):
        experts = e0 + tl.arange(0, E_BLOCK)
        carry = tl.zeros([E_BLOCK], tl.int32)
        for c0 in range(0, num_chunks, C_BLOCK):
            chunks = c0 + tl.arange(0, C_BLOCK)
            m = (chunks[:, None] < num_chunks) & (experts[None, :] < num_experts)
            offs = chunks[:, None] * num_experts + experts[None, :]
            cnt = tl.load(chunk_expert_count_ptr + offs, mask=m, other=0)
            tl.store(chunk_expert_base_ptr + offs, carry[None, :] + tl.cumsum(cnt, 0) - cnt, mask=m)
            carry += tl.sum(cnt, axis=0)
        for peer in range(0, world_size):
            counts = region(peer_bases_ptr, peer, counts_off, tl.int32)
            tl.store(counts + rank * ROW + experts, carry, mask=experts < num_experts)

    # 2. Prefix over chunks, per destination rank: chunk offsets inside each stream.
    ranks = tl.arange(0, W_P2)
    carry_r = tl.zeros([W_P2], tl.int32)
    for c0 in range(0, num_chunks, C_BLOCK):
        chunks = c0 + tl.arange(0, C_BLOCK)
        m = (chunks[:, None] < num_chunks) & (ranks[None, :] < world_size)
        cnt = tl.load(
            chunk_rank_count_ptr + chunks[:, None] * world_size + ranks[None, :], mask=m, other=0
        )
        start = carry_r[None, :] + tl.cumsum(cnt, 0) - cnt
        tl.store(
            send_chunk_start_ptr + chunks[:, None] * world_size + ranks[None, :], start, mask=m
        )
        carry_r += tl.sum(cnt, axis=0)
    tl.store(
        send_chunk_start_ptr + num_chunks * world_size + ranks, carry_r, mask=ranks < world_size
    )
    tl.debug_barrier()

    invalid = (tl.load(invalid_row_ptr) < num_tokens).to(tl.int32)
    for peer in range(0, world_size):
        counts = region(peer_bases_ptr, peer, counts_off, tl.int32) + rank * ROW + num_experts
        # A counts row: per-expert totals, then tokens, invalid routing, pad_multiple.
        tl.store(counts + 0, num_tokens)
        tl.store(counts + 1, invalid)
        tl.store(counts + 2, pad_multiple)
        table = region(peer_bases_ptr, peer, chunk_table_off, tl.int32) + rank * (NC_MAX + 1)
        for c0 in range(0, num_chunks + 1, C_BLOCK):
            chunks = c0 + tl.arange(0, C_BLOCK)
            m = chunks <= num_chunks
            tl.store(
                table + chunks,
                tl.load(send_chunk_start_ptr + chunks * world_size + peer, mask=m),
                mask=m,
            )
    for peer in range(0, world_size):
        flags = region(peer_bases_ptr, peer, count_flags_off, tl.int64)
        signal(flags + rank, seq)

    # 3. Wait for every peer's counts.
    my_flags = region(peer_bases_ptr, rank, count_flags_off, tl.int64)
    for peer in range(0, world_size):
        wait_at_least(my_flags + peer, seq, timeout_ns, status_ptr, peer, 1)  # STAGE_LAYOUT
    counts = region(peer_bases_ptr, rank, counts_off, tl.int32)
    table = region(peer_bases_ptr, rank, chunk_table_off, tl.int32)

    # 4. Received streams: chunk offsets and token counts of every source; abort on bad routing.
    srcs = tl.arange(0, W_P2)
    smask = srcs < world_size
    extra = counts + srcs * ROW + num_experts
    tl.store(recv_src_tokens_ptr + srcs, tl.load(extra + 0, mask=smask), mask=smask)
    invalid_src = tl.where(tl.load(extra + 1, mask=smask, other=0) != 0, srcs, W_P2)
    first_invalid = tl.min(invalid_src, axis=0)
    tl.store(info_ptr + 1, tl.where(first_invalid < W_P2, first_invalid, -1).to(tl.int64))
    for src in range(0, world_size):
        for c0 in range(0, NC_MAX + 1, C_BLOCK):
            chunks = c0 + tl.arange(0, C_BLOCK)
            m = chunks <= NC_MAX
            row = tl.load(table + src * (NC_MAX + 1) + chunks, mask=m)
            tl.store(recv_chunk_start_ptr + src * (NC_MAX + 1) + chunks, row, mask=m)

    # 5. Segments of every destination's local experts; this rank's source offset inside them.
    local = tl.arange(0, L_P2)
    lmask = local < experts_per_rank
    for dst in range(0, world_size):
        m = (srcs[:, None] < world_size) & lmask[None, :]
        cmat = tl.load(
            counts + srcs[:, None] * ROW + dst * experts_per_rank + local[None, :], mask=m, other=0
        )
        total = tl.sum(cmat, axis=0)
        dst_pad = tl.load(counts + dst * ROW + num_experts + 2)
        padded = (total + dst_pad - 1) // dst_pad * dst_pad
        seg_start = tl.cumsum(padded, 0) - padded
        my_offset = tl.sum(tl.where(srcs[:, None] < rank, cmat, 0), axis=0)
        base = seg_start + my_offset
        # Add the base to this rank's chunk prefixes for the experts of `dst`.
        experts = dst * experts_per_rank + local
        for c0 in range(0, num_chunks, C_BLOCK):
            chunks = c0 + tl.arange(0, C_BLOCK)
            cm = (chunks[:, None] < num_chunks) & lmask[None, :]
            ptrs = chunk_expert_base_ptr + chunks[:, None] * num_experts + experts[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=cm) + base[None, :], mask=cm)
        if dst == rank:
            tl.store(expert_layout_ptr + local, seg_start, mask=lmask)
            tl.store(expert_layout_ptr + experts_per_rank + local, total, mask=lmask)
            tl.store(expert_layout_ptr + 2 * experts_per_rank + local, padded, mask=lmask)
            present = tl.minimum(seg_start + padded, max_rows) - seg_start
            tl.store(tokens_per_expert_ptr + local, tl.maximum(present, 0).to(tl.int64), mask=lmask)
            tl.store(info_ptr, tl.sum(padded, axis=0).to(tl.int64))
    tl.store(control_ptr + 2, seq)
