"""SwiGLUExperts (hybrid_ep_triton.experts) against a plain-torch reference written here: a loop
over experts in float32 on the inputs as the kernels see them (bf16 values; FP8 values times
their scales), with the activation requantized by ``reference.quantize_fp8`` where the kernels
requantize it.

Tolerances, per expert (or per gradient), of its largest reference magnitude: bf16 2e-2 (the
kernels round the activation and the output to bf16, 2^-9 each); FP8 against the FP8
reference 2e-2 (the output's rounding, and now and then an activation value on the other side
of an e4m3 rounding); FP8 against the bf16 weights it was quantized from, a relative
Frobenius error of 8e-2 (docs/formats.md). The end-to-end cases run dispatch, the experts and
combine on CPU ranks and compare each token's weighted sum of its experts with the layer
computed from the tokens alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_failures, expect_error

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.experts import SwiGLUExperts, Workspace, quantize_weights_fp8
from hybrid_ep_triton.tools.launcher import rank_device

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
TOL = 2e-2
FP8_FROM_BF16_TOL = 8e-2


def _weights(num_experts: int, hidden: int, ffn: int, seed: int):
    """bf16 W1 [L, 2F, H], W2 [L, H, F] with outputs of magnitude about 1."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * ffn, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, ffn, generator=g) / ffn**0.5
    return w1.to(BF16), w2.to(BF16)


def _dequantized_weights(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    experts, rows, cols = values.shape
    blocks = values.float().reshape(experts, rows // 128, 128, cols // 128, 128)
    return (blocks * scales[:, :, None, :, None]).reshape(experts, rows, cols)


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, requantize: bool = False):
    """One expert in float32: x [n, H], w1 [2F, H], w2 [H, F] (float32); ``requantize``: the
    activation as the FP8 kernels pass it on (reference.quantize_fp8, dequantized)."""
    ffn = w1.shape[0] // 2
    h = x @ w1.T
    act = F.silu(h[:, :ffn]) * h[:, ffn:]
    if requantize:
        act = reference.dequantize_fp8(*reference.quantize_fp8(act))
    return act @ w2.T


def _fp8_rows(x: torch.Tensor, low_latency: bool):
    """(values, scales, dequantized float32) of bf16 rows [..., H]: the low-latency dispatch's
    cast with its scales' layout (rows fastest) or the normal dispatch's (row-major)."""
    flat = x.reshape(-1, x.shape[-1])
    if low_latency:
        values, scales = reference.quantize_fp8_low_latency(flat)
    else:
        values, scales = reference.quantize_fp8(flat)
    dequantized = values.float().reshape(flat.shape[0], -1, 128) * scales[:, :, None]
    values, scales = values.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)
    if low_latency and x.dim() == 3:  # [L, C, G], strides (G * C, 1, C), as the dispatch's
        scales = scales.transpose(1, 2).contiguous().transpose(1, 2)
    return values, scales, dequantized.reshape(x.shape)


def _assert_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    got = got.float().cpu()
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    assert err <= tol * max(scale, 1e-6), f"{what}: error {err:.3g}, largest {scale:.3g}"


def _experts(num_experts, hidden, ffn, seed, fp8):
    """(SwiGLUExperts' arguments on the CPU, float32 W1 and W2 as the kernels see them, bf16
    W1 and W2 before any quantization)."""
    w1, w2 = _weights(num_experts, hidden, ffn, seed)
    if not fp8:
        return (w1, w2), w1.float(), w2.float(), (w1, w2)
    (q1, s1), (q2, s2) = quantize_weights_fp8(w1), quantize_weights_fp8(w2)
    return (q1, q2, s1, s2), _dequantized_weights(q1, s1), _dequantized_weights(q2, s2), (w1, w2)


def _module(arguments, device, **kwargs) -> SwiGLUExperts:
    return SwiGLUExperts(*(t.to(device) for t in arguments), **kwargs)


# --- low-latency blocks ----------------------------------------------------------------------

LOW_LATENCY_CASES = [
    # (L, C, H, F, counts): a hot expert (the most rows), an empty one, odd counts
    pytest.param(3, 24, 64, 32, (21, 0, 5), id="hot-empty-odd"),
    # H and F not multiples of the CPU tiles (masked channels and columns), a full block
    pytest.param(2, 20, 80, 48, (20, 7), id="partial-tiles-full-block"),
    pytest.param(3, 8, 64, 32, (0, 0, 0), id="all-empty"),
]


