"""``hybrid_ep_triton.megatron`` against Megatron-Core's own dispatchers, on the real package.

Two Megatron-Core MoE layers (local spec: TopKRouter, SequentialMLP experts with SwiGLU) get
identical weights; one keeps a dispatcher of Megatron-Core's own, the other is switched to
this library by ``use_hybrid_ep``. Every rank feeds both the same fresh random tokens; the
forward outputs, the gradients of the input, the router and the experts, and the loss over
plain SGD steps must agree (fp32: tight tolerance), and the loss must go down.

Where: on CPU ranks (gloo, the Triton interpreter) none of Megatron-Core's dispatchers
communicates (alltoall's constructor makes a torch.cuda.Stream, allgather's gather allocates on
CUDA) and its router's gating moves CPU weights to CUDA. There the reference is one
Megatron-Core layer on a group of this rank alone, with every expert, fed every rank's tokens
(Megatron-Core's allgather dispatcher, which then moves nothing but permutes); both layers run
the stages of ``MoELayer.forward`` themselves after the gating logits (x @ router.weight.T
through Megatron-Core's router_gating_linear; routing, preprocess, dispatch, experts, combine and
postprocess are the package's). With HEP_TEST_DEVICE=cuda the reference is Megatron-Core's
alltoall dispatcher on the same expert-parallel group, both layers run ``MoELayer.forward``
whole, at hidden 256 in fp32 and bf16, over 20 steps. Splits: expert-parallel over the whole
group, and data-parallel x expert-parallel (expert-parallel size 1 on 2 ranks; EP 2 x DP 2 on 4
GPUs): the Buffer must be over Megatron-Core's expert-parallel group.

Megatron-Core's own flex dispatcher (``MoEFlexTokenDispatcher``) with its "deepep" and
"hybridep" backends runs unmodified on ``hybrid_ep_triton.deep_ep`` (``register()`` before
Megatron-Core imports deep_ep, so in processes of their own) and is compared the same way. Its
"hybridep" backend makes an overflow flag with ``torch.zeros(1, device="cuda")`` when it is
built; on CPU ranks that one call is made on the CPU (``_cuda_flag_on_cpu``), which changes no
result (the flag is only read with ``moe_expert_rank_capacity_factor``, unset here). Where ranks
share a GPU (gloo), the reference is the one-rank layer, as on CPU ranks: Megatron-Core's
alltoall dispatcher needs NCCL.

One launch per split runs every case; the tests read their part of the failure messages.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from conftest import expect_error

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")
pytestmark = pytest.mark.slow

ON_GPU = os.environ.get("HEP_TEST_DEVICE") == "cuda"
EXPERTS_PER_RANK, TOPK = 4, 2
HIDDEN, FFN, SEQ, BATCH = (256, 128, 64, 2) if ON_GPU else (16, 8, 5, 2)
STEPS = 20 if ON_GPU else 3
LR = 0.5
# Largest difference allowed, relative to the reference tensor's largest magnitude. fp32: on a
# GPU the experts' matrix products over other row counts than the one-rank layer's take other
# kernels, which sum in other orders (1.0e-5 to 1.2e-5 at EP 4); a misplaced row is off by O(1).
TOL = {torch.float32: 3e-5, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    seed: int
    dtype: torch.dtype = torch.float32
    pad_multiple: int = 1
    async_finish: bool = False
    agree_on_inputs: bool = False  # the Buffer's: a host agreement before every call


CASES = [Case(1), Case(2, pad_multiple=8, agree_on_inputs=True)]
if ON_GPU:
    CASES += [Case(3, torch.bfloat16), Case(4, torch.bfloat16, pad_multiple=16, async_finish=True)]


def _config(dtype: torch.dtype, experts: int, dispatcher: str, ep: int, backend: str = "deepep"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        moe_flex_dispatcher_backend=backend,
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=experts,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not ON_GPU,
        perform_initialization=False,  # weights are copied in
    )


def _dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_world_size()


def _layer(config, pg_collection=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = spec.submodules.mlp(config=config, pg_collection=pg_collection)
    return layer.cuda() if ON_GPU else layer


def _alone() -> torch.distributed.ProcessGroup:
    """A group of this rank alone (collective: every rank makes every rank's)."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _full_weights(seed: int, experts: int):
    """router [E, H], fc1 [E, 2F, H], fc2 [E, H, F]: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(experts, HIDDEN, generator=g),
        torch.randn(experts, 2 * FFN, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.randn(experts, HIDDEN, FFN, generator=g) / FFN**0.5,
    ]


def _params(layer) -> list[torch.nn.Parameter]:
    """router weight, then each local expert's fc1 and fc2 weights."""
    params = [layer.router.weight]
    for expert in layer.experts.local_experts:
        params += [expert.linear_fc1.weight, expert.linear_fc2.weight]
    return params


def _load(layer, weights) -> None:
    router, fc1, fc2 = weights
    full = [router]
    for e in layer.local_expert_indices:
        full += [fc1[e], fc2[e]]
    with torch.no_grad():
        for p, w in zip(_params(layer), full, strict=True):
            p.copy_(w)


def _forward(layer, x: torch.Tensor) -> torch.Tensor:
    """MoELayer.forward: whole on GPUs; on CPU ranks its stages after the gating logits."""
    if ON_GPU:
        return layer(x)[0]
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    logits = router_gating_linear(x, layer.router.weight, None, torch.float32)
    probs, routing_map = layer.router.routing(logits.reshape(-1, logits.shape[-1]))
    hidden, probs = layer.preprocess(x, probs, routing_map)
    hidden, probs = layer.dispatch(hidden, probs)
    out, _ = layer.routed_experts_compute(hidden, probs)
    return layer.postprocess(layer.combine(out), None)


def _train(layer, xs, targets, denom: int, reduce: bool = True):
    """SGD steps on the global mean squared error; with ``reduce`` gradients are summed over
    each parameter's data-parallel group (experts: the expert data-parallel group). Returns
    the first step's [output, x grad, router grad, each expert's fc1 and fc2 grads] and every
    step's global loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    params = _params(layer)
    losses, first = [], None
    for x, target in zip(xs, targets, strict=True):
        x = x.clone().requires_grad_(True)
        for p in params:
            p.grad = None
        out = _forward(layer, x)
        loss = ((out.float() - target) ** 2).sum() / denom
        loss.backward()
        loss = loss.detach().clone()
        if reduce:
            for p in params:
                group = (
                    parallel_state.get_data_parallel_group()
                    if getattr(p, "allreduce", True)
                    else parallel_state.get_expert_data_parallel_group()
                )
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(loss)
        losses.append(float(loss))
        if first is None:
            first = [out.detach().float(), x.grad.float()] + [p.grad.float() for p in params]
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return first, losses


def _data(case: Case, rank: int, device):
    """This rank's batch, the same at each of the STEPS steps: inputs [SEQ, BATCH, H] in the
    case's dtype and float32 targets."""
    g = torch.Generator().manual_seed(case.seed * 100 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(device, case.dtype)
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(device)
    return [x] * STEPS, [target] * STEPS


def _reference(case: Case, rank: int, world: int, ep: int, weights, alone):
    """Megatron-Core's own layer: with an NCCL group its alltoall dispatcher over the same
    groups; else (CPU ranks, ranks sharing a GPU) one layer with every expert on ``alone``, fed
    every rank's tokens (this rank's rows and experts are taken from its output and
    gradients)."""
    import torch.distributed as dist

    experts = ep * EXPERTS_PER_RANK
    denom = world * SEQ * BATCH * HIDDEN
    if dist.get_backend() == "nccl":
        layer = _layer(_config(case.dtype, experts, "alltoall", ep))
        _load(layer, weights)
        return _train(layer, *_data(case, rank, "cuda"), denom)
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    for name in ("tp", "cp", "tp_cp", "tp_dp_cp", "ep", "expt_tp", "tp_ep", "expt_dp", "dp"):
        setattr(groups, name, alone)
    layer = _layer(_config(case.dtype, experts, "allgather", 1), groups)
    _load(layer, weights)
    data = [_data(case, r, "cuda" if ON_GPU else "cpu") for r in range(world)]
    xs = [torch.cat([d[0][step] for d in data]) for step in range(STEPS)]
    targets = [torch.cat([d[1][step] for d in data]) for step in range(STEPS)]
    (out, x_grad, router_grad, *expert_grads), losses = _train(
        layer, xs, targets, denom, reduce=False
    )
    from megatron.core import parallel_state

    rows = slice(rank * SEQ, (rank + 1) * SEQ)
    first = 2 * EXPERTS_PER_RANK * parallel_state.get_expert_model_parallel_rank()
    mine = expert_grads[first : first + 2 * EXPERTS_PER_RANK]
    return [out[rows], x_grad[rows], router_grad, *mine], losses


def _case(rank: int, world: int, ep: int, case: Case, alone, backend=None) -> list[str]:
    """One case: ``use_hybrid_ep`` (backend None), or Megatron-Core's flex dispatcher with
    ``backend`` ("deepep", "hybridep") on hybrid_ep_triton.deep_ep, against the reference."""
    import torch.distributed as dist

    from hybrid_ep_triton.megatron import HybridEPTokenDispatcher, use_hybrid_ep

    failures, what = [], f"{case} world={world} ep={ep}" + (f" flex {backend}" if backend else "")
    experts = ep * EXPERTS_PER_RANK
    weights = _full_weights(case.seed, experts)
    want, want_losses = _reference(case, rank, world, ep, weights, alone)

    if backend is None:
        layer = _layer(_config(case.dtype, experts, "alltoall" if ON_GPU else "allgather", ep))
        _load(layer, weights)
        buffer = use_hybrid_ep(
            layer,
            max_tokens_per_rank=SEQ * BATCH,
            num_sms=None if ON_GPU else 1,
            pad_multiple=case.pad_multiple,
            async_finish=case.async_finish,
            agree_on_inputs=case.agree_on_inputs,
        )
        if buffer.agree_on_inputs != case.agree_on_inputs:
            failures.append(f"{what}: the Buffer's agree_on_inputs is {buffer.agree_on_inputs}")
        if not isinstance(layer.token_dispatcher, HybridEPTokenDispatcher):
            failures.append(f"{what}: use_hybrid_ep left {type(layer.token_dispatcher)}")
    else:
        from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

        with _cuda_flag_on_cpu():
            layer = _layer(_config(case.dtype, experts, "flex", ep, backend))
        _load(layer, weights)
        if not isinstance(layer.token_dispatcher, MoEFlexTokenDispatcher):
            failures.append(f"{what}: the layer's dispatcher is {type(layer.token_dispatcher)}")
    data = _data(case, rank, "cuda" if ON_GPU else "cpu")
    got, got_losses = _train(layer, *data, world * SEQ * BATCH * HIDDEN)
    if backend is None:
        buffer.destroy()

    reference = "alltoall" if dist.get_backend() == "nccl" else "one-rank layer"
    names = ["output", "x grad", "router grad"]
    names += [f"expert {i} fc{j} grad" for i in range(EXPERTS_PER_RANK) for j in (1, 2)]
    got.append(torch.tensor(got_losses))
    want.append(torch.tensor(want_losses))
    names.append("losses")
    diffs = [_diff(a, b) for a, b in zip(got, want, strict=True)]
    for name, diff in zip(names, diffs, strict=True):
        if not diff <= TOL[case.dtype]:
            failures.append(f"{what}: {name} differ by {diff:.2e} (relative to the largest)")
    if not got_losses[-1] < 0.95 * got_losses[0]:
        failures.append(f"{what}: the loss did not go down: {got_losses}")
    if rank == 0:
        print(f"{what}: largest relative difference {max(diffs):.2e} ({reference}); losses:")
        for step, (a, b) in enumerate(zip(got_losses, want_losses, strict=True)):
            print(f"  step {step:2d}  hybrid_ep {a:.6f}  {reference} {b:.6f}")
    return failures


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (inf for different shapes)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _errors(world: int) -> list[str]:
    """Unsupported models and a Buffer over another group raise ValueError, before any Buffer
    is built (the calls that raise are not collective)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from hybrid_ep_triton import Buffer
    from hybrid_ep_triton.megatron import HybridEPTokenDispatcher, use_hybrid_ep

    failures = []
    ep = world // _dp_size()
    experts = ep * EXPERTS_PER_RANK
    layer = _layer(_config(torch.float32, experts, "alltoall" if ON_GPU else "allgather", ep))

    expect = partial(expect_error, failures, ValueError)

    expect(
        "no Megatron-Core MoELayer",
        lambda: use_hybrid_ep(torch.nn.Linear(2, 2), max_tokens_per_rank=4),
    )
    expect("SequentialMLP", lambda: use_hybrid_ep(layer, max_tokens_per_rank=4, max_recv_tokens=64))
    for name in ("moe_pad_expert_input_to_capacity", "moe_shared_expert_overlap"):
        bad = copy.copy(layer)
        bad.config = copy.copy(layer.config)
        setattr(bad.config, name, True)
        expect(f"config.{name}", lambda bad=bad: use_hybrid_ep(bad, max_tokens_per_rank=4))
    # FP8 and FP4 training pad each expert's rows as Megatron-Core's HybridEP backend does (its
    # config refuses fp8 for MoE without Transformer Engine: set on a built one), and the MXFP8
    # recipe sends MXFP8 rows, which need H % 128 == 0 (CPU ranks' H is 16: there the default
    # is a ValueError, and wire_format=None sends the params dtype).
    for name, value, pad, want in [
        ("fp8", "e4m3", 1, 16),
        ("fp8_recipe", "mxfp8", 64, 64),
        ("fp4", "nvfp4", 3, 384),
    ]:
        quantized = copy.copy(layer)
        quantized.config = copy.copy(layer.config)
        if name == "fp8_recipe":
            quantized.config.fp8 = "e4m3"
        setattr(quantized.config, name, value)
        mxfp8 = name == "fp8_recipe"
        wire = "config"
        if mxfp8 and HIDDEN % 128:
            expect("multiple of 128", lambda q=quantized: use_hybrid_ep(q, max_tokens_per_rank=4))
            wire = None
        with use_hybrid_ep(quantized, max_tokens_per_rank=4, pad_multiple=pad, wire_format=wire):
            dispatcher = quantized.token_dispatcher.dispatcher
            got = dispatcher.pad_multiple, dispatcher.wire_format
        want = want, "mxfp8" if mxfp8 and wire else None
        if got != want:
            failures.append(
                f"{name}={value}, pad_multiple {pad}: (padding, wire format) {got}, not {want}"
            )
    if _dp_size() > 1 and not ON_GPU:
        # A Buffer over the world is not the expert-parallel group (collective: every rank).
        # CPU ranks only: on GPUs a process has one NVSHMEM world, the expert-parallel group's.
        with Buffer(None, hidden_size=HIDDEN, max_tokens_per_rank=4, num_experts=experts) as buf:
            old = layer.token_dispatcher
            groups = ProcessGroupCollection()
            groups.ep, groups.expt_tp, groups.tp_ep = old.ep_group, old.tp_group, old.tp_ep_group
            expect(
                "expert-parallel group",
                lambda: HybridEPTokenDispatcher(
                    layer.num_local_experts,
                    layer.local_expert_indices,
                    layer.config,
                    groups,
                    buffer=buf,
                ),
            )
        dist.barrier()
    return failures


def _body(rank: int, world: int, ep: int) -> dict[str, list[str]]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        if ON_GPU:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        alone = None if torch.distributed.get_backend() == "nccl" else _alone()
        results = {
            "matches": [m for case in CASES for m in _case(rank, world, ep, case, alone)],
            "errors": _errors(world),
        }
    finally:
        parallel_state.destroy_model_parallel()
    return {part: [f"rank {rank}: {m}" for m in msgs] for part, msgs in results.items()}


SPLITS = {"ep2": (2, 2), "dp2_ep1": (2, 1)}
if ON_GPU:
    SPLITS |= {"ep1": (1, 1), "dp2_ep2": (4, 2)}
_RESULTS: dict[str, dict[str, list[str]]] = {}


def _failures(launch, split: str, part: str) -> str:
    if split not in _RESULTS:
        world, ep = SPLITS[split]
        if ON_GPU and world > torch.cuda.device_count():
            pytest.skip("Megatron-Core's own dispatcher needs NCCL: one GPU per rank")
        # On GPUs in processes of their own: Buffers over expert-parallel groups smaller than
        # the world bring up NVSHMEM over those groups, and a process has one NVSHMEM world.
        per_rank = launch(_body, world, ep, fresh=ON_GPU)
        _RESULTS[split] = {p: [m for r in per_rank for m in r[p]] for p in per_rank[0]}
    return "\n".join(_RESULTS[split][part])


@pytest.mark.parametrize("split", list(SPLITS))
def test_megatron_layer_matches_megatron_dispatcher(launch, split):
    failures = _failures(launch, split, "matches")
    assert not failures, failures


@pytest.mark.parametrize("split", list(SPLITS))
def test_unsupported_models_raise_value_errors(launch, split):
    failures = _failures(launch, split, "errors")
    assert not failures, failures


@contextlib.contextmanager
def _cuda_flag_on_cpu():
    """On CPU ranks: Megatron-Core's HybridEP manager makes its over-budget flag with
    ``torch.zeros(1, dtype=torch.bool, device="cuda")`` when it is built; make tensors asked for
    on CUDA on the CPU meanwhile (nothing else is made then)."""
    if ON_GPU:
        yield
        return
    zeros = torch.zeros

    def on_cpu(*args, device=None, **kwargs):
        return zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.zeros = on_cpu
    try:
        yield
    finally:
        torch.zeros = zeros


# Megatron-Core's "deepep" backend asserts TP x EP > 1; its "hybridep" one takes EP 1 too.
FLEX_CASES = [Case(5)] + ([Case(6, torch.bfloat16)] if ON_GPU else [])
GPU = pytest.mark.gpu
FLEX_SPLITS = [
    ("deepep", "ep2"),
    ("hybridep", "ep2"),
    ("hybridep", "dp2_ep1"),
    pytest.param("hybridep", "ep1", marks=GPU),
    pytest.param("deepep", "dp2_ep2", marks=GPU),
    pytest.param("hybridep", "dp2_ep2", marks=GPU),
    pytest.param("deepep", "ep4", marks=GPU),
    pytest.param("hybridep", "ep4", marks=GPU),
]
FLEX_WORLDS = {**SPLITS, "ep4": (4, 4), "dp2_ep2": (4, 2), "ep1": (1, 1)}


@pytest.mark.parametrize("backend, split", FLEX_SPLITS)
def test_megatron_flex_dispatcher_on_deep_ep_matches(launch, backend, split):
    from megatron_flex import flex_body

    world, ep = FLEX_WORLDS[split]
    # In new processes: register() must come before Megatron-Core's first import of deep_ep.
    per_rank = launch(flex_body, world, ep, backend, fresh=True)
    failures = [m for r in per_rank for m in r]
    assert not failures, "\n".join(failures)
