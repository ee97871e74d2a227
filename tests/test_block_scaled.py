"""MXFP8 and NVFP4 rows (one process): the Triton quantizers (kernels/quantize.py, through
ops.quantize) against the plain-torch reference (reference.quantize_mxfp8 / quantize_nvfp4), bit
for bit, on awkward rows and on any finite bit patterns; the reference against torchao 0.18,
whose rules it follows (where torchao is installed: `nox -s tests` installs it); the error of a
round trip; the scale layouts; refused shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_ep_triton import reference
from hybrid_ep_triton.ops import quantize as ops

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# By float dtype: its bits as an integer dtype, and the mask of its sign and mantissa bits (an
# exponent of zero: a subnormal).
_BITS = {
    torch.bfloat16: (torch.int16, -(2**15) | 0x7F),
    torch.float16: (torch.int16, -(2**15) | 0x3FF),
    torch.float32: (torch.int32, -(2**31) | 0x7FFFFF),
}


def _flush_bf16_subnormals(x: torch.Tensor, device: str) -> torch.Tensor:
    """Triton 3.9's interpreter converts every bf16 subnormal to float32 wrongly (GPUs convert
    them exactly); in a block of small enough values that shows (MXFP8 divides such blocks by
    2^-126), so bf16 rows on CPU get +-0 instead."""
    if device == "cuda" or x.dtype != torch.bfloat16:
        return x
    tiny = x.float().abs() < 2.0**-126
    return torch.where(tiny, x * 0, x)


def _awkward_rows(num: int, hidden: int, dtype: torch.dtype, gen, device: str) -> torch.Tensor:
    """Rows over every magnitude of ``dtype`` (one scale per row, logarithmically spaced), with
    a zero block, a row of zeros, subnormals, -0.0, the dtype's largest magnitudes, a block of
    subnormals only, e2m1 and e4m3 ties and values past saturation."""
    info = torch.finfo(dtype)
    low, high = torch.log10(torch.tensor(info.tiny)), torch.log10(torch.tensor(info.max)) - 1
    scale = torch.logspace(float(low), float(high), num)[:, None]
    x = (torch.randn(num, hidden, generator=gen) * scale).to(dtype)
    x[0, :32] = 0.0
    x[1] = 0.0
    specials = [info.smallest_normal / 3, -info.smallest_normal / 5, -0.0, info.max, -info.max]
    x[2, 3:8] = torch.tensor(specials).to(dtype)
    x[3, 32:64] = (torch.arange(1, 33) * info.smallest_normal / 64).to(dtype)  # subnormals only
    # Multiples of 1/4 up to 8 (e2m1 ties at scale 1) and values around 448 (e4m3 ties, past
    # its largest value) with amax 510: MXFP8 scale 2^0, NVFP4 scale e4m3(85) = 88.
    x[4, :64] = (torch.arange(-32, 32) * 0.25).to(dtype)
    x[5, :32] = torch.tensor([440.0, 456, 448, 464, 480, 500, 510, -449] * 4).to(dtype)
    return _flush_bf16_subnormals(x, device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = _bytes(got).cpu(), _bytes(want).cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} bytes differ, first at {bad[:5].tolist()}: "
        f"{got[tuple(bad[:5].t())].tolist()} != {want[tuple(bad[:5].t())].tolist()}"
    )


def _check_mxfp8(x: torch.Tensor, device: str) -> None:
    values, scales = ops.quantize_mxfp8(x.to(device))
    assert (values.dtype, scales.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    want_values, want_scales = reference.quantize_mxfp8(x)
    _assert_same_bytes(scales, want_scales, "MXFP8 scales")
    # NaN values: e4m3fn has two (0x7F, 0xFF), and which sign a NaN gets is not specified.
    values, want_values = _bytes(values).cpu(), _bytes(want_values)
    nan = ((values & 0x7F) == 0x7F) & ((want_values & 0x7F) == 0x7F)
    _assert_same_bytes(
        torch.where(nan, 0x7F, values), torch.where(nan, 0x7F, want_values), "MXFP8 values"
    )


def _check_nvfp4(x: torch.Tensor, per_tensor_scale, device: str) -> None:
    scale = None if per_tensor_scale is None else per_tensor_scale.to(device)
    values, scales = ops.quantize_nvfp4(x.to(device), scale)
    assert (values.dtype, scales.dtype) == (torch.float4_e2m1fn_x2, torch.float8_e4m3fn)
    want_values, want_scales = reference.quantize_nvfp4(x, per_tensor_scale)
    _assert_same_bytes(scales, want_scales, "NVFP4 scales")
    _assert_same_bytes(values, want_values, "NVFP4 values")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_quantizer_matches_reference(device, dtype):
    """Awkward rows (37 tokens, 384 channels), infinities and NaN included: the kernel and the
    reference give the same bytes."""
    x = _awkward_rows(37, 384, dtype, torch.Generator().manual_seed(1), device)
    x[6, 0], x[6, 33], x[6, 40] = float("inf"), -float("inf"), 1.0  # saturate, scale 247
    x[7, 1], x[7, 2], x[7, 3], x[7, 4] = float("nan"), float("inf"), -2.0, 0.0  # scale 255
    _check_mxfp8(x, device)
    _, scales = reference.quantize_mxfp8(x)
    assert _bytes(scales)[1].tolist() == [0] * 12  # a row of zeros: the smallest exponent
    assert _bytes(scales)[5, 0] == 127 and _bytes(scales)[6, 0] == 247
    assert _bytes(scales)[6, 1] == 247 and _bytes(scales)[7, 0] == 255


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "per_tensor_scale", [None, 0.37, 2.0**-100, 1e20], ids=["none", "0.37", "2^-100", "1e20"]
)
def test_nvfp4_quantizer_matches_reference(device, dtype, per_tensor_scale):
    """Awkward rows (37 tokens, 384 channels), infinities included, with and without a
    per-tensor scale (one that puts scales in e4m3's range, and two that clamp them at 448 and
    at 2^-6): the kernel and the reference give the same bytes."""
    x = _awkward_rows(37, 384, dtype, torch.Generator().manual_seed(2), device)
    x[6, 0], x[6, 17], x[6, 40] = float("inf"), -float("inf"), 1.0
    s = None if per_tensor_scale is None else torch.tensor(per_tensor_scale)
    _check_nvfp4(x, s, device)
    if per_tensor_scale is None:
        values, scales = reference.quantize_nvfp4(x)
        assert (_bytes(scales)[1] == 0x08).all() and (_bytes(values)[1] == 0).all()  # 2^-6, 0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(DTYPES),
    num_tokens=st.integers(1, 5),
    groups=st.integers(1, 2),
    per_tensor_scale=st.sampled_from([None, 1.0, 3e-3, 2.0**-60, 2.0**60]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantizers_match_reference_on_any_finite_bits(
    device, dtype, num_tokens, groups, per_tensor_scale, seed
):
    """Rows of uniformly random bit patterns (non-finite ones made 0: ties, the largest
    magnitudes, -0.0 all occur), every third 32-channel block scaled down by 2^-40 and another
    of the dtype's subnormals only: both kernels give the reference's bytes."""
    gen = torch.Generator().manual_seed(seed)
    ints, subnormal = _BITS[dtype]
    info = torch.iinfo(ints)
    bits = torch.randint(info.min, info.max, (num_tokens, groups * 4, 32), generator=gen)
    bits = bits.to(ints)
    bits[:, 1::3] &= subnormal
    x = bits.view(dtype).view(num_tokens, groups * 128)
    x = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
    blocks = x.view(num_tokens, groups * 4, 32)
    blocks[:, ::3] = (blocks[:, ::3].float() * 2**-40).to(dtype)
    x = _flush_bf16_subnormals(x, device)
    _check_mxfp8(x, device)
    _check_nvfp4(x, None if per_tensor_scale is None else torch.tensor(per_tensor_scale), device)


def test_quantizers_on_odd_token_counts_and_strided_rows(device):
    """1, 17 and 33 tokens (tails of the kernels' 16-token blocks), rows of a wider tensor (a
    row stride past the hidden size), and no tokens at all."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(33, 384, generator=gen).to(torch.bfloat16)
    for x in (wide[:1, :256], wide[:17, 128:], wide[:, :128], wide[:0]):
        _check_mxfp8(x, device)
        _check_nvfp4(x, torch.tensor(0.01), device)
        assert ops.quantize_mxfp8(x.to(device))[0].shape == x.shape


