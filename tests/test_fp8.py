"""FP8 dispatch (``Buffer.dispatch`` with an (e4m3 values, scales) pair, or ``quantize=True``)
against the plain-torch reference, bit for bit: the reference quantizer
(``reference.quantize_fp8``), then ``reference.dispatch`` of the values (as bytes) and of the
scales, which lays rows out exactly as bf16 rows would be (padding: values 0, scales 0).

One Buffer per spawn runs its cases in order (as in test_dispatch_combine): FP8 pairs and
quantized rows, exact mode and max_recv_tokens, pad_multiple, -1 slots, empty ranks, odd token
counts, FP8 rows along a handle of a bf16 dispatch and bf16 rows along an FP8 one, and a
combine (in the Buffer's dtype) after an FP8 dispatch. With 2 ranks also the gradients of
quantize=True dispatches of rows that require grad (straight through the quantization); on GPUs
also dispatches of the format (pairs, and quantize=format) replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_no_failures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.ops.quantize import quantize_fp8
from hybrid_ep_triton.ops.scaled_rows import ScaledValues
from hybrid_ep_triton.runtime.planner import SCALED_FORMATS
from hybrid_ep_triton.tools.launcher import rank_device

MAX_TOKENS = 9


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte values or scales as uint8 (the reference dispatches bytes); float32 as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


QUANTIZERS, DEQUANTIZERS = reference.QUANTIZERS, reference.DEQUANTIZERS


def _awkward_rows(num: int, hidden: int, gen) -> torch.Tensor:
    """bf16 rows over many magnitudes, with a zero block, a row of zeros, subnormal bf16
    values, -0.0 and values at the largest bf16 magnitudes."""
    scale = torch.logspace(-30, 30, num)[:, None] if num else torch.ones(0, 1)
    x = (torch.randn(num, hidden, generator=gen) * scale).to(torch.bfloat16)
    if num >= 4:
        x[0, :128] = 0.0
        x[1] = 0.0
        x[2, 3:9] = torch.tensor([1e-40, -1e-40, -0.0, 3e38, -3e38, 2.0**-133])
    return x


def _quantize(x: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.quantize_fp8 (kernels/quantize.py's quantizer) on ``x`` [T, H], run on ``device``:
    (e4m3 bits [T, H] uint8, scales [T, H / 128] float32), copied back to the CPU."""
    values, scales = quantize_fp8(x.to(device))
    assert (values.dtype, scales.dtype) == (torch.float8_e4m3fn, torch.float32)
    return values.view(torch.uint8).cpu(), scales.cpu()


def _assert_quantized_as_reference(x: torch.Tensor, values, scales) -> None:
    want_values, want_scales = reference.quantize_fp8(x)
    assert torch.equal(scales, want_scales)
    bad = (values != want_values.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} values differ, first {bad[:5].tolist()}"


def test_quantizer_matches_reference(device):
    """The quantizing kernel against reference.quantize_fp8, bit for bit (one process), also
    where a row's 128-channel groups outnumber a program's (1152 channels: 8 and 1)."""
    wide = _awkward_rows(19, 1152, torch.Generator().manual_seed(5))
    _assert_quantized_as_reference(wide, *_quantize(wide, device))
    x = _awkward_rows(37, 384, torch.Generator().manual_seed(0))
    values, scales = _quantize(x, device)
    _assert_quantized_as_reference(x, values, scales)
    want_values, want_scales = reference.quantize_fp8(x)
    assert (values[1] == 0).all() and (scales[1] == 0).all()  # a zero row: zeros, scale 0
    # Within e4m3's relative precision of the input.
    err = (reference.dequantize_fp8(want_values, want_scales) - x.float()).abs()
    assert (err <= x.float().abs() * 2**-4 + want_scales.repeat_interleave(128, 1) * 2**-9).all()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    num_tokens=st.integers(1, 5),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantizer_matches_reference_on_any_finite_bits(device, dtype, num_tokens, groups, seed):
    """Rows of uniformly random bit patterns (non-finite ones made 0: ties, the largest
    magnitudes, -0.0 all occur), one block in three scaled down by 2^-40 and another of
    subnormals only: the kernel and the reference give the same bits (one process)."""
    gen = torch.Generator().manual_seed(seed)
    ints, subnormal = _BITS[dtype]
    info = torch.iinfo(ints)
    bits = torch.randint(info.min, info.max, (num_tokens, groups, 128), generator=gen).to(ints)
    # Blocks of subnormals only (fp32: amax below the floor, 2^-119). Not bf16's on CPU:
    # Triton 3.9's interpreter converts bf16 subnormals to float32 wrongly (-1.0286e-38 as
    # -8.8e-39; GPUs convert them exactly), which only shows in a block of nothing else.
    if device == "cuda" or dtype != torch.bfloat16:
        bits[:, 1::3] &= subnormal
    x = bits.view(dtype).view(num_tokens, 128 * groups)
    x = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
    blocks = x.view(num_tokens, groups, 128)
    blocks[:, ::3] = (blocks[:, ::3].float() * 2**-40).to(dtype)
    _assert_quantized_as_reference(x, *_quantize(x, device))


