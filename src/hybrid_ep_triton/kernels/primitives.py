"""Communication primitives that every kernel uses to talk to its peers.

The symmetric heap gives every rank one buffer of the same size and layout. A kernel receives
``peer_bases``, an int64 tensor [world] of the buffers' base addresses as mapped in this process,
and byte offsets of the regions inside the buffer; ``region`` turns (rank, offset) into a typed
pointer. Stores through it go over NVLink on GPUs and into shared memory on CPU ranks.

Ordering protocol: a producer writes its data, then ``signal`` sets a flag with release semantics
at system scope; the consumer's ``wait_at_least`` spins with acquire semantics until the flag
reaches the value it expects. Flags only grow (they carry a sequence number), so a flag left over
from an earlier call never satisfies a later wait, and nothing ever resets them.

Across nodes, peers of another node have no peer pointer (their ``peer_bases`` entry is 0):
``net_put_signal`` moves a contiguous block from this rank's heap into theirs and then sets a
flag there, and ``net_signal`` sets a flag alone. On GPUs these are NVSHMEM device calls
(``nvshmemx_putmem_signal_block``, ``nvshmemx_signal_op``: NVSHMEM's device bitcode is linked
into the kernels that use them, see ``runtime.nvshmem_bitcode``); under the interpreter
(CPU ranks) a copy into the peer's shared memory followed by the release of its flag, and the
source must lie in the sender's own heap, as a NIC reads only registered memory.
``net_bases_ptr`` [world]: on GPUs every entry is this rank's heap base (NVSHMEM takes the
symmetric address of an object as mapped locally); on CPU ranks each rank's mapped segment.

Every wait is bounded: after ``timeout_ns`` it records (TIMED_OUT, peer, stage) in the caller's
local status words and returns; every later wait of any program sees the status and returns at
once, so a missing peer turns into an error the host raises, never a hang. Waits on peers that
may be masked (failed ranks) are kernels/peers.py's.
"""

import os
import time

import triton
import triton.language as tl
from triton.language import core

