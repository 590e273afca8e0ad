"""mode=plan: every pipeline rank's memory and the predicted step at full scale, before anything runs.

    python train.py mode=plan model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=64 \
        strategy=modular_pipeline strategy.pipeline_degree=16 strategy.tensor_parallel=1d \
        strategy.tensor_grid=8 strategy.micro_batches=64 data.global_batch_size=1536 data.sequence_length=2048

The same composition and validation as `fit`, then the cost model (cost/) of the
very plan `fit` would run: a table on the terminal, `plan.json`, the predicted step as a Gantt
chart in seconds (`plan.png`) and the memory of each rank role (`plan_memory.png`). The model is
not yet calibrated against this machine (issue 16): the default efficiency is an assumption.
"""

from pathlib import Path

from layerwise.planning.inputs import device_of
from layerwise.planning.render import _write, caveats, table
from layerwise.planning.result import plan_result
from layerwise.planning.roles import GIB
from layerwise.planning.search import search


def plan(cfg, world_size: int, run_directory, second_estimator=None, charts: bool = True) -> dict:
    """Compute, print and write the plan; returns what plan.json holds. With plan.search=true,
    rank every valid layout instead (planning/search.py). With plan.dry_run=true,
    `second_estimator(cfg, world_size, result)` adds each role's dry run (train.py passes
    layerwise/tools/cross_check.py's `annotate`, a tool above this room; a run's own plan charts
    pass none). `charts=False` (a run's `trainer.charts`) writes plan.json without its PNGs."""
    if cfg.plan.search:
        return search(cfg, cfg.hardware.nodes * cfg.hardware.devices_per_node, run_directory)
    result, timeline = plan_result(cfg, world_size, with_timeline=True)
    device = device_of(cfg)
    result["caveats"] = caveats(device, cfg.strategy.get("tensor_parallel"))
    if cfg.plan.dry_run and second_estimator is not None:  # one dry-run rank per role
        second_estimator(cfg, world_size, result)
    _write(result, timeline, Path(run_directory), device.memory_bytes, charts)
    print(table(result, device))
    if "host_bytes" in result:
        print(f"host store per data rank: {sum(result['host_bytes'].values()) / GIB:.2f} GiB of "
              f"{cfg.hardware.host_memory_bytes / GIB:.0f} ({'fits' if result['host_fits'] else 'does NOT fit'})")
    return result
