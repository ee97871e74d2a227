"""Waiting on peers that may fail: the mask, masked waits, heartbeats, telling the other ranks,
the data launches' handshakes, and the farewell at destroy().

The mask is int64 [2W + 1] in every rank's heap (runtime/planner.py's ``mask`` region): word i
nonzero where rank i is masked here (Buffer.update_mask; a wait that ran out with
mask_failed_ranks: MASKED_HERE until this rank has told the others; a peer that masked it and
said so: 1), then this rank's heartbeat (the time, written while it waits), then the words into
which the ranks of other nodes push theirs. Every launch of both modes reads it: a masked rank is
neither sent to nor waited for, and a wait on a live one goes through ``await_peers``, which
masks the peer instead of recording a timeout where the Buffer says so (MASK_FAILED).

A wait needs a ``Masking`` bundle of the calling kernel's values (a kernel's sync bundle with
these fields serves): rank, control_ptr, status_ptr (its STATUS words), timeout_ns, mask_ptr
(this rank's mask), bases_ptr (every rank's heap base here, 0 on another node), net_bases_ptr and
mask_off (the mask's byte offset in every heap).
"""

from collections import namedtuple

import triton
import triton.language as tl

from .control import MASK_FAILED, MASKS_NEW
from .primitives import (
    block_any,
    clock_ns,
    net_signal,
    node_first_rank,
    read_uniform,
    region,
    signal,
    time_out_after,
)

Masking = namedtuple(
    "Masking", "rank control_ptr status_ptr timeout_ns mask_ptr bases_ptr net_bases_ptr mask_off"
)
# The most timeouts a masking wait lasts while the peer's heartbeat moves (await_peers).
BEAT_TIMEOUTS = tl.constexpr(4)
# Heartbeats a waiting rank pushes to the ranks of other nodes per timeout.
BEAT_PUSHES = tl.constexpr(8)
# The mask word a wait that ran out writes: nonzero as every mask word, and this value until the
# rank that set it has told the other ranks (which then set 1).
MASKED_HERE = tl.constexpr(2)
# A rank's word in the farewell region (destroy()): it frees the heap with the others, or it
# leaves it (a peer masked, silent or leaving).
FREE_TOGETHER = tl.constexpr(1)
LEAVING = tl.constexpr(2)


@triton.jit
def live(m, peer):
    """Whether ``peer`` (scalar or tensor) is not masked here."""
    return read_uniform(m.mask_ptr + peer) == 0


@triton.jit
def await_peer(flag_ptr, target, peer, stage, m, W, NODES: tl.constexpr):
    """Whether ``*flag_ptr`` reached ``target``: waits unless ``peer`` is masked, or until it
    is; past timeout_ns a Buffer with mask_failed_ranks masks it (the next tell_new_masks tells
    the other ranks), else the timeout is recorded."""
    # A flag that is up (the common case) costs one read.
    arrived = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") >= target
    if not arrived:
        one = tl.zeros([1], tl.int32)
        came = await_peers(flag_ptr + one, target, one == 0, peer + one, peer, stage, m, W, NODES)
        arrived = tl.max(came.to(tl.int32), axis=0) > 0
    return arrived


