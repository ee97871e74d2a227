"""hybrid-ep tune writes the per-machine cache; a Buffer takes its configuration from it, the
entry for its own hidden size, dtype, output layout and nodes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.runtime.planner import KernelConfig, default_config
from hybrid_ep_triton.runtime.tuning import cache_key, store
from hybrid_ep_triton.tools.launcher import rank_device, ranks_per_gpu

# Tuned where the suite runs (CPU ranks, or GPU ranks sharing GPUs), where its Buffers then look.
TUNE = [
    "--device",
    DEVICE,
    "--ranks",
    "2",
    "--tokens",
    "4",
    "--hidden",
    "8",
    "--experts",
    "4",
    "--topk",
    "2",
    "--sms",
    "2",
    "--chunks",
    "2",
    "--block-h",
    "32",
    "--warps",
    "1",
    "--slices",
    "1,2",
    "--warmup",
    "1",
    "--iters",
    "2",
    "--dtype",
    "float16",
    "--rows",
    "token",
]
TUNED = dict(hidden=8, dtype=torch.float16, expand=False, num_sms=None, ranks_per_node=None)
UNTUNED = {
    "hidden": dict(TUNED, hidden=6),
    "dtype": dict(TUNED, dtype=torch.bfloat16),
    "layout": dict(TUNED, expand=True),
    "nodes": dict(TUNED, ranks_per_node=1),  # tuned within one node: not for 2 nodes of 1
}


def _configs_body(rank: int, world_size: int, entry: dict | None = None) -> dict:
    """Each untuned and tuned Buffer's configuration; ``entry``: a tuned configuration rank 0
    stores first, as hybrid-ep tune would have (where tune may not time these ranks)."""
    if entry is not None:
        if rank == 0:
            hidden, dtype, expand = TUNED["hidden"], TUNED["dtype"], TUNED["expand"]
            key = cache_key(rank_device(), world_size, hidden, dtype, expand)
            store(key, KernelConfig(**entry), {})
        torch.distributed.barrier()
    configs = {}
    for name, b in (("tuned", TUNED), ("tuned, 3 SMs", dict(TUNED, num_sms=3)), *UNTUNED.items()):
        with Buffer(
            None,
            hidden_size=b["hidden"],
            max_tokens_per_rank=4,
            num_experts=4,
            dtype=b["dtype"],
            expand=b["expand"],
            num_sms=b["num_sms"],
            ranks_per_node=b["ranks_per_node"],
            device=rank_device(),
        ) as buf:
            configs[name] = dataclasses.asdict(buf._rt.plan.config)
    return configs


@pytest.mark.slow
def test_tune_caches_the_best_configuration_and_buffer_uses_it(launch, tmp_path, monkeypatch):
    monkeypatch.setenv("HEP_CACHE_DIR", str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "hybrid_ep_triton", "tune", *TUNE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if DEVICE == "cuda" and ranks_per_gpu(2) > 1:
        # Times under MPS are not speeds: tune refuses ranks that share a GPU, before any starts.
        # What a Buffer on such ranks does with a tuned entry is checked with one stored here.
        assert result.returncode == 2, result.stdout + result.stderr
        assert "tune times one rank per GPU: 2 ranks would share the GPUs" in result.stderr
        best = dict(_heuristic(8), num_sms=2, chunk_tokens=2, h_slices=2)
        assert best["chunk_tokens"] != _heuristic(8)["chunk_tokens"], best
        _check_buffers_take(best, launch(_configs_body, 2, best))
        return
    assert result.returncode == 0, result.stdout + result.stderr
    entries = json.loads((tmp_path / "kernel_configs.json").read_text())
    (key, entry), *others = entries.items()
    assert not others and key.endswith("|world 2|hidden 8|torch.float16|token rows"), entries
    best = entry["config"]
    assert best["h_slices"] in (1, 2) and best["num_sms"] == 2, best
    # The heuristic's chunks are longer (4 tokens on CPUs): a Buffer that used it cannot pass
    # for a tuned one.
    assert best["chunk_tokens"] == 2 != _heuristic(8)["chunk_tokens"], best
    assert entry["measured"]["dispatch_us"] > 0 and entry["measured"]["combine_us"] > 0
    _check_buffers_take(best, launch(_configs_body, 2))


def _check_buffers_take(best: dict, per_rank: list[dict]) -> None:
    """Every rank's tuned Buffers took ``best`` (with their own num_sms), the others the
    heuristic's configuration."""
    for configs in per_rank:
        assert configs["tuned"] == best
        assert configs["tuned, 3 SMs"] == dict(best, num_sms=3)
        for name, b in UNTUNED.items():
            assert configs[name] == _heuristic(b["hidden"]), name


def _heuristic(hidden: int) -> dict:
    """The configuration of an untuned Buffer of the test's sizes on the suite's device."""
    return dataclasses.asdict(default_config(hidden, 4, None, DEVICE == "cuda"))


def test_cache_entry_of_another_version_falls_back_to_the_heuristic(tmp_path, monkeypatch):
    from hybrid_ep_triton.runtime.tuning import select_config

    monkeypatch.setenv("HEP_CACHE_DIR", str(tmp_path))
    current = dataclasses.asdict(default_config(8, 4, 2, False))
    renamed = {("num_programs" if k == "num_sms" else k): v for k, v in current.items()}
    config = dict(current, chunk_tokens=8)
    for name, entry in (("current", config), ("renamed field", renamed)):
        (tmp_path / "kernel_configs.json").write_text(json.dumps({"k": {"config": entry}}))
        got = dataclasses.asdict(select_config("k", 6, 4, None, False))
        assert got == (
            config if name == "current" else dataclasses.asdict(default_config(6, 4, None, False))
        ), name


def test_the_default_budget_fits_the_context(tmp_path, monkeypatch):
    """Without num_sms a GPU configuration takes at most the SMs the process's context may use
    (6, as a 6% MPS share of an H200 leaves: below the heuristic's 8), a tuned one too; a num_sms
    that is given is kept (the Buffer refuses it then)."""
    from hybrid_ep_triton.runtime.tuning import select_config

    monkeypatch.setenv("HEP_CACHE_DIR", str(tmp_path))
    assert select_config("k", 7168, 4096, None, True) == default_config(7168, 4096, None, True)
    assert select_config("k", 7168, 4096, None, True, available_sms=132).num_sms == 8
    assert select_config("k", 7168, 4096, None, True, available_sms=6) == default_config(
        7168, 4096, 6, True
    )
    assert select_config("k", 7168, 4096, 8, True, available_sms=6).num_sms == 8
    tuned = dataclasses.replace(default_config(7168, 4096, 16, True), chunk_tokens=64)
    entry = {"config": dataclasses.asdict(tuned)}
    (tmp_path / "kernel_configs.json").write_text(json.dumps({"k": entry}))
    assert select_config("k", 7168, 4096, None, True, available_sms=32) == tuned
    assert select_config("k", 7168, 4096, None, True, available_sms=6) == dataclasses.replace(
        tuned, num_sms=6
    )
