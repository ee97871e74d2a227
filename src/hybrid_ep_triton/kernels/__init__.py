"""Triton kernels only: ``@triton.jit`` functions, no torch calls.

primitives: peer pointers, release signals, bounded acquire waits (used by all the others);
route: the dispatch layout; dispatch: the token move and expansion; combine: the reduction back;
quantize: the FP8, MXFP8 and NVFP4 quantizers; control: the control block's words and the stage
codes by name; work: column parts and work queues that dispatch and combine share;
low_latency: the low-latency mode's dispatch and combine (decode).

The low-latency kernels' meta-parameters: W ranks, L local experts, B = E - L receive blocks,
M the Buffer's low_latency_tokens, S column slices of a row (a program and a flag each), K
slots of a token (K_P2 its power of 2), SCAN routing entries scanned at a time, ROWS rows and
BLOCK_H columns of a tile, STAGES tiles in flight (tl.range's num_stages), PARTS column parts of
a slice that combine's receive role sums in programs of their own, GROUPS 128-channel groups a
quantizing program takes (QC_P2: the power of 2 of a row's chunks of them, G_P2 of its groups),
ROW_BYTES a staged dispatch row (header and payload), FP8 / ROUND / UE8M0 the row format,
ALIGNED rows 16-byte aligned, HAS_STATS statistics given, ZERO_COPY combine's x is its buffer,
NODES nodes of the group, SEND / RECEIVE which halves of a call the launch runs.

What these kernels need of Triton beyond its API (cache keys settled before Triton 3.8, the
interpreter's scalars as indices before 3.7) is runtime/triton_compat.py's, applied when
``ops`` is imported.
"""
