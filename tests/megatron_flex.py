"""The ranks of tests/test_megatron.py's flex-dispatcher comparison.

This module makes ``import deep_ep`` give ``hybrid_ep_triton.deep_ep`` (``register()``) before
it imports Megatron-Core (through test_megatron), which looks for deep_ep when it is first
imported: a new rank process that runs ``flex_body`` imports this module first, and so finds
Megatron-Core's flex dispatcher with both its DeepEP backends available.
"""

from __future__ import annotations

import hybrid_ep_triton.deep_ep

hybrid_ep_triton.deep_ep.register()

import test_megatron  # noqa: E402
import torch  # noqa: E402


def flex_body(rank: int, world: int, ep: int, backend: str) -> list[str]:
    """Every case of FLEX_CASES with Megatron-Core's flex dispatcher on ``backend``."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        if test_megatron.ON_GPU:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        alone = None if torch.distributed.get_backend() == "nccl" else test_megatron._alone()
        failures = [
            message
            for case in test_megatron.FLEX_CASES
            for message in test_megatron._case(rank, world, ep, case, alone, backend)
        ]
    finally:
        parallel_state.destroy_model_parallel()
    return [f"rank {rank}: {m}" for m in failures]
