"""Grouped GEMMs of the experts' SwiGLU MLP, y = (silu(x W_gate^T) * (x W_up^T)) W_down^T per
local expert, over the rows that dispatch lays out (ops/experts.py launches them).

Weights: W1 [L, 2F, H], expert e's gate rows [0, F) then its up rows [F, 2F) (the two
nn.Linear weights of a DeepSeek or Mixtral expert stacked, not interleaved); W2 [L, H, F].

Row layouts (LAYOUT), a row's address being base + expert * expert_stride + row * row_stride:

- LOW_LATENCY: a low-latency dispatch's [L, C, ·] blocks, C = W * M' rows an expert; rows
  [0, count[e]) of block e are valid (``recv_count``, int32 [L]). Row tile t is expert
  t // cdiv(C, BLOCK_M)'s; a tile past the count ends at once, so empty capacity costs a
  program start, no loads.
- EXPERT_MAJOR: a normal dispatch's rows [N, ·] (expert_stride 0), counts[e] rows (int64
  ``tokens_per_expert``) of each expert after those of the experts before it, in any counts
  (padded or not). Expert e owns cdiv(counts[e], BLOCK_M) row tiles after the tiles of the
  experts before it, each program finding its expert from a cumulative sum of the counts it
  reads itself (no host read, so a CUDA graph captures it); the grid has cdiv(N, BLOCK_M) + L
  row tiles, at least as many as the experts' tiles and those of the rows past them (the zero
  tail of a max_recv_tokens dispatch), which the output GEMM zeroes.

Precision: products accumulate in float32 (tl.dot), outputs are bf16. With FP8 (DeepSeek-V3's
formats): W1 and W2 are e4m3 values with a float32 scale per 128x128 block, x is e4m3 values
with a float32 scale per row and 128 channels; each BLOCK_K step (BLOCK_K dividing 128) is an
e4m3 product whose float32 result is scaled by the row's and the weight block's scales before
it is added. The SwiGLU output is then requantized per row and 128 channels by the library's
fp8 rule (kernels/quantize.py: a = max(amax, 2^-119), scale = a / 448) for the down GEMM.

Meta-parameters: BLOCK_M rows, BLOCK_N output columns and BLOCK_K inner channels of a tile
(the gate/up GEMM's BLOCK_N counts columns of F: its tile takes BLOCK_N gate and BLOCK_N up
rows of W1; with FP8 it is 128, one scale group of the activation), BLOCK_R rows a weight
gradient step takes, GROUP_M row tiles that take every column tile before the next rows start
(Triton's matmul ordering: the group's rows and weight tiles stay in L2), L_P2 the local
experts' power of 2, FP8 the operands' format, SAVE_PRE keep the pre-activations (gate | up,
bf16 [rows, 2F]) for the backward pass.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .primitives import INTERPRETED
from .quantize import AMAX_FLOOR, E4M3_MAX, e4m3_bits

LOW_LATENCY = tl.constexpr(0)
EXPERT_MAJOR = tl.constexpr(1)
FP8_BLOCK = tl.constexpr(128)  # channels a scale covers: a row's group, a weight block's side

# A matrix operand: element (major, k) at ptr + major * major_stride + k * k_stride (ptr at
# its expert's block); with FP8 its scale at scales_ptr + (major // major_per_scale) *
# scale_major_stride + (k // 128) * scale_k_stride (major_per_scale: 1 for rows, 128 for a
# weight's blocks).
Operand = namedtuple(
    "Operand",
    "ptr major_stride k_stride scales_ptr scale_major_stride scale_k_stride major_per_scale",
)


if INTERPRETED:

    @triton.jit
    def dot_16bit(a, b, acc):
        """acc + a @ b for bf16 a, b. The interpreter (Triton 3.9) multiplies bf16 operands as
        integers, so they go in as float32, whose products of bf16 values are exact."""
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)

else:

    @triton.jit
    def dot_16bit(a, b, acc):
        """acc + a @ b for bf16 a, b, accumulated in float32 by the tensor cores."""
        return tl.dot(a, b, acc)


@triton.jit
def tile_of_program(program, row_tiles, col_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of ``program``: GROUP_M row tiles take every column tile before
    the next GROUP_M start."""
    per_group = GROUP_M * col_tiles
    first = (program // per_group) * GROUP_M
    size = tl.minimum(row_tiles - first, GROUP_M)
    return first + (program % per_group) % size, (program % per_group) // size


@triton.jit
def expert_rows(counts_ptr, expert, num_experts, L_P2: tl.constexpr):
    """(first, end) of ``expert``'s rows in the expert-major layout."""
    experts = tl.arange(0, L_P2)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0).to(tl.int32)
    mine = experts == expert
    end = tl.sum(tl.where(mine, tl.cumsum(counts, 0), 0))
    return end - tl.sum(tl.where(mine, counts, 0)), end