# By float dtype: its bits as an integer dtype, and the mask of its sign and mantissa bits (an
# exponent of zero: a subnormal).
_BITS = {
    torch.bfloat16: (torch.int16, -(2**15) | 0x7F),
    torch.float16: (torch.int16, -(2**15) | 0x3FF),
    torch.float32: (torch.int32, -(2**31) | 0x7FFFFF),
}


def test_fp8_values_read_as_dequantized_rows():
    """ScaledValues (one process): torch sees [N, H] bf16 rows, the reference's dequantized ones;
    detach keeps the FP8 data; dequantize() passes the gradient through; writes are refused."""
    fp8, scales = reference.quantize_fp8(_awkward_rows(5, 256, torch.Generator().manual_seed(3)))
    values = ScaledValues(fp8, scales, SCALED_FORMATS["fp8"], torch.bfloat16).requires_grad_()
    want = reference.dequantize_fp8(fp8, scales).to(torch.bfloat16)
    assert (values.shape, values.dtype) == (fp8.shape, torch.bfloat16)
    assert torch.equal(values * 1, want) and type(values * 1) is torch.Tensor
    detached = values.detach()
    assert (
        type(detached) is ScaledValues and detached.quantized is fp8 and detached.scales is scales
    )
    grad = torch.randn(want.shape).to(torch.bfloat16)
    (values.dequantize().float() * grad).sum().backward()
    assert values.grad.dtype == torch.bfloat16 and torch.equal(values.grad, grad)
    with pytest.raises(RuntimeError, match="read-only"):
        detached.mul_(2)
    with pytest.raises(RuntimeError, match="read-only"):
        torch.add(want, want, out=detached)


def test_reference_quantizer_refuses_hidden_not_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        reference.quantize_fp8(torch.zeros(2, 100))


# (name, tokens per rank, topk, unused_prob, pad_multiple, recv, source)
# recv: "exact" or "more" (max_recv_tokens = needed + 3: zero tail). source: "pair" (FP8 rows
# given), "quantize" (bf16 rows quantized by the kernels), "pair_on_bf16_handle" (a bf16
# dispatch, then FP8 rows along its handle), "bf16_on_fp8_handle" (the other way round).
CASES = [
    ("pair", (5, 8, 1, 9), 2, 0.0, 1, "exact", "pair"),
    ("quantize_unused_pad3_zero_tail", (9, 3, 7, 0), 3, 0.3, 3, "more", "quantize"),
    ("pair_on_bf16_handle_empty_rank", (0, 7, 4, 6), 2, 0.2, 1, "exact", "pair_on_bf16_handle"),
    ("bf16_on_fp8_handle_zero_tail", (7, 9, 2, 5), 1, 0.0, 1, "more", "bf16_on_fp8_handle"),
]


