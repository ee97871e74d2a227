"""A Plan keys the caches of every call (its hash is computed once): plans of the same sizes are
equal and hash alike, in this process and once pickled into another."""

import multiprocessing
import pickle

import torch

from hybrid_ep_triton.runtime.planner import default_config, make_plan

SIZES = dict(world_size=2, hidden=7168, max_tokens=128, num_experts=256, dtype=torch.bfloat16)


def _plan(**changes):
    sizes = {**SIZES, **changes}
    return make_plan(**sizes, config=default_config(sizes["hidden"], sizes["max_tokens"], 8, True))


def _hashes_alike_here(pickled: bytes) -> bool:
    """In a fresh process: the unpickled plan and one made there are equal and hash alike (a
    dtype's hash, part of a plan's, differs between processes)."""
    plan = pickle.loads(pickled)
    return plan == _plan() and hash(plan) == hash(_plan()) and {_plan(): 1}.get(plan) == 1


def test_plans_of_the_same_sizes_hash_alike_also_after_pickling():
    plan = _plan()
    assert plan == _plan() and hash(plan) == hash(_plan())
    for changed in (_plan(hidden=4096), _plan(dtype=torch.float16), _plan(world_size=4)):
        assert changed != plan and {plan: 1}.get(changed) is None
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and hash(copy) == hash(plan)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_hashes_alike_here, (pickle.dumps(plan),))