from .control import (
    DATA_SEQ,
    DATA_TICKET,
    FIRST_QUEUE,
    SECOND_QUEUE,
    STATUS_CODE,
    STATUS_PEER,
    STATUS_STAGE,
    STATUS_TIMED_OUT,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Bytes of the widest access, a 16-byte vector: heap regions, staged rows and outputs start at
# multiples of it, and saying so (tl.multiple_of) lets the compiler move 16 bytes at a time.
ALIGNMENT = tl.constexpr(16)

# The kernels' integer arguments whose value class (1, a multiple of 16, other) changes from
# call to call but not their machine code: the layout and dispatch kernels take them as
# do_not_specialize, so that Triton compiles one build for all their values instead of one per
# combination of classes (else a soak keeps compiling for hundreds of rounds). With
# tests/sm90_compile.py's builder: marking each of them, or all, divisible by 16 gives the same
# sm_90 code as leaving them unmarked, at EP2, EP8 and 2 nodes of 8; num_tokens, num_chunks do
# change it (so does making every count unspecialised, which slows combine down), and
# pad_multiple, num_quantizers stay per job.
UNSPECIALISED = ("max_rows", "num_out_rows", "report_tag", "refused", "outputs_tag")
# The rank, which Triton would specialise as rank 0 (a multiple of 16), rank 1 (the constant 1)
# and any other: the data-move and layout kernels take it as do_not_specialize, so that every
# rank runs one build, and Triton's cache (and a prebuild) holds a third as many. Rank 0's
# class already gives the unmarked sm_90 code for dispatch and combine at EP2 and EP8; rank 1's
# own build (fewer spills) is given up, which the other ranks of an exchange, running the
# unmarked code, do not get anyway.
SAME_ON_EVERY_RANK = ("rank",)

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


if INTERPRETED:

    @triton.jit
    def back_off():
        """Pause a polling loop (on CPU ranks clock_ns yields already)."""
        pass

else:

    @triton.jit
    def back_off():
        """Pause a polling loop for about a microsecond, so that it issues few reads."""
        tl.inline_asm_elementwise(
            "nanosleep.u32 1000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


# NVSHMEM's sig_op for "set the flag to the value" (NVSHMEM_SIGNAL_SET in nvshmem.h; 10 adds).
_SIGNAL_SET: tl.constexpr = tl.constexpr(9)

if INTERPRETED:

    @triton.jit
    def fence_system():
        """Order this thread's earlier stores before its later ones for every observer (the
        host too); the interpreter's stores are in order already."""
        pass

else:

    @triton.jit
    def fence_system():
        """Order this thread's earlier stores before its later ones for every observer, the
        host reading mapped memory included."""
        tl.inline_asm_elementwise(
            "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def publish_block_writes():
    """Every thread fences its own writes, then the program's threads meet: every warp's
    stores, not only one thread's, are visible system-wide (peers, the host, a NIC) before
    what any thread does next."""
    fence_system()
    tl.debug_barrier()


# Decisions and values that warps must share. A program's warps run apart between barriers, so
# two warps that each read a word another program or rank changes, or the clock, can see it at
# different moments. Where that decides a loop or a branch holding a barrier (an atomic whose
# result is used, signal(), a reduction across warps), the warps take different numbers of
# barriers and meet at the wrong ones: shared memory they exchange through is overwritten
# while another warp still reads it. Hence such words, where they decide a wait or a branch or
# give a call's sequence number, are read with read_uniform, and a decision on the clock is the
# whole block's (block_any). (The normal mode's data paths read the mask per warp where it
# picks a chunk's rows: warps can disagree there only in the launch during which a rank
# becomes masked, on that rank's rows.)


@triton.jit
def read_uniform(ptr, mask=None, other=0):
    """The words at ``ptr`` (a pointer, or a tensor of them where ``mask``; ``other`` elsewhere),
    which other programs or ranks change while the kernel runs, the same in every thread: a
    relaxed atomic at system scope, which Triton performs once per element and hands to every
    thread that holds the element."""
    value = tl.atomic_add(ptr, 0, mask=mask, sem="relaxed", scope="sys")
    if mask is not None:
        value = tl.where(mask, value, other)
    return value


if INTERPRETED:

    @triton.jit
    def block_any(pred):
        """Whether scalar ``pred`` holds in any thread of the program (one thread here)."""
        return pred

else:

    @triton.jit
    def block_any(pred):
        """Whether scalar ``pred`` holds in any thread of the program, the same answer in
        every thread (``bar.red.or``, CUDA's __syncthreads_or: a barrier of the whole
        program, so every thread must call it at the same point)."""
        answer = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $1, 0; bar.red.or.pred p, 0, p; "
            "selp.u32 $0, 1, 0, p; }",
            "=r,r",
            [pred.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        return answer != 0


if INTERPRETED:

    class NetworkSourceError(RuntimeError):
        """A network put whose source does not lie in the sender's own symmetric heap."""

    @triton.jit
    def net_put(net_bases_ptr, rank, pe, dst_off, src, nbytes, heap_bytes):
        """Put ``nbytes`` bytes from ``src`` (in this rank's heap) to byte ``dst_off`` of
        ``pe``'s heap."""
        own = tl.load(net_bases_ptr + rank)
        first = src.to(tl.int64)
        if (first < own) | (first + nbytes > own + heap_bytes):
            raise NetworkSourceError(
                f"rank {int(rank)}: a network put to rank {int(pe)} reads {int(nbytes)} bytes at "
                f"{int(first):#x}, outside this rank's heap [{int(own):#x}, "
                f"{int(own + heap_bytes):#x}): a NIC reads only registered memory"
            )
        src_bytes = first.to(tl.pointer_type(tl.uint8))
        dst_bytes = (tl.load(net_bases_ptr + pe) + dst_off).to(tl.pointer_type(tl.uint8))
        for b0 in range(0, nbytes, 4096):
            offs = b0 + tl.arange(0, 4096)
            mask = offs < nbytes
            tl.store(dst_bytes + offs, tl.load(src_bytes + offs, mask=mask), mask=mask)

    @triton.jit
    def net_put_signal(net_bases_ptr, rank, pe, dst_off, src, nbytes, flag_off, value, heap_bytes):
        """Put ``nbytes`` bytes from ``src`` (in this rank's heap) to byte ``dst_off`` of
        ``pe``'s heap, then set the int64 flag at ``flag_off`` there to ``value`` (release)."""
        net_put(net_bases_ptr, rank, pe, dst_off, src, nbytes, heap_bytes)
        net_signal(net_bases_ptr, pe, flag_off, value)

    @triton.jit
    def net_signal(net_bases_ptr, pe, flag_off, value):
        """Set the int64 flag at ``flag_off`` of ``pe``'s heap to ``value`` (release)."""
        signal((tl.load(net_bases_ptr + pe) + flag_off).to(tl.pointer_type(tl.int64)), value)

    @triton.jit
    def net_fence():
        """Order this program's earlier network puts before its later ones (the interpreter's
        stores land in order)."""
        pass

else:

    @core.extern
    def _putmem_signal_block(dst, src, nbytes, flag, value, sig_op, pe, _semantic=None):
        return core.extern_elementwise(
            "",
            "",
            [dst, src, nbytes, flag, value, sig_op, pe],
            {
                (
                    core.int64,
                    core.int64,
                    core.int64,
                    core.int64,
                    core.int64,
                    core.int32,
                    core.int32,
                ): ("nvshmemx_putmem_signal_block", core.int32)
            },
            is_pure=False,
            _semantic=_semantic,
        )

    @core.extern
    def _signal_op(flag, value, sig_op, pe, _semantic=None):
        return core.extern_elementwise(
            "",
            "",
            [flag, value, sig_op, pe],
            {(core.int64, core.int64, core.int32, core.int32): ("nvshmemx_signal_op", core.int32)},
            is_pure=False,
            _semantic=_semantic,
        )

    @core.extern
    def _putmem_block(dst, src, nbytes, pe, _semantic=None):
        return core.extern_elementwise(
            "",
            "",
            [dst, src, nbytes, pe],
            {
                (core.int64, core.int64, core.int64, core.int32): (
                    "nvshmemx_putmem_block",
                    core.int32,
                )
            },
            is_pure=False,
            _semantic=_semantic,
        )

    @core.extern
    def _fence(_semantic=None):
        return core.extern_elementwise(
            "", "", [], {(): ("nvshmem_fence", core.int32)}, is_pure=False, _semantic=_semantic
        )

    @triton.jit
    def net_put_signal(net_bases_ptr, rank, pe, dst_off, src, nbytes, flag_off, value, heap_bytes):
        """Put ``nbytes`` bytes from ``src`` (in this rank's heap) to byte ``dst_off`` of
        ``pe``'s heap, then set the int64 flag at ``flag_off`` there to ``value``; every thread
        of the program calls it (a block-scoped NVSHMEM call). Returns once ``src`` may be
        reused; the flag is set after the data has landed."""
        base = tl.load(net_bases_ptr + pe)
        publish_block_writes()  # the block's stores to src, for a NIC that reads them
        # Sizes and values may be compile-time constants: make every argument a typed scalar.
        _putmem_signal_block(
            base + dst_off,
            src.to(tl.int64),
            tl.zeros([], tl.int64) + nbytes,
            base + flag_off,
            tl.zeros([], tl.int64) + value,
            tl.full([], _SIGNAL_SET, tl.int32),
            (tl.zeros([], tl.int32) + pe).to(tl.int32),
        )

    @triton.jit
    def net_signal(net_bases_ptr, pe, flag_off, value):
        """Set the int64 flag at ``flag_off`` of ``pe``'s heap to ``value`` (an atomic: it is
        not ordered after earlier puts to ``pe``, so it carries no data with it)."""
        tl.debug_barrier()
        _signal_op(
            tl.load(net_bases_ptr + pe) + flag_off,
            tl.zeros([], tl.int64) + value,
            tl.full([], _SIGNAL_SET, tl.int32),
            (tl.zeros([], tl.int32) + pe).to(tl.int32),
        )

    @triton.jit
    def net_put(net_bases_ptr, rank, pe, dst_off, src, nbytes, heap_bytes):
        """Put ``nbytes`` bytes from ``src`` (in this rank's heap) to byte ``dst_off`` of
        ``pe``'s heap; every thread of the program calls it (block-scoped). Returns once
        ``src`` may be reused; ordered before a later net_signal to ``pe`` only by net_fence."""
        publish_block_writes()  # the block's stores to src, for a NIC that reads them
        _putmem_block(
            tl.load(net_bases_ptr + pe) + dst_off,
            src.to(tl.int64),
            tl.zeros([], tl.int64) + nbytes,
            (tl.zeros([], tl.int32) + pe).to(tl.int32),
        )

    @triton.jit
    def net_fence():
        """Order this program's earlier network puts to a rank before its later puts and
        signals to that rank (nvshmem_fence), so that a flag set after them carries them."""
        tl.debug_barrier()
        _fence()


@triton.jit
def net_put_rows_signal(
    net_bases_ptr,
    rank,
    pe,
    dst_off,
    dst_row_bytes,
    src,
    src_row_bytes,
    num_rows,
    row_bytes,
    flag_off,
    value,
    heap_bytes,
):
    """Put ``num_rows`` rows of ``row_bytes`` bytes each from ``src`` (in this rank's heap,
    ``src_row_bytes`` apart) to byte ``dst_off`` of ``pe``'s heap (``dst_row_bytes`` apart), a
    row at a time (column slices of rows, which no single put covers), then set the int64 flag
    at ``flag_off`` there to ``value``, after them and this program's earlier puts to ``pe``
    (net_fence)."""
    src_bytes = src.to(tl.pointer_type(tl.uint8))
    for j in range(0, num_rows):
        net_put(
            net_bases_ptr,
            rank,
            pe,
            dst_off + j * dst_row_bytes,
            src_bytes + j * src_row_bytes,
            row_bytes,
            heap_bytes,
        )
    net_fence()
    net_signal(net_bases_ptr, pe, flag_off, value)


@triton.jit
def region(peer_bases_ptr, rank, byte_offset, dtype: tl.constexpr):
    """Typed pointer to ``byte_offset`` inside ``rank``'s symmetric buffer: the start of a region,
    or of a 16-byte aligned part of one (offsets inside a region go on the pointer)."""
    base = tl.load(peer_bases_ptr + rank)
    # Heap buffers and their regions are 256-byte aligned (the planner's _ALIGN); saying so
    # lets the compiler use 16-byte accesses, which an address loaded from memory would not.
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(dtype)), ALIGNMENT)


@triton.jit
def host_pointer(address, dtype: tl.constexpr):
    """Typed pointer to ``address``, an integer argument that holds the address of host memory
    (a record the host writes or polls; Triton takes no CPU tensor). Made an int64 by adding
    one first: Triton types an integer argument by its value, int32 below 2**31, and the
    interpreter holds one below 2**32 in 4 bytes (as uint32 where it calls it int64, so that
    ``.to(tl.int64)`` changes nothing), which it cannot make a pointer of 8 (such addresses
    occur on CPU ranks). Compiled, the addition folds away."""
    return (address + tl.zeros([], tl.int64)).to(tl.pointer_type(dtype))


@triton.jit
def signal(flag_ptr, value):
    """Make every write of this program visible system-wide, then set ``*flag_ptr = value``:
    the program's threads meet, then one thread's release (cumulative: it publishes what the
    other warps wrote before the barrier too)."""
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
    waiting = (_read_flag(flag_ptr) < target) & (read_uniform(status_ptr) == 0)
    while waiting:
        time_out_after(start, timeout_ns, status_ptr, peer, stage)
        waiting = (_read_flag(flag_ptr) < target) & (read_uniform(status_ptr) == 0)
    tl.debug_barrier()


@triton.jit
def wait_all_at_least(flag_ptrs, target, mask, timeout_ns, status_ptr, peer, stage):
    """wait_at_least() for the flags ``flag_ptrs`` [N] where ``mask``: until every one is
    >= ``target``."""
    start = clock_ns()
    waiting = _any_below(flag_ptrs, target, mask) & (read_uniform(status_ptr) == 0)
    while waiting:
        time_out_after(start, timeout_ns, status_ptr, peer, stage)
        waiting = _any_below(flag_ptrs, target, mask) & (read_uniform(status_ptr) == 0)
    tl.debug_barrier()


@triton.jit
def _any_below(flag_ptrs, target, mask):
    value = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
    return tl.max((mask & (value < target)).to(tl.int32), axis=0) > 0


@triton.jit
def time_out_after(start, timeout_ns, status_ptr, peer, stage):
    """Inside a wait that began at ``start``: past ``timeout_ns``, the first waiter to time out
    records (STATUS_TIMED_OUT, peer, stage)."""
    if block_any(clock_ns() - start > timeout_ns):
        timed_out = tl.full([], STATUS_TIMED_OUT, tl.int64)
        if tl.atomic_cas(status_ptr + STATUS_CODE, tl.zeros([], tl.int64), timed_out) == 0:
            tl.store(status_ptr + STATUS_PEER, peer)
            tl.store(status_ptr + STATUS_STAGE, stage)


# Words of a host record (wait_host_record): the tag, HOST_RECORD_VALUES values, the check.
HOST_RECORD_WORDS = tl.constexpr(8)
HOST_RECORD_VALUES = tl.constexpr(6)


@triton.jit
def host_record_weights(idx):
    """The check's weight of each word of a host record: 2i + 1 for value i = 1..6, else 0."""
    return tl.where((idx >= 1) & (idx <= HOST_RECORD_VALUES), 2 * idx + 1, 0).to(tl.int64)


@triton.jit
def wait_host_record(record_ptr, tag, timeout_ns, status_ptr, peer, stage):
    """Spin until the host has written the record ``tag`` at ``record_ptr`` (int64
    [HOST_RECORD_WORDS] in its pinned memory, through the device's mapping), at most
    ``timeout_ns``; returns the record's words ([HOST_RECORD_WORDS] int64; on a timeout,
    whatever was there: the caller looks at the status).

    The host writes [tag, v1 .. v6, check], check = tag + sum of (2i + 1) * v_i, the tag
    last. A device may see the words of host stores in another order where the host orders
    no stores (Arm hosts): a record whose check does not add up is read again, not taken.
    One program of a launch should wait here, the others for what it copies into device
    memory: every poll is a read over PCIe (loads with the .cv cache operator, which fetch the
    line again where the GPU's L2 holds a copy of it; not an atomic, which on host memory may
    be a read and a write that undo a host store between them). With all of a launch's
    expanders polling, the polls crowd out the host's stores: an exact-mode dispatch waits
    milliseconds for its record (volatile loads), or does not get it at all (.cv loads). Polls
    are a microsecond apart (``back_off``).
    """
    idx = tl.arange(0, HOST_RECORD_WORDS)
    weights = host_record_weights(idx)
    start = clock_ns()
    words = tl.load(record_ptr + idx, cache_modifier=".cv")
    # (each thread reads the record itself: the loop goes on while any thread lacks it)
    waiting = block_any(~_complete_record(words, idx, weights, tag))
    waiting = waiting & (read_uniform(status_ptr) == 0)
    while waiting:
        time_out_after(start, timeout_ns, status_ptr, peer, stage)
        back_off()
        words = tl.load(record_ptr + idx, cache_modifier=".cv")
        waiting = block_any(~_complete_record(words, idx, weights, tag))
        waiting = waiting & (read_uniform(status_ptr) == 0)
    return words


@triton.jit
def _complete_record(words, idx, weights, tag):
    check = record_word(words, HOST_RECORD_VALUES + 1)
    return (record_word(words, 0) == tag) & (check == tag + tl.sum(words * weights, axis=0))


@triton.jit
def record_word(words, i):
    """Word ``i`` of a host record's words."""
    idx = tl.arange(0, HOST_RECORD_WORDS)
    return tl.sum(tl.where(idx == i, words, 0), axis=0)


@triton.jit
def node_first_rank(rank, R: tl.constexpr, NODES: tl.constexpr):
    """The first rank of ``rank``'s node (nodes are R consecutive ranks)."""
    first = 0
    if NODES > 1:
        first = rank // R * R
    return first


@triton.jit
def rail_peer(node, rank, R: tl.constexpr):
    """The rank of ``node`` with ``rank``'s local index (of R ranks a node): the one peer there
    that ``rank`` reaches over the network (its rail)."""
    return node * R + rank % R


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
    reset the work queues (FIRST_QUEUE, SECOND_QUEUE) for the next launch.

    A ticket, not a barrier: each program takes one and leaves; the last one stores the new
    sequence number for the next launch on the stream. Nobody waits, so programs need not be
    co-resident.
    """
    ticket = tl.atomic_add(control_ptr + DATA_TICKET, 1)
    if ticket == num_programs - 1:
        tl.store(control_ptr + FIRST_QUEUE, 0)
        tl.store(control_ptr + SECOND_QUEUE, 0)
        tl.store(control_ptr + DATA_TICKET, 0)
        tl.store(control_ptr + DATA_SEQ, seq)
