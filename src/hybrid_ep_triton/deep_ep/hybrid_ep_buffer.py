"""HybridEP's ``HybridEPBuffer`` (DeepEP's hybrid-ep branch) over ``hybrid_ep_triton.Buffer``.

The calls keep HybridEP's signatures, outputs and meanings, so that Megatron-Core's flex
dispatcher (backend "hybridep") and vLLM's hybrid_ep prepare/finalize run unchanged;
docs/deep_ep.md lists every difference. In brief:

- ``dispatch_with_permute`` / ``combine_with_unpermute`` are a Buffer of ``expand=True`` (rows
  grouped by local expert, padded per expert); ``dispatch`` / ``combine`` a Buffer of
  ``expand=False`` (one row per (token, rank)). A routing map becomes [T, K] slots of expert ids.
- The Buffers start at ``max_num_of_tokens_per_rank`` tokens and grow as DeepEP V1's normal mode
  does (``_sizing``); non-blocking calls (a fixed row count) do not grow them.
- ``combine_with_unpermute``'s probs gradient is the Buffer's own: the dispatch sends the
  per-slot probs as a leaf that requires grad and keeps the small autograd graph of its
  permuted probs in the handle; the combine differentiates it (one all_to_all over the group).

Shapes: T tokens of this rank, H ``hidden_dim``, E experts, L = E / group size local experts,
R ranks of an NVLink domain (a node), K slots per token, N rows received.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .. import Buffer as _HepBuffer
from ..runtime.checks import ranks_per_host
from ..runtime.planner import MAX_TOPK
from ._sizing import TOKEN_QUANTUM, Sized, gather, round_up
from .buffer import _dtype_of, _token_ranks, _values

_DOMAIN_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
# HybridEP passes FP8 rows as float8_e4m3fn or as their bytes.
_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


class TokenHandle(tuple):
    """A ``dispatch``'s handle: HybridEP's 7-tuple (sparse_to_dense_map, rdma_to_attn_map,
    attn_to_rdma_map, num_dispatched_tokens_tensor, local_expert_routing_map, num_of_tokens,
    config), with this library's handle and Buffer as attributes.

    num_dispatched_tokens_tensor [1] int32 on the CPU: N. local_expert_routing_map [N, L] bool:
    which of this rank's experts each row goes to. num_of_tokens: T. HybridEP's kernel tables and
    config are None. A tuple rebuilt from the parts lacks the attributes: calls refuse it.
    """

    inner: object  # the Buffer's DispatchHandle
    buffer: _HepBuffer

    def __new__(cls, parts, inner, buffer):
        handle = super().__new__(cls, parts)
        handle.inner, handle.buffer = inner, buffer
        return handle


class PermuteHandle(TokenHandle):
    """A ``dispatch_with_permute``'s handle: HybridEP's 11-tuple (sparse_to_dense_map,
    rdma_to_attn_map, attn_to_rdma_map, num_dispatched_tokens_tensor, local_expert_routing_map,
    row_id_map, num_permuted_tokens, tokens_per_expert, num_of_tokens_per_rank, config,
    overflow_flag), with what ``combine_with_unpermute`` needs as attributes.

    tokens_per_expert [L] int32: (token, expert) pairs per local expert, unpadded.
    num_of_tokens_per_rank: T. overflow_flag [1] int32 on the rows' device: 1 where the rows
    needed more than num_permuted_tokens (the rest were dropped). The other items are None.
    Attributes: ``recv_probs`` [N] float32 permuted probs with their graph back to
    ``slot_probs`` [T, K] float32 (both None without probs), ``counts`` the tokens_per_expert
    the dispatch returned (padded), ``num_of_experts`` E.
    """

    recv_probs: torch.Tensor | None
    slot_probs: torch.Tensor | None
    counts: torch.Tensor
    num_of_experts: int

    def __new__(cls, parts, inner, buffer, recv_probs, slot_probs, counts, num_of_experts):
        handle = super().__new__(cls, parts, inner, buffer)
        handle.recv_probs, handle.slot_probs = recv_probs, slot_probs
        handle.counts, handle.num_of_experts = counts, num_of_experts
        return handle


class HybridEPBuffer:
    """HybridEP's communication buffer for expert parallelism, on ``hybrid_ep_triton.Buffer``s.

    Collective, like HybridEP's: every rank of ``group`` makes one (a host all-gather of host
    names and token counts). The Buffers that move data are made at the first dispatch of each
    kind (permuted or token rows; its rows' dtype and device): docs/deep_ep.md, "Sizes".

    Args:
        group: the torch.distributed group of the expert-parallel ranks (NCCL, or gloo).
        hidden_dim: H, elements per token row.
        max_num_of_tokens_per_rank: tokens a rank passes to a dispatch: the Buffers' first
            capacity (the largest of the ranks', rounded up to 16); larger calls grow it.
        num_local_experts: L, experts per rank.
        use_fp8: HybridEP's FP8 rows: recorded; a call's rows are FP8 when it passes
            scaling_factor.
        num_sms_dispatch_api: HybridEP's SMs of dispatch: ignored (this library's tuning).
        num_sms_combine_api: HybridEP's SMs of combine: ignored.
        num_sms_preprocessing_api: HybridEP's SMs of its metadata scan: ignored.
        num_blocks_permute: HybridEP's blocks of its permute: ignored.
        num_blocks_unpermute: HybridEP's blocks of its unpermute: ignored.
        load_cached_kernels: HybridEP's JIT cache: ignored (Triton's cache holds the builds).
        use_shared_buffer: ignored.
        enable_custom_allgather: ignored.
        num_of_hybrid_ep_ranks_per_nvlink_domain: R, consecutive ranks of a node; None: the
            environment's NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, else the ranks of a host.
        use_mnnvl: ignored (nodes are R ranks).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: int = 32,
        num_sms_combine_api: int = 32,
        num_sms_preprocessing_api: int = 108,
        num_blocks_permute: int | None = None,
        num_blocks_unpermute: int | None = None,
        load_cached_kernels: bool = False,
        use_shared_buffer: bool = True,
        enable_custom_allgather: bool = True,
        num_of_hybrid_ep_ranks_per_nvlink_domain: int | None = None,
        use_mnnvl: bool | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        everyone = gather(group, (socket.gethostname(), max_num_of_tokens_per_rank))
        per_domain = num_of_hybrid_ep_ranks_per_nvlink_domain or int(
            os.environ.get(_DOMAIN_ENV, "0")
        )
        if not per_domain:
            per_domain = ranks_per_host([host for host, _ in everyone])
        if per_domain < 1 or self.group_size % per_domain:
            raise ValueError(
                f"the ranks per NVLink domain ({per_domain}) must divide the group size "
                f"{self.group_size}"
            )
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = per_domain
        self.local_rank = self.rank % per_domain
        self.node_rank = self.rank // per_domain
        self.num_of_nodes = self.group_size // per_domain
        self.hidden_dim = hidden_dim
        self.num_local_experts = num_local_experts
        self.num_of_experts = num_local_experts * self.group_size
        self.use_fp8 = use_fp8
        # Every rank sizes alike: Megatron-Core passes each rank's first token count.
        largest = max(tokens for _, tokens in everyone)
        self.max_num_of_tokens_per_rank = round_up(max(largest, 1), TOKEN_QUANTUM)
        self._sized = Sized(group, self._make)
        self._sized.capacity = self.max_num_of_tokens_per_rank

    # -- HybridEP's small calls ------------------------------------------------------------

    def update_template_config(self, *args, **kwargs):
        """Unsupported: there are no HybridEP kernel templates to configure."""
        raise ValueError(
            "update_template_config is not supported: this library's kernels take their "
            "parameters from its tuning cache, not HybridEP's templates"
        )

    def empty_jit_cache(self) -> None:
        """Nothing to do: Triton's cache holds the kernel builds."""

    def destroy(self) -> None:
        """Free every Buffer, earlier (smaller) ones too (collective)."""
        self._sized.destroy()

    # -- permuted rows ---------------------------------------------------------------------

    def dispatch_with_permute(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        num_of_experts: int | None = None,
        use_fp8: bool | None = None,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        scaling_factor: torch.Tensor | None = None,
        num_permuted_tokens: int | None = None,
        pad_multiple: int | None = None,
        handle: PermuteHandle | None = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
        num_dispatched_tokens: int | None = None,
        use_host_meta: bool | None = None,
    ):
        """Send each token to its experts' ranks, one row per (token, local expert). Collective.

        Args:
            hidden: [T, H] rows (bf16, fp16, fp32), or FP8 values (float8_e4m3fn or uint8).
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused; or routing_map.
            topk_weights: [T, K] float32 probs of those slots, or None.
            num_of_experts_per_rank: L, or None.
            num_of_experts: E with topk_idx, or None (the buffer's).
            use_fp8: accepted; the rows are FP8 when scaling_factor is given.
            routing_map: [T, E] bool, True where a token goes to an expert.
            probs: [T, E] float32 with routing_map, or None.
            scaling_factor: [T, H / 128] float32 scales of FP8 hidden, or None.
            num_permuted_tokens: with non_blocking, the rows returned (M); else not read.
            pad_multiple: pad each local expert's rows with zero rows of prob 0 to a multiple of
                it (None: 1).
            handle: an earlier dispatch_with_permute's: send hidden along its routing.
            non_blocking: M rows, no host synchronisation, no growth (needs
                num_permuted_tokens).
            fuse_permute_dispatch: accepted (the permute is always fused).
            num_dispatched_tokens: HybridEP's count of received tokens: not read.
            use_host_meta: HybridEP's host metadata: not read.

        Returns:
            dispatched hidden [N, H] in hidden's dtype (rows by local expert, then source
            rank, then source token; padding zero), dispatched probs [N] float32 (0 on padding)
            or None, dispatched scaling factor [N, H / 128] float32 or None, tokens_per_expert
            [L] int64 padded (blocking: on the CPU; else on the rows' device), the handle.
        """
        with torch.no_grad():
            rows = self._rows(hidden, scaling_factor)
            if handle is not None:
                return self._permute_along(rows, hidden, topk_weights, probs, handle)
            if non_blocking and num_permuted_tokens is None:
                raise ValueError("a non_blocking dispatch_with_permute needs num_permuted_tokens")
            self._check_experts_per_rank(num_of_experts_per_rank)
            slots, slot_probs, map_overflow = self._routing(
                topk_idx, topk_weights, num_of_experts, routing_map, probs, not non_blocking
            )
            pad = pad_multiple or 1
            worst = int(num_permuted_tokens) if non_blocking else None
            kind = (True, _dtype_of(rows), _values(rows).device)
            buffer, outputs, stats, leaf = self._sized.run(
                _values(rows).shape[0],
                lambda: self._send(kind, rows, slots, slot_probs, pad, worst, keep_graph=True),
                growable=worst is None,
            )
            recv, recv_probs, tokens_per_expert, inner = outputs
            values, scales = recv if isinstance(recv, tuple) else (recv, None)
            overflow = torch.zeros(1, dtype=torch.int32, device=stats.device)
            if worst is not None:
                # The rows needed, padding included, against M: on the device, no host read.
                needed = round_up(stats, pad).sum()
                over = needed > worst
                if map_overflow is not None:
                    over = over | map_overflow
                overflow = over.int().reshape(1)
            # A view of the Buffer's handle: a copy, as HybridEP's output is its own.
            tokens_per_expert = (
                tokens_per_expert.cpu() if worst is None else tokens_per_expert.clone()
            )
            parts = (None,) * 7 + (stats.int(), hidden.shape[0], None, overflow)
            handle = PermuteHandle(
                parts, inner, buffer, recv_probs, leaf, tokens_per_expert, self.num_of_experts
            )
            dispatched_probs = None if recv_probs is None else recv_probs.detach()
            return values.view(hidden.dtype), dispatched_probs, scales, tokens_per_expert, handle

    def combine_with_unpermute(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor | None = None,
        handle: PermuteHandle | None = None,
        pad_multiple: int | None = None,
        fuse_unpermute_combine: bool = False,
        num_dispatched_tokens: int | None = None,
    ):
        """Sum each token's rows from every rank, unweighted (padding ignored). Collective.

        Args:
            hidden: [N, H] rows in the dispatch's order, of the dispatched rows' dtype.
            probs: [N] float32 per-row values (e.g. the gradient of the dispatched probs), or
                None.
            handle: the dispatch_with_permute's handle.
            pad_multiple: accepted (the handle's padding is used).
            fuse_unpermute_combine: accepted (the unpermute is always fused).
            num_dispatched_tokens: HybridEP's count of received tokens: not read.

        Returns:
            combined hidden [T, H] (the sum in fp32, rounded to hidden's dtype), combined probs
            [T, E] float32 (each (token, expert)'s row value, 0 elsewhere) or None without probs.
        """
        handle = _own(handle, PermuteHandle, "dispatch_with_permute")
        with torch.no_grad():
            combined = handle.buffer.combine(hidden.detach().contiguous(), handle.inner)
        if probs is None:
            return combined, None
        if handle.slot_probs is None:
            raise ValueError("combine_with_unpermute got probs for a dispatch made without probs")
        with torch.enable_grad():
            # Kept (retain_graph): the graph's tensors live in the handle anyway.
            (grad,) = torch.autograd.grad(
                handle.recv_probs, handle.slot_probs, probs.detach().float(), retain_graph=True
            )
        return combined, _scatter_slots(grad, handle.inner.topk_idx, handle.num_of_experts)

    # -- token rows ------------------------------------------------------------------------

    def dispatch(
        self,
        hidden: torch.Tensor,
        scaling_factor: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_of_experts: int | None = None,
        probs: torch.Tensor | None = None,
        routing_map: torch.Tensor | None = None,
        num_dispatched_tokens_tensor: torch.Tensor | None = None,
        num_dispatched_tokens: int | None = None,
        handle: TokenHandle | None = None,
    ):
        """Send each token to the ranks of its experts, one row per (token, rank). Collective.

        Args:
            hidden: [T, H] rows (bf16, fp16, fp32), or FP8 values (float8_e4m3fn or uint8).
            scaling_factor: [T, H / 128] float32 scales of FP8 hidden, or None.
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused; or routing_map.
            topk_weights: [T, K] float32 probs of those slots, or None.
            num_of_experts: E with topk_idx, or None (the buffer's).
            probs: [T, E] float32 with routing_map, or None.
            routing_map: [T, E] bool, True where a token goes to an expert.
            num_dispatched_tokens_tensor: HybridEP's count tensor: not read (the handle has it).
            num_dispatched_tokens: None: exactly the rows received (a host read); N: N rows, no
                host synchronisation, no growth.
            handle: an earlier dispatch's: send hidden along its routing.

        Returns:
            dispatched hidden [N, H] in hidden's dtype (by source rank, then source token),
            dispatched probs [N, L * R] float32 (the columns of this rank's experts; the node's
            other ranks' 0) or None, dispatched scaling factor [N, H / 128] float32 or None,
            the handle (a TokenHandle).
        """
        with torch.no_grad():
            rows = self._rows(hidden, scaling_factor)
            if handle is not None:
                handle = _own(handle, TokenHandle, "dispatch")
                recv, recv_topk_idx, recv_weights = self._along(rows, topk_weights, probs, handle)
            else:
                blocking = num_dispatched_tokens is None
                slots, weights, _ = self._routing(
                    topk_idx, topk_weights, num_of_experts, routing_map, probs, blocking
                )
                kind = (False, _dtype_of(rows), _values(rows).device)
                buffer, outputs, _, _ = self._sized.run(
                    _values(rows).shape[0],
                    lambda: self._send(kind, rows, slots, weights, 1, num_dispatched_tokens),
                    growable=blocking,
                )
                recv, recv_topk_idx, recv_weights, _, inner = outputs
            recv_values, scales = recv if isinstance(recv, tuple) else (recv, None)
            dispatched_probs = None
            if recv_weights is not None:
                # This rank's experts' columns among the node's R * L.
                per_node = self.num_of_hybrid_ep_ranks_per_nvlink_domain * self.num_local_experts
                first = self.local_rank * self.num_local_experts
                node_slots = torch.where(recv_topk_idx >= 0, recv_topk_idx + first, -1)
                dispatched_probs = _scatter_slots(recv_weights, node_slots, per_node)
            if handle is None:
                # A row's "ranks" with one expert a rank are its local experts.
                local = _token_ranks(recv_topk_idx, 1, self.num_local_experts)
                count = torch.tensor([recv_values.shape[0]], dtype=torch.int32, device="cpu")
                parts = (None, None, None, count, local, hidden.shape[0], None)
                handle = TokenHandle(parts, inner, buffer)
            return recv_values.view(hidden.dtype), dispatched_probs, scales, handle

    def combine(
        self, hidden: torch.Tensor, probs: torch.Tensor | None = None, handle=None
    ) -> tuple[torch.Tensor, None]:
        """Sum each token's rows from every rank it went to, unweighted. Collective.

        Args:
            hidden: [N, H] rows in the dispatch's order, of the dispatched rows' dtype.
            probs: unsupported (ValueError): combine_with_unpermute returns the probs' way back.
            handle: the dispatch's handle.

        Returns:
            combined hidden [T, H] (the sum in fp32, rounded to hidden's dtype), None.
        """
        if probs is not None:
            raise ValueError(
                "combine's probs are not supported: use dispatch_with_permute and "
                "combine_with_unpermute, which return the probs' gradient"
            )
        handle = _own(handle, TokenHandle, "dispatch")
        with torch.no_grad():
            return handle.buffer.combine(hidden.detach().contiguous(), handle.inner), None

    # -- internals -------------------------------------------------------------------------

    def _make(self, kind, capacity: int) -> _HepBuffer:
        """The Buffer of ``kind`` (expand, dtype, device) for ``capacity`` tokens a rank."""
        expand, dtype, device = kind
        return _HepBuffer(
            self.group,
            hidden_size=self.hidden_dim,
            max_tokens_per_rank=capacity,
            num_experts=self.num_of_experts,
            dtype=dtype,
            expand=expand,
            device=device,
            ranks_per_node=self.num_of_hybrid_ep_ranks_per_nvlink_domain,
        )

    def _rows(self, hidden: torch.Tensor, scaling_factor: torch.Tensor | None):
        """hidden as the Buffer takes it: contiguous rows, or an FP8 pair (values, scales)."""
        hidden = hidden.detach().contiguous()
        if scaling_factor is None:
            if hidden.dtype in _FP8_DTYPES:
                raise ValueError(f"{hidden.dtype} hidden needs its scaling_factor")
            return hidden
        if hidden.dtype not in _FP8_DTYPES:
            raise ValueError(f"scaling_factor goes with FP8 hidden, got {hidden.dtype} rows")
        return hidden.view(torch.float8_e4m3fn), scaling_factor.detach().float().contiguous()

    def _check_experts_per_rank(self, num_of_experts_per_rank: int | None) -> None:
        if num_of_experts_per_rank not in (None, self.num_local_experts):
            raise ValueError(
                f"num_of_experts_per_rank must be the buffer's {self.num_local_experts}, got "
                f"{num_of_experts_per_rank}"
            )

    def _routing(self, topk_idx, topk_weights, num_of_experts, routing_map, probs, blocking):
        """[T, K] slots (global expert ids, -1 unused), their float32 probs or None, and (a
        routing map when not blocking) a bool device scalar: some row had more than K."""
        if routing_map is not None:
            experts = routing_map.shape[-1]
            self._check_experts(experts)
            routing_map = routing_map.reshape(-1, experts)
            routed = routing_map.sum(dim=1)
            overflow = None
            if blocking:
                topk = int(routed.max()) if routed.numel() else 0  # one host read
            else:
                topk = min(experts, MAX_TOPK)
                overflow = (routed > topk).any()
            ids = torch.where(
                routing_map, torch.arange(self.num_of_experts, device=routing_map.device), experts
            )
            # Each row's K lowest routed ids (the Buffer takes at least one slot).
            ids = ids.topk(max(topk, 1), dim=1, largest=False).values
            slots = torch.where(ids < experts, ids, -1)
            slot_probs = None
            if probs is not None:
                taken = probs.reshape(-1, experts).gather(1, slots.clamp(min=0))
                slot_probs = torch.where(slots >= 0, taken.float(), 0.0)
            return slots, slot_probs, overflow
        if topk_idx is None:
            raise ValueError("pass topk_idx (with num_of_experts) or routing_map")
        self._check_experts(num_of_experts or self.num_of_experts)
        weights = None if topk_weights is None else topk_weights.float().contiguous()
        return topk_idx, weights, None

    def _check_experts(self, num_of_experts: int) -> None:
        if num_of_experts != self.num_of_experts:
            raise ValueError(
                f"the routing must cover the buffer's {self.num_of_experts} experts "
                f"({self.num_local_experts} a rank), got {num_of_experts}"
            )

    def _send(self, kind, rows, slots, slot_probs, pad, worst, keep_graph=False):
        """A dispatch with a new layout on the Buffer of ``kind``: (the Buffer, its outputs,
        each local expert's (token, expert) pairs [L] int64, the probs' leaf or None). With
        ``keep_graph`` the per-slot probs are a leaf that requires grad, so that the permuted
        probs keep their graph (combine_with_unpermute's gradient)."""
        buffer = self._sized.buffer(kind)
        stats = torch.zeros(self.num_local_experts, dtype=torch.int64, device=buffer.device)
        leaf = slot_probs
        if keep_graph and slot_probs is not None:
            leaf = slot_probs.detach().requires_grad_(True)
        with torch.set_grad_enabled(keep_graph):
            outputs = buffer.dispatch(
                rows,
                slots,
                leaf,
                pad_multiple=pad,
                max_recv_tokens=worst,
                expert_recv_stats=stats,
            )
        return buffer, outputs, stats, leaf if keep_graph else None

    def _along(self, rows, topk_weights, probs, handle: TokenHandle):
        """A dispatch along ``handle``: recv rows, then (token rows) recv_topk_idx, and the
        received per-row probs or None (probs [T, E] or topk_weights [T, K] given)."""
        slots = handle.inner.topk_idx
        weights = None
        if topk_weights is not None:
            weights = topk_weights.float().contiguous()
        elif probs is not None:
            taken = probs.reshape(slots.shape[0], -1).gather(1, slots.long().clamp(min=0))
            weights = torch.where(slots >= 0, taken.float(), 0.0)
        outputs = handle.buffer.dispatch(rows, topk_weights=weights, handle=handle.inner)
        if handle.buffer.expand:
            recv, recv_weights, _, _ = outputs
            return recv, recv_weights
        recv, recv_topk_idx, recv_weights, _, _ = outputs
        return recv, recv_topk_idx, recv_weights

    def _permute_along(self, rows, hidden, topk_weights, probs, handle):
        """dispatch_with_permute along ``handle``: its outputs, the handle's counts."""
        handle = _own(handle, PermuteHandle, "dispatch_with_permute")
        recv, recv_probs = self._along(rows, topk_weights, probs, handle)
        values, scales = recv if isinstance(recv, tuple) else (recv, None)
        return values.view(hidden.dtype), recv_probs, scales, handle.counts, handle


