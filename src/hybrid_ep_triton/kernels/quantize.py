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
GROUP = tl.constexpr(128)  # channels that share a scale (planner.FP8_GROUP)
GROUP_WORDS = tl.constexpr(32)  # int32 words of a group's e4m3 values, 4 a word


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
def group_scales(groups):
    """The scales of ``groups`` [M, G, GROUP] float32: each group's amax / 448, IEEE division."""
    return tl.math.div_rn(tl.max(tl.abs(groups), axis=2), E4M3_MAX)


@triton.jit
def e4m3_words(x, GROUPS: tl.constexpr):
    """Rows ``x`` [M, GROUPS * GROUP] float32 (whole groups) quantized, as the kernels move FP8
    rows: (value words [M, GROUPS * GROUP_WORDS] int32, the e4m3 value of channel 4w + j in
    bits 8j of word w, as a little-endian view of the bytes has it; scales [M, GROUPS]
    float32)."""
    M: tl.constexpr = x.shape[0]
    groups = tl.reshape(x, [M, GROUPS, GROUP])
    scales = group_scales(groups)
    ratio = tl.where(scales[:, :, None] > 0, tl.math.div_rn(groups, scales[:, :, None]), 0.0)
    value_bytes = tl.reshape(to_e4m3_bits(ratio), [M, GROUPS * GROUP_WORDS, 4])
    # The bytes' bit fields do not overlap: their sum is the word (wrapping past the sign bit).
    words = tl.sum(value_bytes << (8 * tl.arange(0, 4))[None, None, :], axis=2)
    return words, scales


@triton.jit
def quantize_fp8_kernel(
    x_ptr,  # [T, H] bf16/fp16/fp32, row stride x_stride
    x_stride,
    values_ptr,  # out [T, H / 4] int32: the e4m3 values' bytes as words, contiguous
    scales_ptr,  # out [T, H / 128] float32, contiguous
    num_tokens,
    hidden,
    BLOCK_T: tl.constexpr,  # tokens per program
    GROUPS: tl.constexpr,  # 128-channel blocks per program
):
    """The quantizer as a pass of its own (the benchmark's quantizing copy): the arithmetic
    that dispatch's senders do as they read rows (kernels/dispatch.py), one group at a time."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < num_tokens
    rows = rows.to(tl.int64)
    channels = tl.arange(0, GROUP)
    num_groups = hidden // GROUP
    first = tl.program_id(1) * GROUPS
    for g in range(first, tl.minimum(first + GROUPS, num_groups)):
        x = tl.load(x_ptr + rows[:, None] * x_stride + g * GROUP + channels[None, :],
                    mask=rmask[:, None])  # fmt: skip
        words, scales = e4m3_words(x.to(tl.float32), 1)
        word = g * GROUP_WORDS + tl.arange(0, GROUP_WORDS)
        tl.store(values_ptr + rows[:, None] * (hidden // 4) + word[None, :], words,
                 mask=rmask[:, None])  # fmt: skip
        tl.store(scales_ptr + rows[:, None] * num_groups + g + tl.arange(0, 1)[None, :], scales,
                 mask=rmask[:, None])  # fmt: skip
