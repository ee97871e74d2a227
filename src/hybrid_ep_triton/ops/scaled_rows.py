"""Block-scaled rows as torch sees them: ``dequantize`` (each format's values times their
block's scale, in float32), and ``ScaledValues``, the values of a quantizing dispatch's output
when the dispatched rows require grad.

torch autograd casts a tensor's gradient to that tensor's dtype, so a float8 output would get a
float8 gradient. A ``ScaledValues`` is a tensor subclass (as Transformer Engine's Float8Tensor)
whose nominal dtype is the dispatched rows' (e.g. bfloat16): autograd gives it a gradient of
that dtype, while it holds the quantized data that crossed the links.
"""

import torch
from torch.utils._pytree import tree_map

from ..runtime.planner import ScaledFormat

# The magnitudes of e2m1's 8 codes (its sign is the nibble's bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: ScaledFormat) -> torch.Tensor:
    """float32 [T, H] from rows of ``fmt``: values ([T, H], NVFP4 [T, H / 2] two a byte, the
    even channel in the low nibble) times the float32 value of their block's scale
    ([T, H / block]). An NVFP4 per-tensor scale is not applied."""
    if fmt.channels_per_byte == 2:
        codes = values.view(torch.uint8)
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
        magnitudes = torch.tensor(_E2M1, dtype=torch.float32, device=codes.device)[codes & 7]
        floats = torch.where(codes >= 8, -magnitudes, magnitudes)
    else:
        floats = values.float()
    rows, hidden = floats.shape
    blocks = floats.reshape(rows, hidden // fmt.block, fmt.block) * scales.float()[:, :, None]
    return blocks.reshape(rows, hidden)


_aten = torch.ops.aten
# Ops that return the same values under a new tensor (autograd's detach among them): the
# result is a ScaledValues of the same data, not a dequantized copy.
_SAME_VALUES = (_aten.detach.default, _aten.alias.default)


class ScaledValues(torch.Tensor):
    """[N, H] rows of block-scaled values with their scales, seen by torch as ``dtype`` rows.

    Attributes:
        quantized: the values as they were dispatched (what a block-scaled GEMM reads, with
            ``scales``): [N, H] float8_e4m3fn (fp8, mxfp8) or [N, H / 2] float4_e2m1fn_x2
            (nvfp4).
        scales: [N, H / block] of the format's scale dtype (planner.SCALED_FORMATS).
        format: the format (planner.ScaledFormat).

    The tensor itself has shape [N, H], dtype ``dtype`` and the values' device, and no storage
    of its own. detach and alias give a ScaledValues of the same data; every other torch op
    sees the dequantized rows (``dequantize``) and returns plain tensors; ops that would write
    into it raise RuntimeError. Its gradient is a plain [N, H] tensor of ``dtype``. Eager mode
    only (no torch.compile).
    """

    quantized: torch.Tensor
    scales: torch.Tensor
    format: ScaledFormat

    @staticmethod
    def __new__(
        cls, quantized: torch.Tensor, scales: torch.Tensor, fmt: ScaledFormat, dtype: torch.dtype
    ):
        rows = quantized.shape[0]
        hidden = quantized.shape[1] * fmt.channels_per_byte
        self = torch.Tensor._make_wrapper_subclass(
            cls, (rows, hidden), strides=(hidden, 1), dtype=dtype, device=quantized.device
        )
        self.quantized, self.scales, self.format = quantized, scales, fmt
        return self

    def dequantize(self) -> torch.Tensor:
        """The rows as a plain [N, H] tensor of the nominal dtype (see ``_dequantized``),
        differentiable: its gradient comes to ``self`` unchanged."""
        # An op on self, which autograd records (clone's gradient is the identity) and
        # __torch_dispatch__ runs on the dequantized rows.
        return self.clone()

    def _dequantized(self) -> torch.Tensor:
        """``dequantize`` of the values in float32, rounded once to the nominal dtype; no
        autograd."""
        return dequantize(self.quantized, self.scales, self.format).to(self.dtype)

    def __repr__(self) -> str:
        return (
            f"ScaledValues(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"format={self.format.name}, quantized={self.quantized})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SAME_VALUES:
            (self,) = args
            return ScaledValues(self.quantized, self.scales, self.format, self.dtype)
        if func is _aten.record_stream.default:
            # The caching allocator must keep the data's blocks (there is no block of its own).
            self, stream = args
            self.quantized.record_stream(stream)
            self.scales.record_stream(stream)
            return None
        # Writing into the dequantized copy would be silently lost: refuse it.
        params = func._schema.arguments
        # (args may stop short of the schema's defaulted parameters)
        bound = dict(zip((param.name for param in params), args, strict=False)) | kwargs
        if any(
            isinstance(bound.get(param.name), ScaledValues)
            for param in params
            if param.alias_info is not None and param.alias_info.is_write
        ):
            raise RuntimeError(
                f"{func}: quantized dispatch values are read-only (they hold the quantized "
                "data); write into a copy, e.g. values.dequantize()"
            )

        def plain(t):
            return t._dequantized() if isinstance(t, ScaledValues) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))
