"""Overlap (async_finish / previous_event) and CUDA graphs.

- async_finish: dispatch and combine on the Buffer's communication stream, while the calling
  stream computes, give the same results as calls on the calling stream (CPU ranks: the calls
  are synchronous and the event is None).
- CUDA graphs (GPU only): a whole forward and backward of router -> dispatch -> experts ->
  combine in max_recv_tokens mode, captured once (a host synchronisation would fail the
  capture), replayed with new tokens and therefore new routing: outputs and gradients equal
  eager mode's, and replays allocate nothing; and a captured dispatch adds its tokens per local
  expert into expert_recv_stats at each replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_no_failures

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.tools.launcher import rank_device

HIDDEN, EXPERTS_PER_RANK, TOPK = 64, 4, 3


def _buffer(world: int, max_tokens: int, dtype=torch.bfloat16) -> Buffer:
    return Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=max_tokens,
        num_experts=world * EXPERTS_PER_RANK,
        dtype=dtype,
        device=rank_device(),
    )


def _async_body(rank: int, world: int) -> list[str]:
    dev = rank_device()
    g = torch.Generator().manual_seed(rank)
    failures = []
    with _buffer(world, 16) as buf:
        for call, max_recv in enumerate((None, world * 16 * TOPK)):
            tokens = 16 - 3 * rank
            x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
            idx = torch.rand(tokens, world * EXPERTS_PER_RANK, generator=g).argsort(1)[:, :TOPK]
            w = torch.rand(tokens, TOPK, generator=g).to(dev)
            idx = idx.to(dev)
            recv_x, recv_w, counts, handle = buf.dispatch(x, idx, w, max_recv_tokens=max_recv)
            out = buf.combine(recv_x * 2, handle, weights=recv_w)

            busy = torch.randn(1024, 1024, device=dev)
            before = torch.cuda.Event() if dev.type == "cuda" else None
            if before is not None:
                before.record()
            *got, event = buf.dispatch(
                x, idx, w, max_recv_tokens=max_recv, previous_event=before, async_finish=True
            )
            busy = busy @ busy  # the calling stream computes meanwhile
            if (event is None) != (dev.type == "cpu"):
                failures.append(f"rank {rank}: dispatch returned event {event!r} on {dev}")
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            a_recv_x, a_recv_w, a_counts, a_handle = got
            a_out, event = buf.combine(a_recv_x * 2, a_handle, weights=a_recv_w, async_finish=True)
            busy = busy @ busy
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            want = {"recv_x": recv_x, "recv_weights": recv_w, "combine": out}
            got = {"recv_x": a_recv_x, "recv_weights": a_recv_w, "combine": a_out}
            if max_recv is not None and dev.type == "cuda":
                for name, value in _async_in_a_graph(buf, x, idx, w, max_recv).items():
                    got[f"{name} (graph)"], want[f"{name} (graph)"] = value, want[name]
            for name, a in got.items():
                if not torch.equal(a, want[name.removesuffix(" (graph)")]):
                    failures.append(f"rank {rank}, call {call}: async {name} differs")
            if not torch.equal(counts, a_counts):
                failures.append(f"rank {rank}, call {call}: async tokens_per_expert differs")
    return failures


def _async_in_a_graph(buf: Buffer, x, idx, w, max_recv: int) -> dict:
    """Capture async dispatch and combine (the communication stream forked from and joined to
    the capturing stream), replay, return the outputs."""

    def calls():
        recv_x, recv_w, _, handle, event = buf.dispatch(
            x, idx, w, max_recv_tokens=max_recv, async_finish=True
        )
        torch.cuda.current_stream().wait_event(event)
        out, event = buf.combine(recv_x * 2, handle, weights=recv_w, async_finish=True)
        torch.cuda.current_stream().wait_event(event)
        return {"recv_x": recv_x, "recv_weights": recv_w, "combine": out}

    calls()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = calls()
    graph.replay()
    torch.cuda.synchronize()
    return outputs


@pytest.mark.parametrize("world", [1, 2])
def test_async_finish_matches_the_calling_stream(launch, world):
    results = launch(_async_body, world)
    assert_no_failures(results)


# --- CUDA graphs ---------------------------------------------------------------------------

GRAPH_TOKENS, GRAPH_HIDDEN, GRAPH_FFN = 256, 512, 256


def _graph_body(rank: int, world: int) -> list[str]:
    from hybrid_ep_triton.moe import MoELayer

    torch.manual_seed(0)  # the same router on every rank
    dev = rank_device()
    local = EXPERTS_PER_RANK
    max_recv = world * GRAPH_TOKENS * min(TOPK, local)
    failures = []
    buf = Buffer(
        None,
        hidden_size=GRAPH_HIDDEN,
        max_tokens_per_rank=GRAPH_TOKENS,
        num_experts=world * local,
        dtype=torch.bfloat16,
        device=dev,
    )
    layer = MoELayer(buf, GRAPH_FFN, TOPK, max_recv_tokens=max_recv)
    # topk_weights' gradient goes back through an all_to_all of the group, which a gloo group
    # (ranks sharing a GPU) runs on the host: a capture refuses it (RuntimeError). There the
    # step is captured without it: neither the router nor x (through the router) learns.
    weights_learn = world == 1 or dist.get_backend() == "nccl"
    layer.router.requires_grad_(weights_learn)
    g = torch.Generator().manual_seed(10 + rank)

    def new_inputs():
        x = torch.randn(GRAPH_TOKENS, GRAPH_HIDDEN, generator=g).to(torch.bfloat16).to(dev)
        return x, torch.randn(GRAPH_TOKENS, GRAPH_HIDDEN, generator=g).to(dev)

    def step(x, projection):
        out = layer(x)
        (out.float() * projection).sum().backward()
        return out

    static_x, static_proj = new_inputs()
    static_x.requires_grad_(weights_learn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS and autograd initialise
        for _ in range(2):
            step(static_x, static_proj)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host synchronisation here would fail the capture
        static_out = step(static_x, static_proj)
    learned = [(name, p) for name, p in layer.named_parameters() if p.requires_grad]
    static_grads = [static_x.grad] + [p.grad for _, p in learned]
    names = ["out", "x grad"] + [f"{name} grad" for name, _ in learned]
    if not weights_learn:
        static_grads, names = static_grads[1:], names[:1] + names[2:]

    for replay in range(3):
        x, projection = new_inputs()  # new tokens, so new routing
        with torch.no_grad():
            static_x.copy_(x)
            static_proj.copy_(projection)
        allocated = torch.cuda.memory_allocated()
        graph.replay()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() != allocated:
            failures.append(f"rank {rank}: replay {replay} changed the allocated memory")
        got = [static_out] + static_grads
        layer.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(weights_learn)
        want = [step(x, projection), x.grad] + [p.grad for _, p in learned]
        if not weights_learn:
            want = want[:1] + want[2:]
        for name, a, b in zip(names, got, want, strict=True):
            if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
                err = (a.float() - b.float()).abs().max()
                failures.append(f"rank {rank}, replay {replay}: graph {name} off by {err:.2e}")
    layer.dispatcher.check()  # no row was dropped
    buf.destroy()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_graph_replay_of_forward_and_backward_matches_eager(launch, world):
    results = launch(_graph_body, world)
    assert_no_failures(results)


def _stats_graph_body(rank: int, world: int) -> list[str]:
    """expert_recv_stats in a captured max_recv_tokens dispatch: each replay adds once."""
    from hybrid_ep_triton import reference

    dev, local, replays = rank_device(), EXPERTS_PER_RANK, 3
    buf = _buffer(world, GRAPH_TOKENS)
    g = torch.Generator().manual_seed(20 + rank)
    idx = torch.rand(GRAPH_TOKENS, world * local, generator=g).argsort(dim=1)[:, :TOPK]
    x = torch.randn(GRAPH_TOKENS, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
    stats = torch.zeros(local, dtype=torch.int64, device=dev)
    max_recv = world * GRAPH_TOKENS * min(TOPK, local)
    idx_on_device = idx.to(dev)  # (a copy from pageable memory cannot be captured)

    def dispatch():
        return buf.dispatch(x, idx_on_device, max_recv_tokens=max_recv, expert_recv_stats=stats)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles
        dispatch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatch()
    stats.zero_()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    expected = replays * reference.tokens_routed_per_local_expert(
        None, idx_on_device, world * local
    )
    buf.destroy()
    if torch.equal(stats.cpu(), expected):
        return []
    return [
        f"rank {rank}: expert_recv_stats {stats.tolist()} after {replays} replays, "
        f"expected {expected.tolist()}"
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_expert_recv_stats_add_up_in_graph_replays(launch, world):
    results = launch(_stats_graph_body, world)
    assert_no_failures(results)
