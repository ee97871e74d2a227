"""The experts of a mixture-of-experts layer as grouped GEMMs over the rows a dispatch lays out:
``SwiGLUExperts``, L SwiGLU MLPs y = (silu(x W_gate^T) * (x W_up^T)) W_down^T, on

- a low-latency dispatch's blocks (``low_latency``): recv_x [L, C, H] with recv_count, its
  output written straight into the buffer that ``low_latency_combine(..., zero_copy=True)``
  reads, in two launches that read the counts on the device (a decode step's CUDA graph
  captures them);
- a normal dispatch's expert-major rows (``forward``): recv_x [N, H] with tokens_per_expert,
  differentiable with respect to the rows and both weights.

The weights are bf16, or FP8 as DeepSeek-V3's checkpoints hold them (float8_e4m3fn with a
float32 scale per 128x128 block, ``quantize_weights_fp8`` makes them from bf16 ones); FP8
weights take FP8 rows (values, scales), such as a low-latency dispatch's with use_fp8.
The kernels are kernels/experts.py's, launched by ops/experts.py; docs/reference.md
("Experts") has the shapes, the workspace and the precision.

Shapes: L local experts, H hidden size, F the experts' inner size, C = W * M' rows an expert
in the low-latency layout, N rows of a normal dispatch.
"""

from __future__ import annotations

import torch

from .ops import experts as ops
from .ops.experts import Workspace

__all__ = ["SwiGLUExperts", "Workspace", "quantize_weights_fp8"]

_FP8_BLOCK = 128  # a weight scale's block side: 128x128 (DeepSeek-V3's checkpoints)
_E4M3_MAX = 448.0
_AMAX_FLOOR = 2.0**-119  # the fp8 rule's floor (docs/formats.md): 448 / a stays finite