@triton.jit
def rows_of_tile(
    tile,
    counts_ptr,
    num_experts,
    capacity,
    LAYOUT: tl.constexpr,
    L_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(expert, first, end) of row tile ``tile``: its rows are [first, min(first + BLOCK_M,
    end)), none where first >= end. ``capacity``: C rows an expert (LOW_LATENCY) or the N rows
    of the tensor (EXPERT_MAJOR, where a tile past the experts' tiles is of the tail: expert
    ``num_experts``, rows from T + (tile - the experts' tiles) * BLOCK_M, T the counts' sum)."""
    if LAYOUT == LOW_LATENCY:
        tiles = tl.cdiv(capacity, BLOCK_M)
        expert = tile // tiles
        first = (tile % tiles) * BLOCK_M
        end = tl.minimum(tl.load(counts_ptr + expert).to(tl.int32), capacity)
    else:
        experts = tl.arange(0, L_P2)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0).to(tl.int32)
        tiles = tl.cdiv(counts, BLOCK_M)
        tile_ends = tl.cumsum(tiles, 0)
        expert = tl.sum(((tile_ends <= tile) & (experts < num_experts)).to(tl.int32))
        mine = experts == expert
        row_end = tl.sum(tl.where(mine, tl.cumsum(counts, 0), 0))
        first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0))
        first = row_end - tl.sum(tl.where(mine, counts, 0)) + (tile - first_tile) * BLOCK_M
        in_tail = expert == num_experts
        first = tl.where(in_tail, tl.sum(counts) + (tile - tl.sum(tiles)) * BLOCK_M, first)
        end = tl.where(in_tail, capacity, tl.minimum(row_end, capacity))
    return expert, first, end


@triton.jit
def program_tile(
    counts_ptr,
    num_experts,
    capacity,
    num_cols,
    LAYOUT: tl.constexpr,
    L_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """(expert, whether it has rows, rows, rows_live, cols, cols_live) of this program's tile
    of a launch over ``num_cols`` output columns (tile_of_program, rows_of_tile)."""
    col_tiles = tl.cdiv(num_cols, BLOCK_N)
    row_tile, col_tile = tile_of_program(
        tl.program_id(0), tl.num_programs(0) // col_tiles, col_tiles, GROUP_M
    )
    expert, first, end = rows_of_tile(
        row_tile, counts_ptr, num_experts, capacity, LAYOUT, L_P2, BLOCK_M
    )
    rows = first + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, first < end, rows, rows < end, cols, cols < num_cols


@triton.jit
def load_block(op: Operand, major, major_live, k0, inner, FP8: tl.constexpr, BLOCK_K: tl.constexpr):
    """[len(major), BLOCK_K] elements of ``op`` from channel k0 (zeros past ``inner`` and at
    rows not live), as e4m3 with FP8; and the scales of their rows (FP8, else 1)."""
    k = k0 + tl.arange(0, BLOCK_K)
    major = major.to(tl.int64)
    mask = major_live[:, None] & (k < inner)[None, :]
    block = tl.load(
        op.ptr + major[:, None] * op.major_stride + k[None, :] * op.k_stride, mask=mask, other=0
    )
    if FP8:
        scale_at = (major // op.major_per_scale) * op.scale_major_stride
        scales = tl.load(
            op.scales_ptr + scale_at + (k0 // FP8_BLOCK) * op.scale_k_stride,
            mask=major_live,
            other=0.0,
        )
        block = block.to(tl.float8e4nv, bitcast=True)
    else:
        scales = 1.0
    return block, scales


@triton.jit
def add_product(acc, a, a_scales, b, b_scales, FP8: tl.constexpr):
    """acc + (a @ b^T), a [M, K], b [N, K]; with FP8 the e4m3 product scaled by a's row scales
    and b's (one scale group of K)."""
    if FP8:
        product = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        return acc + product * a_scales[:, None] * b_scales[None, :]
    return dot_16bit(a, tl.trans(b), acc)


@triton.jit
def product_tile(
    a: Operand,
    rows,
    rows_live,
    b: Operand,
    cols,
    cols_live,
    inner,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """float32 [BLOCK_M, BLOCK_N]: sum over k < inner of a[rows, k] * b[cols, k]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        x, x_scales = load_block(a, rows, rows_live, k0, inner, FP8, BLOCK_K)
        w, w_scales = load_block(b, cols, cols_live, k0, inner, FP8, BLOCK_K)
        acc = add_product(acc, x, x_scales, w, w_scales, FP8)
    return acc


@triton.jit
def store_fp8_rows(values_ptr, scales_ptr, rows, rows_live, cols, act, ffn):
    """Quantize ``act`` (float32 [rows, 128], one group of each row: ``cols``) by the fp8 rule
    into e4m3 bits at values_ptr [rows, F] and float32 scales at scales_ptr [rows, F / 128]."""
    group = tl.min(cols, axis=0) // FP8_BLOCK
    amax = tl.max(tl.abs(act), axis=1)
    floored = tl.maximum(amax, AMAX_FLOOR)
    scales = tl.where(amax > 0, tl.math.div_rn(floored, E4M3_MAX), 0.0)
    bits = e4m3_bits(act * tl.math.div_rn(E4M3_MAX, floored)[:, None])
    tl.store(
        values_ptr + rows[:, None] * ffn + cols[None, :], bits.to(tl.uint8), mask=rows_live[:, None]
    )
    tl.store(scales_ptr + rows * (ffn // FP8_BLOCK) + group, scales, mask=rows_live)


@triton.jit(do_not_specialize=("capacity",))
def gate_up_kernel(
    # x [.., H]: bf16, or e4m3 bits with float32 scales (a row's groups scale_k_stride apart)
    x_ptr,
    x_expert_stride,
    x_row_stride,
    x_scales_ptr,
    x_scale_expert_stride,
    x_scale_row_stride,
    x_scale_k_stride,
    # W1 [L, 2F, H] contiguous; FP8: its scales [L, 2F / 128, H / 128]
    w1_ptr,
    w1_scales_ptr,
    counts_ptr,  # recv_count int32 [L] (LOW_LATENCY) or tokens_per_expert int64 [L]
    # out: act [.., F] contiguous rows (bf16, or e4m3 bits and float32 [.., F / 128] scales),
    # an expert's block act_expert_rows rows after the one before; pre [.., 2F] bf16 likewise
    act_ptr,
    act_scales_ptr,
    act_expert_rows,
    pre_ptr,
    capacity,  # C (LOW_LATENCY) or N (EXPERT_MAJOR)
    hidden,
    ffn,
    num_experts,
    LAYOUT: tl.constexpr,
    FP8: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    L_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The gate/up GEMM and SwiGLU: act = silu(x W_gate^T) * (x W_up^T), a program per (row
    tile, BLOCK_N columns of F)."""
    expert, has_rows, rows, rows_live, cols, cols_live = program_tile(
        counts_ptr, num_experts, capacity, ffn, LAYOUT, L_P2, BLOCK_M, BLOCK_N, GROUP_M
    )
    if (not has_rows) | (expert >= num_experts):
        return
    e = expert.to(tl.int64)
    x = Operand(
        x_ptr + e * x_expert_stride,
        x_row_stride,
        1,
        x_scales_ptr + e * x_scale_expert_stride,
        x_scale_row_stride,
        x_scale_k_stride,
        1,
    )
    w_scale_rows = tl.cdiv(2 * ffn, FP8_BLOCK)
    w1 = Operand(
        w1_ptr + e * 2 * ffn * hidden,
        hidden,
        1,
        w1_scales_ptr + e * w_scale_rows * tl.cdiv(hidden, FP8_BLOCK),
        tl.cdiv(hidden, FP8_BLOCK),
        1,
        FP8_BLOCK,
    )
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a, a_scales = load_block(x, rows, rows_live, k0, hidden, FP8, BLOCK_K)
        w, w_scales = load_block(w1, cols, cols_live, k0, hidden, FP8, BLOCK_K)
        gate = add_product(gate, a, a_scales, w, w_scales, FP8)
        w, w_scales = load_block(w1, ffn + cols, cols_live, k0, hidden, FP8, BLOCK_K)
        up = add_product(up, a, a_scales, w, w_scales, FP8)
    act = gate * tl.sigmoid(gate) * up
    block_rows = e * act_expert_rows + rows.to(tl.int64)
    live = rows_live[:, None] & cols_live[None, :]
    if SAVE_PRE:
        pre = pre_ptr + block_rows[:, None] * 2 * ffn + cols[None, :]
        tl.store(pre, gate.to(tl.bfloat16), mask=live)
        tl.store(pre + ffn, up.to(tl.bfloat16), mask=live)
    if FP8:
        store_fp8_rows(act_ptr, act_scales_ptr, block_rows, rows_live, cols, act, ffn)
    else:
        tl.store(
            act_ptr + block_rows[:, None] * ffn + cols[None, :], act.to(tl.bfloat16), mask=live
        )


@triton.jit(do_not_specialize=("capacity",))
def grouped_gemm_kernel(
    # a [.., K] (bf16, or e4m3 bits with float32 scales [.., K / 128], rows contiguous)
    a_ptr,
    a_expert_stride,
    a_row_stride,
    a_scales_ptr,
    a_scale_expert_stride,
    a_scale_row_stride,
    # b [L, N_out, K] by strides (e, n, k); FP8: contiguous scales [L, N_out / 128, K / 128]
    b_ptr,
    b_expert_stride,
    b_col_stride,
    b_k_stride,
    b_scales_ptr,
    counts_ptr,
    # out [.., N_out] bf16, rows contiguous
    out_ptr,
    out_expert_stride,
    out_row_stride,
    capacity,
    inner,
    out_cols,
    num_experts,
    LAYOUT: tl.constexpr,
    FP8: tl.constexpr,
    L_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out = a @ b[e]^T on each expert's rows (the down GEMM, y = act W2^T; and in the backward
    pass dx = d(gate | up) W1); in EXPERT_MAJOR, zeros in the rows past the experts'."""
    expert, has_rows, rows, rows_live, cols, cols_live = program_tile(
        counts_ptr, num_experts, capacity, out_cols, LAYOUT, L_P2, BLOCK_M, BLOCK_N, GROUP_M
    )
    if not has_rows:
        return
    e = tl.minimum(expert, num_experts - 1).to(tl.int64)  # (a tail tile reads no operand)
    if expert < num_experts:
        k_scales = tl.cdiv(inner, FP8_BLOCK)
        a = Operand(
            a_ptr + e * a_expert_stride,
            a_row_stride,
            1,
            a_scales_ptr + e * a_scale_expert_stride,
            a_scale_row_stride,
            1,
            1,
        )
        b = Operand(
            b_ptr + e * b_expert_stride,
            b_col_stride,
            b_k_stride,
            b_scales_ptr + e * tl.cdiv(out_cols, FP8_BLOCK) * k_scales,
            k_scales,
            1,
            FP8_BLOCK,
        )
        acc = product_tile(
            a, rows, rows_live, b, cols, cols_live, inner, FP8, BLOCK_M, BLOCK_N, BLOCK_K
        )
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    out = out_ptr + e * out_expert_stride + rows.to(tl.int64)[:, None] * out_row_stride
    tl.store(out + cols[None, :], acc.to(tl.bfloat16), mask=rows_live[:, None] & cols_live[None, :])


@triton.jit(do_not_specialize=("num_rows",))
def swiglu_grad_kernel(
    dy_ptr,  # [N, H] bf16, contiguous
    w2_ptr,  # [L, H, F] bf16, contiguous
    pre_ptr,  # [N, 2F] bf16: the forward pass's gate | up
    counts_ptr,  # tokens_per_expert int64 [L]
    dpre_ptr,  # out [N, 2F] bf16: d(gate | up)
    num_rows,
    hidden,
    ffn,
    num_experts,
    L_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The backward pass through the down GEMM and SwiGLU (expert-major rows): dact = dy W2[e],
    then dgate = dact * up * silu'(gate), dup = dact * silu(gate)."""
    expert, has_rows, rows, rows_live, cols, cols_live = program_tile(
        counts_ptr, num_experts, num_rows, ffn, EXPERT_MAJOR, L_P2, BLOCK_M, BLOCK_N, GROUP_M
    )
    if (not has_rows) | (expert >= num_experts):
        return
    dy = Operand(dy_ptr, hidden, 1, dy_ptr, 0, 0, 1)
    w2 = Operand(w2_ptr + expert.to(tl.int64) * hidden * ffn, 1, ffn, w2_ptr, 0, 0, 1)
    dact = product_tile(
        dy, rows, rows_live, w2, cols, cols_live, hidden, False, BLOCK_M, BLOCK_N, BLOCK_K
    )
    at = rows.to(tl.int64)[:, None] * 2 * ffn + cols[None, :]
    live = rows_live[:, None] & cols_live[None, :]
    gate = tl.load(pre_ptr + at, mask=live, other=0.0).to(tl.float32)
    up = tl.load(pre_ptr + at + ffn, mask=live, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(dpre_ptr + at, (dact * up * sig * (1 + gate * (1 - sig))).to(tl.bfloat16), mask=live)
    tl.store(dpre_ptr + at + ffn, (dact * gate * sig).to(tl.bfloat16), mask=live)


@triton.jit
def weight_grad_kernel(
    g_ptr,  # [N, N_out] bf16, contiguous: the gradient of the GEMM's output
    a_ptr,  # [N, K] bf16, contiguous: the GEMM's input rows
    counts_ptr,  # tokens_per_expert int64 [L]
    dw_ptr,  # out [L, N_out, K] bf16, contiguous
    out_cols,
    inner,
    num_experts,
    L_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """dw[e] = g[rows of e]^T @ a[rows of e] (expert-major rows), a program per (expert,
    BLOCK_N x BLOCK_K tile of dw[e]); an expert without rows gets zeros."""
    n_tiles = tl.cdiv(out_cols, BLOCK_N)
    k_tiles = tl.cdiv(inner, BLOCK_K)
    program = tl.program_id(0)
    expert = program // (n_tiles * k_tiles)
    n0 = (program // k_tiles) % n_tiles * BLOCK_N
    k0 = program % k_tiles * BLOCK_K
    first, end = expert_rows(counts_ptr, expert, num_experts, L_P2)
    g = Operand(g_ptr, out_cols, 1, g_ptr, 0, 0, 1)
    a = Operand(a_ptr, inner, 1, a_ptr, 0, 0, 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for r0 in range(first, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rows_live = rows < end
        g_rows, _ = load_block(g, rows, rows_live, n0, out_cols, False, BLOCK_N)
        a_rows, _ = load_block(a, rows, rows_live, k0, inner, False, BLOCK_K)
        acc = dot_16bit(tl.trans(g_rows), a_rows, acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    out = dw_ptr + expert.to(tl.int64) * out_cols * inner + cols.to(tl.int64)[:, None] * inner
    tl.store(
        out + ks[None, :],
        acc.to(tl.bfloat16),
        mask=(cols < out_cols)[:, None] & (ks < inner)[None, :],
    )
