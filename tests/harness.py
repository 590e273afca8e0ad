"""Test helpers: compose configs like train.py does, and run functions on forked gloo ranks.

`run_on_ranks` is the launcher train.py uses (layerwise.launch.run_ranks): ranks are forked, get
MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK/NODE_RANK in their own environment (the test
process's environment is never touched), destroy their process group on the way out, and are
killed if any rank fails; the failing rank's traceback is raised here.
"""

import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from layerwise.config import register_schemas
from layerwise.launch import RankError, run_ranks  # noqa: F401  (re-exported for tests)

CONFIG_DIRECTORY = str(Path(__file__).resolve().parent.parent / "conf")
# Every multi-process test runs the strict point-to-point check (NCCL's issue order; parallel/comm.py).
STRICT_POINT_TO_POINT = "trainer.check_point_to_point_order=true"
QUICK = ["logger=none", "trainer.progress=none", "trainer.limit_val_batches=1",
         "data.global_batch_size=8", "data.sequence_length=32", "model.layers=2", "model.hidden=32",
         "model.heads=2", "data.max_bytes=2000000", STRICT_POINT_TO_POINT]


def compose_config(*overrides: str):
    """The composed (unvalidated) config for these overrides, as train.py would see it."""
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIRECTORY, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_on_ranks(function, world_size: int, *arguments):
    assert "LOCAL_RANK" not in os.environ, "a previous test leaked LOCAL_RANK"
    return run_ranks(function, world_size, *arguments, timeout=300)

# Named tolerances of every "equals the single-process reference" test (fp32).
LOSS_RTOL = 1e-5
PARAMETER_RTOL = 1e-5
# The key part of the fused qkv bias has an analytically zero gradient (softmax ignores a constant
# added to every key), so its computed gradient is round-off, which Adam normalises into steps of
# up to lr: those entries drift by ~1e-6 between equal computations summed in another order.
PARAMETER_ATOL = 1e-5
# bf16 keeps 8 bits of mantissa (relative step 2^-8 ≈ 4e-3): two equal computations whose fp32
# reductions run in another order round differently in a few matrix products per step.
BF16_LOSS_RTOL = 1e-2


def assert_same_losses(actual, expected):
    import torch
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=LOSS_RTOL, atol=0)


def assert_same_parameters(actual: dict, expected: dict):
    import torch
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=PARAMETER_RTOL,
                                   atol=PARAMETER_ATOL, msg=lambda m: f"{name}: {m}")


def consolidated_parameters(run_directory, strategy_name: str) -> dict:
    """The full model's state dict from a run's `last` checkpoint, whatever the strategy.

    A single file is already whole; a per-rank directory is merged by the strategy module's
    `consolidate(rank_state_dicts, layout) -> state_dict` (pipelines: disjoint keys; shards:
    concatenated), which is also what a user calls to export a single-device checkpoint.
    """
    import json
    from pathlib import Path

    import torch

    from strategies import strategy_entry

    path = Path(run_directory) / "checkpoints" / "last.ckpt"
    if path.is_file():
        state = torch.load(path, weights_only=False, map_location="cpu")["state_dict"]
        return {name.removeprefix("module."): value for name, value in state.items()}
    layout = json.loads((path / "layout.json").read_text())
    ranks = sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    states = [torch.load(p, weights_only=False, map_location="cpu")["state_dict"] for p in ranks]
    return strategy_entry(strategy_name).consolidate(states, layout)


def cached_references(tmp_path_factory, run):
    """`reference(layers) -> (summary, directory)`: single-process runs made once per module with
    that module's `run(directory, *overrides)`, so every strategy case compares with the same one."""
    cache = {}

    def reference(layers):
        if layers not in cache:
            directory = tmp_path_factory.mktemp(f"single{layers}")
            cache[layers] = (run(directory, "strategy=single", f"model.layers={layers}"), directory)
        return cache[layers]
    return reference
