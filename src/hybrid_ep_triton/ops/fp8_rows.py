"""``Fp8Values``: the values of an FP8 dispatch's output when the dispatched rows require grad.

torch autograd casts a tensor's gradient to that tensor's dtype, so a float8 output would get a
float8 gradient. An ``Fp8Values`` is a tensor subclass (as Transformer Engine's Float8Tensor)
whose nominal dtype is the dispatched rows' (e.g. bfloat16): autograd gives it a gradient of
that dtype, while it holds the FP8 data that crossed the links.
"""

import torch
from torch.utils._pytree import tree_map

from ..runtime.planner import FP8_GROUP

_aten = torch.ops.aten
# Ops that return the same values under a new tensor (autograd's detach among them): the
# result is an Fp8Values of the same data, not a dequantized copy.
_SAME_VALUES = (_aten.detach.default, _aten.alias.default)


class Fp8Values(torch.Tensor):
    """[N, H] rows of FP8 values with their scales, seen by torch as ``dtype`` rows.

    Attributes:
        fp8: [N, H] float8_e4m3fn, the values as they were dispatched (what an FP8 GEMM reads,
            with ``scales``).
        scales: [N, H / 128] float32; channel h of row n is fp8[n, h] * scales[n, h // 128].

    The tensor itself has shape [N, H], dtype ``dtype`` and fp8's device, and no storage of
    its own. detach and alias give an Fp8Values of the same data; every other torch op sees
    the dequantized rows (``dequantize``) and returns plain tensors; ops that would write into
    it raise RuntimeError. Its gradient is a plain [N, H] tensor of ``dtype``. Eager mode only
    (no torch.compile).
    """

    fp8: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self = torch.Tensor._make_wrapper_subclass(
            cls, fp8.shape, strides=fp8.stride(), dtype=dtype, device=fp8.device
        )
        self.fp8, self.scales = fp8, scales
        return self

    def dequantize(self) -> torch.Tensor:
        """The rows as a plain [N, H] tensor of the nominal dtype (see ``_dequantized``),
        differentiable: its gradient comes to ``self`` unchanged."""
        # An op on self, which autograd records (clone's gradient is the identity) and
        # __torch_dispatch__ runs on the dequantized rows.
        return self.clone()

    def _dequantized(self) -> torch.Tensor:
        """fp8 * scales per 128-channel block in float32, rounded once to the nominal dtype
        (``reference.dequantize_fp8``'s rule); no autograd."""
        rows, hidden = self.fp8.shape
        blocks = self.fp8.float().reshape(rows, hidden // FP8_GROUP, FP8_GROUP)
        return (blocks * self.scales[:, :, None]).reshape(rows, hidden).to(self.dtype)

    def __repr__(self) -> str:
        return f"Fp8Values(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self.fp8})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SAME_VALUES:
            (self,) = args
            return Fp8Values(self.fp8, self.scales, self.dtype)
        if func is _aten.record_stream.default:
            # The caching allocator must keep the data's blocks (there is no block of its own).
            self, stream = args
            self.fp8.record_stream(stream)
            self.scales.record_stream(stream)
            return None
        # Writing into the dequantized copy would be silently lost: refuse it.
        params = func._schema.arguments
        # (args may stop short of the schema's defaulted parameters)
        bound = dict(zip((param.name for param in params), args, strict=False)) | kwargs
        if any(
            isinstance(bound.get(param.name), Fp8Values)
            for param in params
            if param.alias_info is not None and param.alias_info.is_write
        ):
            raise RuntimeError(
                f"{func}: FP8 dispatch values are read-only (they hold FP8 data); write into a "
                "copy, e.g. values.dequantize()"
            )

        def plain(t):
            return t._dequantized() if isinstance(t, Fp8Values) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))