def _rank_body(
    rank: int,
    world: int,
    expand: bool,
    ranks_per_node: int | None,
    hidden: int,
    cases: tuple,
    fmt: str = "fp8",
) -> list[str]:
    failures: list[str] = []
    group = dist.group.WORLD
    dev = rank_device()
    num_experts = 8
    buf = Buffer(
        None,
        hidden_size=hidden,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=num_experts,
        expand=expand,
        ranks_per_node=ranks_per_node,
        device=dev,
    )
    try:
        if world == 2 and expand and fmt == "fp8":
            failures += _refused_calls(buf, dev, hidden)
        if world == 2 and expand and hidden % 128 == 0:
            failures += _compiled_matches_eager(buf, dev, hidden, rank, fmt)
        if world == 2 and hidden % 128 == 0:  # (quantize needs whole 128-channel groups)
            failures += _gradients_match_reference(buf, dev, hidden, rank, expand, fmt)
        if dev.type == "cuda":
            failures += _graph_replays_match_eager(buf, dev, hidden, rank, world, fmt)
        for index in cases:
            name, tokens, topk, unused, pad, recv, source = CASES[index]
            if not expand:
                pad = 1
            gen = torch.Generator().manual_seed(1000 * index + rank)
            num_tokens = tokens[rank % len(tokens)]
            x = _awkward_rows(num_tokens, hidden, gen)
            if fmt != "fp8" and dev.type == "cpu":
                # Triton's interpreter reads subnormal bf16 wrongly (GPUs do not): flushed, as
                # in test_block_scaled (the FP8 quantizer's amax floor hides them).
                x = torch.where(x.float().abs() < 2.0**-126, 0.0, x)
            idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices
            idx[torch.rand(num_tokens, topk, generator=gen) < unused] = -1
            w = torch.rand(num_tokens, topk, generator=gen)
            values, scales = QUANTIZERS[fmt](x)

            def ref(rows, max_recv, idx=idx, w=w, pad=pad):
                got = reference.dispatch(
                    group,
                    rows.to(dev),
                    idx.to(dev),
                    w.to(dev),
                    num_experts=num_experts,
                    pad_multiple=pad,
                    max_recv_tokens=max_recv,
                    expand=expand,
                )
                return [t.cpu() for t in got[:-1]], got[-1]

            max_recv = None
            if recv == "more":
                max_recv = ref(x, None)[1].num_recv_rows + 3
            (want_values, *want_rest), _ = ref(_bits(values), max_recv)
            (want_scales, *_), _ = ref(_bits(scales), max_recv)
            (want_bf16, *_), _ = ref(x, max_recv)
            kw = dict(topk_weights=w.to(dev), pad_multiple=pad, max_recv_tokens=max_recv)
            pair = values.to(dev), scales.to(dev)
            if source == "pair":
                got = buf.dispatch(pair, idx.to(dev), **kw)
            elif source == "quantize":
                got = buf.dispatch(x.to(dev), idx.to(dev), quantize=fmt, **kw)
            elif source == "pair_on_bf16_handle":
                first = buf.dispatch(x.to(dev), idx.to(dev), **kw)
                got = buf.dispatch(pair, topk_weights=w.to(dev), handle=first[-1])
            else:
                first = buf.dispatch(pair, idx.to(dev), **kw)
                got = buf.dispatch(x.to(dev), topk_weights=w.to(dev), handle=first[-1])
                got, first = first, got  # check the FP8 dispatch; the bf16 rows below

            def fail(msg, name=name):
                failures.append(f"[W{world} expand={expand} case {name!r}] rank {rank}: {msg}")

            (got_values, got_scales), *got_rest, handle = got
            dtypes = (got_values.dtype, got_scales.dtype)
            if dtypes != (SCALED_FORMATS[fmt].values_dtype, SCALED_FORMATS[fmt].scale_dtype):
                fail(f"recv_x is {dtypes}")
            elif not torch.equal(_bits(got_values.cpu()), want_values):
                fail(f"{fmt} values differ from the reference")
            elif not torch.equal(_bits(got_scales.cpu()), want_scales):
                fail("scales differ from the reference")
            for g, e in zip(got_rest, want_rest, strict=True):
                if not torch.equal(g.cpu(), e):
                    fail("weights, ids or tokens_per_expert differ from the reference")
            if source == "bf16_on_fp8_handle" and not torch.equal(first[0].cpu(), want_bf16):
                fail("bf16 rows along an FP8 dispatch's handle differ from the reference")
            # Combine stays in the Buffer's dtype, on the FP8 dispatch's handle.
            y = torch.randn(got_values.shape[0], hidden, generator=gen).to(torch.bfloat16)
            out = buf.combine(y.to(dev), handle).cpu()
            _, ref_handle = ref(x, max_recv)
            want = reference.combine(group, y.to(dev), ref_handle).cpu()
            if not _close(out, want):
                fail("combine after an FP8 dispatch differs from the reference")
    finally:
        buf.destroy()
    return failures


