"""One Megatron-Core MoE layer's forward+backward time: its alltoall dispatcher against this
library (``hybrid_ep_triton.megatron.use_hybrid_ep``), one rank per local GPU.

Sizes per rank as DeepSeek-V3's: 4096 tokens, hidden 7168, 16 experts per rank, top-8, expert
FFN 2048, bf16; Megatron-Core's local spec (TopKRouter in fp32, SequentialMLP experts with
SwiGLU). Both layers are timed eagerly, interleaved, with CUDA events around
forward+backward (median of --iters after --warmup); the same tokens each iteration. CUDA
graphs: the local spec's SequentialMLP reads tokens_per_expert on the host (.tolist()), so the
layer does not capture; TEGroupedMLP would need Transformer Engine.

Usage (one process per GPU is spawned): python bench/megatron_bench.py [--ranks N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

TOKENS, HIDDEN, EXPERTS_PER_RANK, TOPK, FFN = 4096, 7168, 16, 8, 2048


def _layer(ep: int, dispatcher: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=56,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=ep * EXPERTS_PER_RANK,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=config).cuda()


def _rank(rank: int, world: int, iters: int, warmup: int, num_sms: int | None) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from hybrid_ep_triton.megatron import use_hybrid_ep

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234 + rank)
    layers = {"alltoall": _layer(world, "alltoall"), "hybrid_ep": _layer(world, "alltoall")}
    buffer = use_hybrid_ep(layers["hybrid_ep"], max_tokens_per_rank=TOKENS, num_sms=num_sms)
    x = torch.randn(TOKENS, 1, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    times = {name: [] for name in layers}
    for i in range(warmup + iters):
        for name, layer in layers.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.distributed.barrier()
            start.record()
            out, _ = layer(x)
            out.backward(grad)
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(start.elapsed_time(end))
    buffer.destroy()
    parallel_state.destroy_model_parallel()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    from hybrid_ep_triton.tools.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-sms", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for megatron-bench-<ranks>.json")
    args = parser.parse_args()
    per_rank = run_ranks(
        _rank, args.ranks, args.iters, args.warmup, args.num_sms, device="cuda", timeout_s=500
    )
    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    print(
        f"One MoE layer, forward+backward, {args.ranks} rank(s) x {torch.cuda.get_device_name()}:"
        f" {TOKENS} tokens/rank, hidden {HIDDEN}, {EXPERTS_PER_RANK} experts/rank, top-{TOPK},"
        f" FFN {FFN}, bf16, SequentialMLP experts; eager, median of {args.iters}, slowest rank"
    )
    print("| dispatcher | ms |\n|---|---|")
    for name, ms in slowest.items():
        print(f"| {name} | {ms:.2f} |")
    print("CUDA graphs: not run (SequentialMLP reads tokens_per_expert on the host)")
    if args.out:
        path = os.path.join(args.out, f"megatron-bench-{args.ranks}.json")
        with open(path, "w") as f:
            json.dump({"ranks": args.ranks, "per_rank_ms": per_rank, "slowest_ms": slowest}, f)


if __name__ == "__main__":
    main()