@pytest.mark.parametrize("num_experts, capacity, hidden, ffn, counts", LOW_LATENCY_CASES)
def test_low_latency_blocks(device, num_experts, capacity, hidden, ffn, counts):
    arguments, w1, w2, _ = _experts(num_experts, hidden, ffn, seed=1, fp8=False)
    experts = _module(arguments, device)
    x = torch.randn(num_experts, capacity, hidden, generator=torch.Generator().manual_seed(2))
    x = x.to(BF16)
    recv_count = torch.tensor(counts, dtype=torch.int32, device=device)
    # out: a column slice of a wider tensor (row stride > H), NaN where nothing may be written
    wide = torch.full((num_experts, capacity, hidden + 16), float("nan"), dtype=BF16)
    wide = wide.to(device)
    out = wide[:, :, 8 : 8 + hidden]
    assert experts.low_latency(x.to(device), recv_count, out=out) is out
    fresh = experts.low_latency(x.to(device), recv_count)
    for e, n in enumerate(counts):
        want = _mlp(x[e, :n].float(), w1[e], w2[e])
        _assert_close(f"expert {e}", out[e, :n], want)
        assert torch.equal(fresh[e, :n].cpu(), out[e, :n].cpu()), f"expert {e}: out=None differs"
        assert out[e, n:].isnan().all(), f"expert {e}: rows past its count were written"
    outside = torch.cat([wide[:, :, :8], wide[:, :, 8 + hidden :]], dim=2)
    assert outside.isnan().all(), "columns outside out were written"


def test_low_latency_fp8(device):
    num_experts, capacity, hidden, ffn, counts = 3, 16, 128, 128, (16, 0, 5)
    arguments, w1, w2, (b1, b2) = _experts(num_experts, hidden, ffn, seed=3, fp8=True)
    experts = _module(arguments, device)
    x = torch.randn(num_experts, capacity, hidden, generator=torch.Generator().manual_seed(4))
    values, scales, x_seen = _fp8_rows(x.to(BF16), low_latency=True)
    recv_count = torch.tensor(counts, dtype=torch.int32, device=device)
    out = experts.low_latency((values.to(device), scales.to(device)), recv_count)
    for e, n in enumerate(counts):
        want = _mlp(x_seen[e, :n], w1[e], w2[e], requantize=True)
        _assert_close(f"expert {e}", out[e, :n], want)
        if n:
            unquantized = _mlp(x[e, :n].to(BF16).float(), b1[e].float(), b2[e].float())
            error = (out[e, :n].float().cpu() - unquantized).norm() / unquantized.norm()
            assert error < FP8_FROM_BF16_TOL, f"expert {e}: {error:.3g} off the bf16 weights"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_workspace_is_kept_per_shape(device, fp8):
    """The activation is allocated by the first call of a shape, and a shared Workspace holds
    one per shape whichever layer calls."""
    num_experts, capacity, hidden, ffn = 2, 8, 128, 128
    workspace = Workspace()
    layers = [
        _module(_experts(num_experts, hidden, ffn, seed, fp8)[0], device, workspace=workspace)
        for seed in (5, 6)
    ]
    x = torch.randn(num_experts, capacity, hidden).to(BF16)
    rows = _fp8_rows(x, low_latency=True)[:2] if fp8 else x
    rows = tuple(t.to(device) for t in rows) if fp8 else rows.to(device)
    recv_count = torch.tensor([3, 8], dtype=torch.int32, device=device)
    for layer in layers + layers:
        layer.low_latency(rows, recv_count)
    per_row = ffn + ffn // 128 * 4 if fp8 else 2 * ffn  # bytes: values (and scales)
    assert workspace.nbytes == num_experts * capacity * per_row


# --- expert-major rows -----------------------------------------------------------------------

GROUPED_CASES = [
    # (H, F, counts, N): odd counts, an empty expert, a tail past the counts (zeros)
    pytest.param(64, 32, (7, 0, 20, 1), 31, id="odd-empty-tail"),
    # counts padded to the CPU row tile, hot expert, H and F not multiples of the tiles
    pytest.param(80, 48, (16, 48, 0), 64, id="padded-hot-partial"),
    pytest.param(64, 32, (0, 0), 0, id="no-rows"),
]


def _segments(counts):
    start = 0
    for e, n in enumerate(counts):
        yield e, start, start + n
        start += n


