"""FP8 quantization of token rows: e4m3 values with one float32 scale per token and 128
consecutive channels (DeepSeek-V3's 1x128 activation blocks), for dispatch's quantizers; and the
block-scaled formats of Blackwell's GEMMs, MXFP8 and NVFP4 (further below).

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

from .primitives import INTERPRETED

# A dispatch launch's QUANTIZE: which quantizer its first programs run (none: rows are moved as
# they are given).
NO_QUANTIZER = tl.constexpr(0)
QUANTIZE_FP8 = tl.constexpr(1)  # quantize_block: e4m3 values, a float32 scale per 128 channels
QUANTIZE_MXFP8 = tl.constexpr(2)
QUANTIZE_NVFP4 = tl.constexpr(3)

# A quantization group: 128 consecutive channels of a row (FP8's 1x128 block, with its scale;
# 4 MXFP8 blocks of 32 channels; 8 NVFP4 blocks of 16).
GROUP_CHANNELS = tl.constexpr(128)
# float32's fields: the mantissa's bits (below the exponent) and their mask, the exponent
# field's mask (after the shift past the mantissa) and its bias. (A kernel that puts one of
# these constants before a tensor in an operation takes its .value: under TRITON_INTERPRET the
# result would stay a tl.constexpr.)
F32_MANTISSA_BITS = tl.constexpr(23)
F32_MANTISSA_MASK = tl.constexpr((1 << F32_MANTISSA_BITS.value) - 1)
F32_EXPONENT_MASK = tl.constexpr(0xFF)
F32_BIAS = tl.constexpr(127)

E4M3_MAX = tl.constexpr(448.0)
E4M3_TINY = tl.constexpr(2.0**-6)  # the smallest normal e4m3 value
E2M1_MAX = tl.constexpr(6.0)
# The smallest power of two whose 448 / amax is finite in float32 (448 * 2^119 < 2^128).
AMAX_FLOOR = tl.constexpr(2.0**-119)


@triton.jit
def to_minifloat_bits(
    v,
    EXPONENT: tl.constexpr,  # exponent bits
    MANTISSA: tl.constexpr,  # mantissa bits
    BIAS: tl.constexpr,  # exponent bias
    LARGEST: tl.constexpr,  # the code of the largest finite magnitude
):
    """float32 ``v`` as the bits (int32) of a float with a sign, EXPONENT and MANTISSA bits:
    to nearest, ties to even; magnitudes past the largest finite one saturate to it."""
    DROPPED: tl.constexpr = F32_MANTISSA_BITS.value - MANTISSA
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> (31 - EXPONENT - MANTISSA)) & (1 << (EXPONENT + MANTISSA))
    magnitude = bits & 0x7FFFFFFF
    # Normal (from 2^(1 - BIAS)): keep MANTISSA bits, round on the dropped ones, rebias 127 ->
    # BIAS. A carry out of the mantissa steps the exponent, as it should.
    kept = magnitude >> DROPPED
    dropped = magnitude & ((1 << DROPPED) - 1)
    half = 1 << (DROPPED - 1)
    round_up = (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
    normal = tl.minimum(kept + round_up.to(tl.int32) - ((F32_BIAS - BIAS) << MANTISSA), LARGEST)
    # Subnormal: multiples of 2^(1 - BIAS - MANTISSA), rounded to even by adding and removing
    # 2^23.
    steps = tl.abs(v) * (1 << (BIAS - 1 + MANTISSA))
    subnormal = ((steps + 8388608.0) - 8388608.0).to(tl.int32)
    smallest_normal = (F32_BIAS + 1 - BIAS) << F32_MANTISSA_BITS  # 2^(1 - BIAS) as float32 bits
    return sign | tl.where(magnitude >= smallest_normal, normal, subnormal)


@triton.jit
def to_e4m3_bits(v):
    """float32 ``v`` as e4m3fn bits (int32 0..255): to nearest, ties to even; magnitudes past
    448 saturate to 448."""
    return to_minifloat_bits(v, 4, 3, 7, 0x7E)


if INTERPRETED:
    e4m3_bits = to_e4m3_bits
else:

    @triton.jit
    def e4m3_bits(v):
        """to_e4m3_bits() by the conversion instruction (cvt.rn.satfinite, the same rounding
        and saturation for finite values), for code where the per-element arithmetic of the
        bit rounding is the cost; the interpreter keeps the bit rounding (its float8
        conversion rounds some values near a power of two wrongly)."""
        return (
            tl.inline_asm_elementwise(
                "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, $1, $1; "
                "cvt.u32.u16 $0, pair; }",
                "=r,r",
                [v],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
            & 0xFF
        )


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
    channels = tl.arange(0, GROUP_CHANNELS)
    for g in range(first_group, last_group):
        cols = g * GROUP_CHANNELS + channels
        x = tl.load(src_ptr + rows[:, None] * src_stride + cols[None, :], mask=rmask[:, None])
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        floored = tl.maximum(amax, AMAX_FLOOR)
        scale = tl.where(amax > 0, tl.math.div_rn(floored, E4M3_MAX), 0.0)
        bits = to_e4m3_bits(x * tl.math.div_rn(E4M3_MAX, floored)[:, None])
        tl.store(
            values_ptr + rows[:, None] * values_stride + cols[None, :],
            bits.to(tl.uint8),
            mask=rmask[:, None],
        )
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
        x_ptr,
        x_stride,
        values_ptr,
        hidden,
        scales_ptr,
        hidden // GROUP_CHANNELS,
        tl.program_id(0) * BLOCK_T,
        num_tokens,
        first,
        tl.minimum(first + GROUPS, hidden // GROUP_CHANNELS),
        BLOCK_T,
    )


# -- MXFP8 and NVFP4 -------------------------------------------------------------------------
#
# The rules are torchao 0.18's, which ``reference.quantize_mxfp8`` and
# ``reference.quantize_nvfp4`` state in plain torch (and their docstrings in words); these
# quantizers match them bit for bit. Both take the calling shape of ``quantize_block``: rows
# [first_row, first_row + ROWS) of ``src``, the 128-channel groups [first_group, last_group) of
# each (4 MXFP8 blocks of 32 channels, or 8 NVFP4 blocks of 16), and write row-major bytes: one
# row of values and one row of scales per token row, each with its own row stride in bytes. The
# largest magnitude of a block is an integer maximum of the float32 bits with the sign cleared:
# exact, and NaN (whose bits exceed infinity's) wins on every target, where a float maximum
# would drop it on GPUs and keep it in the interpreter.


@triton.jit
def e8m0_from_amax_bits(amax_bits):
    """The biased E8M0 scale (int32 0..247, or 255) of an MXFP8 block whose largest magnitude
    has the float32 bits ``amax_bits`` (sign cleared): its exponent field - 127 - 8 (e4m3's
    largest power of two is 2^8), clamped below at -127, plus 127; 255 for a NaN. The clamp above
    (128) is never reached: an infinite amax gives 247."""
    biased = tl.maximum(((amax_bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK) - 8, 0)
    return tl.where(amax_bits > 0x7F800000, 255, biased)


@triton.jit
def quantize_mxfp8_block(
    src_ptr,  # [T, H] bf16/fp16/fp32, row stride src_stride
    src_stride,
    values_ptr,  # out [T, H] e4m3 bits as uint8, row stride values_stride bytes
    values_stride,
    scales_ptr,  # out [T, H / 32] E8M0 bytes as uint8, row stride scales_stride bytes
    scales_stride,
    first_row,
    num_rows,  # rows of src: the block's rows past it are left alone
    first_group,  # 128-channel groups [first_group, last_group): 4 scales each
    last_group,
    ROWS: tl.constexpr,  # rows of the block, from first_row
):
    """MXFP8 rows [first_row, first_row + ROWS) of ``src``, channels of groups [first_group,
    last_group): torchao's to_mx with ScaleCalculationMode.FLOOR (``reference.quantize_mxfp8``).
    The division by the block's power of two, at least 2^-126, is a product with its reciprocal
    (a power of two from 2^-120 to 2^126): the same float32."""
    rows = first_row + tl.arange(0, ROWS)
    rmask = rows < num_rows
    rows = rows.to(tl.int64)
    blocks = tl.arange(0, 4)
    channels = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [4, 32]
    for g in range(first_group, last_group):
        cols = g * GROUP_CHANNELS + channels
        x = tl.load(
            src_ptr + rows[:, None, None] * src_stride + cols[None, :, :], mask=rmask[:, None, None]
        )
        x = x.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        biased = e8m0_from_amax_bits(tl.max(magnitude, axis=2))  # [ROWS, 4]
        finite = biased != 255
        reciprocal = (2 * F32_BIAS.value - tl.maximum(biased, 1)) << F32_MANTISSA_BITS
        reciprocal = reciprocal.to(tl.float32, bitcast=True)
        reciprocal = tl.where(finite, reciprocal, 1.0)
        quantized = to_e4m3_bits(x * reciprocal[:, :, None])
        # A block with a NaN is divided by infinity (byte 255 as float32): +-0, and NaN where x
        # is NaN or infinite.
        sign = (bits >> 24) & 0x80
        over_infinity = sign | tl.where(magnitude >= 0x7F800000, 0x7F, 0)
        quantized = tl.where(finite[:, :, None], quantized, over_infinity)
        tl.store(
            values_ptr + rows[:, None, None] * values_stride + cols[None, :, :],
            quantized.to(tl.uint8),
            mask=rmask[:, None, None],
        )
        tl.store(
            scales_ptr + rows[:, None] * scales_stride + (g * 4 + blocks)[None, :],
            biased.to(tl.uint8),
            mask=rmask[:, None],
        )


@triton.jit
def to_e2m1_bits(v):
    """float32 ``v`` as an e2m1 nibble (int32 0..15, 8 the sign): to nearest, ties to even;
    magnitudes past 6 saturate to 6 (NaN too)."""
    return to_minifloat_bits(v, 2, 1, 1, 7)


@triton.jit
def quantize_nvfp4_block(
    src_ptr,  # [T, H] bf16/fp16/fp32, row stride src_stride
    src_stride,
    values_ptr,  # out [T, H / 2] e2m1 pairs as uint8 (even channel low), row stride in bytes
    values_stride,
    scales_ptr,  # out [T, H / 16] e4m3 bits as uint8, row stride scales_stride bytes
    scales_stride,
    per_tensor_scale_ptr,  # float32 scalar s, read if PER_TENSOR_SCALE
    first_row,
    num_rows,  # rows of src: the block's rows past it are left alone
    first_group,  # 128-channel groups [first_group, last_group): 8 scales, 64 bytes each
    last_group,
    ROWS: tl.constexpr,  # rows of the block, from first_row
    PER_TENSOR_SCALE: tl.constexpr,  # False: s = 1 (torchao's per_tensor_scale=None)
):
    """NVFP4 rows [first_row, first_row + ROWS) of ``src``, channels of groups [first_group,
    last_group): torchao's nvfp4_quantize (``reference.quantize_nvfp4``), its divisions IEEE
    (div_rn) and its products as there: b = amax / 6, scale = e4m3(clamp(b [/ s], 2^-6, 448)),
    value = e2m1(x * ((1 [/ s]) / scale))."""
    rows = first_row + tl.arange(0, ROWS)
    rmask = rows < num_rows
    rows = rows.to(tl.int64)
    blocks = tl.arange(0, 8)
    pairs = tl.arange(0, 8)
    # Channel 16 * block + 2 * pair + half of a group, [8, 8, 2].
    channels = (
        blocks[:, None, None] * 16 + pairs[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    )
    bytes_ = blocks[:, None] * 8 + pairs[None, :]  # [8, 8]
    if PER_TENSOR_SCALE:
        s = tl.load(per_tensor_scale_ptr)
        numerator = tl.math.div_rn(1.0, s)
    for g in range(first_group, last_group):
        cols = g * GROUP_CHANNELS + channels
        x = tl.load(
            src_ptr + rows[:, None, None, None] * src_stride + cols[None, :, :, :],
            mask=rmask[:, None, None, None],
        )
        x = x.to(tl.float32)
        magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax = tl.max(tl.max(magnitude, axis=3), axis=2).to(tl.float32, bitcast=True)
        block_scale = tl.math.div_rn(amax, E2M1_MAX)  # [ROWS, 8]
        if PER_TENSOR_SCALE:
            block_scale = tl.math.div_rn(block_scale, s)
        scale_bits = to_e4m3_bits(tl.minimum(tl.maximum(block_scale, E4M3_TINY), E4M3_MAX))
        # The e4m3 scale as float32 (a normal e4m3 value: rebias 7 -> 127).
        scale = (scale_bits << (F32_MANTISSA_BITS - 3)) + ((F32_BIAS - 7) << F32_MANTISSA_BITS)
        scale = scale.to(tl.float32, bitcast=True)
        if PER_TENSOR_SCALE:
            reciprocal = tl.math.div_rn(numerator, scale)
        else:
            reciprocal = tl.math.div_rn(1.0, scale)
        codes = to_e2m1_bits(x * reciprocal[:, :, None, None])
        low, high = tl.split(codes)
        packed = low | (high << 4)
        tl.store(
            values_ptr + rows[:, None, None] * values_stride + (g * 64 + bytes_)[None, :, :],
            packed.to(tl.uint8),
            mask=rmask[:, None, None],
        )
        tl.store(
            scales_ptr + rows[:, None] * scales_stride + (g * 8 + blocks)[None, :],
            scale_bits.to(tl.uint8),
            mask=rmask[:, None],
        )


@triton.jit
def quantize_block_scaled_kernel(
    x_ptr,  # [T, H] bf16/fp16/fp32, row stride x_stride
    x_stride,
    values_ptr,  # out uint8, contiguous: [T, H] e4m3 bits (MXFP8), [T, H / 2] e2m1 pairs (NVFP4)
    scales_ptr,  # out uint8, contiguous: [T, H / 32] E8M0 bytes (MXFP8), [T, H / 16] e4m3 bits
    per_tensor_scale_ptr,  # float32 scalar, read if NVFP4 and PER_TENSOR_SCALE
    num_tokens,
    hidden,
    BLOCK_T: tl.constexpr,  # tokens per program
    GROUPS: tl.constexpr,  # 128-channel groups per program
    NVFP4: tl.constexpr,  # False: MXFP8
    PER_TENSOR_SCALE: tl.constexpr,
):
    """MXFP8 or NVFP4 quantization alone, for tests and the benchmark: program (i, j) takes
    BLOCK_T tokens from i * BLOCK_T, GROUPS groups from j * GROUPS."""
    first_row = tl.program_id(0) * BLOCK_T
    first = tl.program_id(1) * GROUPS
    last = tl.minimum(first + GROUPS, hidden // GROUP_CHANNELS)
    if NVFP4:
        quantize_nvfp4_block(
            x_ptr,
            x_stride,
            values_ptr,
            hidden // 2,
            scales_ptr,
            hidden // 16,
            per_tensor_scale_ptr,
            first_row,
            num_tokens,
            first,
            last,
            BLOCK_T,
            PER_TENSOR_SCALE,
        )
    else:
        quantize_mxfp8_block(
            x_ptr,
            x_stride,
            values_ptr,
            hidden,
            scales_ptr,
            hidden // 32,
            first_row,
            num_tokens,
            first,
            last,
            BLOCK_T,
        )
