"""FP8 quantization of a Buffer's token rows on their own (kernels/quantize.py says the rule):
what a quantize=True dispatch's quantizers do as it sends, for the benchmark's copy rows. And
MXFP8 / NVFP4 quantization of rows (``quantize_mxfp8``, ``quantize_nvfp4``; the rules are
torchao's, stated by ``reference.quantize_mxfp8`` / ``reference.quantize_nvfp4``), which need no
Buffer: for tests and the benchmark."""

import torch
import triton

from ..kernels.quantize import quantize_block_scaled_kernel, quantize_fp8_kernel
from ..runtime.planner import FP8_GROUP, ceil_div
from . import Runtime
from .launch import KernelLauncher

_BLOCK_T = 16
_GROUPS = 8


def quantize_rows(rt: Runtime, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] (rows contiguous, H % 128 == 0) as (values [T, H] float8_e4m3fn, scales
    [T, H / 128] float32), on the current stream."""
    num_tokens, hidden = x.shape
    values = torch.empty(num_tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(num_tokens, hidden // FP8_GROUP, dtype=torch.float32, device=x.device)
    if num_tokens:
        grid = (ceil_div(num_tokens, _BLOCK_T), ceil_div(hidden // FP8_GROUP, _GROUPS))
        rt.launcher(_quantize_launcher)(
            grid,
            specialized=dict(x_ptr=x, x_stride=x.stride(0), num_tokens=num_tokens),
            aligned=dict(values_ptr=values.view(torch.uint8), scales_ptr=scales),
        )
    return values, scales


def _quantize_launcher(rt: Runtime) -> KernelLauncher:
    return KernelLauncher(
        quantize_fp8_kernel, hidden=rt.plan.hidden, BLOCK_T=_BLOCK_T, GROUPS=_GROUPS
    )


def _check_rows(x: torch.Tensor, name: str) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} quantizes [T, H] bf16/fp16/fp32 rows, got {x.dtype} {x.shape}")
    num_tokens, hidden = x.shape
    if hidden % FP8_GROUP:
        raise ValueError(
            f"{name} kernels need a hidden size that is a multiple of 128, got {hidden}"
        )
    if num_tokens > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} kernels need rows with contiguous channels")
    return num_tokens, hidden


def _grid(num_tokens: int, hidden: int) -> tuple[int, int]:
    return triton.cdiv(num_tokens, _BLOCK_T), triton.cdiv(hidden // FP8_GROUP, _GROUPS)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] bf16/fp16/fp32 (channels contiguous, H % 128 == 0, else ValueError) as MXFP8
    (values [T, H] float8_e4m3fn, scales [T, H / 32] float8_e8m0fnu, row-major), on the current
    stream: bit for bit ``reference.quantize_mxfp8``."""
    num_tokens, hidden = _check_rows(x, "MXFP8")
    values = torch.empty(num_tokens, hidden, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_tokens, hidden // 32, dtype=torch.uint8, device=x.device)
    if num_tokens:
        quantize_block_scaled_kernel[_grid(num_tokens, hidden)](
            x, x.stride(0), values, scales, None, num_tokens, hidden,
            BLOCK_T=_BLOCK_T, GROUPS=_GROUPS, NVFP4=False, PER_TENSOR_SCALE=False,
        )  # fmt: skip
    return values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def quantize_nvfp4(
    x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] bf16/fp16/fp32 (channels contiguous, H % 128 == 0, else ValueError) as NVFP4
    (values [T, H / 2] float4_e2m1fn_x2, even channel in the low nibble, scales [T, H / 16]
    float8_e4m3fn, row-major), on the current stream: bit for bit ``reference.quantize_nvfp4``.
    ``per_tensor_scale``: None, or a float32 tensor of one positive finite value on x's device,
    read by the kernel (not checked here: that would wait for the GPU)."""
    num_tokens, hidden = _check_rows(x, "NVFP4")
    if per_tensor_scale is not None and (
        per_tensor_scale.numel() != 1
        or per_tensor_scale.dtype != torch.float32
        or per_tensor_scale.device != x.device
    ):
        raise ValueError("per_tensor_scale must be a float32 tensor of one value on x's device")
    values = torch.empty(num_tokens, hidden // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_tokens, hidden // 16, dtype=torch.uint8, device=x.device)
    if num_tokens:
        quantize_block_scaled_kernel[_grid(num_tokens, hidden)](
            x, x.stride(0), values, scales, per_tensor_scale, num_tokens, hidden,
            BLOCK_T=_BLOCK_T, GROUPS=_GROUPS, NVFP4=True,
            PER_TENSOR_SCALE=per_tensor_scale is not None,
        )  # fmt: skip
    return values.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn)
