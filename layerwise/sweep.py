"""A sweep is checked whole before its first point runs, whatever launcher runs it.

    python train.py -m strategy=modular_pipeline,zero_layered strategy.micro_batches=2,4 debug=fast
        one invalid point (here #3) rejects the sweep with exit code 2 before any point starts,
        naming every invalid point, its field and its fix at once
    python train.py -m ... mode=check    a dry sweep: the table of points and their validity, nothing run

Hydra calls its callbacks' `on_multirun_start` after composing the multirun's config and before it
creates the sweeper, the launcher or the sweep directory (hydra/_internal/hydra.py, `Hydra.multirun`;
https://hydra.cc/docs/experimental/callbacks/). `SweepCheck`, registered first under
`hydra.callbacks` in conf/config.yaml, expands the command's overrides into the points exactly as
Hydra's basic sweeper will (same order, same numbers), composes each point as its job will, and
validates it as `train.py` would (`layerwise.preflight.validate`: every cross-group check and the
plan-mode memory fit; under `hydra/launcher=slurm` also the job's resources against the Trainer,
`layerwise.cluster.slurm.job_resources`). So Hydra's basic launcher (the default), `hydra/launcher=local`,
`hydra/launcher=slurm` and hydra-submitit's own launchers are all covered by one check.

Our launchers (layerwise/cluster/slurm.py) need the points' configs too (directories, Slurm resources): they
call the same `check_points`, which returns what the callback already checked instead of checking
again, and checks itself when the callback did not run (a sweeper that picks its points as it goes).
"""

import sys
from typing import Dict, List, Optional, Sequence

from hydra.core.utils import filter_overrides
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

# Points checked in this process, by (sweep directory, number, overrides): the callback checks them,
# the launcher that runs them reuses the result (the same master config, so the same configs).
CHECKED: Dict[tuple, dict] = {}
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


class SweepRejected(SystemExit):
    """Raised (as exit code 2) when a point is invalid: nothing has been started or submitted."""


# ================================================================================ the points

def sweep_points(config, config_loader) -> Optional[List[List[str]]]:
    """Every point's overrides, numbered as Hydra's basic sweeper numbers its jobs (the product of
    the sweep overrides, hydra.sweeper.params first); None under another sweeper, which chooses its
    points as it runs (its launcher checks each batch then)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.sweeper
    if not is_a(sweeper._target_, BASIC_SWEEPER):
        return None
    arguments = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
    arguments += OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def is_a(target: str, qualified_name: str) -> bool:
    """The class `target` names is, or derives from, the class named `qualified_name`. By name, not
    issubclass: Hydra's plugin discovery executes the hydra_plugins modules again, so one plugin
    class can exist as two objects (hydra/core/plugins.py, `_scan_all_plugins`)."""
    from hydra.utils import get_class
    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001 - an unimportable class: Hydra's own instantiation names it
        return False
    return any(f"{k.__module__}.{k.__qualname__}" == qualified_name for k in cls.__mro__)


def submits_to_slurm(config) -> bool:
    """The points run on a Slurm cluster's nodes (ours or hydra-submitit's Slurm launcher), so this
    machine's devices do not matter (`validate(..., submitting=True)`)."""
    return is_a(config.hydra.launcher._target_, SUBMITIT_SLURM)


def checks_job_resources(config) -> bool:
    """hydra/launcher=slurm derives each point's job resources from its hardware profile: the
    launcher's values must agree with the Trainer's (layerwise.cluster.slurm.job_resources)."""
    return is_a(config.hydra.launcher._target_, "layerwise.cluster.slurm.SlurmLauncher")


def compose_point(config_loader, config, overrides: Sequence[str], number: int):
    """The point's composed config as its job will see it (job number set, so its directory)."""
    cfg = config_loader.load_sweep_config(config, list(overrides))
    with read_write(cfg.hydra.job), open_dict(cfg.hydra.job):
        cfg.hydra.job.num = number
    return cfg


def check_point(config_loader, config, overrides: Sequence[str], number: int) -> dict:
    """One point composed and validated: its number, name, overrides, config (None if it did not
    compose), world size, Slurm resources (hydra/launcher=slurm) and problems (empty when valid)."""
    from layerwise.config.errors import ConfigError
    from layerwise.config.validate import composition_problem
    from layerwise.preflight import validate

    point = {"number": number, "name": " ".join(filter_overrides(overrides)) or "(no overrides)",
             "overrides": list(overrides), "cfg": None, "world": None, "resources": None, "problems": []}
    try:
        point["cfg"] = compose_point(config_loader, config, overrides, number)
    except (HydraException, OmegaConfBaseException) as error:  # e.g. a knob this point's strategy lacks
        point["problems"] = [composition_problem(error)]
        return point
    try:
        point["world"] = validate(point["cfg"], submitting=submits_to_slurm(config))
    except ConfigError as error:
        point["problems"] = list(error.problems)
        return point
    if checks_job_resources(config):
        from layerwise.cluster.slurm import job_resources
        point["resources"], point["problems"] = job_resources(point["cfg"], point["world"])
    return point


