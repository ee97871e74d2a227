"""Train a tiny Megatron-Core MoE language model with this library as its token dispatcher, on
every local GPU (expert-parallel over all of them), and print its losses beside those of the
same model with Megatron-Core's alltoall dispatcher.

The model: Megatron-Core's GPTModel with the local layer spec (no Transformer Engine), 2
layers, hidden 256, 4 experts per GPU, top-2, bf16; one fixed batch of random tokens per GPU,
Adam. Both runs start from the same weights (the same seeds).

GPTModel, though Megatron-Core 0.19.2 announces it as deprecated in favour of HybridModel at
every build: HybridModel needs Transformer Engine here. Its stock stack spec is made of Transformer
Engine layers, and HybridStack makes its final layer norm with Transformer Engine's TENorm
whatever the spec says (megatron/core/models/hybrid/hybrid_block.py); a HybridModel of local
layers builds only without that final norm (post_layer_norm=False), a different model.

    pip install 'hybrid-ep-triton[megatron]'
    python examples/megatron_moe.py [--steps 10]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

HIDDEN, EXPERTS_PER_GPU, TOPK, VOCAB, SEQ, BATCH = 256, 4, 2, 512, 128, 2


def build_model(ep: int):
    """A GPTModel on this GPU, its weights from fixed seeds (the same on every call)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=4 * HIDDEN,
        moe_ffn_hidden_size=HIDDEN,
        num_moe_experts=ep * EXPERTS_PER_GPU,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        params_dtype=torch.bfloat16,
        bf16=True,
        # No biases, as in DeepSeek-V3: with them, megatron-core 0.19.2's SequentialMLP adds
        # its experts' biases in place into an autograd view, which torch refuses.
        add_bias_linear=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
    )
    # Some of its modules (the position embedding) are made in float32 whatever params_dtype
    # says; Megatron-Core's training loop casts the model to bf16 (Float16Module), as here.
    return model.cuda().bfloat16()


def train(model, tokens: torch.Tensor, steps: int) -> list[float]:
    """Adam steps on one batch; returns the loss of each step, averaged over the ranks."""
    from megatron.core import parallel_state

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1], device="cuda").expand(BATCH, -1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        # attention_mask None: the local spec's causal softmax makes the causal mask.
        loss = model(inputs, position_ids, None, labels=labels).float().mean()
        loss.backward()
        # Data parallelism by hand: dense weights over the data-parallel group, experts over
        # the expert data-parallel group (Megatron-Core's DDP wrapper does this in training).
        for p in model.parameters():
            dense = getattr(p, "allreduce", True)
            group = (
                parallel_state.get_data_parallel_group()
                if dense
                else parallel_state.get_expert_data_parallel_group()
            )
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def run(rank: int, world: int, steps: int) -> list[tuple[float, float]]:
    from megatron.core import parallel_state

    from hybrid_ep_triton.megatron import use_hybrid_ep

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda()
    losses = {}
    for name in ("alltoall", "hybrid_ep"):
        model = build_model(world)
        buffer = None
        if name == "hybrid_ep":
            # The one call: every MoE layer of the model now dispatches through this library.
            buffer = use_hybrid_ep(model, max_tokens_per_rank=SEQ * BATCH)
        losses[name] = train(model, tokens, steps)
        if buffer is not None:
            buffer.destroy()
    parallel_state.destroy_model_parallel()
    return list(zip(losses["alltoall"], losses["hybrid_ep"], strict=True))


def main() -> None:
    from hybrid_ep_triton.tools.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("this example needs CUDA GPUs (Megatron-Core's layers run on CUDA)")
    rows = run_ranks(run, gpus, args.steps, device="cuda", timeout_s=600)[0]
    print(f"{gpus} GPU(s), expert-parallel size {gpus}; loss per step:")
    print(" step   alltoall  hybrid_ep")
    for step, (a, b) in enumerate(rows):
        print(f"{step:5d}  {a:9.4f}  {b:9.4f}")


if __name__ == "__main__":
    main()
