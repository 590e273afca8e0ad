"""Plan mode's second estimator: the dry run of the real code, checked against the analytic plan.

Issue 16 item 2. For one rank of each distinct role of an analytic plan (layerwise/planning/mode.py
`plan_result`: the role's first pipeline rank, data and tensor index 0), `layerwise.tools.dry_run.dry_run`
sets the rank up at the full world size under the fake process group and measures a training step
(the second: gradients and optimizer state exist). Two comparisons per role:

1. memory: the step's `peak_compute_bytes` (parallel/memory.py's meter, as real runs measure it)
   against the role's analytic bytes before the allocator margin; they agree when the ratio
   dry / analytic is within 1 ± MEMORY_TOLERANCE;
2. communication: the step's logical bytes per kind (parallel/comm.py's Communicator) against the
   plan's `comm_bytes_per_step_by_pipeline_rank` (cost/traffic.py); they agree only when every kind is equal.

Where they disagree the entry says so, with both numbers; nothing is hidden or averaged away.
"""

from __future__ import annotations

from cost.traffic import model_parameters as traffic_model_parameters
from layerwise.config.layout import layout_of
from layerwise.tools.dry_run import dry_run
from parallel.comm import KINDS
from parallel.layout import rank_of

MEMORY_TOLERANCE = 0.05  # issue 16 item 2: the two estimators agree within 5% on memory
# Above this many parameters the dry run uses fake tensors (shapes only, no storage): a model of
# 5·10⁷ parameters already holds 0.8 GB of fp32 weights, gradients and Adam moments on one rank of
# this machine, and its step would take minutes of real arithmetic on 2 cores.
FAKE_TENSORS_ABOVE = 5 * 10 ** 7
RELATIVE_EXACT = 1e-12  # "equal" for float sums of the same terms in a different order


def model_parameters(cfg) -> float:
    """The whole model's parameter count from its shapes (cost/traffic.py's one count)."""
    from layerwise.planning.inputs import shape_of
    return traffic_model_parameters(shape_of(cfg), cfg.model.layers)


def role_rank(cfg, world_size: int, pipeline_rank: int) -> int:
    """The global rank at `pipeline_rank` with data and tensor index 0 (parallel/layout.py's order)."""
    return rank_of({"data": 0, "pipeline": pipeline_rank, "context": 0, "tensor": 0}, layout_of(cfg, world_size))


def compare(role: dict, analytic_kinds: dict, measured: dict) -> dict:
    """One role's comparison (module docstring): the numbers, the ratio and what disagrees."""
    analytic = sum(role["memory_bytes"].values())
    peak = measured["peak_compute_bytes"]
    dry_kinds = measured["bytes_by_kind"]
    differing = [kind for kind in KINDS if not _equal(analytic_kinds.get(kind, 0.0), dry_kinds.get(kind, 0.0))]
    return {"role": role["role"], "pipeline_rank": role["pipeline_ranks"][0], "rank": measured["rank"],
            "analytic_peak_compute_bytes": analytic, "dry_run_peak_compute_bytes": peak, "ratio": peak / analytic,
            "memory_agrees": abs(peak / analytic - 1) <= MEMORY_TOLERANCE,
            "analytic_comm_bytes_per_step": {kind: float(analytic_kinds.get(kind, 0.0)) for kind in KINDS},
            "dry_run_comm_bytes_per_step": dict(dry_kinds), "collective_bytes_equal": not differing,
            "kinds_differing": differing, "fake_tensors": measured["fake_tensors"],
            "emulated": measured["emulated"], "wall_time_s": measured["seconds"],
            "most_sends_held": measured.get("most_sends_held")}


def _equal(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE_EXACT * max(abs(a), abs(b))


def cross_check(cfg, world_size: int, result: dict, fake_tensors: bool | None = None) -> list:
    """Dry-run one rank of each role of `result` (plan_result's) and compare (module docstring).
    fake_tensors: None chooses by the model's parameter count (FAKE_TENSORS_ABOVE)."""
    if "comm_bytes_per_step_by_pipeline_rank" not in result:  # l2l's relay: priced in closed form, not dry-run yet
        return []
    if fake_tensors is None:
        fake_tensors = model_parameters(cfg) > FAKE_TENSORS_ABOVE
    if cfg.hardware.process_group_backend == "gloo":
        result = _without_gloo_temporaries(cfg, world_size)
    entries = []
    for role in result["roles"]:
        pipeline_rank = role["pipeline_ranks"][0]
        measured = dry_run(cfg, role_rank(cfg, world_size, pipeline_rank), world_size, fake_tensors=fake_tensors)
        measured["fake_tensors"] = fake_tensors
        entries.append(compare(role, result["comm_bytes_per_step_by_pipeline_rank"][pipeline_rank], measured))
    return entries


def _without_gloo_temporaries(cfg, world_size: int) -> dict:
    """The plan the fake group can be held to: a gloo plan counts gloo's reduce-scatter temporaries
    (cost.memory.gloo_temporaries), which the fake process group, like NCCL, never makes. Only
    they are taken out: the sends held stay gloo's, which the dry run's fake group also completes
    only in `wait()` (docs/strategies/pipeline_memory.md)."""
    from layerwise.planning.result import plan_result
    from layerwise.planning.inputs import training_plan_of, workload_of
    from cost.memory import memory
    result = plan_result(cfg, world_size)
    workload, schedule = workload_of(cfg, world_size), training_plan_of(cfg)
    for role in result["roles"]:
        role["memory_bytes"] = memory(workload, schedule, role["pipeline_ranks"][0], cfg.plan.flash_attention,
                                      temporaries=False)
    return result


def describe(entry: dict) -> str:
    """One line: the role, both memory figures and their ratio, and whether the bytes are equal."""
    mib = 2 ** 20
    memory = "agree" if entry["memory_agrees"] else f"DISAGREE (beyond {MEMORY_TOLERANCE:.0%})"
    collectives = "equal" if entry["collective_bytes_equal"] else "DIFFER in " + ", ".join(
        f"{kind} (analytic {entry['analytic_comm_bytes_per_step'][kind]:.6g}, dry run "
        f"{entry['dry_run_comm_bytes_per_step'][kind]:.6g})" for kind in entry["kinds_differing"])
    return (f"dry run rank {entry['rank']} for {entry['role']}: peak {entry['dry_run_peak_compute_bytes'] / mib:.2f} MiB "
            f"vs analytic {entry['analytic_peak_compute_bytes'] / mib:.2f} MiB, ratio {entry['ratio']:.3f}: {memory}; "
            f"collective bytes {collectives} ({'fake' if entry['fake_tensors'] else 'real'} tensors, "
            f"{entry['wall_time_s']:.1f} s)")


def annotate(cfg, world_size: int, result: dict) -> None:
    """plan.dry_run=true (train.py hands this to planning/mode.py's `plan`): each role of `result`
    gets its dry run under "dry_run", and one line per role is printed."""
    for role, entry in zip(result["roles"], cross_check(cfg, world_size, result)):
        role["dry_run"] = entry
        print(describe(entry))
