"""Launches of the experts' grouped GEMMs (kernels/experts.py), their argument checks, and the
workspace that keeps the low-latency path's intermediate activation between calls.

Every check raises ValueError naming the argument before anything is launched. The launches
read the experts' row counts on the device and never wait for the host, so a CUDA graph
captures them.
"""

import contextlib
import dataclasses
import functools

import torch
from triton import cdiv, next_power_of_2

from ..kernels.experts import (
    EXPERT_MAJOR,
    FP8_BLOCK,
    LOW_LATENCY,
    gate_up_kernel,
    grouped_gemm_kernel,
    swiglu_grad_kernel,
    weight_grad_kernel,
)
from ..runtime.checks import check_interpreted_on_cpu, check_tensor, describe
from .launch import KernelLauncher

BF16, FP8, F32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
# The kernels' LAYOUT values as host integers (a launch passes them; tables are keyed by them).
LOW_LATENCY_ROWS, EXPERT_MAJOR_ROWS = LOW_LATENCY.value, EXPERT_MAJOR.value
SCALE_BLOCK = FP8_BLOCK.value  # channels an FP8 scale covers; a weight scale's block side
_COUNT_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A launch's tile (kernels/experts.py's BLOCK_M, BLOCK_N, BLOCK_K; the weight gradients'
    BLOCK_R in block_m) and its launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# GPUs, by (role, FP8, expert-major rows): 64 rows a tile where a decode's expert has tens
# (low-latency blocks), 128 in a prefill's expert-major rows, with 8 warps where the
# accumulators need them (no spills: checked by tests/test_experts.py's sm_90 builds). The
# gate/up GEMM's block_n counts columns of F (as many gate and up rows of W1 each): 128 with
# FP8, one scale group of the activation it requantizes, and then 32 rows a tile (its two
# accumulators and FP8 operands spill past 255 registers at 64 under Triton 3.6); FP8 tiles
# take 128 channels a step, a weight block's.
_GPU_TILES = {
    ("gate_up", False, False): Tiles(64, 64, 64, 4, 4),
    ("gate_up", False, True): Tiles(128, 64, 64, 8, 3),
    ("gate_up", True, False): Tiles(32, 128, 128, 8, 3),
    ("gate_up", True, True): Tiles(32, 128, 128, 8, 3),
    ("rows", False, False): Tiles(64, 128, 64, 4, 4),
    ("rows", False, True): Tiles(128, 128, 64, 8, 3),
    ("rows", True, False): Tiles(64, 128, 128, 8, 3),
    ("rows", True, True): Tiles(64, 128, 128, 8, 3),
    ("swiglu_grad", False, True): Tiles(128, 64, 64, 8, 3),
    ("weight_grad", False, True): Tiles(64, 128, 128, 8, 3),  # block_m: BLOCK_R
}
# CPU ranks (the interpreter, whose cost is per program and per operation), by (role, FP8):
# the smallest tiles tl.dot takes, but the gate/up GEMM's 128 columns with FP8.
_CPU_TILES = {
    ("gate_up", False): Tiles(16, 32, 32, 1, 1),
    ("gate_up", True): Tiles(16, 128, 32, 1, 1),
    ("rows", False): Tiles(16, 32, 32, 1, 1),
    ("rows", True): Tiles(16, 32, 32, 1, 1),
    ("swiglu_grad", False): Tiles(16, 32, 32, 1, 1),
    ("weight_grad", False): Tiles(16, 32, 32, 1, 1),
}


def tiles_for(role: str, device: torch.device, fp8: bool, layout) -> Tiles:
    """The tile of ``role`` (gate_up, rows: the down GEMM and dx, swiglu_grad, weight_grad)."""
    if device.type != "cuda":
        return _CPU_TILES[role, fp8]
    return _GPU_TILES[role, fp8, layout == EXPERT_MAJOR_ROWS]


@functools.cache
def _launcher(kernel, num_warps: int, num_stages: int) -> KernelLauncher:
    return KernelLauncher(kernel, num_warps=num_warps, num_stages=num_stages)


def _launch(kernel, tiles: Tiles, grid: int, device: torch.device, **arguments) -> None:
    """One launch of ``kernel`` on ``device``'s current stream; every argument specialised as
    Triton would (they are the caller's tensors and sizes, or allocations of any age). The
    meta-parameters of ``tiles`` that the kernel takes (BLOCK_R: weight_grad's rows a step) and
    L_P2, of ``num_experts``, are added here."""
    meta = dict(
        L_P2=next_power_of_2(arguments["num_experts"]),
        BLOCK_M=tiles.block_m,
        BLOCK_R=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
    )
    arguments.update({name: v for name, v in meta.items() if name in kernel.arg_names})
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _launcher(kernel, tiles.num_warps, tiles.num_stages)((grid,), arguments, {})


