"""Triton kernels only: ``@triton.jit`` functions, no torch calls.

primitives: peer pointers, release signals, bounded acquire waits (used by all the others);
peers: waits on peers that may fail (the mask, heartbeats, handshakes, destroy()'s farewell);
route: the dispatch layout; dispatch: the token move and expansion; combine: the reduction back;
quantize: the FP8, MXFP8 and NVFP4 quantizers; control: the control block's words and the stage
codes by name; work: column parts and work queues that dispatch and combine share;
low_latency: the low-latency mode's dispatch and combine (decode); token_counts: what a dispatch
would send where, counted on one rank (DeepEP's get_dispatch_layout).

The meta-parameters (constexprs) by name. Sizes: W ranks, R ranks a node, NODES nodes (R_P2,
N_P2, W_P2: their powers of 2), E_P2 and L_P2 the powers of 2 of the experts and of a rank's,
T_MAX the Buffer's max_tokens_per_rank, K_P2 a token's slots rounded up. Chunks and tiles: CHUNK
tokens a chunk, NC_MAX chunks of T_MAX tokens, H_SLICES column slices of a chunk (a work item is
a (chunk, slice)), BLOCK_H columns of a tile (COPY_BLOCK_H: of combine's copies), COPY_UNROLL
expert rows gathered at once, STAGES tiles in flight in the streaming copies, LP_MAX most column
parts of a work item for the local roles, P_MAX most sending programs (the ready flags' width).
Rows' metadata: MS entries of a staged row (min(L, 32): its expert rows or local expert ids),
MS_P2 its power of 2. The layout kernel: ROW int32 words of per-expert totals, tokens, invalid
and pad, LR words of a layout row, PAIRS slots a side of its tiles of slot pairs, C_BLOCK and
TABLE_BLOCK tiles of its chunk tables. A network slot (planner.NetSlot): META_INTS, META_FLOATS,
NET_COLS, DATA_OFF, SLOT_BYTES. Row formats: SCALE_WORDS 32-bit words of a block-scaled row's
scales (0: rows of the Buffer's dtype), QUANTIZE the quantizer a dispatch runs (kernels/
quantize.py), CHANNEL_GROUPS its 128-channel groups. Modes: TOKEN_ROWS one row per token
(expand=False), HAS_WEIGHTS weights given, WRITE_ROWS a dispatch with a new layout (it writes the
handle's rows), OUTPUTS_FROM_HOST an exact-mode move whose outputs the host records.

The low-latency kernels' meta-parameters: W ranks, L local experts, B = E - L receive blocks,
M the Buffer's low_latency_tokens, S column slices of a row (a program and a flag each), K
slots of a token (K_P2 its power of 2), SCAN routing entries scanned at a time, ROWS rows and
BLOCK_H columns of a tile, STAGES tiles in flight (tl.range's num_stages), PARTS column parts of
a slice that combine's receive role sums in programs of their own, GROUPS 128-channel groups of a
token's row a dispatch program takes (QC_P2: the power of 2 of a row's chunks that an FP8
dispatch stages, G_P2 of its groups),
ROW_BYTES a staged dispatch row (header and payload), FP8 / ROUND / UE8M0 the row format,
ALIGNED rows 16-byte aligned, HAS_STATS statistics given, ZERO_COPY combine's x is its buffer,
NODES nodes of the group, SEND / RECEIVE which halves of a call the launch runs.

Every kernel bundles its arguments once, at its top: namedtuples of runtime values (dispatch's
Tokens, Layout, Outputs, Heap, Sync; combine's Rows, CombineHeap, CombineSync; ...) and ``k``, a
constexpr namedtuple of its meta-parameters (``k: tl.constexpr = DispatchConsts(...)``: without
the annotation Triton 3.6 turns the fields of an assigned namedtuple into tensors), each built
in the order of its fields from groups of the kernel's arguments, a group a line
(``Tokens(*(rank, x_ptr, ...), *(...))``), which ruff leaves as they are. Roles and helpers take
the bundles and read the fields they use.

The steps of the normal mode's data moves (send a chunk, pack and forward a network slot, expand,
reduce, sum) are ``noinline`` functions: each gets a register allocation of its own, so that a
kernel needs the most any step needs rather than their sum (sm_90 at 16 warps without spills).
A bundle passed to one becomes one parameter per field, and LLVM drops the fields it does not
read, so a helper costs what its flat argument list did: the same registers and stack, and the
same sm_90 code but for the order of its parameters and the registers chosen around the calls.

The kernels themselves take flat arguments, grouped under labelled comments (the longest
signatures, the dispatch kernels', laid out by hand a group a line): Triton 3.6-3.9
compile tuple arguments, but a launch binds the arguments by name (ops/launch.py's
KernelLauncher) and a Relaunch builds the driver's parameter array from the compiled signature,
one scalar or pointer each; a tuple there would send every launch back through Triton's
launcher.

What these kernels need of Triton beyond its API (cache keys settled before Triton 3.8, the
interpreter's scalars as indices before 3.7) is runtime/triton_compat.py's, applied when
``ops`` is imported.
"""
