"""A Megatron-Core-style token dispatcher on a ``Buffer``, and an example MoE layer built on it.

``TokenDispatcher`` is what a Megatron-Core MoE layer calls around its experts:
``dispatch(hidden_states, probs, routing_map)`` sends every token to the ranks of its experts
and returns the rows grouped by local expert; ``combine(expert_output)`` sends the expert outputs
back and sums them per token. ``MoELayer`` is a complete, small layer on it: a top-k router,
SwiGLU experts computed with one grouped GEMM per projection, and the dispatcher in between.
``hybrid_ep_triton.megatron`` builds Megatron-Core's own dispatcher interface on
``TokenDispatcher`` (its ``prepare`` and ``send`` halves of ``dispatch``).

Shapes: T tokens of this rank, H hidden size, E global experts, L = E / group size local
experts (rank r owns experts r*L .. r*L+L-1), K = router_topk, N rows received by this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .buffer import Buffer
from .ops.scaled_rows import ScaledValues
from .runtime.checks import check_int, check_quantize_format, check_tensor, describe
from .runtime.planner import SCALED_FORMATS

__all__ = ["MoELayer", "TokenDispatcher"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


class TokenDispatcher:
    """Dispatch and combine for one MoE layer, as a Megatron-Core token dispatcher.

    ``dispatch`` keeps the routing (the Buffer's handle) and the input's shape, and the next
    ``combine`` uses and drops them: calls alternate dispatch, combine, dispatch, ... Both are
    collective over the Buffer's group (every rank calls them, in the same order) and
    differentiable: dispatch with respect to hidden_states and probs, combine with respect to
    expert_output; their backward passes are collective too.

    Args:
        buffer: the Buffer of the expert-parallel group; E, H, the token dtype and
            max_tokens_per_rank are the Buffer's.
        router_topk: K, experts per token: the slots of topk_idx, the most True entries in a
            row of routing_map; 1 <= K <= E.
        max_recv_tokens: None (exact mode): dispatch returns exactly the rows needed, once the
            host has read the row count. M: dispatch always returns M rows and never
            synchronises with the host; rows past sum(tokens_per_expert) are zero with prob 0,
            rows past M are
            dropped and ``check()`` raises OverflowError. M = world * max_tokens_per_rank *
            min(K, L) + L * (pad_multiple - 1) never drops a row.
        pad_multiple: pad each local expert's rows with zero rows (prob 0) to a multiple of it.
        wire_format: None: rows cross the links in the Buffer's dtype. "fp8", "mxfp8" or
            "nvfp4": the dispatch quantizes them as it sends (``Buffer.dispatch``'s quantize;
            H a multiple of 128), and permuted_tokens are the rows dequantized on arrival, in
            the Buffer's dtype (each value times its block's scale, rounded once), their
            gradient passed straight through. Fewer bytes cross the links (per channel: 2 in
            bf16, 1.03 in fp8 and mxfp8, 0.56 in nvfp4) and the experts see the format's error.

    Attributes: buffer, router_topk, max_recv_tokens, pad_multiple, wire_format, num_experts
    (E), num_local_experts (L) and device (the Buffer's).
    """

    def __init__(
        self,
        buffer: Buffer,
        router_topk: int,
        *,
        max_recv_tokens: int | None = None,
        pad_multiple: int = 1,
        wire_format: str | None = None,
    ):
        if not isinstance(buffer, Buffer):
            raise ValueError(f"buffer must be a hybrid_ep_triton.Buffer, got {type(buffer)}")
        check_wire_format(wire_format, buffer.hidden_size)
        if not buffer.expand:
            raise ValueError("buffer must expand into expert-major rows (expand=True)")
        check_int("router_topk", router_topk, 1, buffer.num_experts)
        if max_recv_tokens is not None:
            check_int("max_recv_tokens", max_recv_tokens, 0)
        check_int("pad_multiple", pad_multiple, 1)
        self.buffer = buffer
        self.router_topk = router_topk
        self.max_recv_tokens = max_recv_tokens
        self.pad_multiple = pad_multiple
        self.wire_format = wire_format
        self.num_experts = buffer.num_experts
        self.num_local_experts = buffer.num_experts // dist.get_world_size(buffer.group)
        self.device = buffer.device
        self._pending = None  # (handle, input shape, N) of a dispatch not combined yet
        self._last_handle = None

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        *,
        topk_idx: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send each token to the ranks of its experts, one row per (token, local expert):
        ``send(*prepare(...), shape=hidden_states.shape)``.

        Args:
            hidden_states: [..., H] tokens of this rank in the Buffer's dtype, flattened to
                [T, H]; T (the product of the leading dims) at most max_tokens_per_rank.
            probs: routing probabilities, floating point (sent as float32): [T, E] with
                routing_map (only the routed entries are used), or [T, K] with topk_idx.
                hidden_states' leading dims in place of T work too.
            routing_map: [T, E] bool, True where a token goes to an expert, at most K per row.
                Exact mode checks the count (on the host); max_recv_tokens mode, which never
                synchronises, routes a row to its K lowest expert ids and ignores the rest.
            topk_idx: instead of routing_map: [T, K] int32 or int64 global expert ids, -1 for
                an unused slot, distinct within a row (the Buffer checks them on the device).

        Returns:
            permuted_tokens: [N, H] in hidden_states' dtype, rows grouped by local expert
                0..L-1, within an expert by source rank, then source token; padding rows zero.
            tokens_per_expert: [L] int64 rows of each local expert (padding included), on the
                tokens' device.
            permuted_probs: [N] float32 prob of each row's (token, expert) pair, 0 on padding.
        """
        routed = self.prepare(hidden_states, probs, routing_map, topk_idx=topk_idx)
        return self.send(*routed, shape=hidden_states.shape)

    def prepare(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        *,
        topk_idx: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The checks and local conversions of ``dispatch``, without communication (arguments
        as there).

        Returns:
            tokens: [T, H] hidden_states with contiguous rows.
            topk_idx: [T, K] global expert ids, -1 for an unused slot (from routing_map: a
                row's K lowest routed ids).
            probs: [T, K] float32, the probs of those slots (0 for -1 slots); differentiable
                with respect to the probs passed in.
        """
        x = self._check_tokens(hidden_states)
        num_tokens = x.shape[0]
        if (routing_map is None) == (topk_idx is None):
            raise ValueError("pass exactly one of routing_map and topk_idx")
        width = self.router_topk if routing_map is None else self.num_experts
        probs = self._flat(
            "probs", probs, hidden_states, width, _FLOAT_DTYPES, "a floating-point dtype"
        )
        if routing_map is not None:
            routing_map = self._flat(
                "routing_map", routing_map, hidden_states, width, (torch.bool,), "torch.bool"
            )
            if self.max_recv_tokens is None and num_tokens:
                self._check_map_counts(routing_map)
            topk_idx, probs = topk_from_map(routing_map, probs, self.router_topk)
        else:
            topk_idx = self._flat(
                "topk_idx", topk_idx, hidden_states, width, _INDEX_DTYPES, "int32 or int64"
            )
        return x, topk_idx, probs.float()

    def send(
        self,
        tokens: torch.Tensor,
        topk_idx: torch.Tensor,
        probs: torch.Tensor,
        *,
        shape: torch.Size | None = None,
        async_finish: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The communication of ``dispatch``: ``prepare``'s outputs in, ``dispatch``'s out.

        Args:
            tokens, topk_idx, probs: as ``prepare`` returns them.
            shape: the shape ``combine`` gives its output (hidden_states' shape; default
                tokens' [T, H]).
            async_finish: run on the Buffer's communication stream; the calling stream waits
                for it before any later work (so other streams may compute meanwhile).
        """
        outputs = self.buffer.dispatch(
            tokens,
            topk_idx,
            probs,
            pad_multiple=self.pad_multiple,
            max_recv_tokens=self.max_recv_tokens,
            async_finish=async_finish,
            quantize=self.wire_format or False,
        )
        permuted, permuted_probs, tokens_per_expert, handle = _wait(outputs, async_finish)
        if self.wire_format is not None:
            permuted = _dequantized(permuted, self.wire_format, self.buffer.dtype)
        self._pending = (handle, tokens.shape if shape is None else shape, permuted.shape[0])
        self._last_handle = handle
        return permuted, tokens_per_expert, permuted_probs

    def combine(self, expert_output: torch.Tensor, *, async_finish: bool = False) -> torch.Tensor:
        """Send the expert outputs back and sum them per token, without weights (Megatron
        applies the probs inside the experts).

        Args:
            expert_output: [N, H] in permuted_tokens' row order and dtype.
            async_finish: as for ``send``.

        Returns:
            hidden_states' shape and dtype: each token's sum of its experts' rows (accumulated
            in float32), zeros for a token routed nowhere.
        """
        if self._pending is None:
            raise RuntimeError(
                "TokenDispatcher.combine needs a dispatch first: every dispatch is combined once"
            )
        handle, shape, num_rows = self._pending
        expected = (num_rows, self.buffer.hidden_size)
        check_tensor("expert_output", expert_output, expected, self.buffer.dtype, self.device)
        self._pending = None
        out = self.buffer.combine(expert_output.contiguous(), handle, async_finish=async_finish)
        return _wait(out, async_finish).reshape(shape)

    def check(self) -> None:
        """Synchronise and raise what the device recorded for the last dispatch: OverflowError
        when max_recv_tokens dropped rows (see ``Buffer.check``)."""
        if self._last_handle is None:
            raise RuntimeError("TokenDispatcher.check needs a dispatch first")
        self.buffer.check(self._last_handle)

    # -- checks -----------------------------------------------------------------------------

    def _check_tokens(self, hidden_states) -> torch.Tensor:
        hidden = self.buffer.hidden_size
        t = hidden_states
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[-1] != hidden:
            raise ValueError(f"hidden_states must have shape [..., {hidden}], got {describe(t)}")
        check_tensor("hidden_states", t, None, self.buffer.dtype, self.device)
        x = t.reshape(-1, hidden)
        x = x if x.stride(1) == 1 else x.contiguous()  # the Buffer wants contiguous rows
        if x.shape[0] > self.buffer.max_tokens_per_rank:
            raise ValueError(
                f"hidden_states must have at most max_tokens_per_rank="
                f"{self.buffer.max_tokens_per_rank} tokens, got {x.shape[0]}"
            )
        return x

    def _flat(self, name, t, hidden_states, width, dtypes, dtype_words) -> torch.Tensor:
        """``t`` as [T, width], checked: [T, width] or hidden_states' leading dims + [width]."""
        num_tokens = hidden_states.numel() // hidden_states.shape[-1]
        shapes = {(num_tokens, width), (*hidden_states.shape[:-1], width)}
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in shapes:
            raise ValueError(f"{name} must have shape {(num_tokens, width)}, got {describe(t)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {dtype_words}, got {t.dtype}")
        if t.device != hidden_states.device:
            raise ValueError(f"{name} must be on {hidden_states.device}, got {t.device}")
        return t.reshape(num_tokens, width)

    def _check_map_counts(self, routing_map: torch.Tensor) -> None:
        most, row = torch.stack(routing_map.sum(dim=1).max(dim=0)).tolist()  # one host read
        if most > self.router_topk:
            raise ValueError(
                f"routing_map rows must have at most router_topk={self.router_topk} True "
                f"entries, got {most} in row {row}"
            )


class MoELayer(torch.nn.Module):
    """Example mixture-of-experts layer: top-k router, SwiGLU experts, a TokenDispatcher.

    forward(hidden_states [..., H]) -> [..., H], same dtype; with x a token,
    out = sum over its K experts e of p_e * (silu(x @ Wg_e) * (x @ Wu_e)) @ Wd_e:
      1. router, in float32: logits = x @ router.weight.T ([T, E]); a token's K experts are its
         K largest logits and p = softmax over those K logits, so the probs sum to 1 per token
         (the same as renormalising the top K of a full softmax; Megatron's default order).
      2. dispatch: rows grouped by local expert, with their probs.
      3. experts: [Wg | Wu] = w_gate_up[e] (gate first), Wd = w_down[e], one torch._grouped_mm
         per projection over all local experts; the prob scales the SwiGLU activation before
         the down projection, as Megatron applies permuted_probs.
      4. combine: the unweighted sum of a token's rows.

    Args:
        buffer: the expert-parallel group's Buffer: H, E and the token dtype are its.
        ffn_hidden_size: F, inner width of each expert.
        router_topk, max_recv_tokens, pad_multiple: as in TokenDispatcher.

    Parameters, on the Buffer's device:
        router.weight: [E, H] float32, the same on every rank (seed every rank alike, or load
            the same weights); it only sees this rank's tokens, so all-reduce (sum) its gradient
            over the group, as for a data-parallel parameter.
        w_gate_up: [L, H, 2F], w_down: [L, F, H], in the Buffer's dtype: this rank's experts,
            global experts rank*L .. rank*L+L-1. Their gradients are complete on this rank.

    torch._grouped_mm wants rows whose strides are multiples of 16 bytes, so H and F must be
    multiples of 8; it runs on CPU in float32 and on CUDA in bfloat16.
    """

    def __init__(
        self,
        buffer: Buffer,
        ffn_hidden_size: int,
        router_topk: int,
        *,
        max_recv_tokens: int | None = None,
        pad_multiple: int = 1,
    ):
        super().__init__()
        self.dispatcher = TokenDispatcher(
            buffer, router_topk, max_recv_tokens=max_recv_tokens, pad_multiple=pad_multiple
        )
        hidden, ffn = buffer.hidden_size, ffn_hidden_size
        check_int("ffn_hidden_size", ffn, 1)
        if hidden % 8 or ffn % 8:
            raise ValueError(
                "torch._grouped_mm needs 16-byte row strides: hidden_size and ffn_hidden_size "
                f"must be multiples of 8, got {hidden} and {ffn}"
            )
        device, local = self.dispatcher.device, self.dispatcher.num_local_experts
        self.router = torch.nn.Linear(hidden, buffer.num_experts, bias=False, device=device)
        self.w_gate_up = torch.nn.Parameter(
            (torch.randn(local, hidden, 2 * ffn, device=device) / hidden**0.5).to(buffer.dtype)
        )
        self.w_down = torch.nn.Parameter(
            (torch.randn(local, ffn, hidden, device=device) / ffn**0.5).to(buffer.dtype)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1]).float()
        logits, topk_idx = self.router(tokens).topk(self.dispatcher.router_topk, dim=-1)
        probs = torch.softmax(logits, dim=-1)  # [T, K] float32

        x, tokens_per_expert, probs = self.dispatcher.dispatch(
            hidden_states, probs, topk_idx=topk_idx
        )
        offs = tokens_per_expert.cumsum(0).to(torch.int32)  # end row of each local expert
        # Rows past offs[-1] (the zero tail of a max_recv_tokens dispatch) have no expert.
        valid = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]
        gate, up = _grouped_mm(x, self.w_gate_up, offs, valid).chunk(2, dim=-1)
        h = F.silu(gate) * up * probs[:, None].to(x.dtype)
        return self.dispatcher.combine(_grouped_mm(h, self.w_down, offs, valid))


def _grouped_mm(x, w, offs, valid):
    """torch._grouped_mm(x, w, offs=offs) with zeros in the rows past offs[-1]. _grouped_mm
    leaves those rows uninitialised, in its output and in its input's gradient; combine and
    dispatch's backward ignore them, but masking both keeps garbage (maybe inf or NaN) out of
    every tensor of the forward and the backward pass."""
    x = torch.where(valid, x, 0)  # the same values; zeroes the gradient rows past offs[-1]
    return torch.where(valid, torch._grouped_mm(x, w, offs=offs), 0)


def check_wire_format(wire_format, hidden_size: int) -> None:
    """ValueError unless ``wire_format`` is None or a format that a Buffer of ``hidden_size``
    channels can quantize into as it sends (``Buffer.dispatch``'s quantize rule, checked here
    before any Buffer exists: the Megatron adapter checks before it builds one)."""
    check_quantize_format("wire_format", wire_format, hidden_size, takes_bools=False)


def _dequantized(rows, wire_format: str, dtype: torch.dtype) -> torch.Tensor:
    """A quantizing dispatch's (values, scales) as plain [N, H] rows of ``dtype``; values that
    are a ScaledValues (rows that required grad) pass the gradient straight through."""
    values, scales = rows
    if not isinstance(values, ScaledValues):
        values = ScaledValues(values, scales, SCALED_FORMATS[wire_format], dtype)
    return values.dequantize()


def _wait(outputs, async_finish: bool):
    """A Buffer call's outputs without the event of an ``async_finish`` call, once the calling
    stream waits for it (CPU ranks: no event)."""
    if not async_finish:
        return outputs
    *outputs, event = outputs
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def topk_from_map(routing_map, probs, topk):
    """[T, E] bool map and probs (or None) -> [T, K] ids (the K lowest routed expert ids, then
    -1) and their probs (0 for -1 slots; None without probs); gathered, so gradients flow back
    to probs. (Also the DeepEP drop-in's, deep_ep.HybridEPBuffer's routing maps.)"""
    ids = routing_map.argsort(dim=1, descending=True, stable=True)[:, :topk]
    routed = routing_map.gather(1, ids)
    if probs is None:
        return ids.masked_fill(~routed, -1), None
    return ids.masked_fill(~routed, -1), probs.gather(1, ids).masked_fill(~routed, 0.0)