def _own(handle, kind: type, call: str):
    """``handle`` if it is a handle of ``kind`` (that of ``call``), else ValueError."""
    if type(handle) is not kind:
        raise ValueError(
            f"handle must be the one {call} returned (a tuple rebuilt from its parts lacks "
            f"this library's handle), got {type(handle).__name__}"
        )
    return handle


def _scatter_slots(per_slot, slots, num_experts):
    """[T, K] per-slot values to [T, E] at each slot's expert (-1 slots dropped)."""
    columns = torch.where(slots >= 0, slots.long(), num_experts)
    full = torch.zeros(
        slots.shape[0], num_experts + 1, dtype=per_slot.dtype, device=per_slot.device
    )
    full.scatter_(1, columns, torch.where(slots >= 0, per_slot, 0.0))
    return full[:, :num_experts]


def indices_to_map(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_of_tokens: int,
    num_of_experts: int,
):
    """HybridEP's conversion of top-k routing to a routing map, on topk_idx's device.

    Args:
        topk_idx: [T, K] int64 (or int32) global expert ids, -1 for an unused slot (skipped).
        topk_weights: [T, K] probs of those slots, or None.
        num_of_tokens: rows of the outputs, at least T (rows past T route nowhere).
        num_of_experts: E.

    Returns:
        routing_map [num_of_tokens, E] bool, probs [num_of_tokens, E] of topk_weights' dtype
        (0 where not routed) or None.
    """
    extra = num_of_tokens - topk_idx.shape[0]
    if extra < 0:
        raise ValueError(
            f"num_of_tokens {num_of_tokens} is less than topk_idx's {topk_idx.shape[0]}"
        )
    if extra:
        topk_idx = torch.cat([topk_idx, topk_idx.new_full((extra, topk_idx.shape[1]), -1)])
        if topk_weights is not None:
            topk_weights = torch.cat(
                [topk_weights, topk_weights.new_zeros(extra, topk_idx.shape[1])]
            )
    # A token's "ranks" with one expert a rank are its experts.
    routing_map = _token_ranks(topk_idx, 1, num_of_experts)
    probs = None
    if topk_weights is not None:
        probs = _scatter_slots(topk_weights, topk_idx, num_of_experts)
    return routing_map, probs
