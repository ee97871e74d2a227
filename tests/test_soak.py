"""The soak (``hybrid_ep_triton.tools.soak``, ``hybrid-ep soak``): the short version for CI.

The full soak is 10,000 rounds on GPUs (see ``hybrid-ep soak --help``); here 20 rounds on two
CPU ranks, with a seed whose draws cover every feature the soak varies on both ranks.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_ep_triton.tools.soak import (
    MEMORY_BOUND,
    SoakConfig,
    _summary,
    format_summary,
    soak_rank,
)

ROUNDS = 20
# Seed 1 draws, in 20 rounds on each of 2 ranks, every feature counted in "coverage".
CONFIG = SoakConfig(rounds=ROUNDS, tokens=6, hidden=8, experts=4, topk=2, seed=1)
FEATURES = {
    "exact",
    "cached",
    "max_recv",
    "no tokens",
    "-1 slots",
    "hot expert",
    "pad_multiple > 1",
    "int32 ids",
    "topk_weights",
    "weighted combine",
    "unweighted combine",
}


@pytest.mark.slow
def test_short_soak_on_two_ranks(launch):
    summaries = launch(soak_rank, 2, CONFIG)
    for rank, s in enumerate(summaries):
        line = format_summary(s)
        assert s["ok"], line + "\n" + "\n".join(s["messages"])
        assert line.startswith(f"soak rank {rank}: {ROUNDS} rounds, 0 failures;"), line
        assert line.endswith("OK") and not s["messages"], line
        assert s["memory_growth"] <= s["memory_bound"], line
        assert s["memory_first"] > 0 and s["ms_first"] > 0, line
        assert set(s["coverage"]) == FEATURES, s["coverage"]
        assert sum(s["coverage"][m] for m in ("exact", "cached", "max_recv")) == ROUNDS


@pytest.mark.slow
def test_short_soak_with_token_rows_across_nodes(launch):
    """Rounds on a Buffer with one row per token (expand=False): no pad multiples; the two ranks
    are two nodes, reached by network puts only; hidden 128, so rows are bf16 or block-scaled
    (FP8, MXFP8 or NVFP4: a given pair or quantize=)."""
    # Seed 23 draws each format's pair and quantize= once or more in rounds 0..7 (all modes).
    config = dataclasses.replace(
        CONFIG, rounds=8, hidden=128, expand=False, ranks_per_node=1, seed=23
    )
    kinds = {f"{fmt} {how}" for fmt in ("fp8", "mxfp8", "nvfp4") for how in ("pair", "quantize")}
    for s in launch(soak_rank, 2, config):
        assert s["ok"], format_summary(s) + "\n" + "\n".join(s["messages"])
        assert {"exact", "cached", "max_recv"} | kinds <= set(s["coverage"]), s["coverage"]
        assert "pad_multiple > 1" not in s["coverage"], s["coverage"]


def test_summary_fails_on_memory_growth():
    """After the warm-up (10% of the rounds), growth past the bound fails; before it, none."""
    cfg = SoakConfig(rounds=20, tokens=1, hidden=1, experts=1, topk=1)
    bound = MEMORY_BOUND["cuda"]
    seconds = [0.001] * 18 + [0.002] * 2
    settling = [100 << 20, 200 << 20] + [200 << 20] * 18  # grows only in the warm-up
    s = _summary(0, cfg, True, 0, [], settling, settling, seconds)
    assert s["ok"] and s["memory_growth"] == 0 and not s["messages"], s
    line = format_summary(s)
    assert "first 100.0 MiB, last 200.0 MiB" in line and "(drift +100.0%)" in line, line
    assert "garbage collection" not in line, line
    collected = format_summary(_summary(0, cfg, True, 0, [], settling, settling, seconds, 2))
    assert "2 readings over it were under it after a garbage collection" in collected, collected
    leaking = [100 << 20] * 2 + [(100 << 20) + i * (1 << 20) for i in range(18)]
    s = _summary(0, cfg, True, 0, [], leaking, leaking, seconds)
    assert not s["ok"] and s["memory_growth"] == 17 << 20 > bound, s
    assert "memory in use grew by 17.0 MiB" in s["messages"][0], s["messages"]
    assert format_summary(s).endswith("FAILED")
