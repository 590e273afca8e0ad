"""mode=plan: every pipeline rank's memory and the predicted step at full scale, before anything runs.

    python train.py mode=plan model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=64 \
        strategy=modular_pipeline strategy.pipeline_degree=16 strategy.tensor_parallel=1d \
        strategy.tensor_grid=8 strategy.micro_batches=64 data.global_batch_size=1536 data.sequence_length=2048

The same composition and validation as `fit`, then the cost model (cost/) of the
very plan `fit` would run: a table on the terminal, `plan.json`, the predicted step as a Gantt
chart in seconds (`plan.png`) and the memory of each rank role (`plan_memory.png`). The model is
not yet calibrated against this machine (issue 16): the default efficiency is an assumption.

mode=check (`check` below) prints and keeps the memory fit of the same plan, one line per rank role,
and the lower bound every strategy must pass (layerwise/config/validate.py memory_lower_bound).
"""

import json
from pathlib import Path

from layerwise.config.validate import memory_lower_bound
from layerwise.planning.inputs import device_of, plan_mode_errors
from layerwise.planning.render import _write, byte_unit, caveats, in_unit, table
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


def check(cfg, world_size: int, run_directory) -> list:
    """mode=check's evidence: the memory it checked, as lines to print (one per rank role: plan mode's
    bytes with the allocator margin against the device, the same numbers as plan mode's table; then
    the lower bound every strategy must pass), and check.json in the run directory holding them."""
    memory = {"lower_bound": memory_lower_bound(cfg, world_size)}
    not_planned = plan_mode_errors(cfg)
    if not_planned:  # fsdp2, kfac; l2l on a profile without host bandwidth
        memory["not_planned"] = not_planned[0]
        lines = [f"memory: no per-role plan ({not_planned[0].split(':')[0]}: mode=plan does not price it)"]
    else:
        result, device = plan_result(cfg, world_size), device_of(cfg, world_size)
        memory.update({"device_memory_bytes": device.memory_bytes, "allocator_margin": result["allocator_margin"],
                       "roles": [{key: role[key] for key in ("role", "pipeline_ranks", "memory_bytes",
                                                              "peak_with_margin_bytes", "fits")}
                                 for role in result["roles"]]})
        lines = [_role_line(role, device.memory_bytes, result["allocator_margin"]) for role in result["roles"]]
        if "host_bytes" in result:  # L2L's host store, as plan mode prints it
            memory.update(host_bytes=result["host_bytes"], host_fits=result["host_fits"])
            lines.append(f"memory: host store per data rank {_bytes(sum(result['host_bytes'].values()))} of "
                         f"{_bytes(cfg.hardware.host_memory_bytes)}: {'fits' if result['host_fits'] else 'does NOT fit'}")
    bound = memory["lower_bound"]
    if bound is not None:
        lines.append(f"memory lower bound (fp32 weights, gradients and {cfg.optimizer.name} state sharded over "
                     f"{world_size} rank(s)): {_bytes(bound['needed_per_rank_bytes'])} per rank of "
                     f"{_bytes(bound['available_per_rank_bytes'])}: fits")  # validate refused it otherwise
    evidence = {"status": "valid", "strategy": cfg.strategy.name, "model": cfg.model.name,
                "hardware": cfg.hardware.name, "world_size": world_size, "memory": memory}
    directory = Path(run_directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "check.json").write_text(json.dumps(evidence, indent=1))
    return lines


def _role_line(role: dict, device_bytes: float, margin: float) -> str:
    """One role's fit, e.g. 'memory: pipeline rank 1 (head) 47.6 MiB of 7.5 GiB per device (plan mode's
    bytes + 10% allocator margin): fits'."""
    return (f"memory: {role['role']} {_bytes(role['peak_with_margin_bytes'])} of {_bytes(device_bytes)} per device "
            f"(plan mode's bytes + {margin:.0%} allocator margin): {'fits' if role['fits'] else 'does NOT fit'}")


def _bytes(value: float) -> str:
    return in_unit(value, byte_unit(value))