@pytest.mark.parametrize("hidden, ffn, counts, num_rows", GROUPED_CASES)
def test_expert_major_rows(device, hidden, ffn, counts, num_rows):
    arguments, w1, w2, _ = _experts(len(counts), hidden, ffn, seed=7, fp8=False)
    experts = _module(arguments, device)
    x = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(8)).to(BF16)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int64, device=device)
    with torch.no_grad():
        y = experts(x.to(device), tokens_per_expert).cpu()
    for e, first, end in _segments(counts):
        _assert_close(f"expert {e}", y[first:end], _mlp(x[first:end].float(), w1[e], w2[e]))
    assert (y[sum(counts) :] == 0).all(), "rows past the counts are not zero"


def test_expert_major_rows_fp8(device):
    hidden, ffn, counts, num_rows = 128, 128, (5, 0, 11), 18
    arguments, w1, w2, _ = _experts(len(counts), hidden, ffn, seed=9, fp8=True)
    experts = _module(arguments, device)
    x = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(10)).to(BF16)
    values, scales, x_seen = _fp8_rows(x, low_latency=False)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int64, device=device)
    y = experts((values.to(device), scales.to(device)), tokens_per_expert).cpu()
    for e, first, end in _segments(counts):
        want = _mlp(x_seen[first:end], w1[e], w2[e], requantize=True)
        _assert_close(f"expert {e}", y[first:end], want)
    assert (y[sum(counts) :] == 0).all()


def test_gradients_match_plain_torch(device):
    """dx, dW1, dW2 against torch autograd of the float32 reference on the same bf16 values."""
    hidden, ffn, counts, num_rows = 64, 32, (7, 0, 20), 30  # three tail rows
    arguments, w1, w2, _ = _experts(len(counts), hidden, ffn, seed=11, fp8=False)
    experts = _module(arguments, device)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(num_rows, hidden, generator=g).to(BF16)
    dy = torch.randn(num_rows, hidden, generator=g).to(BF16)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int64, device=device)
    x_dev = x.to(device, copy=True).requires_grad_()
    experts(x_dev, tokens_per_expert).backward(dy.to(device))

    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x.float(), w1, w2))
    y = torch.zeros(num_rows, hidden)
    for e, first, end in _segments(counts):
        y = y.index_add(0, torch.arange(first, end), _mlp(xr[first:end], w1r[e], w2r[e]))
    y.backward(dy.float())
    for name, got, want in (
        ("dx", x_dev.grad, xr.grad),
        ("dW1", experts.w1.grad, w1r.grad),
        ("dW2", experts.w2.grad, w2r.grad),
    ):
        assert got.dtype == BF16, name
        _assert_close(name, got, want, tol=3e-2)
    assert (x_dev.grad[sum(counts) :] == 0).all(), "tail rows' gradient is not zero"


def test_fp8_weights_quantizer():
    """quantize_weights_fp8: a scale per 128x128 block (amax / 448; 0 for a block of zeros) and
    values within e4m3's rounding of the weights, on blocks of very different magnitudes."""
    magnitudes = torch.tensor([1e-3, 1.0, 0.0, 50.0]).repeat_interleave(128)[None, :, None]
    w = (torch.randn(2, 512, 128) * magnitudes).to(BF16)
    values, scales = quantize_weights_fp8(w)
    assert values.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (2, 4, 1)
    amax = w.float().reshape(2, 4, 128, 1, 128).abs().amax(dim=(2, 4))
    assert torch.equal(scales, amax / 448)
    error = (_dequantized_weights(values, scales) - w.float()).abs()
    block_amax = amax.repeat_interleave(128, 1).repeat_interleave(128, 2)
    # half an e4m3 step of the value's magnitude, or of the smallest normal one (2^-6 * 448 / a)
    assert (error <= 2**-4 * w.float().abs() + 2**-10 * block_amax / 448).all()


# --- arguments -------------------------------------------------------------------------------