def checked_points(config_loader, config, job_overrides, first_number: int = 0) -> list:
    """Every point composed and validated, once per process (see CHECKED), numbered from
    `first_number` as the launcher numbers its jobs."""
    sweep = str(config.hydra.sweep.dir)
    points = []
    for number, overrides in enumerate(job_overrides, start=first_number):
        key = (sweep, number, tuple(overrides))
        if key not in CHECKED:
            CHECKED[key] = check_point(config_loader, config, overrides, number)
        points.append(CHECKED[key])
    return points


def check_points(config_loader, config, job_overrides, first_number: int = 0) -> list:
    """The points, all valid; else raise SweepRejected naming every invalid point, its field and
    its fix, before any point starts."""
    points = checked_points(config_loader, config, job_overrides, first_number)
    if any(point["problems"] for point in points):
        print(rejection(points), file=sys.stderr, flush=True)
        raise SweepRejected(2)
    return points


def rejection(points: list) -> str:
    """`layerwise: sweep rejected ...` and one line per problem, each naming its point."""
    invalid = [point for point in points if point["problems"]]
    lines = "\n".join(f"  - point #{point['number']} ({point['name']}): {problem}"
                      for point in invalid for problem in point["problems"])
    return (f"layerwise: sweep rejected before its first point: {len(invalid)} of {len(points)} point"
            f"{'s' if len(points) > 1 else ''} invalid, nothing was started or submitted:\n{lines}\n"
            f"(add mode=check to list every point's validity without running any)")


# ================================================================================ a dry sweep

def dry_sweep_table(points: list) -> str:
    """The points and their validity, one line per problem (mode=check over a sweep)."""
    from layerwise.tools.report import text_table, varying_overrides

    shared, labels = varying_overrides([{"override_list": filter_overrides(point["overrides"])} for point in points])
    cells = []
    for point, label in zip(points, labels):
        problems = point["problems"] or [""]
        cells.append([str(point["number"]), label, ranks(point), "no" if point["problems"] else "yes",
                      problems[0]])
        cells += [["", "", "", "", problem] for problem in problems[1:]]
    valid = sum(not point["problems"] for point in points)
    title = (f"[layerwise] dry sweep (mode=check), nothing run: {valid} of {len(points)} points valid; "
             f"every point: {' '.join(shared) or '(no shared overrides)'}")
    return title + "\n" + text_table(["#", "point", "ranks", "valid", "problem and fix"], cells)


def ranks(point: dict) -> str:
    """The point's world size; also for an invalid point whose config composed, when it has one."""
    from layerwise.config.validate import world_size
    if point["world"] is not None:
        return str(point["world"])
    try:
        return str(world_size(point["cfg"])) if point["cfg"] is not None else ""
    except Exception:  # noqa: BLE001 - an unknown strategy has no world size; the problem says why
        return ""


# ================================================================================ the hook

class SweepCheck(Callback):
    """Hydra callback (hydra.callbacks.sweep_check): before a multirun's first point, check them all.

    Every point valid: the sweep goes on (its launcher reuses the checked points). One invalid:
    exit 2 naming each invalid point, its field and its fix. Every point mode=check: print the
    table of points and their validity, then exit (0 when all are valid, else 2): a dry sweep."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from hydra.core.global_hydra import GlobalHydra

        config_loader = GlobalHydra.instance().config_loader()
        overrides = sweep_points(config, config_loader)
        if overrides is None:
            print(f"[layerwise] hydra.sweeper={config.hydra.sweeper._target_} picks its points as it runs: "
                  f"hydra/launcher=local or slurm checks each batch before it starts, any launcher each "
                  f"point as it starts", file=sys.stderr, flush=True)
            return
        points = checked_points(config_loader, config, overrides)
        if not dry_sweep(config, points):
            check_points(config_loader, config, overrides)  # exit 2 here if a point is invalid
            return
        print(dry_sweep_table(points), flush=True)
        invalid = sum(bool(point["problems"]) for point in points)
        if invalid:
            print(f"layerwise: dry sweep: {invalid} of {len(points)} points invalid (the table names "
                  f"each problem and its fix)", file=sys.stderr, flush=True)
        raise SystemExit(2 if invalid else 0)


def dry_sweep(config, points: list) -> bool:
    """Every point runs mode=check (a point that did not compose counts with the sweep's own mode)."""
    return all((config if point["cfg"] is None else point["cfg"]).mode == "check" for point in points)
