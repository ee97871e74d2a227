"""``hybrid_ep_triton.moe`` on CPU ranks, fp32 (the wire formats in bf16, also on GPUs).

TokenDispatcher: its rows, counts and probs must equal the plain-torch reference dispatcher's
(both input forms, exact and max_recv_tokens modes, -1 slots, a token routed nowhere, a rank
with no tokens), its combine the reference combine's; gradients are checked against the closed
form of combine(rows * probs): out[t] = (sum of t's routed probs) * x[t]. Bad arguments raise
ValueError naming them. Its wire formats (bf16 rows sent as fp8, mxfp8 or nvfp4, dequantized on
arrival) against the reference's rows of the quantized-then-dequantized tokens, on CPU ranks and
on GPUs (the rest of this file runs on CPU ranks only).

MoELayer: every rank builds the full model from one seed and keeps its experts; a
single-process model with every expert and every token (plain matmuls, a loop over experts)
is the reference. Both take a few plain SGD steps on a global mean squared error: the first
step's gradients (this rank's input, the all-reduced router weight, the local experts) and every
step's loss must match, and the loss must go down.

A launch costs seconds, so the ranks of each group size are launched once, build one Buffer
and run every check in it; the tests read their part of the per-rank failure messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import expect_error

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.moe import MoELayer, TokenDispatcher
from hybrid_ep_triton.tools.launcher import rank_device

# fp32 experts: torch._grouped_mm takes fp32 on CPUs only. On GPUs the layer is checked in
# bf16 by tests/test_streams.py (CUDA-graph replay of its forward and backward against eager).
# The wire formats' test (bf16, no experts) runs on both.
cpu_only = pytest.mark.skipif(
    os.environ.get("HEP_TEST_DEVICE") == "cuda", reason="fp32 CPU ranks only"
)

HIDDEN, FFN, EXPERTS_PER_RANK, MAX_TOKENS = 8, 8, 2, 6
WIRE_HIDDEN = 128  # a quantizing dispatch quantizes 128 channels at a time
TOL = {"rtol": 1e-4, "atol": 1e-5}
LR = 1.0


@dataclass(frozen=True)
class Case:
    seed: int
    tokens: tuple[int, ...]  # T of each rank
    topk: int
    form: str = "idx"  # dispatcher input: "map" (probs [T, E] + routing_map) or "idx" (topk_idx)
    max_recv: bool = False  # max_recv_tokens mode, sized never to drop a row; else exact mode
    pad_multiple: int = 1
    leading: bool = False  # hidden_states [2, T / 2, H] instead of [T, H]
    steps: int = 0  # MoELayer: SGD steps

    def shape(self, rank: int) -> tuple[int, ...]:
        tokens = self.tokens[rank]
        return (2, tokens // 2, HIDDEN) if self.leading else (tokens, HIDDEN)

    def max_recv_tokens(self, world: int) -> int | None:
        if not self.max_recv:
            return None
        rows = world * MAX_TOKENS * min(self.topk, EXPERTS_PER_RANK)
        return rows + EXPERTS_PER_RANK * (self.pad_multiple - 1)


CASES = {
    2: {
        "dispatcher": [
            Case(1, (5, 3), 2, form="map"),
            Case(2, (0, 6), 3, max_recv=True, pad_multiple=3, leading=True),
        ],
        "layer": [Case(11, (5, 3), 2, steps=5)],
    },
    3: {
        "dispatcher": [Case(3, (4, 0, 6), 3, form="map", max_recv=True, pad_multiple=2)],
        "layer": [Case(12, (4, 0, 6), 3, max_recv=True, pad_multiple=2, leading=True, steps=3)],
    },
}


def _compare(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        failures.append(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    elif not torch.allclose(got, want, **TOL):
        failures.append(f"{what}: off by {(got - want).abs().max():.2e}")


# -- TokenDispatcher ----------------------------------------------------------------------------


def _routing(g: torch.Generator, tokens: int, experts: int, topk: int):
    """[T, K] distinct expert ids with -1 slots (token 0 has only -1 slots), the same routing
    as a [T, E] bool map, and [T, E] probs."""
    idx = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :topk]
    idx = idx.masked_fill(torch.rand(tokens, topk, generator=g) < 0.3, -1)
    idx[:1] = -1
    rows, slots = (idx >= 0).nonzero(as_tuple=True)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[rows, idx[rows, slots]] = True
    return idx, routing_map, torch.rand(tokens, experts, generator=g)


def _dispatcher_case(buf: Buffer, rank: int, world: int, case: Case) -> list[str]:
    failures, what = [], str(case)
    g = torch.Generator().manual_seed(case.seed * 100 + rank)
    tokens, experts, shape = case.tokens[rank], buf.num_experts, case.shape(rank)
    x = torch.randn(tokens, HIDDEN, generator=g)
    idx, routing_map, full_probs = _routing(g, tokens, experts, case.topk)
    slot_probs = full_probs.gather(1, idx.clamp(min=0))  # [T, K], what the reference sends
    hidden = x.reshape(shape).requires_grad_(True)

    max_recv = case.max_recv_tokens(world)
    d = TokenDispatcher(buf, case.topk, max_recv_tokens=max_recv, pad_multiple=case.pad_multiple)
    if case.form == "map":  # off-map entries of full_probs must be ignored
        probs = full_probs.clone().requires_grad_(True)
        rows, tokens_per_expert, row_probs = d.dispatch(hidden, probs, routing_map)
    else:
        probs = slot_probs.clone().requires_grad_(True)
        rows, tokens_per_expert, row_probs = d.dispatch(hidden, probs, topk_idx=idx)
    ref_rows, ref_probs, ref_counts, ref_handle = reference.dispatch(
        None,
        x,
        idx,
        slot_probs,
        num_experts=experts,
        pad_multiple=case.pad_multiple,
        max_recv_tokens=max_recv,
    )
    for name, got, want in [
        ("permuted_tokens", rows, ref_rows),
        ("tokens_per_expert", tokens_per_expert, ref_counts),
        ("permuted_probs", row_probs, ref_probs),
    ]:
        if got.shape != want.shape or not torch.equal(got.detach(), want):
            failures.append(f"{what}: {name} differs from the reference: {got} vs {want}")

    expert_output = rows * row_probs[:, None]
    bad = partial(d.combine, expert_output[:, 1:])
    expect_error(failures, ValueError, "expert_output", bad)  # raises before anything moves
    out = d.combine(expert_output)
    expect_error(failures, RuntimeError, "dispatch first", partial(d.combine, expert_output))
    ref_out = reference.combine(None, expert_output.detach(), ref_handle)
    _compare(failures, f"{what}: combine", out.detach(), ref_out.reshape(shape))

    # out[t] = (sum of t's routed probs) * x[t]: closed-form gradients of <out, proj>.
    proj = torch.randn(shape, generator=g)
    (out * proj).sum().backward()
    routed = idx >= 0
    token_probs = (slot_probs * routed).sum(dim=1)
    _compare(failures, f"{what}: grad", hidden.grad, token_probs.reshape(shape[:-1] + (1,)) * proj)
    x_dot_proj = (x * proj.reshape(tokens, HIDDEN)).sum(dim=1, keepdim=True)
    mask = routing_map if case.form == "map" else routed
    _compare(failures, f"{what}: probs grad", probs.grad, mask * x_dot_proj)
    return failures


def _argument_errors(buf: Buffer) -> list[str]:
    """Bad arguments raise ValueError naming them, before anything moves (nothing collective)."""
    failures, experts = [], buf.num_experts
    d = TokenDispatcher(buf, 2)
    x, probs, idx = torch.zeros(3, HIDDEN), torch.rand(3, experts), torch.tensor([[0, 1]] * 3)
    routing_map = torch.zeros(3, experts, dtype=torch.bool)
    too_many = routing_map.clone()
    too_many[1, :3] = True  # three experts for router_topk=2
    expect_error(failures, RuntimeError, "dispatch first", partial(d.combine, x))
    for words, make, kwargs in [
        ("router_topk", TokenDispatcher, {"router_topk": experts + 1}),
        ("max_recv_tokens", TokenDispatcher, {"router_topk": 2, "max_recv_tokens": -1}),
        ("pad_multiple", TokenDispatcher, {"router_topk": 2, "pad_multiple": 0}),
        ("wire_format", TokenDispatcher, {"router_topk": 2, "wire_format": "int8"}),
        ("multiple of 128", TokenDispatcher, {"router_topk": 2, "wire_format": "mxfp8"}),
        ("multiples of 8", MoELayer, {"ffn_hidden_size": 12, "router_topk": 2}),
    ]:
        expect_error(failures, ValueError, words, partial(make, buf, **kwargs))
    for words, args, kwargs in [
        ("hidden_states", (torch.zeros(3, HIDDEN + 1), probs, routing_map), {}),
        ("hidden_states", (x.double(), probs, routing_map), {}),
        ("max_tokens_per_rank", (torch.zeros(MAX_TOKENS + 1, HIDDEN), probs, routing_map), {}),
        ("exactly one", (x, probs), {}),
        ("exactly one", (x, probs, routing_map), {"topk_idx": idx}),
        ("probs", (x, probs[:, 1:], routing_map), {}),
        ("probs", (x, probs.long(), routing_map), {}),
        ("routing_map", (x, probs, routing_map.long()), {}),
        ("got 3 in row 1", (x, probs, too_many), {}),
        ("topk_idx", (x, probs[:, :2]), {"topk_idx": torch.zeros(3, 3).long()}),
        ("topk_idx", (x, probs[:, :2]), {"topk_idx": idx.float()}),
    ]:
        expect_error(failures, ValueError, words, partial(d.dispatch, *args, **kwargs))
    return failures


def _wire_format_case(rank: int, world: int) -> list[str]:
    """wire_format: permuted_tokens are exactly the reference's rows of the tokens quantized
    and dequantized (the format's rule in plain torch), plain tensors of the Buffer's dtype;
    probs, counts and combine as without it; the tokens' gradient straight through. Rows that
    require grad (a ScaledValues underneath) and rows that do not (a pair) in turn."""
    failures, experts, dtype, dev = [], world * EXPERTS_PER_RANK, torch.bfloat16, rank_device()
    with Buffer(
        None,
        hidden_size=WIRE_HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=experts,
        dtype=dtype,
        num_sms=1,
        device=dev,
    ) as buf:
        for i, fmt in enumerate(reference.QUANTIZERS):
            what = f"wire_format={fmt}"
            g = torch.Generator().manual_seed(1000 * i + rank)
            tokens = MAX_TOKENS - 2 * rank
            # Blocks of very different magnitudes, so that the scales differ.
            magnitudes = torch.logspace(-6, 6, WIRE_HIDDEN // 16, base=2).repeat_interleave(16)
            x = (torch.randn(tokens, WIRE_HIDDEN, generator=g) * magnitudes).to(dtype).to(dev)
            idx, _, full_probs = _routing(g, tokens, experts, 2)
            probs = full_probs.gather(1, idx.clamp(min=0)).to(dev)
            idx = idx.to(dev)
            hidden = x.clone().requires_grad_(i % 2 == 0)
            d = TokenDispatcher(buf, 2, wire_format=fmt)
            rows, counts, row_probs = d.dispatch(hidden, probs, topk_idx=idx)
            on_wire = reference.DEQUANTIZERS[fmt](*reference.QUANTIZERS[fmt](x)).to(dtype)
            ref_rows, ref_probs, ref_counts, handle = reference.dispatch(
                None, on_wire, idx, probs, num_experts=experts
            )
            if type(rows) is not torch.Tensor:
                failures.append(f"{what}: permuted_tokens is a {type(rows).__name__}")
            for name, got, want in [
                ("permuted_tokens", rows, ref_rows),
                ("tokens_per_expert", counts, ref_counts),
                ("permuted_probs", row_probs, ref_probs),
            ]:
                if got.shape != want.shape or not torch.equal(got.detach(), want):
                    failures.append(f"{what}: {name} differs from the reference")
            out = d.combine(rows)
            _compare(
                failures,
                f"{what}: combine",
                out.detach().float(),
                reference.combine(None, rows.detach(), handle).float(),
            )
            if hidden.requires_grad:  # out[t] = (t's routed slots) * on_wire[t]
                proj = torch.randn(tokens, WIRE_HIDDEN, generator=g).to(dtype).to(dev)
                (out.float() * proj.float()).sum().backward()
                routed = (idx >= 0).sum(dim=1, keepdim=True)
                _compare(failures, f"{what}: grad", hidden.grad.float(), (routed * proj).float())
    return failures


# -- MoELayer -------------------------------------------------------------------------------------


def _full_model(seed: int, world: int, tokens: tuple[int, ...]):
    """[router [E, H], w_gate_up [E, H, 2F], w_down [E, F, H]], and every rank's inputs and
    targets [T_r, H]."""
    g = torch.Generator().manual_seed(seed)
    experts = world * EXPERTS_PER_RANK
    weights = [
        torch.randn(experts, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.randn(experts, HIDDEN, 2 * FFN, generator=g) / HIDDEN**0.5,
        torch.randn(experts, FFN, HIDDEN, generator=g) / FFN**0.5,
    ]
    xs = [torch.randn(t, HIDDEN, generator=g) for t in tokens]
    targets = [torch.randn(t, HIDDEN, generator=g) for t in tokens]
    return weights, xs, targets


def _reference_layer(x, router, w_gate_up, w_down, topk: int) -> torch.Tensor:
    """MoELayer's function with every expert, one expert at a time with plain matmuls."""
    top_logits, idx = (x @ router.t()).topk(topk, dim=-1)
    probs = torch.softmax(top_logits, dim=-1)
    out = torch.zeros_like(x)
    for e in range(router.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gate, up = (x[tok] @ w_gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, tok, (F.silu(gate) * up * probs[tok, slot, None]) @ w_down[e])
    return out


def _train(steps: int, loss_fn, x: torch.Tensor, params: list, sync=lambda loss: loss):
    """SGD steps on ``params``; ``sync(loss)`` runs after each backward and returns the global
    loss. Returns the losses and the first step's gradients of x and params."""
    losses, first_grads = [], None
    for _ in range(steps):
        for t in (x, *params):
            t.grad = None
        loss = loss_fn()
        loss.backward()
        losses.append(float(sync(loss.detach().clone())))
        first_grads = first_grads or [t.grad.clone() for t in (x, *params)]
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return losses, first_grads


def _layer_case(buf: Buffer, rank: int, world: int, case: Case) -> list[str]:
    failures, what = [], str(case)
    weights, xs, targets = _full_model(case.seed, world, case.tokens)
    denom = sum(case.tokens) * HIDDEN  # the loss is the mean over every rank's outputs

    ref_x = torch.cat(xs).requires_grad_(True)
    ref_params = [w.clone().requires_grad_(True) for w in weights]
    ref_target = torch.cat(targets)
    ref_losses, ref_grads = _train(
        case.steps,
        lambda: ((_reference_layer(ref_x, *ref_params, case.topk) - ref_target) ** 2).sum() / denom,
        ref_x,
        ref_params,
    )

    layer = MoELayer(
        buf,
        FFN,
        case.topk,
        max_recv_tokens=case.max_recv_tokens(world),
        pad_multiple=case.pad_multiple,
    )
    mine = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    params = [layer.router.weight, layer.w_gate_up, layer.w_down]
    with torch.no_grad():
        for p, full in zip(params, [weights[0], weights[1][mine], weights[2][mine]], strict=True):
            p.copy_(full)
    x = xs[rank].reshape(case.shape(rank)).requires_grad_(True)
    target = targets[rank].reshape(case.shape(rank))

    def sync(loss: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(layer.router.weight.grad)  # replicated: every rank's tokens count
        dist.all_reduce(loss)
        return loss

    losses, grads = _train(
        case.steps, lambda: ((layer(x) - target) ** 2).sum() / denom, x, params, sync
    )

    start = sum(case.tokens[:rank])
    want = [ref_grads[0][start : start + case.tokens[rank]].reshape(x.shape), ref_grads[1]]
    want += [ref_grads[2][mine], ref_grads[3][mine]]
    for name, got, ref in zip(["x", "router", "w_gate_up", "w_down"], grads, want, strict=True):
        _compare(failures, f"{what}: {name} grad", got, ref)
    _compare(failures, f"{what}: losses", torch.tensor(losses), torch.tensor(ref_losses))
    if not losses[-1] < 0.9 * losses[0]:
        failures.append(f"{what}: the loss did not go down: {losses}")
    return failures


# -- one launch per group size, shared by the tests ----------------------------------------------

_RESULTS: dict[int, dict[str, list[str]]] = {}


def _body(rank: int, world: int, cases: dict[str, list[Case]]) -> dict[str, list[str]]:
    """Every check of one group size: {part: this rank's failure messages}."""
    with _buffer(world) as buf:
        results = {
            "dispatcher": [
                m for c in cases["dispatcher"] for m in _dispatcher_case(buf, rank, world, c)
            ],
            "errors": _argument_errors(buf),
            "layer": [m for c in cases["layer"] for m in _layer_case(buf, rank, world, c)],
        }
    return {part: [f"rank {rank}: {m}" for m in msgs] for part, msgs in results.items()}


def _buffer(world: int) -> Buffer:
    return Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=world * EXPERTS_PER_RANK,
        dtype=torch.float32,
        num_sms=1,  # the fewest interpreted programs: the kernels are not what is tested here
    )


def _failures(launch, world: int, part: str) -> str:
    """``part``'s failures on every rank; the ranks run once per group size for all tests."""
    if world not in _RESULTS:
        per_rank = launch(_body, world, CASES[world])
        _RESULTS[world] = {part: [m for r in per_rank for m in r[part]] for part in per_rank[0]}
    return "\n".join(_RESULTS[world][part])


@cpu_only
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dispatcher_matches_the_reference(launch, world):
    failures = _failures(launch, world, "dispatcher")
    assert not failures, failures


@cpu_only
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_bad_arguments_raise_value_errors(launch, world):
    failures = _failures(launch, world, "errors")
    assert not failures, failures


def _wire_format_body(rank: int, world: int) -> list[str]:
    return [f"rank {rank}: {m}" for m in _wire_format_case(rank, world)]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_wire_formats_deliver_the_dequantized_rows(launch, world):
    failures = [m for per_rank in launch(_wire_format_body, world) for m in per_rank]
    assert not failures, failures


@cpu_only
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_moe_layer_trains_like_a_single_process_model(launch, world):
    failures = _failures(launch, world, "layer")
    assert not failures, failures