# -- weights and arguments --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """The weights of L SwiGLU experts, checked (``check_weights``)."""

    w1: torch.Tensor  # [L, 2F, H]: gate rows [0, F), up rows [F, 2F); bf16 or float8_e4m3fn
    w2: torch.Tensor  # [L, H, F]
    w1_scales: torch.Tensor | None  # FP8: float32 [L, 2F / 128, H / 128], one per 128x128 block
    w2_scales: torch.Tensor | None  # FP8: float32 [L, H / 128, F / 128]

    @property
    def fp8(self) -> bool:
        return self.w1_scales is not None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def ffn(self) -> int:
        return self.w2.shape[2]

    @property
    def device(self) -> torch.device:
        return self.w1.device


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_weights(w1, w2, w1_scales=None, w2_scales=None) -> ExpertWeights:
    """W1 [L, 2F, H] and W2 [L, H, F], both bf16, or both float8_e4m3fn with their float32
    128x128 block scales (then H and F multiples of 128); contiguous, on one device."""
    if not (isinstance(w1, torch.Tensor) and w1.dim() == 3 and w1.shape[1] % 2 == 0):
        raise ValueError(f"w1 must be a [L, 2F, H] tensor, got {describe(w1)}")
    if w1.dtype not in (BF16, FP8):
        raise ValueError(f"w1 must be bfloat16 or float8_e4m3fn, got {w1.dtype}")
    num_experts, ffn, hidden = w1.shape[0], w1.shape[1] // 2, w1.shape[2]
    if min(num_experts, ffn, hidden) < 1:
        raise ValueError(f"w1 must have experts, rows and columns, got {tuple(w1.shape)}")
    device = w1.device
    check_interpreted_on_cpu(device)
    check_tensor("w2", w2, (num_experts, hidden, ffn), w1.dtype, device)
    _check_contiguous("w1", w1)
    _check_contiguous("w2", w2)
    fp8 = w1.dtype == FP8
    for name, scales, (rows, cols) in (
        ("w1_scales", w1_scales, (2 * ffn, hidden)),
        ("w2_scales", w2_scales, (hidden, ffn)),
    ):
        if not fp8:
            if scales is not None:
                raise ValueError(f"{name} are the scales of float8_e4m3fn weights: pass None")
            continue
        if scales is None:
            raise ValueError(f"float8_e4m3fn weights need {name} (float32 128x128 block scales)")
        shape = (num_experts, cdiv(rows, SCALE_BLOCK), cdiv(cols, SCALE_BLOCK))
        check_tensor(name, scales, shape, F32, device)
        _check_contiguous(name, scales)
    if fp8 and (hidden % SCALE_BLOCK or ffn % SCALE_BLOCK):
        raise ValueError(
            f"float8_e4m3fn w1 and w2 need a hidden size and an inner size F that are "
            f"multiples of {SCALE_BLOCK} (the activations' scale groups), got H={hidden}, F={ffn}"
        )
    return ExpertWeights(w1, w2, w1_scales, w2_scales)