def _refused_calls(buf: Buffer, dev, hidden: int) -> list[str]:
    """Bad FP8 calls: a clear ValueError before anything moves (every rank makes the same
    calls, so none waits for a peer); one rank's bad pair along a handle; then an empty pair,
    strided as torch may make it, taken."""
    failures = []
    x = torch.randn(4, hidden).to(torch.bfloat16).to(dev)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    idx[:, 1] = 1
    values, scales = (t.to(dev) for t in reference.quantize_fp8(x.cpu()))
    unaligned = torch.zeros(4, hidden + 4, dtype=torch.float8_e4m3fn, device=dev)[:, 1:-3]
    grad_scales = scales.detach().requires_grad_()
    for what, call, match in [
        ("values bf16", lambda: buf.dispatch((x, scales), idx), "float8_e4m3fn"),
        ("scales [T, 1]", lambda: buf.dispatch((values, scales[:, :1]), idx), "scales"),
        ("scales bf16", lambda: buf.dispatch((values, scales.to(x.dtype)), idx), "float32"),
        ("three items", lambda: buf.dispatch((values, scales, scales), idx), "pair"),
        ("values at an odd byte", lambda: buf.dispatch((unaligned, scales), idx), "4 bytes"),
        (
            "a pair with quantize",
            lambda: buf.dispatch((values, scales), idx, quantize=True),
            "quantize",
        ),
        ("scales requiring grad", lambda: buf.dispatch((values, grad_scales), idx), "gradient"),
    ]:
        try:
            call()
            failures.append(f"{what}: no ValueError")
        except ValueError as e:
            if match not in str(e):
                failures.append(f"{what}: ValueError {str(e)!r} does not mention {match!r}")
    # Rank 1's bad pair along a handle: it raises, and runs the call with zero rows of the
    # Buffer's dtype, which rank 0, receiving FP8 pairs from it, neither waits for nor faults
    # on; the next new-layout dispatch is a ValueError on both ranks.
    handle = buf.dispatch((values, scales), idx)[-1]
    bad = dist.get_rank() == 1
    try:
        buf.dispatch((values, scales[:, :1] if bad else scales), handle=handle)
        if bad:
            failures.append("a bad pair along a handle on rank 1: no ValueError")
    except ValueError as e:
        if not bad or "scales" not in str(e):
            failures.append(f"a bad pair along a handle on rank 1: {e!r}")
    try:
        buf.dispatch((values, scales), idx)
        failures.append("the dispatch after a bad pair along a handle: no ValueError")
    except ValueError as e:
        if "refused its cached dispatch's x" not in str(e):
            failures.append(f"the dispatch after a bad pair along a handle: {e!r}")
    # No rows: any strides (torch.where makes [0, N] tensors strided (1, 0)), on every rank.
    empty_scales = torch.zeros(0, dtype=torch.float32, device=dev).as_strided(
        (0, hidden // 128), (1, 0)
    )
    (got, _), *_ = buf.dispatch((values[:0], empty_scales), idx[:0])
    if got.shape[0] != 0:
        failures.append(f"an empty pair: {got.shape[0]} rows received, not 0")
    return failures


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal but for bf16 rounding (combine sums partial rows rounded to bf16)."""
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class _Fp8GemmStandIn(torch.autograd.Function):
    """What an FP8 GEMM does with dispatched values: it reads their float8 data (``.quantized``) and
    the scales, and returns a gradient for the values in their nominal dtype."""

    @staticmethod
    def forward(ctx, values, scales, weight):
        ctx.save_for_backward(weight)
        return DEQUANTIZERS[values.format.name](values.quantized, scales) @ weight

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        return (grad_out @ weight.T).to(torch.bfloat16), None, None


def _gradients_match_reference(buf: Buffer, dev, hidden: int, rank: int, expand: bool, fmt: str):
    """quantize=True with x requiring grad, a new layout (padded with expand), then along its
    handle: the values are a ScaledValues of the reference's FP8 rows; x's gradient is the
    reference combine of the values' gradient rows (through the dequantizing torch ops, then
    through an FP8 GEMM's stand-in). In one layout each (the interpreter is slow): with token
    rows topk_weights' gradient is the bf16 dispatch's; with expand, combine reads the values
    as their dequantized rows, and without grad mode they are a plain float8 tensor."""
    failures = []
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(500 + rank)
    num_tokens, topk, pad = (6, 4)[rank], 3, 2 if expand else 1
    xs = [torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
    idx = torch.rand(num_tokens, 8, generator=gen).topk(topk, dim=1).indices
    idx[torch.rand(num_tokens, topk, generator=gen) < 0.3] = -1
    idx, w = idx.to(dev), torch.rand(num_tokens, topk, generator=gen).to(dev)

    def ref(rows):
        return reference.dispatch(
            group, rows.to(dev), idx, w, num_experts=8, pad_multiple=pad, expand=expand
        )

    def fail(msg):
        failures.append(f"[W2 expand={expand} gradients] rank {rank}: {msg}")

    # A new layout; the loss reads the values through torch ops (the dequantized rows).
    x, w_fp8 = xs[0].to(dev).requires_grad_(), w.clone().requires_grad_()
    got = buf.dispatch(x, idx, w_fp8, pad_multiple=pad, quantize=fmt)
    (values, scales), recv_w, handle = got[0], got[1 if expand else 2], got[-1]
    ref_values, ref_scales = QUANTIZERS[fmt](xs[0])
    *_, ref_handle = ref(xs[0])
    want_bits, want_scales = ref(_bits(ref_values))[0], ref(_bits(ref_scales))[0]
    if not (
        torch.equal(_bits(values.quantized), want_bits)
        and torch.equal(_bits(scales), want_scales)
        and values.scales is scales
    ):
        fail("the values' .quantized or the scales differ from the reference")
    values_dtype, scale_dtype = SCALED_FORMATS[fmt].values_dtype, SCALED_FORMATS[fmt].scale_dtype
    want = DEQUANTIZERS[fmt](want_bits.view(values_dtype), want_scales.view(scale_dtype))
    want = want.to(torch.bfloat16)
    if values.dtype != torch.bfloat16 or not torch.equal(values.dequantize(), want):
        fail(f"values ({values.dtype}) do not read as the reference's dequantized rows")
    if expand:
        with torch.no_grad():  # combine's kernels too read the dequantized rows
            out = buf.combine(values, handle)
        if not _close(out, reference.combine(group, want, ref_handle)):
            fail("combine of the values differs from the reference combine of their rows")
    grad_rows = torch.randn(values.shape, generator=gen).to(torch.bfloat16).to(dev)
    grad_w = torch.rand(recv_w.shape, generator=gen).to(dev)
    ((values * grad_rows).float().sum() + (recv_w * grad_w).sum()).backward()
    if not _close(x.grad, reference.combine(group, grad_rows, ref_handle)):
        fail("x's gradient is not the combine of the values' gradient rows")
    if not expand:
        w_bf16 = w.clone().requires_grad_()
        recv_w_bf16 = buf.dispatch(xs[0].to(dev), topk_weights=w_bf16, handle=handle)[2]
        (recv_w_bf16 * grad_w).sum().backward()
        if w_fp8.grad is None or not torch.equal(w_fp8.grad, w_bf16.grad):
            fail("topk_weights' gradient differs from the bf16 dispatch's")

    # Along the handle, the values consumed as FP8 data by a custom autograd.Function.
    x = xs[1].to(dev).requires_grad_()
    (values, scales), *_ = buf.dispatch(x, handle=handle, quantize=fmt)
    if expand:
        with torch.no_grad():  # the same rows without grad mode: a plain tensor of the values
            (plain_values, _), *_ = buf.dispatch(x, handle=handle, quantize=fmt)
        if type(plain_values) is not torch.Tensor or plain_values.dtype != values_dtype:
            fail(f"without grad mode the values are {type(plain_values).__name__}")
    try:
        buf.dispatch((values, scales), handle=handle)
        fail("a ScaledValues in a pair: no ValueError")
    except ValueError as e:
        if ".quantized" not in str(e):
            fail(f"a ScaledValues in a pair: ValueError {str(e)!r} does not mention .quantized")
    try:  # every rank refused that call along a handle: the next new-layout dispatch says so
        buf.dispatch(xs[0].to(dev), idx)
        fail("the dispatch after a refused call along a handle: no ValueError")
    except ValueError as e:
        if "(this rank) refused its cached dispatch's x" not in str(e):
            fail(f"the dispatch after a refused call along a handle: {e!r}")
    weight = (torch.randn(hidden, 8, generator=gen) / hidden**0.5).to(dev)  # rows of ~0.2
    grad_out = torch.randn(values.shape[0], 8, generator=gen).to(dev)
    (_Fp8GemmStandIn.apply(values, scales, weight) * grad_out).sum().backward()
    grad_rows = (grad_out @ weight.T).to(torch.bfloat16)
    if not _close(x.grad, reference.combine(group, grad_rows, ref_handle)):
        fail("x's gradient through a cached dispatch and .quantized is not the combine of its rows")
    return failures


def _compiled_matches_eager(buf: Buffer, dev, hidden: int, rank: int, fmt: str) -> list[str]:
    """Dispatches of ``fmt`` (a given pair, then quantize=fmt) under torch.compile(fullgraph=True)
    go through the torch.library operator and its fake implementation: the same outputs as eager
    mode."""
    gen = torch.Generator().manual_seed(77 + rank)
    x = _awkward_rows(5, hidden, gen).to(dev)
    idx = torch.rand(5, 8, generator=gen).topk(2, dim=1).indices.to(dev)
    w = torch.rand(5, 2, generator=gen).to(dev)
    pair = tuple(t.to(dev) for t in QUANTIZERS[fmt](x.cpu()))

    def step(x, values, scales, idx, w):
        (recv_values, recv_scales), recv_w, tokens_per_expert, _ = buf.dispatch(
            (values, scales), idx, w, max_recv_tokens=24
        )
        (quantized, quantized_scales), *_ = buf.dispatch(x, idx, max_recv_tokens=24, quantize=fmt)
        return (
            recv_values.view(torch.uint8),
            recv_scales.view(torch.uint8),
            recv_w,
            tokens_per_expert,
            quantized.view(torch.uint8),
            quantized_scales.view(torch.uint8),
        )

    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=False)
    eager, traced = step(x, *pair, idx, w), compiled(x, *pair, idx, w)
    if all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True)):
        return []
    return [f"an {fmt} dispatch under torch.compile differs from eager mode"]


def _graph_replays_match_eager(
    buf: Buffer, dev, hidden: int, rank: int, world: int, fmt: str
) -> list[str]:
    """Dispatches of ``fmt`` captured in a CUDA graph (max_recv_tokens mode: a given pair, then
    quantize=fmt where H is a multiple of 128), replayed on new rows copied into the captured
    inputs: the outputs of eager calls on those rows, bit for bit (GPUs only)."""
    gen = torch.Generator().manual_seed(55 + rank)
    num_tokens, topk = 7, 2
    idx = torch.rand(num_tokens, 8, generator=gen).topk(topk, dim=1).indices.to(dev)
    w = torch.rand(num_tokens, topk, generator=gen).to(dev)
    x = _awkward_rows(num_tokens, hidden, gen).to(dev)
    pair = [t.to(dev) for t in QUANTIZERS[fmt](x.cpu())]
    max_recv = world * num_tokens * topk

    def calls():
        # Either layout: the rows, then weights, ids or tokens_per_expert, then the handle.
        (values, scales), *rest, _ = buf.dispatch(tuple(pair), idx, w, max_recv_tokens=max_recv)
        outputs = [_bits(values), _bits(scales), *rest]
        if hidden % 128 == 0:
            (quantized, quantized_scales), *_ = buf.dispatch(
                x, idx, max_recv_tokens=max_recv, quantize=fmt
            )
            outputs += [_bits(quantized), _bits(quantized_scales)]
        return outputs

    calls()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    fresh = _awkward_rows(num_tokens, hidden, gen).flip(0)
    x.copy_(fresh.to(dev))
    for t, new in zip(pair, QUANTIZERS[fmt](fresh), strict=True):
        t.copy_(new.to(dev))
    graph.replay()
    torch.cuda.synchronize()
    eager = calls()
    if all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True)):
        return []
    return [f"{fmt} dispatches replayed from a CUDA graph differ from eager calls on the same rows"]


# hidden 256: two 128-channel scale blocks, 66 words a row, past one 64-word tile on CPU. One
# rank at hidden 7168 on GPUs only: the GPU configuration's full tiles and column slices. The
# larger CPU groups run some of the cases (the interpreter is slow): every case runs somewhere.
ALL = tuple(range(len(CASES)))


@pytest.mark.parametrize(
    "world,expand,ranks_per_node,hidden,cases",
    [
        pytest.param(2, True, None, 256, ALL, marks=pytest.mark.slow),
        pytest.param(4, False, None, 256, (1, 2), marks=pytest.mark.slow),
        (2, False, 1, 256, (0, 1, 3)),
        pytest.param(1, True, None, 7168, ALL, marks=pytest.mark.gpu),
        pytest.param(1, False, None, 7168, ALL, marks=pytest.mark.gpu),
    ],
    ids=[
        "W2-expert_rows",
        "W4-token_rows",
        "W2-2x1-token_rows",
        "W1-H7168-expert_rows",
        "W1-H7168-token_rows",
    ],
)
def test_fp8_dispatch_matches_reference(launch, world, expand, ranks_per_node, hidden, cases):
    results = launch(_rank_body, world, expand, ranks_per_node, hidden, cases)
    assert_no_failures(results)


# The formats of Blackwell's block-scaled GEMMs, as FP8 above: pairs, quantize=format, along
# handles, gradients at 2 ranks. Hidden 160: a row's scales end inside a word (MXFP8 5 bytes,
# NVFP4 10), so they move in a row of whole words and the caller sees a view (pairs only:
# quantize takes whole 128-channel groups).
@pytest.mark.parametrize(
    "fmt,world,expand,ranks_per_node,hidden,cases",
    [
        ("mxfp8", 2, True, None, 256, (0, 1)),
        ("nvfp4", 2, False, 1, 256, (1, 2, 3)),
        ("nvfp4", 2, True, None, 160, (0, 2)),
        pytest.param("nvfp4", 4, True, None, 256, (0, 1), marks=pytest.mark.slow),
        pytest.param("mxfp8", 4, False, None, 256, (2, 3), marks=pytest.mark.slow),
        pytest.param("mxfp8", 2, False, 1, 160, (0, 3), marks=pytest.mark.slow),
        pytest.param("mxfp8", 1, True, None, 7168, ALL, marks=pytest.mark.gpu),
        pytest.param("nvfp4", 1, False, None, 7168, ALL, marks=pytest.mark.gpu),
    ],
    ids=[
        "mxfp8-W2-expert_rows",
        "nvfp4-W2-2x1-token_rows",
        "nvfp4-W2-H160-expert_rows",
        "nvfp4-W4-expert_rows",
        "mxfp8-W4-token_rows",
        "mxfp8-W2-2x1-H160-token_rows",
        "mxfp8-W1-H7168-expert_rows",
        "nvfp4-W1-H7168-token_rows",
    ],
)
def test_block_scaled_dispatch_matches_reference(
    launch, fmt, world, expand, ranks_per_node, hidden, cases
):
    results = launch(_rank_body, world, expand, ranks_per_node, hidden, cases, fmt)
    assert_no_failures(results)
