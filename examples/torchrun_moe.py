"""One mixture-of-experts layer on every rank of one node, its tokens moved by hybrid_ep_triton:

    torchrun --standalone --nproc-per-node 8 examples/torchrun_moe.py   # one process per GPU
    torchrun --standalone --nproc-per-node 2 examples/torchrun_moe.py   # no GPU: 2 CPU ranks

Each rank routes its tokens to the top-k of E experts (a softmax router), ``dispatch`` sends
every token to the ranks that hold its experts, each rank runs its own experts (SwiGLU MLPs) on
the rows it received, grouped by expert, and ``combine`` brings the expert outputs back to the
token's rank, summed with the router's weights. Every expert's weights come from a seed of its
own, so each rank can also compute its tokens' output without any communication, expert by
expert: the script checks the layer against that and exits 1 where they differ.

On CPU ranks the kernels run in Triton's interpreter (slowly, hence the small sizes there),
which has to be chosen before triton is imported: the script sets TRITON_INTERPRET=1 itself
when torch sees no GPU.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hybrid_ep_triton as hep  # noqa: E402  (after TRITON_INTERPRET is set)

ON_GPU = torch.cuda.is_available()
# Tokens per rank, hidden size, the experts' inner size, experts per rank, experts per token.
TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOPK = (
    (4096, 1024, 512, 8, 4) if ON_GPU else (32, 64, 32, 2, 2)
)
DTYPE = torch.bfloat16
# bf16: combine rounds each rank's partial sum of a token and the output, 2^-8 relative each.
MAX_RELATIVE_ERROR = 3e-2


def expert_weights(expert: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Global expert ``expert``'s SwiGLU weights: gate and up [H, F], down [F, H]."""
    g = torch.Generator().manual_seed(1000 + expert)
    gate = torch.randn(HIDDEN, FFN, generator=g) / HIDDEN**0.5
    up = torch.randn(HIDDEN, FFN, generator=g) / HIDDEN**0.5
    down = torch.randn(FFN, HIDDEN, generator=g) / FFN**0.5
    return tuple(w.to(device, DTYPE) for w in (gate, up, down))


def swiglu(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    gate, up, down = weights
    return (F.silu(x @ gate) * (x @ up)) @ down


def main() -> int:
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    num_experts = EXPERTS_PER_RANK * world

    # This rank's tokens, and the router, the same on every rank.
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))
    x = x.to(device, DTYPE)
    router = torch.randn(HIDDEN, num_experts, generator=torch.Generator().manual_seed(99))
    probs = torch.softmax(x.float() @ router.to(device), dim=-1)
    topk_weights, topk_idx = probs.topk(TOPK, dim=-1)  # [T, K] float32, int64

    # This rank's experts: global experts rank * L ... (rank + 1) * L - 1.
    local = [expert_weights(rank * EXPERTS_PER_RANK + e, device) for e in range(EXPERTS_PER_RANK)]

    # Collective; sized once for TOKENS tokens from every rank.
    with hep.Buffer(
        None, hidden_size=HIDDEN, max_tokens_per_rank=TOKENS, num_experts=num_experts, dtype=DTYPE
    ) as buffer:
        recv_x, recv_weights, tokens_per_expert, handle = buffer.dispatch(x, topk_idx, topk_weights)
        # recv_x holds tokens_per_expert[e] rows for local expert e, then those of e + 1.
        segments = recv_x.split(tokens_per_expert.tolist())
        y = torch.cat([swiglu(rows, w) for rows, w in zip(segments, local, strict=True)])
        out = buffer.combine(y, handle, weights=recv_weights)  # [T, H]

    # The same layer without communication: out[t] = sum over t's experts e of weight * e(x[t]).
    expected = torch.zeros(TOKENS, HIDDEN, device=device)
    for expert in topk_idx.unique().tolist():
        rows, slots = (topk_idx == expert).nonzero(as_tuple=True)
        y_expert = swiglu(x[rows], expert_weights(expert, device)).float()
        expected[rows] += topk_weights[rows, slots, None] * y_expert
    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    print(
        f"rank {rank}/{world}: {TOKENS} tokens sent, {recv_x.shape[0]} expert rows received "
        f"(per local expert: {tokens_per_expert.tolist()}), largest error {error:.1e} of the "
        f"largest output ({'OK' if error <= MAX_RELATIVE_ERROR else 'TOO LARGE'})",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if error <= MAX_RELATIVE_ERROR else 1


if __name__ == "__main__":
    raise SystemExit(main())