def _bad_calls(device):
    """(call, the argument its ValueError names)."""
    w1, w2 = (t.to(device) for t in _weights(2, 128, 128, seed=13))
    bf16 = SwiGLUExperts(w1, w2)
    q1, q2, s1, s2 = (t.to(device) for t in _experts(2, 128, 128, seed=13, fp8=True)[0])
    fp8 = SwiGLUExperts(q1, q2, s1, s2)
    ones = torch.ones(1, 1, 1, device=device)  # F = 64: FP8 needs multiples of 128
    narrow = (q1[:1, :128], q2[:1, :, :64].contiguous(), ones, ones)
    x = torch.zeros(2, 4, 128, dtype=BF16, device=device)
    count = torch.zeros(2, dtype=torch.int32, device=device)
    values, scales, _ = _fp8_rows(x.cpu(), low_latency=True)
    values, scales = values.to(device), scales.to(device)
    rows = torch.zeros(6, 128, dtype=BF16, device=device)
    per_expert = torch.tensor([2, 4], device=device)
    return [
        (lambda: SwiGLUExperts(w1[0], w2), "w1"),
        (lambda: SwiGLUExperts(w1, w2[:, :, :64]), "w2"),
        (lambda: SwiGLUExperts(w1, w2.float()), "w2"),
        (lambda: SwiGLUExperts(q1, q2), "w1_scales"),
        (lambda: SwiGLUExperts(q1, q2, s1, s2[:1]), "w2_scales"),
        (lambda: SwiGLUExperts(w1, w2, s1, s2), "w1_scales"),
        (lambda: SwiGLUExperts(*narrow), "w1"),
        (lambda: bf16.low_latency(x.float(), count), "x"),
        (lambda: bf16.low_latency(x[:1], count), "x"),
        (lambda: bf16.low_latency(x, count.long()), "recv_count"),
        (lambda: bf16.low_latency(x, count, out=x[:, :2]), "out"),
        (lambda: bf16.low_latency((values, scales), count), "x"),
        (lambda: fp8.low_latency(x, count), "x"),
        (lambda: fp8.low_latency((values, scales.view(torch.int32)), count), "scales"),
        (lambda: fp8.low_latency((values, scales[:, :, :0]), count), "scales"),
        (lambda: bf16(rows, per_expert.float()), "tokens_per_expert"),
        (lambda: bf16(rows, per_expert[:1]), "tokens_per_expert"),
        (lambda: bf16(rows[:, :64], per_expert), "rows"),
        (lambda: bf16(torch.zeros(128, 6, dtype=BF16, device=device).t(), per_expert), "rows"),
        (lambda: fp8(rows, per_expert), "rows"),
    ]


def test_bad_arguments_are_named(device):
    failures = []
    for index, (call, named) in enumerate(_bad_calls(device)):
        found = []
        expect_error(found, ValueError, named, call)
        failures += [f"call {index}: {failure}" for failure in found]
    assert not failures, failures


# --- end to end: dispatch, experts, combine on CPU ranks ----------------------------------------

WORLD, HIDDEN, FFN, NUM_EXPERTS, TOKENS, TOPK = 2, 128, 128, 8, 6, 3


def _rank_inputs(rank: int):
    """x [T, H] bf16, topk_idx [T, K] (distinct ids, some -1 slots), weights [T, K] of
    ``rank``."""
    g = torch.Generator().manual_seed(100 + rank)
    num_tokens = TOKENS - rank  # ranks pass different counts
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(BF16)
    idx = torch.rand(num_tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    idx[torch.rand(num_tokens, TOPK, generator=g) < 0.2] = -1
    weights = torch.rand(num_tokens, TOPK, generator=g)
    return x, idx, weights


def _layer(x_seen, idx, weights, w1, w2, requantize):
    """Each token's weighted sum over its valid slots of its experts' outputs (float32)."""
    out = torch.zeros(x_seen.shape[0], HIDDEN)
    for t in range(x_seen.shape[0]):
        for k, e in enumerate(idx[t].tolist()):
            if e >= 0:
                out[t] += weights[t, k] * _mlp(x_seen[t : t + 1], w1[e], w2[e], requantize)[0]
    return out


def _decode_and_prefill_body(rank: int, world: int) -> list[str]:
    """On one Buffer: a low-latency dispatch, the experts into the zero-copy combine buffer,
    the combine; then a normal dispatch, the experts on its expert-major rows, combine; each
    in bf16 and FP8, against the layer computed from the tokens alone."""
    failures = []
    dev = rank_device()
    local = NUM_EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    x, idx, weights = _rank_inputs(rank)
    x, idx, weights = x.to(dev), idx.to(dev), weights.to(dev)
    buf = Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=TOKENS,
        num_experts=NUM_EXPERTS,
        low_latency_tokens=TOKENS,
        device=dev,
    )
    try:
        for fp8 in (False, True):
            arguments, w1, w2, _ = _experts(NUM_EXPERTS, HIDDEN, FFN, seed=14, fp8=fp8)
            experts = _module([t[mine] for t in arguments], dev)
            fmt = "fp8" if fp8 else "bf16"

            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                x, idx, TOKENS, NUM_EXPERTS, use_fp8=fp8
            )
            combine_buffer = buf.get_next_low_latency_combine_buffer(handle)
            experts.low_latency(recv_x, recv_count, out=combine_buffer)
            out, _, _ = buf.low_latency_combine(
                combine_buffer, idx, weights, handle, zero_copy=True
            )
            x_seen = _fp8_rows(x.cpu(), low_latency=True)[2] if fp8 else x.cpu().float()
            want = _layer(x_seen, idx.cpu(), weights.cpu(), w1, w2, fp8)
            _check(failures, f"rank {rank} low-latency {fmt}", out, want)

            recv, recv_weights, tokens_per_expert, handle = buf.dispatch(
                x, idx, weights, quantize=fp8
            )
            y = experts(recv, tokens_per_expert)
            out = buf.combine(y, handle, weights=recv_weights)
            x_seen = _fp8_rows(x.cpu(), low_latency=False)[2] if fp8 else x.cpu().float()
            want = _layer(x_seen, idx.cpu(), weights.cpu(), w1, w2, fp8)
            _check(failures, f"rank {rank} normal {fmt}", out, want)
        buf.check()
    except Exception as error:
        failures.append(f"rank {rank} raised {error!r}")
    finally:
        buf.destroy()
    return failures


