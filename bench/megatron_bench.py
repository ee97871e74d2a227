"""One Megatron-Core MoE layer's forward+backward time with each dispatcher: its alltoall
dispatcher, this library (``hybrid_ep_triton.megatron.use_hybrid_ep``), and Megatron-Core's flex
dispatcher (``MoEFlexTokenDispatcher``) with its "deepep" and "hybridep" backends running on
``hybrid_ep_triton.deep_ep`` (``register()`` before Megatron-Core is imported); one rank per
local GPU (``--ranks``, default every GPU).

Sizes per rank as DeepSeek-V3's: 4096 tokens, hidden 7168, 16 experts per rank, top-8, expert
FFN 2048, bf16; Megatron-Core's local spec (TopKRouter in fp32, SequentialMLP experts with
SwiGLU). Every layer gets the first layer's weights and the same tokens; the first iteration's
outputs and input gradients are checked against the alltoall layer's (bf16: within 3e-2 of the
largest magnitude). The layers are timed eagerly, interleaved (iteration i of each before
iteration i + 1 of any), with CUDA events around forward+backward and a synchronisation after
each (median of --iters after --warmup, the same tokens each iteration; the interquartile range
beside it); the reported time is the slowest rank's median. CUDA graphs: the local spec's
SequentialMLP reads tokens_per_expert on the host (.tolist()), so the layer does not capture;
TEGroupedMLP would need Transformer Engine.

World 1 (one GPU): Megatron-Core's flex dispatcher asserts TP x EP > 1 for its "deepep"
backend, and DeepEP's recommended configs (kept by the drop-in) have no entry for one rank;
both guard DeepEP's own kernels, which run on 2 to 8 ranks a node. tests/test_megatron.py gets
around it with two ranks sharing one GPU under MPS, compared with a one-rank allgather layer
(the alltoall dispatcher needs NCCL, one rank per GPU): right for correctness, but two ranks
sharing the GPU time each other's work, not the layer at world 1 beside alltoall. So at world
1 this script builds the "deepep" flex dispatcher as a "hybridep" one, then gives it the
``_DeepepManager`` that MoEFlexTokenDispatcher.__init__ makes for "deepep" (the same arguments;
only the assertion is skipped), and answers the drop-in's get_dispatch_config /
get_combine_config for one rank with the two-rank entries (the drop-in records a Config's sizes
and ignores them). The timed calls are then the flex dispatcher's own, unmodified. "hybridep"
takes world 1 as it is. With 2 or more GPUs nothing is patched.

CPU ranks (``--device cpu``, the smoke test: tiny sizes, fp32, Triton's interpreter): Megatron-
Core's alltoall dispatcher makes a CUDA stream when it is built and its router's gating moves
weights to CUDA, so there the baseline is its allgather dispatcher (at world 1 it moves nothing)
and every layer runs MoELayer.forward's stages after the gating logits (as
tests/test_megatron.py does); times are the host's wall-clock.

Usage: python bench/megatron_bench.py [--ranks N] [--out DIR] [--device cpu]
Writes <out>/<date>-<machine>-megatron-bench-<commit>.{json,md} with --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import hybrid_ep_triton.deep_ep

# Before Megatron-Core's first import of deep_ep (its fused_a2a module), in this process and in
# the rank processes (spawned: they import this module first).
hybrid_ep_triton.deep_ep.register()

# NVSHMEM fixes its heap's size at its first Buffer; a rank here holds several (use_hybrid_ep's,
# the drop-in's token and metadata Buffers, the HybridEP one's). Address space, not memory.
_HEAP_BYTES = 16 << 30
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


@dataclass(frozen=True)
class Sizes:
    tokens: int  # per rank
    hidden: int
    heads: int
    experts_per_rank: int
    topk: int
    ffn: int
    dtype: str


SIZES = {
    "cuda": Sizes(4096, 7168, 56, 16, 8, 2048, "bfloat16"),
    "cpu": Sizes(16, 64, 4, 4, 2, 32, "float32"),
}


def _config(sizes: Sizes, ep: int, dispatcher: str, backend: str = "deepep", on_gpu=True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, sizes.dtype)
    return TransformerConfig(
        num_layers=1,
        hidden_size=sizes.hidden,
        num_attention_heads=sizes.heads,
        ffn_hidden_size=sizes.ffn,
        moe_ffn_hidden_size=sizes.ffn,
        num_moe_experts=ep * sizes.experts_per_rank,
        moe_router_topk=sizes.topk,
        moe_token_dispatcher_type=dispatcher,
        moe_flex_dispatcher_backend=backend,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
    )


def _layer(config, on_gpu: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = spec.submodules.mlp(config=config)
    return layer.cuda() if on_gpu else layer


def _flex_layer(sizes: Sizes, ep: int, backend: str, on_gpu: bool):
    """A layer with Megatron-Core's flex dispatcher on ``backend`` (at world 1, "deepep" as the
    module docstring says)."""
    at_world_1 = backend == "deepep" and ep == 1
    with _cuda_zeros_on_cpu(not on_gpu):
        layer = _layer(_config(sizes, ep, "flex", "hybridep" if at_world_1 else backend, on_gpu),
                       on_gpu)  # fmt: skip
    if at_world_1:
        _deepep_manager_at_world_1(layer)
    return layer


def _deepep_manager_at_world_1(layer) -> None:
    """Give the flex dispatcher of ``layer`` the DeepEP manager MoEFlexTokenDispatcher.__init__
    makes for "deepep" (its own code, without the TP x EP > 1 assertion), and the drop-in a
    Config for one rank."""
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    from hybrid_ep_triton.deep_ep import Buffer

    for name in ("get_dispatch_config", "get_combine_config"):
        two_ranks = getattr(Buffer, name)
        setattr(Buffer, name, staticmethod(lambda n, f=two_ranks: f(max(n, 2))))
    dispatcher = layer.token_dispatcher
    config = dispatcher.config
    config.moe_flex_dispatcher_backend = "deepep"
    dispatcher._comm_manager = _DeepepManager(
        group=dispatcher.tp_ep_group,
        num_local_experts=dispatcher.num_local_experts,
        router_topk=dispatcher.tp_size * config.moe_router_topk,
        num_experts=dispatcher.tp_size * config.num_moe_experts,
        config=config,
    )
    dispatcher.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]


@contextlib.contextmanager
def _cuda_zeros_on_cpu(active: bool):
    """CPU ranks: Megatron-Core's HybridEP manager makes a flag with torch.zeros(...,
    device="cuda") when it is built; make it on the CPU meanwhile (tests/test_megatron.py)."""
    if not active:
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


def _forward(layer, x: torch.Tensor, on_gpu: bool) -> torch.Tensor:
    """MoELayer.forward: whole on GPUs; on CPU ranks its stages after the gating logits."""
    if on_gpu:
        return layer(x)[0]
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    logits = router_gating_linear(x, layer.router.weight, None, torch.float32)
    probs, routing_map = layer.router.routing(logits.reshape(-1, logits.shape[-1]))
    hidden, probs = layer.preprocess(x, probs, routing_map)
    hidden, probs = layer.dispatch(hidden, probs)
    out, _ = layer.routed_experts_compute(hidden, probs)
    return layer.postprocess(layer.combine(out), None)


def _layers(world: int, sizes: Sizes, on_gpu: bool, num_sms: int | None) -> tuple[dict, list]:
    """{name: layer}, the baseline first, every one with its weights; and the Buffers to
    destroy."""
    from hybrid_ep_triton.megatron import use_hybrid_ep

    baseline = "alltoall" if on_gpu else "allgather"
    layers = {baseline: _layer(_config(sizes, world, baseline, on_gpu=on_gpu), on_gpu)}
    layers["hybrid_ep"] = _layer(_config(sizes, world, baseline, on_gpu=on_gpu), on_gpu)
    buffers = [use_hybrid_ep(layers["hybrid_ep"], max_tokens_per_rank=sizes.tokens,
                             num_sms=num_sms if on_gpu else 1)]  # fmt: skip
    for backend in ("deepep", "hybridep"):
        layers[f"flex {backend}"] = _flex_layer(sizes, world, backend, on_gpu)
    weights = layers[baseline].state_dict()
    for layer in layers.values():
        layer.load_state_dict(weights)
    return layers, buffers


def _dispatcher_classes(layers: dict) -> dict[str, str]:
    """{name: the class of its token dispatcher (and of a flex dispatcher's manager)}."""
    found = {}
    for name, layer in layers.items():
        dispatcher = layer.token_dispatcher
        manager = getattr(dispatcher, "_comm_manager", None)
        found[name] = type(dispatcher).__name__
        if manager is not None:
            found[name] += f" / {type(manager).__name__}"
    return found


def _rank(rank: int, world: int, opts: dict) -> dict:
    from megatron.core import parallel_state

    on_gpu = opts["device"] == "cuda"
    sizes = SIZES[opts["device"]]
    dtype = getattr(torch, sizes.dtype)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234 + rank)
    else:
        torch.manual_seed(1234 + rank)
    layers, buffers = _layers(world, sizes, on_gpu, opts["num_sms"])
    classes = _dispatcher_classes(layers)
    device = "cuda" if on_gpu else "cpu"
    x = torch.randn(sizes.tokens, 1, sizes.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    times = {name: [] for name in layers}
    first = {}
    for i in range(opts["warmup"] + opts["iters"]):
        for name, layer in layers.items():
            x.grad = None
            torch.distributed.barrier()
            ms, out = _forward_backward_ms(layer, x, grad, on_gpu)
            if i == 0:
                first[name] = (out.detach().float().cpu(), x.grad.float().cpu())
            if i >= opts["warmup"]:
                times[name].append(ms)
    for buffer in buffers:
        buffer.destroy()
    parallel_state.destroy_model_parallel()
    return dict(times=times, errors=_differences(first, TOLERANCE[dtype]), dispatchers=classes)


def _forward_backward_ms(layer, x, grad, on_gpu: bool) -> tuple[float, torch.Tensor]:
    """One forward+backward of ``layer``: its ms (CUDA events around it, then a
    synchronisation; on CPU ranks the wall-clock) and its output."""
    if on_gpu:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
    t0 = time.perf_counter()
    out = _forward(layer, x, on_gpu)
    out.backward(grad)
    if not on_gpu:
        return (time.perf_counter() - t0) * 1e3, out
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out


def _differences(first: dict, tolerance: float) -> list[str]:
    """Where a layer's first output or input gradient differs from the baseline's (the first
    layer's) by more than ``tolerance`` of the baseline's largest magnitude."""
    (baseline, want), *others = first.items()
    errors = []
    for name, got in others:
        for what, a, b in zip(("output", "x grad"), got, want, strict=True):
            diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            if not diff <= tolerance:
                errors.append(f"{name}: {what} differs from {baseline}'s by {diff:.2e}")
    return errors


def _summary(per_rank: list[dict]) -> dict:
    """{name: {ms, p25, p75 (the slowest rank's, by median), ratio to the baseline}}."""
    found = {}
    for name in per_rank[0]["times"]:
        slowest = max((r["times"][name] for r in per_rank), key=statistics.median)
        quartiles = statistics.quantiles(slowest, n=4, method="inclusive")
        found[name] = dict(ms=statistics.median(slowest), p25=quartiles[0], p75=quartiles[-1])
    baseline = found[next(iter(found))]["ms"]
    for entry in found.values():
        entry["ratio"] = entry["ms"] / baseline
    return found


def _report(result: dict) -> list[str]:
    s = result["sizes"]
    lines = [
        f"# One Megatron-Core MoE layer, forward+backward: {result['ranks']} rank(s) x "
        f"{result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}, megatron-core "
        f"{result['megatron_core']}; {s['tokens']} tokens/rank, hidden {s['hidden']}, "
        f"{s['experts_per_rank']} experts/rank, top-{s['topk']}, FFN {s['ffn']}, {s['dtype']}, "
        f"SequentialMLP experts; eager, median of {result['iters']} after {result['warmup']} "
        "(interquartile range), slowest rank; ratio to the first row. flex: Megatron-Core's "
        "MoEFlexTokenDispatcher on hybrid_ep_triton.deep_ep"
        + (" (deepep at world 1: see bench/megatron_bench.py)" if result["ranks"] == 1 else ""),
        "",
        "| dispatcher | ms | IQR ms | ratio |",
        "|---|---:|---|---:|",
    ]  # fmt: skip
    for name, e in result["summary"].items():
        lines.append(f"| {name} | {e['ms']:.2f} | {e['p25']:.2f}-{e['p75']:.2f} | "
                     f"{e['ratio']:.3f} |")  # fmt: skip
    lines += ["", "Dispatchers: " + "; ".join(f"{name}: {cls}" for name, cls in
                                             result["dispatchers"].items())]  # fmt: skip
    lines += ["", "CUDA graphs: not run (SequentialMLP reads tokens_per_expert on the host)"]
    if result["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    return lines


def _megatron_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a carried package folder (.megatron-site)
        from megatron.core import package_info

        return package_info.__version__


def main() -> int:
    from hybrid_ep_triton.tools.bench import commit
    from hybrid_ep_triton.tools.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda where torch sees a GPU")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=None, help="default: every GPU (CPU: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (CPU: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (CPU: 1)")
    parser.add_argument("--num-sms", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for the JSON and Markdown")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    ranks = args.ranks or (torch.cuda.device_count() if on_gpu else 1)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    opts = dict(device=device, num_sms=args.num_sms, warmup=warmup,
                iters=args.iters or (20 if on_gpu else 2))  # fmt: skip
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_HEAP_BYTES))
    per_rank = run_ranks(_rank, ranks, opts, device=device, timeout_s=540)
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    result = dict(
        machine=name, machine_slug=f"{ranks}x{name.replace('NVIDIA ', '').replace(' ', '')}",
        date=datetime.date.today().isoformat(), commit=commit(), ranks=ranks,
        megatron_core=_megatron_version(),
        sizes=asdict(SIZES[device]), **opts, dispatchers=per_rank[0]["dispatchers"],
        per_rank_ms=[r["times"] for r in per_rank],
        errors=sorted({e for r in per_rank for e in r["errors"]}),
    )  # fmt: skip
    result["summary"] = _summary(per_rank)
    lines = _report(result)
    print("\n".join(lines), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"{result['date']}-{result['machine_slug']}-megatron-bench-"
                            f"{result['commit']}")  # fmt: skip
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
