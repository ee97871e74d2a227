"""HybridEP's ``HybridEPBuffer`` (DeepEP's hybrid-ep branch) over ``hybrid_ep_triton.Buffer``.

HybridEP's signatures, outputs and meanings (Megatron-Core's flex dispatcher "hybridep", vLLM's
hybrid_ep prepare/finalize), each call one native call: ``dispatch_with_permute`` /
``combine_with_unpermute`` on a Buffer of ``expand=True`` (rows by local expert, padded),
``dispatch`` / ``combine`` on one of ``expand=False`` (a row per (token, rank)), sized as
``sizing`` says. A routing map becomes [T, K] slots of expert ids. ``combine_with_unpermute``'s
probs gradient is the native Buffer's autograd: the dispatch sends the per-slot probs as a leaf
that requires grad, and the handle keeps the permuted probs' graph, which the combine
differentiates (one all_to_all). docs/deep_ep.md lists every difference.

Shapes: T tokens of this rank, H ``hidden_dim``, E experts, L = E / group size local experts,
R ranks of an NVLink domain (a node), K slots per token, N rows received.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .. import Buffer as NativeBuffer
from ..moe import topk_from_map
from ..runtime.checks import ranks_per_host
from ..runtime.planner import MAX_TOPK
from .routing import hybrid_rows, indices_to_map, received_values, scatter_slots
from .sizing import TOKEN_QUANTUM, Handle, Sized, check_handle, gather, round_up

DOMAIN_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"

__all__ = ["HybridEPBuffer", "indices_to_map"]


class HybridEPBuffer:
    """HybridEP's communication buffer for expert parallelism, on native Buffers.

    Collective: every rank of ``group`` makes one (a host all-gather of host names and token
    counts). The native Buffers are made at the first dispatch of each kind (permuted or token
    rows; its rows' dtype and device): docs/deep_ep.md, "Sizes".

    Args:
        group: the torch.distributed group of the expert-parallel ranks (NCCL, or gloo).
        hidden_dim: H, elements per token row.
        max_num_of_tokens_per_rank: the Buffers' first capacity (the ranks' largest, to 16).
        num_local_experts: L, experts per rank.
        use_fp8: recorded; a call's rows are FP8 when it passes scaling_factor.
        num_sms_dispatch_api: ignored (this library's tuning), as the other SM counts.
        num_sms_combine_api: ignored.
        num_sms_preprocessing_api: ignored.
        num_blocks_permute: ignored.
        num_blocks_unpermute: ignored.
        load_cached_kernels: ignored (Triton's cache holds the builds).
        use_shared_buffer: ignored.
        enable_custom_allgather: ignored.
        num_of_hybrid_ep_ranks_per_nvlink_domain: R (None: $DOMAIN_ENV, else a host's ranks).
        use_mnnvl: ignored.
    """

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 use_fp8=False, num_sms_dispatch_api=32, num_sms_combine_api=32,
                 num_sms_preprocessing_api=108, num_blocks_permute=None,
                 num_blocks_unpermute=None, load_cached_kernels=False, use_shared_buffer=True,
                 enable_custom_allgather=True, num_of_hybrid_ep_ranks_per_nvlink_domain=None,
                 use_mnnvl=None):  # fmt: skip
        self.group, self.rank = group, dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        everyone = gather(group, (socket.gethostname(), max_num_of_tokens_per_rank))
        per_domain = num_of_hybrid_ep_ranks_per_nvlink_domain or int(os.getenv(DOMAIN_ENV, "0"))
        per_domain = per_domain or ranks_per_host([host for host, _ in everyone])
        if per_domain < 1 or self.group_size % per_domain:
            raise ValueError(f"the ranks per NVLink domain ({per_domain}) must divide the group")
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = per_domain
        self.local_rank, self.node_rank = self.rank % per_domain, self.rank // per_domain
        self.num_of_nodes = self.group_size // per_domain
        self.hidden_dim, self.num_local_experts = hidden_dim, num_local_experts
        self.num_of_experts, self.use_fp8 = num_local_experts * self.group_size, use_fp8
        # Every rank sizes alike: Megatron-Core passes each rank's first token count.
        largest = max(tokens for _, tokens in everyone)
        self.max_num_of_tokens_per_rank = round_up(max(largest, 1), TOKEN_QUANTUM)
        self._sized = {
            expand: Sized(group, self._make, self.max_num_of_tokens_per_rank)
            for expand in (True, False)
        }

    def update_template_config(self, *args, **kwargs):
        """Unsupported: there are no HybridEP kernel templates to configure."""
        raise ValueError("update_template_config is not supported (no HybridEP templates)")

    def empty_jit_cache(self) -> None:
        """Nothing to do: Triton's cache holds the kernel builds."""

    def destroy(self) -> None:
        """Free every Buffer, earlier (smaller) ones too (collective)."""
        for sized in self._sized.values():
            sized.destroy()

    def dispatch_with_permute(self, hidden, topk_idx=None, topk_weights=None,
                              num_of_experts_per_rank=None, num_of_experts=None, use_fp8=None,
                              routing_map=None, probs=None, scaling_factor=None,
                              num_permuted_tokens=None, pad_multiple=None, handle=None,
                              non_blocking=False, fuse_permute_dispatch=False,
                              num_dispatched_tokens=None, use_host_meta=None):  # fmt: skip
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
            pad_multiple: pad each local expert's rows with zero rows (prob 0) to it (None: 1).
            handle: an earlier dispatch_with_permute's: send hidden along its routing.
            non_blocking: M rows, no host synchronisation, no growth.
            fuse_permute_dispatch: accepted (the permute is always fused).
            num_dispatched_tokens: not read.
            use_host_meta: not read.

        Returns: hidden [N, H] of hidden's dtype (rows by local expert, then source rank and
        token; padding zero), probs [N] float32 (0 on padding) or None, scaling factor
        [N, H / 128] float32 or None, tokens_per_expert [L] int64 padded (blocking: on the CPU),
        the handle (HybridEP's 11-tuple: [7] tokens_per_expert [L] int32 unpadded, [8] T, [10]
        overflow_flag [1] int32, 1 where the rows needed more than M; the others None).
        """
        if handle is not None:
            recv, recv_probs = self._along(
                hidden, scaling_factor, topk_weights, probs, handle, True
            )
            values, scales = received_values(recv, hidden)
            return values, recv_probs, scales, handle.counts, handle
        worst = num_permuted_tokens if non_blocking else None
        rows, (slots, slot_probs, map_overflow), refused = self._inputs(
            hidden,
            scaling_factor,
            topk_idx,
            topk_weights,
            num_of_experts,
            routing_map,
            probs,
            num_of_experts_per_rank,
            not non_blocking,
            non_blocking and worst is None,
        )
        pad, stats, leaf = pad_multiple or 1, None, None
        if refused is None:
            stats = torch.zeros(self.num_local_experts, dtype=torch.int64, device=hidden.device)
            if slot_probs is not None:  # a leaf, so that the permuted probs keep their graph
                leaf = slot_probs.detach().requires_grad_(True)

        def call(buffer, refused):
            if refused is not None:
                buffer.refuse("dispatch", *refused, max_recv_tokens=worst)
            with torch.enable_grad():
                return buffer.dispatch(
                    rows,
                    slots,
                    leaf,
                    pad_multiple=pad,
                    max_recv_tokens=worst,
                    expert_recv_stats=stats,
                )

        recv, recv_probs, tokens_per_expert, native = self._run(True, rows, call, refused, worst)
        overflow = torch.zeros(1, dtype=torch.int32, device=stats.device)
        if worst is not None:  # the rows needed, padding included, against M: no host read
            over = round_up(stats, pad).sum() > worst
            overflow = (over if map_overflow is None else over | map_overflow).int().reshape(1)
        # A copy of the native handle's counts, as HybridEP's output is its own.
        counts = tokens_per_expert.cpu() if worst is None else tokens_per_expert.clone()
        parts = (None,) * 7 + (stats.int(), hidden.shape[0], None, overflow)
        handle = Handle(
            parts,
            native,
            self._sized[True].buffer,
            recv_probs=recv_probs,
            slot_probs=leaf,
            counts=counts,
        )
        values, scales = received_values(recv, hidden)
        recv_probs = None if recv_probs is None else recv_probs.detach()
        return values, recv_probs, scales, counts, handle

    def combine_with_unpermute(self, hidden, probs=None, handle=None, pad_multiple=None,
                               fuse_unpermute_combine=False,
                               num_dispatched_tokens=None):  # fmt: skip
        """Sum each token's rows from every rank, unweighted (padding ignored). Collective.

        Args:
            hidden: [N, H] rows in the dispatch's order, of the dispatched rows' dtype.
            probs: [N] float32 per-row values (e.g. the dispatched probs' gradient), or None.
            handle: the dispatch_with_permute's handle.
            pad_multiple: accepted (the handle's padding is used).
            fuse_unpermute_combine: accepted (the unpermute is always fused).
            num_dispatched_tokens: not read.

        Returns: hidden [T, H] (fp32 sums rounded to hidden's dtype), combined probs [T, E]
        float32 (each (token, expert)'s row value, 0 elsewhere) or None without probs.
        """
        check_handle(handle, expand=True)
        with torch.no_grad():
            combined = handle.buffer.combine(hidden.detach().contiguous(), handle.native)
        if probs is None:
            return combined, None
        if handle.slot_probs is None:
            raise ValueError("combine_with_unpermute got probs for a dispatch made without probs")
        # The native Buffer's autograd of the permuted probs: one all_to_all over the group.
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(
                handle.recv_probs, handle.slot_probs, probs.detach().float(), retain_graph=True
            )
        return combined, scatter_slots(grad, handle.native.topk_idx, self.num_of_experts)

    def dispatch(self, hidden, scaling_factor=None, topk_idx=None, topk_weights=None,
                 num_of_experts=None, probs=None, routing_map=None,
                 num_dispatched_tokens_tensor=None, num_dispatched_tokens=None,
                 handle=None):  # fmt: skip
        """Send each token to the ranks of its experts, one row per (token, rank). Collective.

        Args:
            hidden: [T, H] rows (bf16, fp16, fp32), or FP8 values (float8_e4m3fn or uint8).
            scaling_factor: [T, H / 128] float32 scales of FP8 hidden, or None.
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused; or routing_map.
            topk_weights: [T, K] float32 probs of those slots, or None.
            num_of_experts: E with topk_idx, or None (the buffer's).
            probs: [T, E] float32 with routing_map, or None.
            routing_map: [T, E] bool, True where a token goes to an expert.
            num_dispatched_tokens_tensor: not read (the handle has it).
            num_dispatched_tokens: None: exactly the rows received (a host read); N: N rows.
            handle: an earlier dispatch's: send hidden along its routing.

        Returns: hidden [N, H] of hidden's dtype (by source rank, then token), probs [N, L * R]
        float32 (this rank's experts' columns; the node's other ranks' 0) or None, scaling
        factor [N, H / 128] float32 or None, the handle (HybridEP's 7-tuple: [3] N, [1] int32
        on the CPU; [4] local_expert_routing_map [N, L] bool; [5] T; the others None).
        """
        worst = num_dispatched_tokens
        if handle is not None:
            recv, recv_weights = self._along(
                hidden, scaling_factor, topk_weights, probs, handle, False
            )
            recv_topk_idx = handle.native.recv_topk_idx
        else:
            rows, (slots, weights, _), refused = self._inputs(
                hidden,
                scaling_factor,
                topk_idx,
                topk_weights,
                num_of_experts,
                routing_map,
                probs,
                None,
                worst is None,
                False,
            )

            def call(buffer, refused):
                if refused is not None:
                    buffer.refuse("dispatch", *refused, max_recv_tokens=worst)
                return buffer.dispatch(rows, slots, weights, max_recv_tokens=worst)

            recv, recv_topk_idx, recv_weights, _, native = self._run(
                False, rows, call, refused, worst
            )
            # A row's "ranks" with one expert a rank are its local experts.
            experts = self.num_local_experts
            local = NativeBuffer.token_counts(recv_topk_idx, experts, experts)[3]
            count = torch.tensor([local.shape[0]], dtype=torch.int32, device="cpu")
            parts = (None, None, None, count, local, hidden.shape[0], None)
            handle = Handle(parts, native, self._sized[False].buffer)
        dispatched_probs = None
        if recv_weights is not None:  # this rank's experts' columns among the node's R * L
            first = self.local_rank * self.num_local_experts
            node_slots = torch.where(recv_topk_idx >= 0, recv_topk_idx + first, -1)
            per_node = self.num_of_hybrid_ep_ranks_per_nvlink_domain * self.num_local_experts
            dispatched_probs = scatter_slots(recv_weights, node_slots, per_node)
        values, scales = received_values(recv, hidden)
        return values, dispatched_probs, scales, handle

    def combine(self, hidden, probs=None, handle=None) -> tuple[torch.Tensor, None]:
        """Sum each token's rows from every rank it went to, unweighted. Collective.

        Args:
            hidden: [N, H] rows in the dispatch's order, of the dispatched rows' dtype.
            probs: unsupported (ValueError): combine_with_unpermute returns the probs' way back.
            handle: the dispatch's handle.

        Returns: hidden [T, H] (fp32 sums rounded to hidden's dtype), None.
        """
        if probs is not None:
            raise ValueError(
                "combine's probs are not supported: combine_with_unpermute "
                "returns the probs' gradient"
            )
        check_handle(handle, expand=False)
        with torch.no_grad():
            return handle.buffer.combine(hidden.detach().contiguous(), handle.native), None

    # -- internals -------------------------------------------------------------------------

    def _make(self, key, capacity: int) -> NativeBuffer:
        """The Buffer of ``key`` (expand, dtype, device) for ``capacity`` tokens a rank."""
        expand, dtype, device = key
        return NativeBuffer(
            self.group,
            hidden_size=self.hidden_dim,
            max_tokens_per_rank=capacity,
            num_experts=self.num_of_experts,
            dtype=dtype,
            expand=expand,
            device=device,
            ranks_per_node=self.num_of_hybrid_ep_ranks_per_nvlink_domain,
        )

    def _run(self, expand: bool, rows, call, refused, worst):
        """``call`` on the Buffer of ``expand`` for ``rows`` (Sized.run), without grad."""
        values = rows[0] if isinstance(rows, tuple) else rows
        dtype = torch.bfloat16 if rows is not values else values.dtype
        key = None if refused else (expand, dtype, values.device)
        with torch.no_grad():
            return self._sized[expand].run(
                key, 0 if refused else values.shape[0], call, refused, worst is None
            )

    def _inputs(
        self,
        hidden,
        scaling_factor,
        topk_idx,
        topk_weights,
        num_of_experts,
        routing_map,
        probs,
        experts_per_rank,
        blocking,
        missing_rows,
    ):
        """A dispatch's rows as the Buffer takes them, its routing ([T, K] slots of global ids,
        -1 unused; their float32 probs or None; with a routing map when not blocking, a bool
        device scalar: a row had more than K) and this rank's refusal of its arguments (the
        native argument it stands for, its ValueError) or None."""
        none = hidden, (None,) * 3
        if missing_rows:
            return *none, ("max_recv_tokens", ValueError("non_blocking needs num_permuted_tokens"))
        try:
            rows = hybrid_rows(hidden, scaling_factor)
        except ValueError as error:
            return *none, ("x", error)
        experts = num_of_experts if routing_map is None else routing_map.shape[-1]
        why = None
        if experts_per_rank not in (None, self.num_local_experts):
            why = f"num_of_experts_per_rank must be the buffer's {self.num_local_experts}"
        elif experts not in (None, self.num_of_experts):
            why = f"the routing must cover the buffer's {self.num_of_experts} experts: {experts}"
        elif routing_map is None and topk_idx is None:
            why = "pass topk_idx (with num_of_experts) or routing_map"
        if why is not None:
            return rows, (None,) * 3, ("topk_idx", ValueError(why))
        if routing_map is None:
            weights = None if topk_weights is None else topk_weights.float().contiguous()
            return rows, (topk_idx, weights, None), None
        with torch.no_grad():
            routing_map = routing_map.reshape(-1, experts)
            routed, overflow = routing_map.sum(dim=1), None
            if blocking:  # one host read
                topk = int(routed.max()) if routed.numel() else 0
            else:
                topk = min(experts, MAX_TOPK)
                overflow = (routed > topk).any()
            # Each row's K lowest routed ids (the Buffer takes at least one slot).
            probs = None if probs is None else probs.reshape(-1, experts).float()
            slots, slot_probs = topk_from_map(routing_map, probs, max(topk, 1))
        return rows, (slots, slot_probs, overflow), None

    def _along(self, hidden, scaling_factor, topk_weights, probs, handle, expand: bool):
        """A dispatch along ``handle`` (of a call with ``expand``): the received rows, and
        per-row probs or None (probs [T, E] or topk_weights [T, K] given)."""
        check_handle(handle, expand)
        slots, weights = handle.native.topk_idx, None
        if topk_weights is not None:
            weights = topk_weights.float().contiguous()
        elif probs is not None:
            taken = probs.reshape(slots.shape[0], -1).gather(1, slots.long().clamp(min=0))
            weights = torch.where(slots >= 0, taken.float(), 0.0)
        with torch.no_grad():
            try:
                rows = hybrid_rows(hidden, scaling_factor)
            except ValueError as error:  # no peer waits for this rank's part
                handle.buffer.refuse("dispatch", "x", error, handle=handle.native)
            out = handle.buffer.dispatch(rows, topk_weights=weights, handle=handle.native)
        return out[0], out[1 if expand else 2]
