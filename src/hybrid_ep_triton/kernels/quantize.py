"""FP8 quantization of token rows: e4m3 values with one float32 scale per token and 128
consecutive channels (DeepSeek-V3's 1x128 activation blocks), for dispatch's quantizers.

The rule, which ``reference.quantize_fp8`` states in plain torch and these kernels match bit
for bit (DeepEP's ``per_token_cast_to_fp8``, with a floor of 2^-119 instead of 1e-4 on the
block's largest magnitude amax, so that small rows keep their precision): with a = max(amax,
2^-119), value = x * (448 / a) rounded to the nearest e4m3 value, ties to even, saturated at
+-448, and scale = a / 448 (both quotients IEEE), or 0 for a block of zeros (whose values are
0). One division per block, a product per channel: the per-channel IEEE division this rule
replaced cost a third of the instructions.

The rounding is done on the float32's bits, not by a conversion instruction, so that the
interpreter (whose float8 conversion rounds some values near a power of two wrongly) and GPUs
give the same bits.
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
# The smallest power of two whose 448 / amax is finite in float32 (448 * 2^119 < 2^128).
AMAX_FLOOR = tl.constexpr(2.0**-119)


@triton.jit
def to_e4m3_bits(v):
    """float32 ``v`` as e4m3fn bits (int32 0..255): to nearest, ties to even; magnitudes past
    448 saturate to 448."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 (from 2^-6): keep 3 mantissa bits, round on the 20 dropped, rebias 127 -> 7.
    # A carry out of the mantissa steps the exponent, as it should.
    kept = magnitude >> 20
    dropped = magnitude & 0xFFFFF
    round_up = (dropped > 0x80000) | ((dropped == 0x80000) & ((kept & 1) == 1))
    normal = tl.minimum(kept + round_up.to(tl.int32) - (120 << 3), 0x7E)
    # Subnormal e4m3: multiples of 2^-9, rounded to even by adding and removing 2^23.
    steps = tl.abs(v) * 512.0
    subnormal = ((steps + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(magnitude >= 0x3C800000, normal, subnormal)


@triton.jit
def quantize_block(
    src_ptr,  # [T, H] bf16/fp16/fp32, row stride src_stride
    src_stride,
    values_ptr,  # out [T, H] e4m3 bits as uint8, row stride values_stride bytes
    values_stride,
    scales_ptr,  # out [T, H / 128] float32, row stride scales_stride
    scales_stride,
    first_row,
    num_rows,  # rows of src: the block's rows past it are left alone
    first_group,  # 128-channel groups [first_group, last_group)
    last_group,
    ROWS: tl.constexpr,  # rows of the block, from first_row
):
    """Quantize rows [first_row, first_row + ROWS) of ``src``, channels of groups
    [first_group, last_group), by the module's rule."""
    rows = first_row + tl.arange(0, ROWS)
    rmask = rows < num_rows
    rows = rows.to(tl.int64)
    channels = tl.arange(0, 128)
    for g in range(first_group, last_group):
        cols = g * 128 + channels
        x = tl.load(src_ptr + rows[:, None] * src_stride + cols[None, :], mask=rmask[:, None])
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        floored = tl.maximum(amax, AMAX_FLOOR)
        scale = tl.where(amax > 0, tl.math.div_rn(floored, E4M3_MAX), 0.0)
        bits = to_e4m3_bits(x * tl.math.div_rn(E4M3_MAX, floored)[:, None])
        tl.store(values_ptr + rows[:, None] * values_stride + cols[None, :], bits.to(tl.uint8),
                 mask=rmask[:, None])  # fmt: skip
        tl.store(scales_ptr + rows * scales_stride + g, scale, mask=rmask)


@triton.jit
def quantize_fp8_kernel(
    x_ptr,  # [T, H] bf16/fp16/fp32, row stride x_stride
    x_stride,
    values_ptr,  # out [T, H] uint8 (the e4m3 bits), contiguous
    scales_ptr,  # out [T, H / 128] float32, contiguous
    num_tokens,
    hidden,
    BLOCK_T: tl.constexpr,  # tokens per program
    GROUPS: tl.constexpr,  # 128-channel groups per program
):
    """The quantization alone (what dispatch's quantizers do), for tests and the benchmark's
    copy rows: program (i, j) takes BLOCK_T tokens from i * BLOCK_T, GROUPS groups from j *
    GROUPS."""
    first = tl.program_id(1) * GROUPS
    quantize_block(
        x_ptr, x_stride, values_ptr, hidden, scales_ptr, hidden // 128,
        tl.program_id(0) * BLOCK_T, num_tokens, first, tl.minimum(first + GROUPS, hidden // 128),
        BLOCK_T,
    )  # fmt: skip