class SwiGLUExperts(torch.nn.Module):
    """L SwiGLU experts (this rank's local experts) as grouped GEMMs.

    Args:
        w1: [L, 2F, H], expert e's gate rows [0, F) then its up rows [F, 2F) (the gate and up
            projections' nn.Linear weights stacked); bf16, or float8_e4m3fn with w1_scales.
        w2: [L, H, F], the down projection's weights, of w1's dtype.
        w1_scales, w2_scales: FP8 weights' float32 scales, one per 128x128 block:
            [L, 2F / 128, H / 128] and [L, H / 128, F / 128] (H and F multiples of 128);
            None for bf16 weights.
        workspace: where ``low_latency`` keeps its intermediate activation (a Workspace that
            several layers may share, as they run one after another); None: one of its own.

    bf16 weights are Parameters (``w1``, ``w2``) whose gradients ``forward`` computes; FP8
    weights and their scales are buffers. All on one device (CUDA, or the CPU under Triton's
    interpreter); a bad argument is a ValueError naming it.
    """

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w1_scales: torch.Tensor | None = None,
        w2_scales: torch.Tensor | None = None,
        *,
        workspace: Workspace | None = None,
    ):
        super().__init__()
        weights = ops.check_weights(w1, w2, w1_scales, w2_scales)
        if weights.fp8:
            for name, value in zip(
                ("w1", "w2", "w1_scales", "w2_scales"), (w1, w2, w1_scales, w2_scales), strict=True
            ):
                self.register_buffer(name, value)
        else:
            self.w1 = torch.nn.Parameter(w1)
            self.w2 = torch.nn.Parameter(w2)
            self.w1_scales = self.w2_scales = None
        self.workspace = Workspace() if workspace is None else workspace

    @property
    def fp8(self) -> bool:
        return self.w1_scales is not None

    def _weights(self) -> ops.ExpertWeights:
        return ops.ExpertWeights(self.w1, self.w2, self.w1_scales, self.w2_scales)

    def low_latency(
        self, x, recv_count: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts on a low-latency dispatch's rows, on the current stream, no host
        synchronisation (no gradient: the low-latency mode serves inference).

        Args:
            x: recv_x [L, C, H]: bf16 for bf16 weights; for FP8 weights the pair (values
                float8_e4m3fn [L, C, H], scales float32 [L, C, H / 128]) of a dispatch with
                use_fp8 (and without use_ue8m0), scales of any strides.
            recv_count: int32 [L]: rows [0, recv_count[e]) of x[e] are valid.
            out: bf16 [L, C, H] (channels contiguous) to write into, e.g.
                ``buffer.get_next_low_latency_combine_buffer(handle)`` for a zero-copy
                combine; None: a new tensor.

        Returns ``out``: rows [0, recv_count[e]) of block e hold expert e's outputs; the
        other rows are not written.
        """
        weights = self._weights()
        values, scales, capacity = ops.check_low_latency(weights, x, recv_count, out)
        if out is None:
            shape = (weights.num_experts, capacity, weights.hidden)
            out = torch.empty(shape, dtype=torch.bfloat16, device=weights.device)
        return ops.low_latency(weights, values, scales, recv_count, out, self.workspace)

    def forward(self, rows, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on a normal dispatch's expert-major rows, on the current stream, no host
        synchronisation.

        Args:
            rows: recv_x [N, H] (channels contiguous): bf16 for bf16 weights, the pair (values
                float8_e4m3fn [N, H], scales float32 [N, H / 128]) of a dispatch with
                quantize="fp8" for FP8 weights. Expert e's rows follow those of e - 1, in any
                counts (pad_multiple needs no relation to the kernels' tiles).
            tokens_per_expert: int64 (or int32) [L], summing to at most N; rows past the sum
                (the zero tail of a max_recv_tokens dispatch) get zeros.

        Returns y [N, H] bf16. With bf16 weights and grad mode on, differentiable with respect
        to rows, w1 and w2 (the backward pass runs the same kernels, no host synchronisation
        either); FP8 weights have no gradient.
        """
        weights = self._weights()
        values, scales = ops.check_grouped(weights, rows, tokens_per_expert)
        differentiable = torch.is_grad_enabled() and not weights.fp8
        if differentiable and (
            values.requires_grad or self.w1.requires_grad or self.w2.requires_grad
        ):
            return _GroupedSwiGLU.apply(values, tokens_per_expert, self.w1, self.w2)
        return ops.grouped(weights, values, scales, tokens_per_expert, False)[0]


class _GroupedSwiGLU(torch.autograd.Function):
    """SwiGLUExperts.forward on bf16 rows and weights, with its backward pass: it keeps the
    rows, the activation [N, F] and the gate and up GEMMs' outputs [N, 2F] (bf16)."""

    @staticmethod
    def forward(ctx, rows, tokens_per_expert, w1, w2):
        weights = ops.ExpertWeights(w1, w2, None, None)
        y, act, pre = ops.grouped(weights, rows, None, tokens_per_expert, True)
        ctx.save_for_backward(rows, act, pre, tokens_per_expert, w1, w2)
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, act, pre, tokens_per_expert, w1, w2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw1, dw2 = ops.grouped_backward(
            ops.ExpertWeights(w1, w2, None, None),
            rows,
            act,
            pre,
            tokens_per_expert,
            dy,
            (needs[0], needs[2], needs[3]),
        )
        return dx, None, dw1, dw2


def quantize_weights_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [L, R, K] (R and K multiples of 128) as FP8 with 128x128 block scales, in plain
    torch (a one-time conversion): (values float8_e4m3fn [L, R, K], scales float32 [L, R / 128,
    K / 128]), by the library's fp8 rule per block (docs/formats.md): with a = max(amax,
    2^-119), value = w * (448 / a) rounded to nearest e4m3, scale = a / 448 (0 for a block of
    zeros). DeepSeek-V3's checkpoints hold the same layout."""
    if not (isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_floating_point()):
        raise ValueError(f"w must be a floating-point [L, R, K] tensor, got {type(w).__name__}")
    experts, rows, cols = w.shape
    if rows % _FP8_BLOCK or cols % _FP8_BLOCK:
        raise ValueError(f"w's last two dimensions must be multiples of 128, got {tuple(w.shape)}")
    blocks = w.float().reshape(
        experts, rows // _FP8_BLOCK, _FP8_BLOCK, cols // _FP8_BLOCK, _FP8_BLOCK
    )
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
    floored = amax.clamp(min=_AMAX_FLOOR)
    values = (blocks * (_E4M3_MAX / floored)).clamp(-_E4M3_MAX, _E4M3_MAX)
    scales = torch.where(amax > 0, floored / _E4M3_MAX, 0.0)
    return (values.to(torch.float8_e4m3fn).reshape(w.shape), scales[:, :, 0, :, 0].contiguous())
