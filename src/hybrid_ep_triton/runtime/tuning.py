"""Kernel configurations of a Buffer: the per-machine cache that ``hybrid-ep tune`` writes, with
the planner's heuristic as the fallback. Tuning never runs implicitly: a Buffer only reads.

The cache is one JSON file (where: ``cache_location.cache_path``), keyed by GPU name, Triton
version, world size, hidden size, dtype and output layout (expert-major rows or token rows: their
kernels move different bytes, so their best configurations differ).
"""

import contextlib
import dataclasses
import json

import torch
import triton

from .cache_location import cache_path
from .planner import KernelConfig, default_config

_FORCED: list[KernelConfig] = []  # set by ``forced`` while a tuner measures a candidate


def cache_key(
    device: torch.device,
    world_size: int,
    hidden: int,
    dtype: torch.dtype,
    expand: bool,
    ranks_per_node: int | None = None,
) -> str:
    """The cache key of a Buffer's configuration (``expand``: the Buffer's output layout; a
    group of several nodes of ``ranks_per_node`` ranks has keys of its own)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    rows = "expert rows" if expand else "token rows"
    key = f"{name}|triton {triton.__version__}|world {world_size}|hidden {hidden}|{dtype}|{rows}"
    if ranks_per_node and ranks_per_node < world_size:
        key += f"|nodes {world_size // ranks_per_node}x{ranks_per_node}"
    return key


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def store(key: str, config: KernelConfig, measured: dict) -> None:
    """Record ``config`` as the best for ``key``, with what was measured (µs, shape)."""
    entries = _load()
    entries[key] = {"config": dataclasses.asdict(config), "measured": measured}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a Buffer reading at the same time sees the old or the new file


def select_config(
    key: str,
    hidden: int,
    max_tokens: int,
    num_sms: int | None,
    on_gpu: bool,
    available_sms: int | None = None,
    cached: bool = True,
) -> KernelConfig:
    """The cached configuration for ``key`` (with a budget of ``num_sms`` when given), else (or
    without ``cached``) the heuristic ``default_config``. Without ``num_sms``, a budget of at
    most ``available_sms`` (the SMs this process's context may use: an MPS share may give it
    fewer than the default 8), so that the default never asks for more than the context has."""
    config = _cached_or_default(key, hidden, max_tokens, num_sms, on_gpu, cached)
    if num_sms is None and available_sms is not None and config.num_sms > available_sms:
        return _cached_or_default(key, hidden, max_tokens, available_sms, on_gpu, cached)
    return config


def _cached_or_default(
    key: str, hidden: int, max_tokens: int, num_sms: int | None, on_gpu: bool, cached: bool
) -> KernelConfig:
    if _FORCED:
        return _FORCED[-1]
    entry = _load().get(key) if cached else None
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    if entry is None or set(entry["config"]) != fields:  # none, or written by another version
        return default_config(hidden, max_tokens, num_sms, on_gpu)
    config = KernelConfig(**entry["config"])
    return dataclasses.replace(config, num_sms=num_sms) if num_sms else config


@contextlib.contextmanager
def forced(config: KernelConfig):
    """Buffers constructed inside use ``config`` (for the tuner's candidates)."""
    _FORCED.append(config)
    try:
        yield
    finally:
        _FORCED.pop()
