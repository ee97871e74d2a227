"""The low-latency mode of DeepEP V1's ``Buffer`` (deep_ep.Buffer inherits it): each call
one call of the low-latency native Buffer, made in the heap the constructor reserves."""

from __future__ import annotations

import torch
import triton

from .. import Buffer as NativeBuffer
from ..ops.reserved import ReservedHeap
from ..runtime.checks import check_mask_out, check_maskable
from .config import tokens_that_fit
from .sizing import Handle, check_handle
from .utils.event import overlap

# A low-latency Buffer's heap beside the area DeepEP's hint covers (the mask, the normal mode's
# flags, a token row per rank): tens of KB at DeepEP's test sizes, a few MB across many nodes.
BESIDE_LOW_LATENCY_BYTES = 8 << 20

__all__ = ["BESIDE_LOW_LATENCY_BYTES", "LowLatencyMode"]


class LowLatencyMode:
    """DeepEP's low-latency calls and rank masking, on one native Buffer made at the first
    low-latency call (again, larger, where a call needs more); see deep_ep.Buffer."""

    def _reserve_low_latency(self) -> None:
        """The constructor's part: with low_latency_mode and num_rdma_bytes, the low-latency
        Buffer's heap, reserved as DeepEP allocates its RDMA buffer (collective), so that the
        first low-latency call waits for no rank on the host (enable_shrink: one may be gone)."""
        self._reserved = self._low_latency = None
        if self.low_latency_mode and self.num_rdma_bytes > 0:
            device = torch.device("cpu")  # CPU ranks: kernels in Triton's interpreter
            if not triton.knobs.runtime.interpret:
                device = torch.device("cuda", torch.cuda.current_device())
            nbytes = self.num_rdma_bytes + BESIDE_LOW_LATENCY_BYTES
            self._reserved = ReservedHeap(self.group, nbytes, device, self.ranks_per_node)
        self._masked = torch.zeros(self.group_size, dtype=torch.int32, device="cpu")
        self._retired: list[NativeBuffer] = []

    def _destroy_low_latency(self) -> None:
        """Free the low-latency Buffers and the reserved heap (collective)."""
        for buffer in [*self._retired, self._low_latency]:
            if buffer is not None:
                buffer.destroy()
        if self._reserved is not None:
            self._reserved.release(self.timeout_s)
        self._retired, self._low_latency, self._reserved = [], None, None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean (flags carry sequence numbers): checks low_latency_mode, as DeepEP
        does; once the low-latency Buffer exists, its barrier of the live ranks."""
        self._check_mode("low_latency_mode")
        if self._low_latency is not None:
            tokens = min(num_max_dispatch_tokens_per_rank, self._low_latency.low_latency_tokens)
            self._low_latency.clean_low_latency_buffer(tokens, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False,
                             **hybrid_ep_branch_args):  # fmt: skip
        """DeepEP's low-latency dispatch (``hybrid_ep_triton.Buffer.low_latency_dispatch``).

        Args:
            x: [T, H] bf16, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: [T, K] int64 global expert ids, -1 unused.
            num_max_dispatch_tokens_per_rank: M', the same on every rank and call of one size.
            num_experts: E.
            cumulative_local_expert_recv_stats: [L] int32 each call adds its counts to, or None.
            dispatch_wait_recv_cost_stats: DeepEP's per-rank wait times: accepted, not updated.
            use_fp8, round_scale, use_ue8m0: the FP8 format (DeepEP's rules).
            async_finish: return an event of the call's completion.
            return_recv_hook: send only; hook() receives.
            hybrid_ep_branch_args: the hybrid-ep branch's extras: ValueError when set.

        Returns: recv_x (or (values, scales)), recv_count [L] int32, handle, event, hook.
        """
        _refuse_extras("low_latency_dispatch", hybrid_ep_branch_args)
        buffer = self._low_latency_buffer(x, num_max_dispatch_tokens_per_rank, num_experts)
        with torch.no_grad():
            recv_x, count, native, event, hook = buffer.low_latency_dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                use_fp8=use_fp8,
                round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
            )
        handle = Handle(tuple(native)[:5], native, buffer)
        return recv_x, count, handle, overlap((event,), async_finish), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None,
                            **hybrid_ep_branch_args):  # fmt: skip
        """DeepEP's low-latency combine (``hybrid_ep_triton.Buffer.low_latency_combine``).

        Args:
            x: [L, W * M', H] bf16 expert outputs in recv_x's rows.
            topk_idx: the dispatch's [T, K] ids.
            topk_weights: [T, K] float32 weights.
            handle: the dispatch's handle (DeepEP's 5-tuple).
            use_logfmt: DeepEP's 10-bit transfer format: ignored (rows travel in bf16, exact).
            zero_copy: read get_next_low_latency_combine_buffer's buffer, not x.
            async_finish, return_recv_hook: as for ``low_latency_dispatch``.
            out: [T, H] bf16 to write into, or None.
            combine_wait_recv_cost_stats: DeepEP's per-rank wait times: accepted, not updated.
            hybrid_ep_branch_args: the hybrid-ep branch's extras: ValueError when set.

        Returns: combined_x [T, H], event, hook.
        """
        _refuse_extras("low_latency_combine", hybrid_ep_branch_args)
        check_handle(handle)
        if zero_copy:  # DeepEP reads the buffer the experts wrote into, whatever x is
            x = self.get_next_low_latency_combine_buffer(handle)
        with torch.no_grad():
            combined, event, hook = handle.buffer.low_latency_combine(
                x,
                topk_idx,
                topk_weights,
                handle.native,
                zero_copy=zero_copy,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
                out=out,
            )
        return combined, overlap((event,), async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """[L, W * M', H] bf16 in the heap, for the experts' outputs of the next combine."""
        check_handle(handle)
        return handle.buffer.get_next_low_latency_combine_buffer(handle.native)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask``) or unmask ``rank_to_mask``, another rank (enable_shrink)."""
        self._check_mode("enable_shrink")
        check_maskable(rank_to_mask, self.rank, self.group_size)
        self._masked[rank_to_mask] = int(bool(mask))
        if self._low_latency is not None:
            self._low_latency.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write int32 [W], 1 where a rank is masked, into ``mask_status`` (enable_shrink)."""
        self._check_mode("enable_shrink")
        if self._low_latency is not None:
            return self._low_latency.query_mask(mask_status)
        check_mask_out(mask_status, self.group_size, None)
        mask_status.copy_(self._masked)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (enable_shrink)."""
        self._check_mode("enable_shrink")
        self._masked.zero_()
        if self._low_latency is not None:
            self._low_latency.clean_mask()

    def _check_mode(self, flag: str) -> None:
        """ValueError unless the constructor's ``flag`` is set (DeepEP asserts it)."""
        if not getattr(self, flag):
            raise ValueError(f"this call needs a Buffer made with {flag}=True, as DeepEP's")

    def _low_latency_buffer(self, x, tokens: int, num_experts: int) -> NativeBuffer:
        """The low-latency Buffer, made (again, larger) when a call needs it. Every rank passes
        the same M', hidden size and E (DeepEP's rule), so each decides alike."""
        self._check_mode("low_latency_mode")
        buffer, hidden = self._low_latency, x.shape[-1]
        shape = hidden, num_experts, x.dtype
        if (
            buffer is not None
            and buffer.low_latency_tokens >= tokens
            and shape == (buffer.hidden_size, buffer.num_experts, buffer.dtype)
        ):
            return buffer
        if buffer is not None:
            self._retired.append(buffer)
        fit = tokens_that_fit(self.num_rdma_bytes, hidden, self.group_size, num_experts)
        buffer = self._low_latency = NativeBuffer(
            self.group,
            hidden_size=hidden,
            max_tokens_per_rank=0,
            num_experts=num_experts,
            dtype=x.dtype,
            ranks_per_node=self.ranks_per_node,
            device=x.device,
            low_latency_tokens=max(tokens, fit),
            mask_failed_ranks=self.enable_shrink,
            timeout_s=self.timeout_s,
            heap=self._reserved,
        )
        for rank in self._masked.nonzero().flatten().tolist():
            buffer.update_mask(rank, True)
        return buffer


def _refuse_extras(call: str, extras: dict) -> None:
    """The hybrid-ep branch's extra arguments: unsupported unless off."""
    on = sorted(name for name, value in extras.items() if value not in (None, False, 0))
    if on:
        raise ValueError(f"{call}: unsupported argument(s) {on} (docs/deep_ep.md)")