def _check_rows(name: str, rows, shape: tuple, weights: ExpertWeights):
    """``rows`` of ``shape`` (last dimension H, channels contiguous): bf16 for bf16 weights, a
    (values, scales) FP8 pair for FP8 weights, scales float32 [..., H / 128] of any strides.
    Returns (values, scales or None)."""
    device, hidden = weights.device, weights.hidden
    if not weights.fp8:
        if isinstance(rows, tuple):
            raise ValueError(f"{name} must be bf16 rows for bf16 weights, got a pair")
        check_tensor(name, rows, shape, BF16, device)
        values, scales = rows, None
    else:
        if not (isinstance(rows, tuple) and len(rows) == 2):
            raise ValueError(
                f"{name} must be an FP8 pair (values, scales) for float8_e4m3fn weights, got "
                f"{describe(rows)}"
            )
        values, scales = rows
        check_tensor(f"{name}'s values", values, shape, FP8, device)
        scale_shape = (*shape[:-1], hidden // SCALE_BLOCK)
        if not (isinstance(scales, torch.Tensor) and scales.dtype == F32):
            raise ValueError(
                f"{name}'s scales must be float32 {list(scale_shape)}, one per row and 128 "
                f"channels (a low-latency dispatch without use_ue8m0), got {describe(scales)}"
            )
        check_tensor(f"{name}'s scales", scales, scale_shape, F32, device)
    if values.stride(-1) != 1 and hidden > 1:
        raise ValueError(f"{name} must have contiguous channels (stride(-1) == 1)")
    return values, scales


def _check_counts(name: str, counts, dtypes: tuple, weights: ExpertWeights) -> None:
    if not isinstance(counts, torch.Tensor) or counts.dtype not in dtypes:
        words = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a {words} tensor, got {describe(counts)}")
    check_tensor(name, counts, (weights.num_experts,), counts.dtype, weights.device)
    _check_contiguous(name, counts)


def check_low_latency(weights: ExpertWeights, x, recv_count, out) -> tuple:
    """A low-latency dispatch's x ([L, C, H], see _check_rows), recv_count (int32 [L]) and
    out (None, or bf16 [L, C, H] with contiguous channels); returns (values, scales, C)."""
    values = x[0] if isinstance(x, tuple) and len(x) == 2 else x
    if not (isinstance(values, torch.Tensor) and values.dim() == 3):
        raise ValueError(f"x must be [L, C, H] rows (or an FP8 pair of them), got {describe(x)}")
    capacity = values.shape[1]
    shape = (weights.num_experts, capacity, weights.hidden)
    values, scales = _check_rows("x", x, shape, weights)
    _check_counts("recv_count", recv_count, (torch.int32,), weights)
    if out is not None:
        check_tensor("out", out, shape, BF16, weights.device)
        if out.stride(2) != 1 and weights.hidden > 1:
            raise ValueError("out must have contiguous channels (stride(2) == 1)")
    return values, scales, capacity


def check_grouped(weights: ExpertWeights, rows, tokens_per_expert) -> tuple:
    """Expert-major rows ([N, H], see _check_rows) and tokens_per_expert (int64 or int32 [L],
    summing to at most N: rows past the sum are the zero tail of a max_recv_tokens dispatch);
    returns (values, scales)."""
    values = rows[0] if isinstance(rows, tuple) and len(rows) == 2 else rows
    if not (isinstance(values, torch.Tensor) and values.dim() == 2):
        raise ValueError(f"rows must be [N, H] (or an FP8 pair of them), got {describe(rows)}")
    values, scales = _check_rows("rows", rows, (values.shape[0], weights.hidden), weights)
    _check_counts("tokens_per_expert", tokens_per_expert, _COUNT_DTYPES, weights)
    return values, scales


# -- the workspace ------------------------------------------------------------------------------


class Workspace:
    """Intermediate activations kept between calls: one tensor per (name, shape, dtype,
    device), allocated by the first call that needs it, so that a later call of that shape
    allocates nothing and a CUDA graph replays into the memory it captured."""

    def __init__(self):
        self._tensors: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device):
        key = (name, tuple(shape), dtype, device)
        found = self._tensors.get(key)
        if found is None:
            found = self._tensors[key] = torch.empty(shape, dtype=dtype, device=device)
        return found

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.nbytes for t in self._tensors.values())

    def clear(self) -> None:
        """Drop every tensor (a CUDA graph that captured one must not replay after)."""
        self._tensors.clear()


