"""Quantization of token rows on their own, without a Buffer, for tests and the benchmark's copy
rows: FP8 1x128 (``quantize_fp8``: what a quantize=True dispatch's quantizers do as it sends;
kernels/quantize.py says the rule, ``reference.quantize_fp8`` states it), MXFP8 and NVFP4
(``quantize_mxfp8``, ``quantize_nvfp4``; the rules are torchao's, stated by
``reference.quantize_mxfp8`` / ``reference.quantize_nvfp4``)."""

import torch
import triton

from ..kernels.quantize import quantize_block_scaled_kernel, quantize_fp8_kernel
from ..runtime.planner import FP8_GROUP

_BLOCK_T = 16
_GROUPS = 8


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


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] bf16/fp16/fp32 (channels contiguous, H % 128 == 0, else ValueError) as FP8
    1x128 (values [T, H] float8_e4m3fn, scales [T, H / 128] float32, row-major), on the
    current stream: bit for bit ``reference.quantize_fp8``."""
    num_tokens, hidden = _check_rows(x, "FP8")
    values = torch.empty(num_tokens, hidden, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_tokens, hidden // FP8_GROUP, dtype=torch.float32, device=x.device)
    if num_tokens:
        quantize_fp8_kernel[_grid(num_tokens, hidden)](
            x, x.stride(0), values, scales, num_tokens, hidden, BLOCK_T=_BLOCK_T, GROUPS=_GROUPS
        )
    return values.view(torch.float8_e4m3fn), scales


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] bf16/fp16/fp32 (channels contiguous, H % 128 == 0, else ValueError) as MXFP8
    (values [T, H] float8_e4m3fn, scales [T, H / 32] float8_e8m0fnu, row-major), on the current
    stream: bit for bit ``reference.quantize_mxfp8``."""
    num_tokens, hidden = _check_rows(x, "MXFP8")
    values = torch.empty(num_tokens, hidden, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_tokens, hidden // 32, dtype=torch.uint8, device=x.device)
    if num_tokens:
        quantize_block_scaled_kernel[_grid(num_tokens, hidden)](
            x,
            x.stride(0),
            values,
            scales,
            None,
            num_tokens,
            hidden,
            BLOCK_T=_BLOCK_T,
            GROUPS=_GROUPS,
            NVFP4=False,
            PER_TENSOR_SCALE=False,
        )
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
            x,
            x.stride(0),
            values,
            scales,
            per_tensor_scale,
            num_tokens,
            hidden,
            BLOCK_T=_BLOCK_T,
            GROUPS=_GROUPS,
            NVFP4=True,
            PER_TENSOR_SCALE=per_tensor_scale is not None,
        )
    return values.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn)
