"""FP8 quantization of a Buffer's token rows on their own (kernels/quantize.py says the rule):
what a quantize=True dispatch's quantizers do as it sends, for the benchmark's copy rows."""

import torch

from ..kernels.quantize import quantize_fp8_kernel
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
