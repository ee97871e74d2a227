"""This library as the token dispatcher of Megatron-Core's own ``MoELayer`` (megatron-core 0.19).

``use_hybrid_ep(model, max_tokens_per_rank=...)`` builds one ``Buffer`` over the model's
expert-parallel group, sized from its config, and gives every ``MoELayer`` of the model a
``HybridEPTokenDispatcher`` on it in place of the dispatcher the layer was built with (the
layer's ``token_dispatcher`` attribute; no Megatron-Core file or class is changed). The layers
then run as before: router, dispatch, Megatron-Core's experts, combine.

megatron-core is imported when this module is (``import hybrid_ep_triton`` never imports it):
``pip install 'hybrid-ep-triton[megatron]'``.

Shapes: T tokens of this rank (sequence x micro-batch, flattened), H hidden size, E global
experts (``num_moe_experts``), L = E / expert-parallel size local experts, K
``moe_router_topk``, N rows received by this rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .buffer import DEFAULT_TIMEOUT_S, Buffer
from .moe import TokenDispatcher, check_wire_format
from .runtime.checks import describe

try:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "hybrid_ep_triton.megatron needs megatron-core 0.19: "
        "pip install 'hybrid-ep-triton[megatron]'"
    ) from e

__all__ = ["HybridEPTokenDispatcher", "use_hybrid_ep"]


class HybridEPTokenDispatcher(MoETokenDispatcher):
    """Megatron-Core's token dispatcher interface on a ``Buffer`` (what ``MoELayer`` calls).

    The stages, as ``MoELayer.forward`` calls them (each collective one is collective over the
    expert-parallel group, in the same order on every rank; all are differentiable):
      dispatch_preprocess(hidden_states [..., H], routing_map [T, E] bool, probs [T, E])
        -> (tokens [T, H], probs [T, K] float32): a row's K lowest routed experts and their
        probs; local, no communication.
      token_dispatch(tokens, probs) -> (rows [N, H], row_probs [N] float32): the Buffer's
        dispatch (collective).
      dispatch_postprocess(rows, row_probs) -> (rows, tokens_per_expert [L] int64 on the
        tokens' device, row_probs [N] in probs' dtype): rows grouped by local expert, within
        an expert by source rank, then source token (the order of Megatron-Core's alltoall
        dispatcher), each expert padded with zero rows of prob 0 to a multiple of
        pad_multiple (tokens_per_expert counts the padding).
      combine_preprocess(expert_output [N, H]) -> the same tensor.
      token_combine(expert_output) -> [..., H] in hidden_states' shape and dtype: the Buffer's
        combine, each token's unweighted sum of its rows (the experts applied the probs).
      combine_postprocess(out) -> out.

    Args:
        num_local_experts, local_expert_indices, config, pg_collection: as for Megatron-Core's
            dispatchers; pg_collection needs ``ep`` (the Buffer's group), ``expt_tp`` (size 1)
            and ``tp_ep``.
        buffer: the Buffer of the expert-parallel group (``expand=True``; E, H, the token
            dtype and max_tokens_per_rank are its).
        max_recv_tokens: None (exact mode, N exactly the rows needed) or M: N == M rows with
            no host synchronisation (CUDA graphs); rows past sum(tokens_per_expert) are zero
            with prob 0, so the experts must take more rows than tokens_per_expert counts
            (SequentialMLP does not). See ``hybrid_ep_triton.moe.TokenDispatcher``.
        pad_multiple: pad each local expert's rows to a multiple of it (grouped GEMMs). With
            config.fp8 or config.fp4, to a multiple of it and of Megatron-Core's quantization
            alignment too (``get_align_size_for_quantization``: 16 for FP8, 32 for MXFP8, 128
            for FP4), as Megatron-Core's own HybridEP backend pads.
        wire_format: the format rows cross the links in (``TokenDispatcher``'s: dequantized
            into the params dtype on arrival, for Megatron-Core's experts, which take rows of
            that dtype and, with FP8 or FP4 training, quantize them again in Transformer
            Engine). "config" (default): "mxfp8" when the config trains with the MXFP8 recipe
            (config.fp8 with fp8_recipe "mxfp8"), else None, the params dtype. MXFP8 alone is
            the default because Transformer Engine's own row-wise MXFP8 quantization of
            dequantized MXFP8 rows gives the same values and scales back (its scale exponent,
            amax / 448 rounded up to a power of two, is the one the rows had); its column-wise
            copy for the weight gradient, and every other recipe (blockwise FP8's fp32 scales,
            NVFP4's second-level scale), would round twice: pass "fp8" or "nvfp4" to choose
            that, or None to send the params dtype always.
        async_finish: run dispatch and combine on the Buffer's communication stream; the
            calling stream waits for each before its next work.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection: ProcessGroupCollection,
        *,
        buffer: Buffer,
        max_recv_tokens: int | None = None,
        pad_multiple: int = 1,
        async_finish: bool = False,
        wire_format: str | None = "config",
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        _check_expert_tp(self.tp_size)
        if not isinstance(buffer, Buffer):
            raise ValueError(f"buffer must be a hybrid_ep_triton.Buffer, got {describe(buffer)}")
        ep_ranks = dist.get_process_group_ranks(self.ep_group)
        if dist.get_process_group_ranks(buffer.group) != ep_ranks:
            raise ValueError(
                f"buffer must be over the expert-parallel group (ranks {ep_ranks}), got ranks "
                f"{dist.get_process_group_ranks(buffer.group)}"
            )
        for name, want, got in [
            ("num_experts", config.num_moe_experts, buffer.num_experts),
            ("hidden_size", config.hidden_size, buffer.hidden_size),
        ]:
            if want != got:
                raise ValueError(f"buffer.{name} must be the config's {want}, got {got}")
        if not isinstance(async_finish, bool):
            raise ValueError(f"async_finish must be True or False, got {describe(async_finish)}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.async_finish = async_finish
        self.dispatcher = TokenDispatcher(
            buffer,
            config.moe_router_topk,
            max_recv_tokens=max_recv_tokens,
            pad_multiple=_quantization_padding(config, pad_multiple),
            wire_format=_wire_format(config, wire_format),
        )
        self.hidden_shape = None
        self._topk_idx = None  # dispatch_preprocess -> token_dispatch
        self._probs_dtype = None
        self._tokens_per_expert = None  # token_dispatch -> dispatch_postprocess
        # What a CUDA graph of the router and preprocess hands to the rest of the layer.
        self.cudagraph_attrs = ["hidden_shape", "_topk_idx", "_probs_dtype"]

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        self._probs_dtype = probs.dtype
        tokens, self._topk_idx, topk_probs = self.dispatcher.prepare(
            hidden_states, probs, routing_map
        )
        return tokens, topk_probs

    def token_dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._topk_idx is None:
            raise RuntimeError("token_dispatch needs dispatch_preprocess first")
        rows, self._tokens_per_expert, row_probs = self.dispatcher.send(
            hidden_states,
            self._topk_idx,
            probs,
            shape=self.hidden_shape,
            async_finish=self.async_finish,
        )
        self._topk_idx = None
        return rows, row_probs

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens_per_expert, self._tokens_per_expert = self._tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs.to(self._probs_dtype)

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dispatcher.combine(hidden_states, async_finish=self.async_finish)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def use_hybrid_ep(
    model,
    *,
    max_tokens_per_rank: int,
    num_sms: int | None = None,
    max_recv_tokens: int | None = None,
    pad_multiple: int = 1,
    async_finish: bool = False,
    wire_format: str | None = "config",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ranks_per_node: int | None = None,
    agree_on_inputs: bool = False,
) -> Buffer:
    """Switch every Megatron-Core ``MoELayer`` of a built model to this library (collective
    over the expert-parallel group: every rank of it calls this, with the same arguments).

    Builds one Buffer over the layers' expert-parallel group (Megatron-Core's
    ``pg_collection.ep``, never the world): hidden size H = ``config.hidden_size``, E =
    ``config.num_moe_experts`` and the token dtype ``config.params_dtype`` from the model's
    config, and sets each layer's ``token_dispatcher`` to a ``HybridEPTokenDispatcher`` on it.
    The layers share the Buffer (they run one after the other). Checks everything before the
    Buffer is built: a config this adapter does not support raises ValueError on every rank
    and nothing changes.

    Args:
        model: a torch.nn.Module holding MoELayer modules (a GPTModel, a MoELayer, a
            Megatron-Core DDP wrapper), or a list of them (virtual pipeline chunks).
        max_tokens_per_rank: the most tokens one rank passes to one layer: sequence length /
            tensor-parallel size x micro-batch size.
        num_sms, timeout_s, ranks_per_node, agree_on_inputs: the Buffer's (see ``Buffer``).
        max_recv_tokens, pad_multiple, async_finish, wire_format: the dispatchers' (see
            ``HybridEPTokenDispatcher``); max_recv_tokens needs experts other than
            SequentialMLP (e.g. TEGroupedMLP).

    Returns:
        the Buffer; ``buffer.destroy()`` frees it once the model is done with it.
    """
    modules = model if isinstance(model, (list, tuple)) else [model]
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"model has no Megatron-Core MoELayer: {describe(model)}")
    groups = {tuple(dist.get_process_group_ranks(layer.ep_group)) for layer in layers}
    if len(groups) != 1:
        raise ValueError(f"the MoE layers must share one expert-parallel group, got {groups}")
    for layer in layers:
        _check_layer(layer, layers[0].config, max_recv_tokens)
    config = layers[0].config
    check_wire_format(_wire_format(config, wire_format), config.hidden_size)
    buffer = Buffer(
        layers[0].ep_group,
        hidden_size=config.hidden_size,
        max_tokens_per_rank=max_tokens_per_rank,
        num_experts=config.num_moe_experts,
        dtype=config.params_dtype,
        num_sms=num_sms,
        timeout_s=timeout_s,
        ranks_per_node=ranks_per_node,
        agree_on_inputs=agree_on_inputs,
    )
    for layer in layers:
        old = layer.token_dispatcher
        groups = ProcessGroupCollection()
        groups.ep, groups.expt_tp, groups.tp_ep = old.ep_group, old.tp_group, old.tp_ep_group
        layer.token_dispatcher = HybridEPTokenDispatcher(
            layer.num_local_experts,
            layer.local_expert_indices,
            layer.config,
            groups,
            buffer=buffer,
            max_recv_tokens=max_recv_tokens,
            pad_multiple=pad_multiple,
            async_finish=async_finish,
            wire_format=wire_format,
        )
    return buffer


def _check_layer(layer, config, max_recv_tokens: int | None) -> None:
    """ValueError for what the adapter does not support (before anything is built)."""
    cfg = layer.config
    for name in ("num_moe_experts", "hidden_size", "moe_router_topk", "params_dtype"):
        if getattr(cfg, name) != getattr(config, name):
            raise ValueError(
                f"the MoE layers must share {name}: {getattr(cfg, name)} and "
                f"{getattr(config, name)}"
            )
    unsupported = {
        "moe_pad_expert_input_to_capacity": "token drop-and-pad",
        "moe_shared_expert_overlap": "shared experts overlapped with the dispatcher",
        "overlap_moe_expert_parallel_comm": "the 1F1B expert-parallel overlap schedule",
        "moe_router_padding_for_quantization": "padding for quantization (use pad_multiple)",
        "moe_latent_size": "latent MoE projections",
    }
    for name, what in unsupported.items():
        if getattr(cfg, name, None):
            raise ValueError(f"{what} is not supported: config.{name} must be off")
    if cfg.transformer_impl == "inference_optimized":
        raise ValueError("transformer_impl='inference_optimized' is not supported")
    _check_expert_tp(layer.token_dispatcher.tp_size)
    if max_recv_tokens is not None and isinstance(layer.experts, SequentialMLP):
        raise ValueError(
            "max_recv_tokens needs experts that take rows past sum(tokens_per_expert); "
            "SequentialMLP (the local spec's experts) splits exactly: leave max_recv_tokens None"
        )


def _quantization_padding(config, pad_multiple: int) -> int:
    """pad_multiple, and with FP8 or FP4 training a multiple of Megatron-Core's alignment for
    its quantized grouped GEMMs (what its HybridEP backend pads each expert's rows to)."""
    if config.fp8 or config.fp4:
        return math.lcm(pad_multiple, get_align_size_for_quantization(config))
    return pad_multiple


def _wire_format(config, wire_format: str | None) -> str | None:
    """The dispatchers' wire format: ``wire_format``, or for "config" the one the config's
    recipe takes back without a second rounding (see ``HybridEPTokenDispatcher``)."""
    if wire_format != "config":
        return wire_format
    if config.fp8 and not config.fp4 and config.fp8_recipe == "mxfp8":
        return "mxfp8"
    return None


def _check_expert_tp(size: int) -> None:
    if size != 1:
        raise ValueError(
            f"expert tensor parallelism is not supported: expert_tensor_parallel_size must be 1, "
            f"got {size}"
        )