@triton.jit
def await_peers(flag_ptrs, target, awaited, peers, first_peer, stage, m, W, NODES: tl.constexpr):
    """[N], whether each flag of ``flag_ptrs`` [N] from ``peers`` [N] reached ``target`` where
    ``awaited``, as ``await_peer`` waits (``first_peer``: the one a recorded timeout names). A
    masked peer is not waited for, nor any longer once another program masks it. Past
    timeout_ns, with MASK_FAILED, the peers still awaited and not masked yet are masked
    (MASKED_HERE, and MASKS_NEW set, so that tell_new_masks tells the others) and the wait
    ends; without, the timeout is recorded as wait_at_least() does.

    Heartbeats: while it waits, a rank writes the time into its word (the mask's word W), and
    about BEAT_PUSHES times a timeout (its waits together) into its word in the heap of every
    live rank of another node. A peer whose heartbeat moves is itself waiting (on a rank that
    is gone, say), not gone: its time starts again, up to BEAT_TIMEOUTS timeouts in all, so
    that it is not masked for another rank's failure.

    A flag that is up costs one poll: everything else happens in the loop, which then never
    runs (on CPU ranks, where every operation is interpreted, a wait is mostly that poll)."""
    masked_ptrs = m.mask_ptr + peers
    arrived, waiting = _awaited(flag_ptrs, target, awaited, masked_ptrs, m.status_ptr)
    start = tl.zeros([], tl.int64)  # 0: the first time round the loop sets it
    starts = tl.zeros(flag_ptrs.shape, tl.int64)
    # No heartbeat read before the first poll in the loop, which counts as a move and starts
    # each peer's time then.
    last_beats = tl.full(flag_ptrs.shape, -1, tl.int64)
    while waiting:
        now = clock_ns()
        start = tl.where(start == 0, now, start)
        own_beat = m.mask_ptr + W
        if NODES > 1:  # the first of this rank's waits in a new period pushes
            period = m.timeout_ns // BEAT_PUSHES + 1
            if block_any(now // period != tl.load(own_beat, volatile=True) // period):
                _push_heartbeat(now, m, W)
        tl.store(own_beat, now)
        if tl.load(m.control_ptr + MASK_FAILED) != 0:
            beats = _beats(m, peers, W, NODES)
            has_beat = awaited & (beats != 0)
            beat_ptrs = tl.where(has_beat, beats, 0).to(tl.pointer_type(tl.int64))
            seen = tl.load(beat_ptrs, mask=has_beat, other=0, volatile=True)
            moved = has_beat & (seen != last_beats) & (now - start < BEAT_TIMEOUTS * m.timeout_ns)
            starts = tl.where(moved, now, starts)
            last_beats = seen
            left = awaited & ~arrived & (now - starts > m.timeout_ns)
            unmasked = tl.where(left, 0, -1).to(tl.int64)  # (-1: no word holds it)
            here = tl.full(masked_ptrs.shape, MASKED_HERE, tl.int64)
            was = tl.atomic_cas(masked_ptrs, unmasked, here)
            set_here = tl.max((left & (was == 0)).to(tl.int32), axis=0) > 0
            tl.store(m.control_ptr + MASKS_NEW, 1, mask=set_here)
        else:
            time_out_after(start, m.timeout_ns, m.status_ptr, first_peer, stage)
        arrived, waiting = _awaited(flag_ptrs, target, awaited, masked_ptrs, m.status_ptr)
    tl.debug_barrier()
    return arrived


@triton.jit
def _beats(m, peers, W, NODES: tl.constexpr):
    """The addresses (int64) of ``peers``' heartbeats: their own word (after their mask) on
    this node, the word they push into this rank's mask on another."""
    base = tl.load(m.bases_ptr + peers)
    beats = tl.where(base != 0, base + m.mask_off + W * 8, 0)
    if NODES > 1:
        pushed = tl.load(m.bases_ptr + m.rank) + m.mask_off + (W + 1) * 8 + peers * 8
        beats = tl.where(base != 0, beats, pushed)
    return beats


@triton.jit
def _push_heartbeat(now, m, W):
    """Heartbeat ``now`` into this rank's word of the pushed heartbeats (after the mask's
    word W) of every live rank of another node, where the waits on this rank read it (a
    network signal each)."""
    for peer in range(0, W):
        if (tl.load(m.bases_ptr + peer) == 0) & live(m, peer):
            net_signal(m.net_bases_ptr, peer, m.mask_off + (W + 1 + m.rank) * 8, now)


@triton.jit
def _awaited(flag_ptrs, target, mask, masked_ptrs, status_ptr):
    """(which flags arrived, whether a live peer's flag is still awaited)."""
    value = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
    arrived = mask & (value >= target)
    live_ = read_uniform(masked_ptrs, mask, 1) == 0
    awaited = tl.max((mask & ~arrived & live_).to(tl.int32), axis=0) > 0
    return arrived, awaited & (read_uniform(status_ptr) == 0)


# -- telling the others --------------------------------------------------------------------


@triton.jit
def tell_new_masks(m, W, NODES: tl.constexpr):
    """Tell the other ranks of the masks this rank set (MASKED_HERE) since it last told, and
    clear MASKS_NEW; one program of a launch calls it where MASKS_NEW was set."""
    tl.store(m.control_ptr + MASKS_NEW, 0)
    for masked in range(0, W):
        # (a load and a store, not a compare-and-swap, which Triton 3.6 fails to compile
        # here; a peer that tells this rank meanwhile writes 1 too)
        if read_uniform(m.mask_ptr + masked) == MASKED_HERE:
            tl.store(m.mask_ptr + masked, 1)
            tell_mask(masked, m, W, NODES)


@triton.jit
def tell_mask(masked, m, W, NODES: tl.constexpr):
    """That this rank masks rank ``masked``: set it in every other live rank's mask (the peers
    of another node by a network signal), and in the masked rank's own: one that is alive finds
    itself masked, so that its destroy() waits for no one either."""
    for peer in range(0, W):
        if (peer != m.rank) & ((peer == masked) | live(m, peer)):
            if tl.load(m.bases_ptr + peer) != 0:
                mask = region(m.bases_ptr, peer, m.mask_off, tl.int64)
                tl.atomic_xchg(mask + masked, 1, sem="relaxed", scope="sys")
            elif NODES > 1:
                net_signal(m.net_bases_ptr, peer, m.mask_off + masked * 8, 1)


@triton.jit
def signal_peer(peer_bases_ptr, net_bases_ptr, peer, region_off, index, value, NODES):
    """Set int64 word ``index`` of the region at byte ``region_off`` of ``peer``'s heap to
    ``value`` after this program's writes (``signal``): on this node by a store, on another
    by a network signal."""
    if tl.load(peer_bases_ptr + peer) != 0:
        signal(region(peer_bases_ptr, peer, region_off, tl.int64) + index, value)
    elif NODES > 1:
        net_signal(net_bases_ptr, peer, region_off + index * 8, value)


# -- the data launches' handshakes -----------------------------------------------------------


@triton.jit
def handshake(
    peer_bases_ptr,
    net_bases_ptr,
    ready_off,
    rank,
    seq,
    m,
    stage,
    P_MAX,
    channel,
    R: tl.constexpr,
    NODES: tl.constexpr,
    W,
):
    """Tell every live peer this rank writes to or is written by that this rank's ``channel``
    started launch ``seq`` (so this rank's earlier launches, which read its staging areas, are
    over), then wait until ``channel`` of each has said the same (``await_peer``: a peer masked
    meanwhile is not waited for). Those peers: every rank of this node (over NVLink) and,
    across nodes, the rank with this rank's local index on every other node (over the
    network), or every rank (``covers_every_rank``). ready flags: int64 [world, P_MAX] in every
    heap."""
    node_first = node_first_rank(rank, R, NODES)
    for peer in range(node_first, node_first + R):
        if live(m, peer):
            signal(region(peer_bases_ptr, peer, ready_off, tl.int64) + rank * P_MAX + channel, seq)
    if NODES > 1:
        every = covers_every_rank(m, W)
        flag_off = ready_off + (rank * P_MAX + channel) * 8
        for peer in range(0, W):
            if _elsewhere_exchanges(peer, rank, every, R) & live(m, peer):
                net_signal(net_bases_ptr, peer, flag_off, seq)
    my_ready = region(peer_bases_ptr, rank, ready_off, tl.int64)
    for peer in range(node_first, node_first + R):
        await_peer(my_ready + peer * P_MAX + channel, seq, peer, stage, m, W, NODES)
    if NODES > 1:
        for peer in range(0, W):
            if _elsewhere_exchanges(peer, rank, every, R):
                await_peer(my_ready + peer * P_MAX + channel, seq, peer, stage, m, W, NODES)


@triton.jit
def covers_every_rank(m, W):
    """Whether a handshake across nodes covers every rank, not only this node's and the
    rail peers: with MASK_FAILED or once a rank is masked. Then every rank finds a failed one
    at the start of the launch, before any rows move, and the ranks of a node whose rail peer
    is masked, which exchange rows directly (kernels/dispatch.py, kernels/combine.py), are
    among the peers."""
    every = tl.load(m.control_ptr + MASK_FAILED) != 0
    for peer in range(0, W):
        every = every | ~live(m, peer)
    return every


@triton.jit
def _elsewhere_exchanges(peer, rank, every, R: tl.constexpr):
    """Whether a handshake of ``rank`` covers ``peer`` of another node: the rank of its local
    index there, or any with ``every``."""
    return (peer // R != rank // R) & (every | (peer % R == rank % R))


@triton.jit
def wait_item(my_ready, carrier, rank, channel, flag_ptr, seq, m, ready_stage, data_stage, k):
    """Whether a work item has landed here: waits first for program ``channel`` of rank
    ``carrier``, which delivers it, to have started the launch, so that a peer that never came
    is named at ``ready_stage``, then for the item's flag at ``flag_ptr`` (``data_stage``);
    False where the carrier is (or got) masked. ``my_ready``: this rank's ready flags
    [W, P_MAX]; ``rank``: this rank; ``k``: P_MAX, W and NODES."""
    # A carrier that is this rank is a program of this launch (across nodes, the sender or
    # forwarder that relays a peer's item), which began its own wait for that peer no later
    # than this one: it must time out first and name the peer. With equal timeouts both
    # deadlines pass together and this wait could win, naming this rank, so it waits twice as
    # long.
    timeout_ns = tl.where(carrier == rank, 2 * m.timeout_ns, m.timeout_ns)
    slow = Masking(
        m.rank,
        m.control_ptr,
        m.status_ptr,
        timeout_ns,
        m.mask_ptr,
        m.bases_ptr,
        m.net_bases_ptr,
        m.mask_off,
    )
    ready = my_ready + carrier * k.P_MAX + channel
    started = await_peer(ready, seq, carrier, ready_stage, slow, k.W, k.NODES)
    return started & await_peer(flag_ptr, seq, carrier, data_stage, slow, k.W, k.NODES)


# A role's bundles (kernels/dispatch.py, kernels/combine.py): ``heap`` with peer_bases_ptr,
# net_bases_ptr and ready_off, ``sync`` a Masking with seq, ``k`` with P_MAX, R, NODES and W;
# each role calls these instead of spelling the same arguments out again.
@triton.jit
def start_channel(channel, rank, stage, heap, sync, k):
    """handshake() for program ``channel`` of a role (its ready flags, then its peers')."""
    handshake(
        heap.peer_bases_ptr,
        heap.net_bases_ptr,
        heap.ready_off,
        rank,
        sync.seq,
        sync,
        stage,
        k.P_MAX,
        channel,
        k.R,
        k.NODES,
        k.W,
    )


@triton.jit
def wait_landed(my_ready, carrier, rank, channel, flag_ptr, ready_stage, data_stage, sync, k):
    """wait_item() with a role's bundles."""
    return wait_item(
        my_ready, carrier, rank, channel, flag_ptr, sync.seq, sync, ready_stage, data_stage, k
    )


# -- destroy() -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=("rank",))
def farewell_kernel(
    peer_bases_ptr,
    net_bases_ptr,
    mask_off,
    farewell_off,
    rank,
    timeout_ns,
    verdict_ptr,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    NODES: tl.constexpr,
):
    """destroy(), one program: whether this rank frees the heap with the others (on GPUs
    NVSHMEM's free waits for every rank: one that never comes would hold the others forever).
    It says its word in its place of every live rank's farewell region (LEAVING where it has
    masked a rank or left before, or finds itself masked, else FREE_TOGETHER), and waits, up to
    timeout_ns (not at all where it is masked itself, nor once told so), for every other
    rank's word: all FREE_TOGETHER, the verdict is FREE_TOGETHER; a word LEAVING or the time
    run out, LEAVING, which it then says, so that a rank that decides later leaves as well.
    Writes the verdict into its own place of its farewell region and into *verdict_ptr."""
    peers = tl.arange(0, W_P2)
    others = (peers < W) & (peers != rank)
    mask = read_uniform(region(peer_bases_ptr, rank, mask_off, tl.int64) + peers, peers < W, 0)
    masked = others & (mask != 0)
    # A rank told that it is masked (a peer masked it) is out of the group: it leaves at once,
    # as the others, which say it nothing, do.
    outcast = tl.max(((peers == rank) & (mask != 0)).to(tl.int32), axis=0) > 0
    words = region(peer_bases_ptr, rank, farewell_off, tl.int64) + peers
    # (this rank's own word holds its last verdict: said again, it does not take LEAVING back)
    left = tl.load(words, mask=peers == rank, other=0) == LEAVING
    leaving = (tl.max((masked | left).to(tl.int32), axis=0) > 0) | outcast
    mine = tl.where(leaving, LEAVING, FREE_TOGETHER)
    _say_farewell(mine, masked, peer_bases_ptr, net_bases_ptr, farewell_off, rank, W, NODES)
    start = clock_ns()
    said = tl.where(others, tl.zeros([W_P2], tl.int64), mine)
    own_mask = region(peer_bases_ptr, rank, mask_off, tl.int64) + rank
    waiting = ~outcast
    while waiting:
        said = tl.where(others, read_uniform(words, others, 0), mine)
        # (told meanwhile that it is masked: no word will come)
        outcast = read_uniform(own_mask) != 0
        waiting = (
            (tl.min(said, axis=0) == 0)
            & (tl.max(said, axis=0) < LEAVING)
            & ~block_any(clock_ns() - start >= timeout_ns)
            & ~outcast
        )
    together = (tl.min(said, axis=0) == FREE_TOGETHER) & (tl.max(said, axis=0) == FREE_TOGETHER)
    together = together & ~outcast
    verdict = tl.where(together, FREE_TOGETHER, LEAVING)
    _say_farewell(verdict, masked, peer_bases_ptr, net_bases_ptr, farewell_off, rank, W, NODES)
    tl.store(words, verdict, mask=peers == rank)
    tl.store(verdict_ptr, verdict)


@triton.jit
def _say_farewell(word, masked, peer_bases_ptr, net_bases_ptr, farewell_off, rank, W, NODES):
    """``word`` into this rank's place of the farewell region of every other rank not
    ``masked`` ([W_P2]: one may be gone, its memory with it; another node's by a network
    signal)."""
    peers = tl.arange(0, masked.shape[0])
    for peer in range(0, W):
        gone = tl.sum(tl.where(peers == peer, masked.to(tl.int32), 0), axis=0)
        if (peer != rank) & (gone == 0):
            signal_peer(peer_bases_ptr, net_bases_ptr, peer, farewell_off, rank, word, NODES)
