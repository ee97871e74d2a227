"""One decode step of a mixture-of-experts layer on every rank: the low-latency dispatch, this
library's experts (SwiGLU MLPs as grouped GEMMs) writing straight into the combine's buffer,
and the low-latency combine:

    torchrun --standalone --nproc-per-node 8 examples/experts_decode.py   # one process per GPU
    torchrun --standalone --nproc-per-node 2 examples/experts_decode.py   # no GPU: 2 CPU ranks
    torchrun ... examples/experts_decode.py --fp8   # FP8 rows and weights (DeepSeek-V3's)

Each rank routes its tokens to the top-k of E experts, ``low_latency_dispatch`` sends them to
the experts' ranks, where they land in [L, C, H] blocks (rows [0, recv_count[e]) of block e
are expert e's), ``SwiGLUExperts.low_latency`` runs every local expert on its rows into the
buffer that ``low_latency_combine(..., zero_copy=True)`` reads, and the combine sums each
token's expert outputs with its weights. None of the three waits for the host, so a serving
engine captures the step in a CUDA graph. Every expert's weights come from a seed of its own,
so each rank also computes its tokens' outputs without any communication, expert by expert
in float32: the script checks the step against that and exits 1 where they differ.

On CPU ranks the kernels run in Triton's interpreter (slowly, hence the small sizes there),
which has to be chosen before triton is imported: the script sets TRITON_INTERPRET=1 itself
when torch sees no GPU.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hybrid_ep_triton as hep  # noqa: E402  (after TRITON_INTERPRET is set)
from hybrid_ep_triton.experts import SwiGLUExperts, quantize_weights_fp8  # noqa: E402

ON_GPU = torch.cuda.is_available()
# Tokens per rank, hidden size, the experts' inner size, experts per rank, experts per token
# (FP8 needs hidden and inner sizes that are multiples of 128).
TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOPK = (
    (128, 2048, 1024, 8, 8) if ON_GPU else (4, 128, 128, 2, 2)
)
# Of the largest output: bf16 rounds the experts' activation and output and the combine's
# sum (2^-9 each); FP8 adds e4m3's rounding of the rows, the weights and the activation.
MAX_RELATIVE_ERROR = {False: 3e-2, True: 1.5e-1}


def expert_weights(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ``expert``'s weights, on the CPU: W1 [2F, H] (gate rows, then up rows),
    W2 [H, F], bf16."""
    g = torch.Generator().manual_seed(1000 + expert)
    w1 = torch.randn(2 * FFN, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
    return w1.to(torch.bfloat16), w2.to(torch.bfloat16)


def expected_outputs(x, topk_idx, topk_weights, num_experts: int) -> torch.Tensor:
    """The layer without communication, in float32: each token's weighted sum of its experts'
    SwiGLU outputs."""
    x = x.float().cpu()
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        token, slot = (topk_idx.cpu() == expert).nonzero(as_tuple=True)
        if len(token):
            w1, w2 = (w.float() for w in expert_weights(expert))
            h = x[token] @ w1.T
            y = (F.silu(h[:, :FFN]) * h[:, FFN:]) @ w2.T
            out.index_add_(0, token, y * topk_weights.cpu()[token, slot, None])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp8", action="store_true", help="FP8 rows and weights")
    fp8 = parser.parse_args().fp8
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    num_experts = EXPERTS_PER_RANK * world

    # This rank's tokens, and the router, the same on every rank.
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))
    x = x.to(device, torch.bfloat16)
    router = torch.randn(HIDDEN, num_experts, generator=torch.Generator().manual_seed(99))
    probs = torch.softmax(x.float() @ router.to(device), dim=-1)
    topk_weights, topk_idx = probs.topk(TOPK, dim=-1)  # [T, K] float32, int64

    # This rank's experts, global experts rank * L ... (rank + 1) * L - 1, stacked.
    mine = [expert_weights(rank * EXPERTS_PER_RANK + e) for e in range(EXPERTS_PER_RANK)]
    w1, w2 = (torch.stack(w).to(device) for w in zip(*mine, strict=True))
    if fp8:  # e4m3 values with a float32 scale per 128x128 block
        (w1, w1_scales), (w2, w2_scales) = quantize_weights_fp8(w1), quantize_weights_fp8(w2)
        experts = SwiGLUExperts(w1, w2, w1_scales, w2_scales)
    else:
        experts = SwiGLUExperts(w1, w2)

    with hep.Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=TOKENS,
        num_experts=num_experts,
        low_latency_tokens=TOKENS,
    ) as buffer:
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, TOKENS, num_experts, use_fp8=fp8
        )
        # The experts write their outputs where the combine reads them: no copy.
        y = buffer.get_next_low_latency_combine_buffer(handle)
        experts.low_latency(recv_x, recv_count, out=y)
        out, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)
        counts = recv_count.tolist()

    want = expected_outputs(x, topk_idx, topk_weights, num_experts)
    error = ((out.float().cpu() - want).abs().max() / want.abs().max()).item()
    ok = error <= MAX_RELATIVE_ERROR[fp8]
    print(
        f"rank {rank}/{world}: {TOKENS} tokens sent, {sum(counts)} expert rows received "
        f"(per local expert: {counts}), {'FP8' if fp8 else 'bf16'}, largest error "
        f"{error:.1e} of the largest output ({'OK' if ok else 'TOO LARGE'})",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
