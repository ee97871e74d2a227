"""torch.compile traces dispatch and combine (torch.library operators) without graph breaks.

A small MoE step (router, dispatch, one scale vector per local expert, combine) is compiled with
fullgraph=True, so any graph break fails; its outputs and gradients must equal eager mode's,
over several calls with new tokens and routing. On CPU ranks the backend is aot_eager (it
traces forward and backward through the fake implementations without generating code); on GPUs
it is inductor.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_failures

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.tools.launcher import rank_device

HIDDEN, EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 8, 2, 2, 6


class _MoEStep(torch.nn.Module):
    def __init__(self, buf: Buffer, world: int, rank: int, max_recv_tokens: int | None):
        super().__init__()
        self.buf, self.max_recv_tokens = buf, max_recv_tokens
        self.router = torch.nn.Linear(HIDDEN, world * EXPERTS_PER_RANK, bias=False)
        self.scales = torch.nn.Parameter(torch.randn(world * EXPERTS_PER_RANK, HIDDEN))
        self.first_expert = rank * EXPERTS_PER_RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, idx = torch.softmax(self.router(x), dim=1).topk(TOPK, dim=1)
        recv_x, recv_w, tokens_per_expert, handle = self.buf.dispatch(
            x, idx, probs, max_recv_tokens=self.max_recv_tokens
        )
        # Local expert of each row without a host read; rows past the segments take the last.
        rows = torch.arange(recv_x.shape[0], device=recv_x.device)
        local = torch.searchsorted(tokens_per_expert.cumsum(0), rows, right=True)
        scale = self.scales[self.first_expert + local.clamp(max=EXPERTS_PER_RANK - 1)]
        return self.buf.combine(recv_x * scale, handle, weights=recv_w)


def _run(step, x: torch.Tensor, projection: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    out = step(x)
    (out * projection).sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in step.parameters()]
    step.zero_grad()
    return [out.detach()] + grads


def _compile_body(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)  # the same weights on every rank
    failures = []
    with Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=world * EXPERTS_PER_RANK,
        dtype=torch.float32,
        device=rank_device(),
    ) as buf:
        for max_recv_tokens in (world * MAX_TOKENS * TOPK, None):
            failures += _compare(buf, world, rank, max_recv_tokens)
    return failures


def _compare(buf: Buffer, world: int, rank: int, max_recv_tokens: int | None) -> list[str]:
    failures = []
    dev = buf.device
    on_gpu = dev.type == "cuda"
    step = _MoEStep(buf, world, rank, max_recv_tokens).to(dev)
    backend = "inductor" if on_gpu else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=False)
    g = torch.Generator().manual_seed(100 + rank)
    for call in range(2):
        # Same token count every call: a new count would retrace (static shapes).
        x = torch.randn(MAX_TOKENS - rank, HIDDEN, generator=g).to(dev)
        projection = torch.randn(MAX_TOKENS - rank, HIDDEN, generator=g).to(dev)
        eager = _run(step, x, projection)
        traced = _run(compiled, x, projection)
        for name, a, b in zip(
            ["out", "x grad", "router grad", "scales grad"], eager, traced, strict=True
        ):
            if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
                err = (a - b).abs().max()
                failures.append(
                    f"rank {rank}, max_recv_tokens={max_recv_tokens}, call {call}: "
                    f"{name} off by {err:.2e}"
                )
    return failures


# One rank on GPUs only: on CPU ranks two cover the same code and compiling costs minutes.
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.slow)]
)
def test_compiled_moe_step_matches_eager(launch, world):
    results = launch(_compile_body, world)
    assert_no_failures(results)
