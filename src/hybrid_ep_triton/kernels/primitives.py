"""Communication primitives that every kernel uses to talk to its peers.

The symmetric heap gives every rank one buffer of the same size and layout. A kernel receives
``peer_bases``, an int64 tensor [world] of the buffers' base addresses as mapped in this process,
and byte offsets of the regions inside the buffer; ``region`` turns (rank, offset) into a typed
pointer. Stores through it go over NVLink on GPUs and into shared memory on CPU ranks.

Ordering protocol: a producer writes its data, then ``signal`` sets a flag with release semantics
at system scope; the consumer's ``wait_at_least`` spins with acquire semantics until the flag
reaches the value it expects. Flags only grow (they carry a sequence number), so a flag left over
from an earlier call never satisfies a later wait, and nothing ever resets them.

Every wait is bounded: after ``timeout_ns`` it records (TIMED_OUT, peer, stage) in the caller's
local status words and returns; every later wait of any program sees the status and returns at
once, so a missing peer turns into an error the host raises, never a hang.
"""

import os
import time

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Status words (int64, rank-local): [code, peer, stage].
STATUS_OK = 0
STATUS_TIMED_OUT = 1

if INTERPRETED:

    @triton.jit
    def clock_ns():
        # CPU ranks are processes that may share one core: hand the core to the peer we wait for.
        os.sched_yield()
        return time.monotonic_ns()

else:

    @triton.jit
    def clock_ns():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


@triton.jit
def region(peer_bases_ptr, rank, byte_offset, dtype: tl.constexpr):
    """Typed pointer to ``byte_offset`` inside ``rank``'s symmetric buffer."""
    base = tl.load(peer_bases_ptr + rank)
    # Heap buffers and their regions are 256-byte aligned (the planner's _ALIGN); saying so
    # lets the compiler use 16-byte accesses, which an address loaded from memory would not.
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(dtype)), 16)


@triton.jit
def signal(flag_ptr, value):
    """Make every write of this program visible system-wide, then set ``*flag_ptr = value``."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _read_flag(flag_ptr):
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def wait_at_least(flag_ptr, target, timeout_ns, status_ptr, peer, stage):
    """Spin until ``*flag_ptr >= target`` (acquire, system scope), at most ``timeout_ns``.

    On timeout the first waiter records (STATUS_TIMED_OUT, peer, stage) in ``status_ptr[0:3]``;
    any recorded status makes every wait return immediately. Returns nothing: the host reads the
    status after the launch and raises TimeoutError.
    """
    start = clock_ns()
    waiting = (_read_flag(flag_ptr) < target) & (tl.load(status_ptr, volatile=True) == 0)
    while waiting:
        if clock_ns() - start > timeout_ns:
            if tl.atomic_cas(status_ptr, tl.zeros([], tl.int64), tl.full([], 1, tl.int64)) == 0:
                # 1 == STATUS_TIMED_OUT; the first waiter to time out names the peer and stage.
                tl.store(status_ptr + 1, peer)
                tl.store(status_ptr + 2, stage)
        waiting = (_read_flag(flag_ptr) < target) & (tl.load(status_ptr, volatile=True) == 0)
    tl.debug_barrier()


@triton.jit
def wait_item(
    my_ready,
    my_flags,
    src,
    w,
    num_senders,
    items_of_src,
    seq,
    timeout_ns,
    status_ptr,
    ready_stage,
    data_stage,
    P_MAX,
):
    """Wait until work item ``w`` from rank ``src`` has landed here: first for the sender that
    carries it (program w % num_senders of ``src``) to have started the launch, so that a peer
    that never came times out at ``ready_stage``, then for the item's flag (``data_stage``).
    ``my_ready``: this rank's ready flags [W, P_MAX]; ``my_flags``: its item flags
    [W, items_of_src]."""
    ready = my_ready + src * P_MAX + w % num_senders
    wait_at_least(ready, seq, timeout_ns, status_ptr, src, ready_stage)
    wait_at_least(my_flags + src * items_of_src + w, seq, timeout_ns, status_ptr, src, data_stage)


@triton.jit
def handshake(
    peer_bases_ptr, ready_off, rank, world_size, seq, timeout_ns, status_ptr, stage, P_MAX, channel
):
    """Tell every peer that this rank's ``channel`` started launch ``seq`` (so this rank's earlier
    launches, which read its staging area, are over), then wait until ``channel`` of every peer
    has said the same. ready flags: int64 [world, P_MAX] in every heap."""
    for peer in range(0, world_size):
        signal(region(peer_bases_ptr, peer, ready_off, tl.int64) + rank * P_MAX + channel, seq)
    my_ready = region(peer_bases_ptr, rank, ready_off, tl.int64)
    for peer in range(0, world_size):
        wait_at_least(my_ready + peer * P_MAX + channel, seq, timeout_ns, status_ptr, peer, stage)


@triton.jit
def take_work(queue_ptr):
    """The next item of a launch's work queue (an int64 counter that starts at 0): a program
    takes items until it gets one past the end, so programs that start late or get cheap items
    take more, and all finish at about the same time."""
    return tl.atomic_add(queue_ptr, 1, sem="relaxed").to(tl.int32)


@triton.jit
def interleaved(item, count_a, count_b):
    """Entry ``item`` of a work queue that spreads ``count_a`` items of one kind (A) evenly among
    ``count_b`` items of another (B), each kind in its own order: (is_a, the item's index within
    its kind), starting with an A item. Work that waits for nothing (A) then does not all come
    first and take the memory bandwidth that the transfers landing meanwhile need."""
    # A tensor from the start: the launcher may have made a count of 1 a compile-time constant.
    total = tl.full([], count_a, tl.int64) + count_b
    entry = item.to(tl.int64)
    # A items among the first `entry` entries: ceil(entry * count_a / total).
    a_before = (entry * count_a + total - 1) // total
    a_through = ((entry + 1) * count_a + total - 1) // total
    is_a = a_through > a_before
    return is_a, tl.where(is_a, a_before, entry - a_before).to(tl.int32)


@triton.jit
def finish_launch(control_ptr, seq, num_programs):
    """Publish ``seq`` as the last completed sequence number once every program got here, and
    reset the work queues (control words 6 and 7) for the next launch.

    A ticket, not a barrier: each program takes one and leaves; the last one stores the new
    sequence number for the next launch on the stream. Nobody waits, so programs need not be
    co-resident.
    """
    ticket = tl.atomic_add(control_ptr + 1, 1)
    if ticket == num_programs - 1:
        tl.store(control_ptr + 6, 0)
        tl.store(control_ptr + 7, 0)
        tl.store(control_ptr + 1, 0)
        tl.store(control_ptr, seq)