def _relu(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(min=0)


def test_round_trips_within_the_formats_error():
    """dequantize(quantize(x)) against x, per element: MXFP8 within e4m3's half step (2^-4
    relative, 2^-10 of the block's scale below e4m3's normals) or, past 448 times the scale,
    saturated; NVFP4 within e2m1's (1/4 relative, 1/4 of the block's scale below 1) or
    saturated at 6 times it."""
    x = _awkward_rows(37, 384, torch.float32, torch.Generator().manual_seed(4), "cpu")
    x = x[(x.abs().amax(dim=1) > 2.0**-100)]  # MXFP8 divides blocks below 2^-118 by 2^-126
    values, scales = reference.quantize_mxfp8(x)
    scale = scales.float().repeat_interleave(32, dim=1)
    err = (reference.dequantize_mxfp8(values, scales) - x).abs()
    bound = (x.abs() * 2**-4 + scale * 2**-10).maximum(x.abs() - 448 * scale)
    assert (err <= bound).all()
    # A block of amax 300 has scale 2^0 and keeps all its values, one of 500 saturates at 448.
    assert (_relu(x.abs() - 448 * scale) > 0).any()
    for per_tensor_scale in (None, torch.tensor(0.37)):
        values, scales = reference.quantize_nvfp4(x, per_tensor_scale)
        total = scales.float() * (1.0 if per_tensor_scale is None else per_tensor_scale)
        total = total.repeat_interleave(16, dim=1)
        err = (reference.dequantize_nvfp4(values, scales, per_tensor_scale) - x).abs()
        bound = (x.abs() / 4 + total / 4).maximum(x.abs() - 6 * total) * (1 + 2**-20)
        assert (err <= bound).all()
    assert torch.equal(
        reference.quantize_nvfp4(torch.zeros(1, 16))[0].view(torch.uint8),
        torch.zeros(1, 8, dtype=torch.uint8),
    )


def test_mxfp8_tiny_blocks_divide_by_2_to_the_minus_126():
    """torchao's floor on the MXFP8 divisor: a block of amax below 2^-118 has E8M0 byte 0
    (2^-127) but its values are x * 2^126, so that it dequantizes to half of x."""
    x = torch.full((1, 32), 2.0**-120)
    values, scales = reference.quantize_mxfp8(x)
    assert _bytes(scales).item() == 0 and (values.float() == 64.0).all()
    assert (reference.dequantize_mxfp8(values, scales) == 2.0**-121).all()


def test_nvfp4_packs_the_even_channel_in_the_low_nibble():
    """Channels (0.5, -6) in one byte: 0xF1 (e2m1 0.5 is 1, -6 is 15), as torchao's pack_uint4
    and torch's float4_e2m1fn_x2 test helpers pack them; scale 1 (e4m3 0x38)."""
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([0.5, -6.0])
    values, scales = reference.quantize_nvfp4(x)
    assert _bytes(values)[0, 0] == 0xF1 and _bytes(scales).item() == 0x38
    assert torch.equal(reference.dequantize_nvfp4(values, scales), x)


def test_blocked_scales_layout():
    """to_blocked_scales: tiles of 128 rows and 4 columns, padded with zero bytes; in a tile,
    (row r, column c) at byte (r % 32) * 16 + (r // 32) * 4 + c."""
    scales = torch.randint(0, 255, (130, 6), dtype=torch.uint8)
    blocked = reference.to_blocked_scales(scales.view(torch.float8_e8m0fnu))
    assert blocked.shape == (256, 8) and blocked.dtype == torch.float8_e8m0fnu
    flat = _bytes(blocked).flatten()
    for r, c in ((0, 0), (1, 0), (33, 2), (127, 3), (128, 0), (129, 5), (5, 4)):
        tile = (r // 128) * 2 + c // 4
        at = tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert flat[at] == scales[r, c], (r, c)
    assert int(flat.sum()) == int(scales.sum())  # the rest is padding


def test_refused_shapes_and_scales():
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.quantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        reference.quantize_nvfp4(torch.zeros(2, 40))
    for bad in (torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(float("inf")), torch.ones(2)):
        with pytest.raises(ValueError, match="per_tensor_scale"):
            reference.quantize_nvfp4(torch.zeros(2, 32), bad)
    # The kernels work in 128-channel groups, on rows of a float dtype.
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.quantize_fp8(torch.zeros(2, 192))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        ops.quantize_fp8(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.quantize_mxfp8(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.quantize_nvfp4(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="per_tensor_scale"):
        ops.quantize_nvfp4(torch.zeros(2, 128), torch.tensor(1.0, dtype=torch.float64))


def test_reference_matches_torchao():
    """The reference against torchao 0.18's own quantizers, bit for bit (values and scales),
    and its dequantization: to_mx(x, float8_e4m3fn, 32, FLOOR), nvfp4_quantize(x, 16, s) with s
    None or given, to_blocked. bf16 and float32 rows (what torchao takes)."""
    pytest.importorskip(
        "torchao.prototype.mx_formats", reason="torchao is not installed (nox -s tests has it)"
    )
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize
    from torchao.prototype.mx_formats.utils import to_blocked

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        x = _awkward_rows(37, 384, dtype, gen, "cpu")
        x[6, 0], x[6, 33] = float("inf"), -float("inf")
        y = x.clone()
        y[7, 1], y[7, 2] = float("nan"), float("inf")
        scales, data = to_mx(y, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
        values, want_scales = reference.quantize_mxfp8(y)
        assert torch.equal(_bytes(scales), _bytes(want_scales))
        nan = data.isnan() & values.float().isnan()
        assert torch.equal(_bytes(values)[~nan], _bytes(data)[~nan])
        dequantized = data.float().view(37, 12, 32) * get_fp_scale(scales)[:, :, None]
        assert torch.equal(
            reference.dequantize_mxfp8(values, want_scales).nan_to_num(),
            dequantized.view(37, 384).nan_to_num(),
        )
        blocked = to_blocked(scales).view(torch.uint8)
        assert torch.equal(_bytes(reference.to_blocked_scales(scales)).flatten(), blocked)
        for s in (None, torch.tensor(0.37), torch.tensor(2.0**-100), torch.tensor(1e20)):
            scales, data = nvfp4_quantize(x, 16, s)
            values, want_scales = reference.quantize_nvfp4(x, s)
            assert torch.equal(_bytes(scales), _bytes(want_scales))
            assert torch.equal(_bytes(values), data)
            want = NVFP4Tensor(data, scales, 16, torch.float32, s).dequantize(torch.float32)
            assert torch.equal(reference.dequantize_nvfp4(values, want_scales, s), want)