def activation_shapes(rows: tuple, ffn: int, fp8: bool) -> dict:
    """{name: (shape, dtype)} of the intermediate activation of ``rows`` ([L, C] or [N]):
    bf16 [rows, F], or e4m3 bits (uint8) [rows, F] and float32 scales [rows, F / 128]."""
    if not fp8:
        return {"act": ((*rows, ffn), BF16)}
    return {"act": ((*rows, ffn), torch.uint8), "act_scales": ((*rows, ffn // SCALE_BLOCK), F32)}


# -- launches -------------------------------------------------------------------------------------


def _strides(t: torch.Tensor, layout) -> tuple:
    """(expert stride, row stride, channel stride) of [L, C, ·] or [N, ·] (expert stride 0)."""
    return tuple(t.stride()) if layout == LOW_LATENCY_ROWS else (0, *t.stride())


def _row_tiles(layout, num_experts: int, capacity: int, block_m: int) -> int:
    if layout == LOW_LATENCY_ROWS:
        return num_experts * cdiv(capacity, block_m)
    return cdiv(capacity, block_m) + num_experts  # the experts' tiles, or the tail's


def _gate_up(weights, layout, x, x_scales, counts, act, act_scales, pre) -> None:
    """act (and pre, unless None) of rows x [L, C, H] or [N, H] (see the kernel)."""
    fp8, capacity = weights.fp8, x.shape[-2]
    tiles = tiles_for("gate_up", weights.device, fp8, layout)
    x_expert, x_row, _ = _strides(x, layout)
    scale_strides = _strides(x_scales, layout) if fp8 else (0, 0, 0)
    grid = _row_tiles(layout, weights.num_experts, capacity, tiles.block_m)
    _launch(
        gate_up_kernel,
        tiles,
        grid * cdiv(weights.ffn, tiles.block_n),
        weights.device,
        x_ptr=x.view(torch.uint8) if fp8 else x,
        x_expert_stride=x_expert,
        x_row_stride=x_row,
        x_scales_ptr=x_scales if fp8 else counts,
        x_scale_expert_stride=scale_strides[0],
        x_scale_row_stride=scale_strides[1],
        x_scale_k_stride=scale_strides[2],
        w1_ptr=weights.w1.view(torch.uint8) if fp8 else weights.w1,
        w1_scales_ptr=weights.w1_scales if fp8 else counts,
        counts_ptr=counts,
        act_ptr=act,
        act_scales_ptr=act_scales if fp8 else counts,
        act_expert_rows=capacity if layout == LOW_LATENCY_ROWS else 0,
        pre_ptr=act if pre is None else pre,
        capacity=capacity,
        hidden=weights.hidden,
        ffn=weights.ffn,
        num_experts=weights.num_experts,
        LAYOUT=layout,
        FP8=fp8,
        SAVE_PRE=pre is not None,
    )


def _rows_gemm(layout, a, a_scales, b, b_strides, b_scales, counts, out, fp8: bool) -> None:
    """out = a @ b[e]^T on each expert's rows: a [L, C, K] or [N, K] (FP8: e4m3 bits and
    float32 row-major scales), b [L, N_out, K] by ``b_strides`` (FP8: contiguous, with its
    128x128 block scales), out [L, C, N_out] or [N, N_out] bf16 (the tail rows zeroed)."""
    num_experts, out_cols = b.shape[0], out.shape[-1]
    capacity, device = a.shape[-2], a.device
    tiles = tiles_for("rows", device, fp8, layout)
    a_expert, a_row, _ = _strides(a, layout)
    scale_expert, scale_row, _ = _strides(a_scales, layout) if fp8 else (0, 0, 0)
    out_expert, out_row, _ = _strides(out, layout)
    grid = _row_tiles(layout, num_experts, capacity, tiles.block_m) * cdiv(out_cols, tiles.block_n)
    _launch(
        grouped_gemm_kernel,
        tiles,
        grid,
        device,
        a_ptr=a,
        a_expert_stride=a_expert,
        a_row_stride=a_row,
        a_scales_ptr=a_scales if fp8 else counts,
        a_scale_expert_stride=scale_expert,
        a_scale_row_stride=scale_row,
        b_ptr=b.view(torch.uint8) if fp8 else b,
        b_expert_stride=b_strides[0],
        b_col_stride=b_strides[1],
        b_k_stride=b_strides[2],
        b_scales_ptr=b_scales if fp8 else counts,
        counts_ptr=counts,
        out_ptr=out,
        out_expert_stride=out_expert,
        out_row_stride=out_row,
        capacity=capacity,
        inner=a.shape[-1],
        out_cols=out_cols,
        num_experts=num_experts,
        LAYOUT=layout,
        FP8=fp8,
    )


def _down(weights, layout, act, act_scales, counts, out) -> None:
    """out = act W2[e]^T."""
    _rows_gemm(
        layout,
        act,
        act_scales,
        weights.w2,
        weights.w2.stride(),
        weights.w2_scales,
        counts,
        out,
        weights.fp8,
    )


def low_latency(weights: ExpertWeights, x, x_scales, recv_count, out, workspace: Workspace):
    """The experts on a low-latency dispatch's [L, C, H] blocks (checked by check_low_latency)
    into ``out`` [L, C, H]: rows [0, recv_count[e]) of block e; the others are not written.
    The activation lives in ``workspace``."""
    device, shape = weights.device, x.shape[:2]
    act = {
        name: workspace.get(name, s, dtype, device)
        for name, (s, dtype) in activation_shapes(shape, weights.ffn, weights.fp8).items()
    }
    _gate_up(
        weights, LOW_LATENCY_ROWS, x, x_scales, recv_count, act["act"], act.get("act_scales"), None
    )
    _down(weights, LOW_LATENCY_ROWS, act["act"], act.get("act_scales"), recv_count, out)
    return out


def grouped(weights: ExpertWeights, x, x_scales, tokens_per_expert, keep_for_backward: bool):
    """The experts on expert-major rows x [N, H] (checked by check_grouped): (y [N, H] bf16,
    zeros past the experts' rows; act [N, F] bf16; pre [N, 2F] bf16, the gate and up GEMMs'
    outputs, or None unless ``keep_for_backward``)."""
    device, num_rows = weights.device, x.shape[0]
    act = {
        name: torch.empty(s, dtype=dtype, device=device)
        for name, (s, dtype) in activation_shapes((num_rows,), weights.ffn, weights.fp8).items()
    }
    pre = None
    if keep_for_backward:
        pre = torch.empty(num_rows, 2 * weights.ffn, dtype=BF16, device=device)
    _gate_up(
        weights,
        EXPERT_MAJOR_ROWS,
        x,
        x_scales,
        tokens_per_expert,
        act["act"],
        act.get("act_scales"),
        pre,
    )
    y = torch.empty(num_rows, weights.hidden, dtype=BF16, device=device)
    _down(weights, EXPERT_MAJOR_ROWS, act["act"], act.get("act_scales"), tokens_per_expert, y)
    return y, act["act"], pre


def grouped_backward(
    weights: ExpertWeights, x, act, pre, tokens_per_expert, dy, needs: tuple[bool, bool, bool]
) -> tuple:
    """(dx, dw1, dw2) of ``grouped`` (bf16 weights) for the gradient dy [N, H] of y, each None
    where ``needs`` says so: dact = dy W2[e], d(gate | up) through SwiGLU, dx = d(gate | up)
    W1[e], dw1[e] = d(gate | up)^T x, dw2[e] = dy^T act, over each expert's rows."""
    device, (num_rows, hidden), ffn = weights.device, x.shape, weights.ffn
    num_experts = weights.num_experts
    dy = dy.contiguous()
    dpre = torch.empty(num_rows, 2 * ffn, dtype=BF16, device=device)
    tiles = tiles_for("swiglu_grad", device, False, EXPERT_MAJOR_ROWS)
    row_tiles = _row_tiles(EXPERT_MAJOR_ROWS, num_experts, num_rows, tiles.block_m)
    grid = row_tiles * cdiv(ffn, tiles.block_n)
    _launch(
        swiglu_grad_kernel,
        tiles,
        grid,
        device,
        dy_ptr=dy,
        w2_ptr=weights.w2,
        pre_ptr=pre,
        counts_ptr=tokens_per_expert,
        dpre_ptr=dpre,
        num_rows=num_rows,
        hidden=hidden,
        ffn=ffn,
        num_experts=num_experts,
    )
    dx = dw1 = dw2 = None
    if needs[0]:
        dx = torch.empty(num_rows, hidden, dtype=BF16, device=device)
        w1 = weights.w1  # as [L, H, 2F] by strides: dx = d(gate | up) @ W1[e]
        _rows_gemm(
            EXPERT_MAJOR_ROWS,
            dpre,
            None,
            w1,
            (w1.stride(0), 1, hidden),
            None,
            tokens_per_expert,
            dx,
            False,
        )
    if needs[1]:
        dw1 = _weight_grad(dpre, x, tokens_per_expert, num_experts)
    if needs[2]:
        dw2 = _weight_grad(dy, act, tokens_per_expert, num_experts)
    return dx, dw1, dw2


def _weight_grad(g: torch.Tensor, a: torch.Tensor, counts, num_experts: int) -> torch.Tensor:
    """dw [L, N_out, K] bf16: dw[e] = g[rows of e]^T @ a[rows of e], g [N, N_out], a [N, K]."""
    out_cols, inner = g.shape[1], a.shape[1]
    dw = torch.empty(num_experts, out_cols, inner, dtype=BF16, device=g.device)
    tiles = tiles_for("weight_grad", g.device, False, EXPERT_MAJOR_ROWS)
    grid = num_experts * cdiv(out_cols, tiles.block_n) * cdiv(inner, tiles.block_k)
    _launch(
        weight_grad_kernel,
        tiles,
        grid,
        g.device,
        g_ptr=g.contiguous(),
        a_ptr=a.contiguous(),
        counts_ptr=counts,
        dw_ptr=dw,
        out_cols=out_cols,
        inner=inner,
        num_experts=num_experts,
    )
    return dw