def _check(failures: list, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        _assert_close(what, got, want)
    except AssertionError as error:
        failures.append(str(error))


def test_dispatch_experts_combine(launch):
    assert_no_failures(launch(_decode_and_prefill_body, WORLD))


# --- the kernels build for Hopper --------------------------------------------------------------

_SM90_SCRIPT = textwrap.dedent(
    """
    import inspect, os, subprocess, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hybrid_ep_triton.kernels import experts as k
    from hybrid_ep_triton.ops.experts import EXPERT_MAJOR_ROWS, LOW_LATENCY_ROWS, tiles_for

    CUDA = torch.device("cuda")
    TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    # Sizes that vary between calls (no divisibility); every other integer as the JIT
    # specialises DeepSeek-V3's shapes: a multiple of 16, or 1 where named.
    ROW_COUNTS = ("capacity", "num_rows", "num_experts")

    def build(label, kernel, role, fp8, layout, pointers, ones=(), **constexprs):
        tiles = tiles_for(role, CUDA, fp8, layout)
        block = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                     GROUP_M=tiles.group_m, BLOCK_R=tiles.block_m, LAYOUT=layout, FP8=fp8,
                     SAVE_PRE=layout == EXPERT_MAJOR_ROWS and not fp8, L_P2=32,
                     **{name: 1 for name in ones}, **constexprs)
        names = list(inspect.signature(kernel.fn).parameters)
        constexprs = {n: v for n, v in block.items() if n in names}
        signature, attrs = {}, {}
        for i, name in enumerate(names):
            if name in constexprs:
                signature[name] = "constexpr"
                continue
            pointer = name.endswith("_ptr")
            signature[name] = pointers.get(name, "*bf16") if pointer else "i32"
            if pointer or name not in ROW_COUNTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([TOOL, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        print(label, " ".join(line.strip() for line in usage.splitlines() if "REG:" in line))

    scales = {n: "*fp32" for n in ("x_scales_ptr", "w1_scales_ptr", "act_scales_ptr",
                                   "a_scales_ptr", "b_scales_ptr")}
    fp8_ptrs = {n: "*u8" for n in ("x_ptr", "w1_ptr", "act_ptr", "a_ptr", "b_ptr")}
    for layout, counts in ((LOW_LATENCY_ROWS, "*i32"), (EXPERT_MAJOR_ROWS, "*i64")):
        for fp8 in (False, True):
            ptrs = {**scales, **(fp8_ptrs if fp8 else {}), "counts_ptr": counts}
            name = f"{'expert-major' if layout else 'low-latency'} {'fp8' if fp8 else 'bf16'}"
            build(f"gate_up {name}", k.gate_up_kernel, "gate_up", fp8, layout, ptrs)
            build(f"down {name}", k.grouped_gemm_kernel, "rows", fp8, layout, ptrs,
                  ones=("b_k_stride",))
    i64 = {"counts_ptr": "*i64", **scales}
    rows = EXPERT_MAJOR_ROWS
    build("dx", k.grouped_gemm_kernel, "rows", False, rows, i64, ones=("b_col_stride",))
    build("swiglu_grad", k.swiglu_grad_kernel, "swiglu_grad", False, rows, i64)
    build("weight_grad", k.weight_grad_kernel, "weight_grad", False, rows, i64)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas runs on Linux")
def test_kernels_build_for_sm90_without_spills():
    """Every build the launches make on a GPU compiles for sm_90 with Triton's own ptxas and
    keeps its accumulators in registers (no stack: spills would cost the GEMMs' speed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 11, result.stdout
    assert all("STACK:0 " in line for line in lines), result.stdout
