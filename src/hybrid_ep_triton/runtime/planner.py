"""The planner: channels, chunks and the symmetric-heap layout of a Buffer.

Everything is sized for the worst case once, at construction (max_tokens_per_rank tokens from
every rank), so a call never allocates heap memory and never waits for the host.
"""

from dataclasses import dataclass, fields

import torch

# Most expert slots of one token that may land on one rank. It bounds the per-row metadata that
# travels with each staged token: min(experts per rank, MAX_TOPK) entries.
MAX_TOPK = 32
# Alignment of every heap region: whole cache lines, and 16-byte vectors at any row start that
# is itself a multiple of 16 bytes.
_ALIGN = 256
# Most SMs a Buffer's senders may be given (num_sms).
MAX_SMS = 132
# Warps an SM runs of a data-move launch: 16 warps use its whole register file at 128 registers
# per thread. A budget of num_sms SMs buys num_sms * WARPS_PER_SM warps of senders, and the
# local roles get WARPS_PER_SM // num_warps programs per SM.
WARPS_PER_SM = 16
# Registers per thread of the data-move kernels, so that WARPS_PER_SM warps fit an SM's 64K.
MAX_REGISTERS = 65536 // (WARPS_PER_SM * 32)
# Warps per program that a GPU configuration may have.
GPU_WARPS = (4, 8, 16)
# Most sending programs (channels) of one launch; the ready flags are sized for it.
MAX_PROGRAMS = MAX_SMS * WARPS_PER_SM // min(GPU_WARPS)
# Channels of an FP8 row that share one float32 scale (DeepSeek-V3's 1x128 activation blocks).
FP8_GROUP = 128
# Most column parts of a work item for the local roles (expansion, reduction, finish): the items
# that land last (or must be sent first) are worked on by up to that many programs at once.
LOCAL_PARTS = 4
# Low-latency mode: column slices of a row, each moved by its own program and released by its
# own flag, so that an expert's rows are moved by that many programs at once; and channels of
# a row that make one slice at the least.
LOW_LATENCY_SLICES = 2
LOW_LATENCY_SLICE_MIN = 2048
# 128-channel groups of a token's row that one program of a low-latency dispatch reads once and
# writes to the token's experts: with FP8 (it quantizes them first, and stages them for the
# sends in chunks of as many groups, a flag each), and with rows of the Buffer's dtype.
LOW_LATENCY_FP8_GROUPS = 32
LOW_LATENCY_ROW_GROUPS = 16
# Bytes of the header in front of a low-latency dispatch row (the source token index, then
# padding that keeps the payload 16-byte aligned), as DeepEP's messages have.
LOW_LATENCY_HEADER = 16


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for ints >= 0. Host code uses this and ``next_power_of_2`` instead of
    triton's: those are constexpr functions that cost about 5 µs per call from Python, and a
    dispatch needs dozens."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the dispatch and combine kernels.

    num_sms: the senders' SM budget.
    programs_per_sm: programs of num_warps warps that one SM's budget holds (WARPS_PER_SM //
        num_warps on GPUs, 1 under the interpreter): the launch has num_sms * programs_per_sm
        senders (channels) and, for the local roles, programs_per_sm programs per free SM. The
        hardware may place the senders on more SMs than num_sms, each beside local programs;
        their warps are num_sms SMs' worth.
    chunk_tokens: tokens per chunk, the unit of a flag; a power of two.
    block_h: hidden elements per tile of the dispatch kernel; a power of two.
    combine_block_h: the same for combine, whose fp32 accumulators need more registers.
    copy_unroll: expert rows combine gathers at once.
    copy_stages: tiles whose loads are in flight in the copies that stream rows (senders, and
        dispatch's own tokens), through shared memory; 1: one tile at a time, in registers.
    h_slices: column slices of a chunk; a work item is one (chunk, slice), so small batches still
        spread over all programs.
    num_warps: warps per program.
    """

    num_sms: int
    programs_per_sm: int
    chunk_tokens: int
    block_h: int
    combine_block_h: int
    copy_unroll: int
    copy_stages: int
    h_slices: int
    num_warps: int

    @property
    def senders(self) -> int:
        """Programs (channels) that move data between ranks."""
        return self.num_sms * self.programs_per_sm


def default_config(hidden: int, max_tokens: int, num_sms: int | None, on_gpu: bool) -> KernelConfig:
    """The documented heuristic.

    On GPUs, up to 8 SMs: programs of 4 warps, four per SM, with 16-token chunks (on 2xH200,
    S1, 8 SMs, against 8-warp programs with 32-token chunks: a dispatch graph 268 instead of
    298 µs and a combine 287 instead of 318 µs with expert-major rows; 223 instead of 236 and
    220 instead of 242 µs with token rows; at 4 SMs with token rows 280 instead of 355 µs).
    Above 8 SMs: programs of 8 warps, two per SM (at 16 SMs a dispatch graph 254 instead of
    287 µs with expert-major rows; against 16-warp programs at 8 SMs, a cached dispatch 302
    instead of 348 µs), with 16-token chunks for small batches (more chunks to spread over the
    programs) and 32 otherwise (fewer flags). Tiles of 8K elements for dispatch and 4K fp32
    accumulators for combine with 8 gathers in flight (make_config: the streaming copies keep 4
    tiles' loads in flight in shared memory), capped at 128 registers: without spills with 8
    warps on sm_90; 4-warp programs spill (S1: 320 bytes of stack in dispatch, 480 in combine)
    and are still the faster ones up to 8 SMs (with 4K-element tiles, which spill less: 224
    and 278 instead of 223 and 267 µs). Under the CPU interpreter: small tiles.
    """
    if not on_gpu:
        return make_config(num_sms or 2, 4, 32, 2, 1, on_gpu)
    num_sms = num_sms or 8
    warps = 4 if num_sms <= 8 else 8
    chunk = 16 if max_tokens <= 512 or warps == 4 else 32
    block_h = min(next_power_of_2(hidden), 8192 // chunk)
    # About two work items per sender when every rank sends max_tokens, at most one tile
    # column per slice.
    senders = num_sms * WARPS_PER_SM // warps
    chunks = max(1, ceil_div(max_tokens, chunk))
    slices = max(1, min(ceil_div(2 * senders, chunks), ceil_div(hidden, block_h), 8))
    return make_config(num_sms, chunk, block_h, slices, warps, on_gpu)


def make_config(
    num_sms: int,
    chunk_tokens: int,
    block_h: int,
    h_slices: int,
    num_warps: int,
    on_gpu: bool,
    copy_unroll: int = 8,
    copy_stages: int = 4,
) -> KernelConfig:
    """A KernelConfig from its free parameters. On GPUs combine tiles are half as wide as
    dispatch's (fp32 accumulators); the interpreter keeps tiles small and 2 gathers in flight."""
    if on_gpu and num_warps not in GPU_WARPS:
        raise ValueError(f"num_warps must be one of {GPU_WARPS} on GPUs, got {num_warps}")
    return KernelConfig(
        num_sms=num_sms,
        programs_per_sm=WARPS_PER_SM // num_warps if on_gpu else 1,
        chunk_tokens=chunk_tokens,
        block_h=block_h,
        combine_block_h=max(block_h // 2, 32) if on_gpu else block_h,
        copy_unroll=copy_unroll if on_gpu else 2,
        copy_stages=copy_stages if on_gpu else 1,
        h_slices=h_slices,
        num_warps=num_warps,
    )


@dataclass(frozen=True)
class NetSlot:
    """One work item (chunk, column slice) as it crosses the network, between a rank's outbox and
    the inbox of the rank with its local index on another node: a contiguous block, so that one
    put-with-signal carries it. Rows are the chunk's tokens to that node in order (at most CHUNK).

    meta   int32 [CHUNK, R, 1 + MS]  dispatch: per row and node rank r, the token's row in the
                                     sender's stream to r (-1: none), then what the sender
                                     would record at r (meta_rows' entries; -1)
    weights float32 [CHUNK, R, MS]   their routing weights
    (combine with token rows' topk_weights: float32 [CHUNK, MAX_TOPK] in their place, the node's
    sums of the slot weights of the slice's rows)
    data   dtype [CHUNK, cols]       the slice's columns (dispatch: tokens; combine: the node's
                                     partial sums); ``cols`` is the widest slice
    """

    meta_ints: int  # R * (1 + MS)
    meta_floats: int  # R * MS
    cols: int
    data_offset: int  # bytes from the slot's start to its data
    bytes: int  # the whole slot, a multiple of _ALIGN


@dataclass(frozen=True)
class ScaledFormat:
    """A block-scaled row format that dispatch moves: per token row, its values (one byte
    holds ``channels_per_byte`` channels) and one scale per ``block`` consecutive channels.

    fp8: DeepSeek-V3's rows, e4m3 values and a float32 scale per 128 channels.
    mxfp8: OCP MX v1.0 MXFP8, e4m3 values and an E8M0 (power of two) scale per 32 channels.
    nvfp4: e2m1 values, two a byte (float4_e2m1fn_x2: the even channel in the low nibble), and
        an e4m3 scale per 16 channels (the per-tensor float32 scale of NVFP4 is not a row's:
        it stays with the caller).
    """

    name: str
    values_dtype: torch.dtype
    channels_per_byte: int
    scale_dtype: torch.dtype
    block: int

    def values_shape(self, tokens: int, hidden: int) -> tuple[int, int]:
        return tokens, hidden // self.channels_per_byte

    def scales_shape(self, tokens: int, hidden: int) -> tuple[int, int]:
        return tokens, hidden // self.block


SCALED_FORMATS = {
    f.name: f
    for f in (
        ScaledFormat("fp8", torch.float8_e4m3fn, 1, torch.float32, FP8_GROUP),
        ScaledFormat("mxfp8", torch.float8_e4m3fn, 1, torch.float8_e8m0fnu, 32),
        ScaledFormat("nvfp4", torch.float4_e2m1fn_x2, 2, torch.float8_e4m3fn, 16),
    )
}


@dataclass(frozen=True)
class ScaledRows:
    """How a dispatch moves rows of a block-scaled format: as int32 words, each row its
    values' words (data_words) then its scales' (scale_words, the scale bytes rounded up to
    whole words), through the same staging areas and network slots as rows of the Buffer's
    dtype (whose H elements of 2 or 4 bytes hold the at most H * 33 / 32 bytes).

    words: a staged row's columns, data_words + scale_words rounded up to a multiple of 16, so
    that staged rows start 64-byte aligned and the kernels' copies are vectorised (Triton knows
    an integer's alignment only as "a multiple of 16").
    block: words per tile, so that a tile has the bytes of a tile of the Buffer's dtype.
    net_cols: words of a network slot's row (the widest column slice).
    """

    format: ScaledFormat
    data_words: int
    scale_bytes: int
    scale_words: int
    words: int
    block: int
    net_cols: int

    @property
    def padded_scales(self) -> bool:
        """Whether a row's scales end inside a word (e.g. MXFP8 at H = 2880: 90 bytes): they
        then move in a row of scale_words words, of which the caller sees the first bytes."""
        return self.scale_words * 4 != self.scale_bytes


def scaled_rows(
    fmt: ScaledFormat, hidden: int, dtype: torch.dtype, config: KernelConfig
) -> ScaledRows | None:
    """The row layout of ``fmt`` for rows of ``hidden`` channels; None unless its blocks and
    its values' words divide them."""
    value_bytes = hidden // fmt.channels_per_byte
    if hidden % fmt.block or value_bytes % 4:
        return None
    data_words = value_bytes // 4
    scale_bytes = hidden // fmt.block * fmt.scale_dtype.itemsize
    scale_words = ceil_div(scale_bytes, 4)
    words = ceil_div(data_words + scale_words, 16) * 16
    block = min(max(config.block_h * dtype.itemsize // 4, 16), next_power_of_2(words))
    net_cols = ceil_div(ceil_div(words, config.h_slices), block) * block
    return ScaledRows(fmt, data_words, scale_bytes, scale_words, words, block, net_cols)


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the regions of one rank's symmetric buffer (the same on every rank).

    In this order: first the regions placed by the world alone, then the low-latency mode's,
    then the normal mode's (make_plan says why).

    mask          int64 [2W + 1]         nonzero where rank i is masked here (Buffer.update_mask,
                                         a wait that ran out: MASKED_HERE until this rank has
                                         told the others; a peer that masked it and said so: 1);
                                         then this rank's heartbeat: the time, written while it
                                         waits; then rank i's heartbeat, pushed here while it
                                         waits by rank i of another node (kernels/peers.py)
    farewell      int64 [W]              rank i's word at destroy(): it frees the heap with the
                                         others (1) or leaves it (2); 0 while it has not said
                                         (this rank's own place: its last verdict)
    ll_*          the low-latency mode's regions (``LowLatencyLayout``), empty without it
    count_flags   int64 [W]              source s published its layout row (sequence number)
    dispatch_ready int64 [W, MAX_PROGRAMS] program p of rank s started a dispatch launch
    combine_ready int64 [W, MAX_PROGRAMS] ... a combine launch (apart from dispatch's, so a
                                         dispatch met by a peer's combine times out instead of
                                         exchanging data)
    chunk_flags   int64 [W, NC_MAX * S]  work item (chunk, slice) from/to rank s has landed
    reduced_flags int64 [W, NC_MAX * S, LOCAL_PARTS]  combine: this rank's partial rows of that
                                         item's column part are ready (block s != own rank), or
                                         the own sums of that part of own chunk are in out
    layout_in     int32 [2, W, LR]       layout rows from every source s, by parity of the layout
                                         sequence number (a source two layouts ahead has seen this
                                         rank's next row, so this one was read): s's per-expert
                                         totals, tokens, invalid, pad (ROW words), the offsets of
                                         s's chunks in its stream to this rank (NC_MAX + 1), and
                                         in its stream to this rank's node (NC_MAX + 1)
    layout_out    int32 [W, LR]          this rank's rows for peers on other nodes, put from here
    meta_rows     int32 [W, T_MAX, MS]   expert-major rows of each staged token (token rows:
                                         each slot's (slot << SLOT_SHIFT) | local id, then
                                         the source token's index)
    meta_weights  float32 [W, T_MAX, MS] their routing weights
    staging       dtype [W, T_MAX, H]    staged tokens (dispatch) or partial sums (combine); block
                                         s: what rank s sent here (this rank's own block is
                                         unused: own tokens are neither staged nor sent back).
                                         Across nodes, in combine, block (n, r) of another node n
                                         holds node rank r's partial rows of the tokens of rank
                                         (n, this rank's local index), in r's numbering
    slot_weights  float32 [W, T_MAX, MAX_TOPK]  token rows, combine with topk_weights: the
                                         slot weights of the partial rows in staging, as rows
                                         of K (empty for expert-major rows)
    net_flags     int64 [N, NC_MAX * S]  across nodes: work item w from node n's rank of this
                                         rank's local index has landed in net_inbox
    net_inbox     [N, NC_MAX * S] NetSlot  what that rank put here (dispatch: tokens to forward
                                         over NVLink; combine: its node's partial sums)
    net_outbox    [N, NC_MAX * S] NetSlot  what this rank puts to node n (network sources must
                                         lie in registered memory)
    """

    count_flags: int
    dispatch_ready: int
    combine_ready: int
    chunk_flags: int
    reduced_flags: int
    layout_in: int
    layout_out: int
    meta_rows: int
    meta_weights: int
    staging: int
    slot_weights: int
    net_flags: int
    net_inbox: int
    net_outbox: int
    mask: int
    farewell: int
    ll_freed: int
    ll_flags: int
    ll_own: int
    ll_quantized: int
    ll_staging: int
    ll_send: int
    total_bytes: int


@dataclass(frozen=True)
class LowLatencyLayout:
    """The low-latency mode's geometry (Buffer's ``low_latency_tokens`` = M > 0), with regions
    in every rank's heap (offsets in HeapLayout):

    ll_freed     int64 [W]          rank i's last low-latency call whose receive is over (so
                                    that a sender two calls later may overwrite its area)
    ll_flags     int64 [2, B, S]    slice s of receive block b has landed: (seq << 17) | rows
                                    (a block from another node lands whole, with slice 0's)
    ll_own       int64 [2, L]       this rank's own rows of local expert e: (seq << 17) | rows
    ll_quantized int64 [M, QC]      chunk c of this rank's token t is quantized and staged (an
                                    FP8 dispatch quantizes each token once, by chunks of
                                    LOW_LATENCY_FP8_GROUPS 128-channel groups): seq
    ll_staging   [2, B, M] rows     receive blocks, by parity of the call's sequence number:
                                    dispatch, block (local expert e, source j != this rank):
                                    rows of ``row_bytes`` (a LOW_LATENCY_HEADER, then the
                                    payload); combine, block (remote expert e): rows of the
                                    Buffer's dtype, hidden wide
    ll_send      [2, E + 1, M] rows send areas, by the host's parity of its calls: rows that a
                                    dispatch puts over the network, by (expert, position), then
                                    an FP8 dispatch's quantized tokens; or the combine buffer
                                    [L, W * M', H] of get_next_low_latency_combine_buffer

    B = E - L (the experts of the other ranks), S = ``slices``, QC = ``token_chunks``.
    """

    tokens: int  # M: most tokens a rank passes to one low-latency dispatch
    slices: int  # S: column slices of a row, each moved by its own program, with its own flag
    experts_per_rank: int  # L
    remote_blocks: int  # B
    payload_bytes: int  # the widest row a call moves: the Buffer's dtype, or FP8 and scales
    row_bytes: int  # header + payload, a multiple of 16
    token_chunks: int  # QC: chunks of a token's row that an FP8 dispatch quantizes, a flag each

    @property
    def area_rows(self) -> int:
        """Rows of one send area: (E + 1) * M."""
        return (self.remote_blocks + self.experts_per_rank + 1) * self.tokens


def low_latency_layout(
    tokens: int, hidden: int, world_size: int, num_experts: int, dtype: torch.dtype
) -> LowLatencyLayout:
    """The low-latency geometry for ``tokens`` (M) tokens a rank; M = 0: none."""
    fp8_bytes = hidden + hidden // FP8_GROUP * 4 if hidden % FP8_GROUP == 0 else 0
    payload = max(hidden * dtype.itemsize, fp8_bytes)
    local = num_experts // world_size
    return LowLatencyLayout(
        tokens=tokens,
        slices=max(1, min(LOW_LATENCY_SLICES, hidden // LOW_LATENCY_SLICE_MIN)),
        experts_per_rank=local,
        remote_blocks=num_experts - local,
        payload_bytes=payload,
        row_bytes=LOW_LATENCY_HEADER + ceil_div(payload, 16) * 16,
        token_chunks=ceil_div(ceil_div(hidden, FP8_GROUP), LOW_LATENCY_FP8_GROUPS),
    )


def low_latency_region_sizes(ll: LowLatencyLayout, world_size: int, num_experts: int) -> list:
    """(name, bytes) of the low-latency heap regions (all empty without the mode)."""
    on = ll.tokens > 0
    return [
        ("ll_freed", world_size * 8 if on else 0),
        ("ll_flags", 2 * ll.remote_blocks * ll.slices * 8 if on else 0),
        ("ll_own", 2 * ll.experts_per_rank * 8 if on else 0),
        ("ll_quantized", ll.tokens * ll.token_chunks * 8),
        ("ll_staging", 2 * ll.remote_blocks * ll.tokens * ll.row_bytes),
        ("ll_send", 2 * ll.area_rows * ll.row_bytes),
    ]


def low_latency_bytes(
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_ranks: int,
    num_experts: int,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Heap bytes per rank that ``Buffer(low_latency_tokens=num_max_dispatch_tokens_per_rank)``
    adds (compare DeepEP's ``get_low_latency_rdma_size_hint``), each region rounded up to the
    heap's alignment."""
    ll = low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, dtype)
    sizes = low_latency_region_sizes(ll, num_ranks, num_experts)
    return _laid_out(sizes)[1]


def deepep_low_latency_bytes(tokens: int, hidden: int, world_size: int, num_experts: int) -> int:
    """DeepEP V1's ``Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world_size,
    num_experts)``, its RDMA buffer for the low-latency mode (csrc/legacy/config.hpp,
    LowLatencyLayout): two send, two receive and two signalling buffers, sized in BF16."""
    scales = hidden // FP8_GROUP
    dispatch_message = 16 + max(hidden * 2, hidden + scales * 4)
    combine_message = scales * 4 + hidden * 2
    send = max(tokens * dispatch_message, num_experts * tokens * combine_message)
    receive = num_experts * tokens * max(dispatch_message, combine_message)
    signalling = ceil_div(num_experts * 4, 128) * 128
    total = 2 * (send + receive + signalling)
    return (total + 128) // 128 * 128


@dataclass(frozen=True)
class Plan:
    world_size: int
    hidden: int
    max_tokens: int
    num_experts: int
    experts_per_rank: int
    dtype: torch.dtype
    config: KernelConfig
    max_chunks: int  # NC_MAX: chunks of max_tokens tokens
    meta_stride: int  # MS
    counts_row: int  # ROW: int32 words of per-expert totals, tokens, invalid, pad
    layout_row: int  # LR: int32 words of a layout row (counts and two chunk tables)
    heap: HeapLayout
    token_rows: bool  # dispatch's output: a row per (token, rank), not per (token, expert)
    ranks_per_node: int  # R: consecutive ranks that reach each other over NVLink
    net_slot: NetSlot
    scaled: tuple[ScaledRows, ...]  # the block-scaled formats whose blocks divide H
    low_latency: LowLatencyLayout  # tokens == 0: no low-latency mode

    @property
    def slot_entries(self) -> int:
        """Entries of a staged row's metadata that name its slots on the destination (MS, less
        the source token's index with token rows)."""
        return self.meta_stride - 1 if self.token_rows else self.meta_stride

    def scaled_rows(self, name: str) -> ScaledRows | None:
        """The layout of format ``name``'s rows (SCALED_FORMATS), None if H does not fit it."""
        return next((rows for rows in self.scaled if rows.format.name == name), None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self._fields()))

    def __hash__(self) -> int:
        # Computed once: a Plan keys caches that every dispatch looks up, and hashing its
        # nested fields costs a µs of host time per lookup.
        return self._hash

    def __reduce__(self):
        # Rebuilt from its fields, so that an unpickled Plan hashes as this process's do (a
        # dtype's hash differs between processes).
        return Plan, self._fields()

    def _fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def nodes(self) -> int:
        """N: nodes of the group; 1 keeps every transfer on NVLink."""
        return self.world_size // self.ranks_per_node


def slice_columns(hidden: int, config: KernelConfig) -> int:
    """Columns of a work item's column slice in dispatch (the last slice may be narrower)."""
    return ceil_div(ceil_div(hidden, config.h_slices), config.block_h) * config.block_h


def make_plan(
    world_size: int,
    hidden: int,
    max_tokens: int,
    num_experts: int,
    dtype: torch.dtype,
    config: KernelConfig,
    token_rows: bool = False,
    ranks_per_node: int | None = None,
    low_latency_tokens: int = 0,
) -> Plan:
    ranks_per_node = ranks_per_node or world_size
    nodes = world_size // ranks_per_node
    experts_per_rank = num_experts // world_size
    max_chunks = max(1, ceil_div(max_tokens, config.chunk_tokens))
    # Token rows also carry the source token's index, after the entries of its slots.
    meta_stride = min(experts_per_rank, MAX_TOPK) + (1 if token_rows else 0)
    counts_row = num_experts + 3
    layout_row = counts_row + 2 * (max_chunks + 1)
    rows = world_size * max(max_tokens, 1)
    items = max_chunks * config.h_slices
    chunk = config.chunk_tokens
    meta_ints = ranks_per_node * (1 + meta_stride)
    meta_floats = ranks_per_node * meta_stride
    cols = slice_columns(hidden, config)
    layouts = (scaled_rows(fmt, hidden, dtype, config) for fmt in SCALED_FORMATS.values())
    scaled = tuple(layout for layout in layouts if layout is not None)
    row_bytes = hidden * dtype.itemsize
    data_bytes = cols * dtype.itemsize  # of a slot's row
    for layout in scaled:  # block-scaled rows move through the same regions
        row_bytes = max(row_bytes, layout.words * 4)
        data_bytes = max(data_bytes, layout.net_cols * 4)
    # Combine puts a token row's slot weights (topk_weights) where dispatch has metadata.
    slot_weights = MAX_TOPK if token_rows else 0
    data_offset = ceil_div(chunk * max(meta_ints + meta_floats, slot_weights) * 4, 16) * 16
    slot_bytes = ceil_div(data_offset + chunk * data_bytes, _ALIGN) * _ALIGN
    # Across nodes only: a group of one node moves nothing over the network.
    net_slots = nodes * items if nodes > 1 else 0
    ll = low_latency_layout(low_latency_tokens, hidden, world_size, num_experts, dtype)
    # First the regions whose place depends on the world alone, then the low-latency mode's,
    # which depend on neither the kernel configuration nor the normal mode's sizes: a heap
    # reserved before the sizes were known (Buffer's ``heap``) has them where every rank's
    # Buffer puts them, and one reserved and never used still says farewell (``fixed_regions``).
    sizes = [
        *_fixed_region_sizes(world_size),
        *low_latency_region_sizes(ll, world_size, num_experts),
        ("count_flags", world_size * 8),
        ("dispatch_ready", world_size * MAX_PROGRAMS * 8),
        ("combine_ready", world_size * MAX_PROGRAMS * 8),
        ("chunk_flags", world_size * items * 8),
        ("reduced_flags", world_size * items * LOCAL_PARTS * 8),
        ("layout_in", 2 * world_size * layout_row * 4),
        ("layout_out", (world_size if nodes > 1 else 0) * layout_row * 4),
        ("meta_rows", rows * meta_stride * 4),
        ("meta_weights", rows * meta_stride * 4),
        ("staging", rows * row_bytes),
        ("slot_weights", rows * slot_weights * 4),
        ("net_flags", net_slots * 8),
        ("net_inbox", net_slots * slot_bytes),
        ("net_outbox", net_slots * slot_bytes),
    ]
    offsets, total_bytes = _laid_out(sizes)
    return Plan(
        world_size=world_size,
        hidden=hidden,
        max_tokens=max_tokens,
        num_experts=num_experts,
        experts_per_rank=experts_per_rank,
        dtype=dtype,
        config=config,
        max_chunks=max_chunks,
        meta_stride=meta_stride,
        counts_row=counts_row,
        layout_row=layout_row,
        heap=HeapLayout(total_bytes=total_bytes, **offsets),
        token_rows=token_rows,
        ranks_per_node=ranks_per_node,
        net_slot=NetSlot(meta_ints, meta_floats, cols, data_offset, slot_bytes),
        scaled=scaled,
        low_latency=ll,
    )


def _fixed_region_sizes(world_size: int) -> list:
    """(name, bytes) of the regions that every plan of ``world_size`` ranks puts first."""
    return [("mask", (2 * world_size + 1) * 8), ("farewell", world_size * 8)]


def fixed_regions(world_size: int) -> dict[str, int]:
    """The byte offsets of the mask and farewell regions in every plan of ``world_size``
    ranks, whatever its sizes (so in a reserved heap that no Buffer took yet)."""
    return _laid_out(_fixed_region_sizes(world_size))[0]


def _laid_out(sizes: list) -> tuple[dict[str, int], int]:
    """The regions ``sizes`` [(name, bytes)] one after another, each at a multiple of the
    heap's alignment: ({name: byte offset}, total bytes)."""
    offsets, cursor = {}, 0
    for name, size in sizes:
        offsets[name] = cursor
        cursor += ceil_div(size, _ALIGN) * _ALIGN
    return offsets, cursor
