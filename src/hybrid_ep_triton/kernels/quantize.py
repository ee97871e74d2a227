"""FP8 quantization of token rows: e4m3 values with one float32 scale per token and 128
consecutive channels (DeepSeek-V3's 1x128 activation blocks).

The rule, which ``reference.quantize_fp8`` states in plain torch and these kernels match bit for
bit: scale = amax / 448 (the block's largest magnitude over e4m3's largest value, IEEE division);
value = x / scale rounded to the nearest e4m3 value, ties to even, saturated at +-448; a block
of zeros has scale 0 and values 0.

The rounding is done on the float32's bits, not by a conversion instruction, so that the
interpreter (whose float8 conversion rounds some values near a power of two wrongly) and GPUs
give the same bits.
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)


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
def quantize_fp8_kernel(
    x_ptr,  # [T, H] bf16/fp16/fp32, row stride x_stride
    x_stride,
    values_ptr,  # out [T, H] uint8 (the e4m3 bits), contiguous
    scales_ptr,  # out [T, H / 128] float32, contiguous
    num_tokens,
    hidden,
    BLOCK_T: tl.constexpr,  # tokens per program
    GROUPS: tl.constexpr,  # 128-channel blocks per program
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < num_tokens
    rows = rows.to(tl.int64)
    channels = tl.arange(0, 128)
    num_groups = hidden // 128
    first = tl.program_id(1) * GROUPS
    for g in range(first, tl.minimum(first + GROUPS, num_groups)):
        cols = g * 128 + channels
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=rmask[:, None])
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), E4M3_MAX)
        ratio = tl.where(scale[:, None] > 0, tl.math.div_rn(x, scale[:, None]), 0.0)
        bits = to_e4m3_bits(ratio)
        tl.store(values_ptr + rows[:, None] * hidden + cols[None, :], bits.to(tl.uint8),
                 mask=rmask[:, None])  # fmt: skip
        tl.store(scales_ptr + rows * num_groups + g, scale, mask=rmask)
