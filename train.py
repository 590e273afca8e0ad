"""layerwise: compose a strategy, a model and a hardware profile, validate, then check, plan or fit.

    python train.py                                  the default experiment
    python train.py strategy=single model=bert_tiny  one run, overridden
    python train.py -m strategy=single,ddp           a sweep: one run directory per point, all checked first
    python train.py -m strategy=single,ddp mode=check  a dry sweep: the points' validity, nothing run
    python train.py mode=check                       compose and validate only
    python train.py mode=plan hardware=dgx_a100_80g  memory per rank and the predicted step, nothing run
    python train.py mode=calibrate                   measure this machine: conf/hardware/calibrated.yaml
    python train.py experiment=repro_training_time   a paper's claim at its scale (plan mode); _small: here
    python train.py --help                           the config groups and their options
    torchrun --nnodes=2 --nproc-per-node=8 ... train.py hardware.nodes=2   ranks started outside

Nothing here initialises CUDA: local GPU ranks are started afterwards (layerwise/run/launch.py).
"""

import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from layerwise.config.store import register_schemas
from layerwise.run.launch import RunInterrupted, external_world_errors, launched_externally, writes_run_files
from layerwise.run.lock import RunDirectoryLocked, check_run_directory_free
from layerwise.config.errors import ConfigError
from layerwise.config.validate import composition_problem
from layerwise.preflight import validate

register_schemas()
os.environ.setdefault("WANDB_MODE", "offline")  # nothing leaves the machine unless asked
# Under torchrun/srun every rank runs this file; Hydra's own files (.hydra/, train.log) come from one.
SILENT_RANK_OVERRIDES = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
# Hydra prints its own composition errors (a wrong type, an unknown key or option) and exits 1; with
# HYDRA_FULL_ERROR=1 it raises them instead, so __main__ reports them like every other bad input.
# Set only while composing: main unsets it first, so errors of the run keep Hydra's short traceback
# and forked ranks do not inherit it. A user's own HYDRA_FULL_ERROR wins (full tracebacks).
RAISE_COMPOSITION_ERRORS = "HYDRA_FULL_ERROR" not in os.environ
FAILED_POINTS = []  # a sweep's failed points so far: Hydra raises the first one's failure at its end


def finish_config(cfg) -> None:
    """Fill what only the launcher knows: the sweep becomes the W&B group of its points."""
    hydra_config = HydraConfig.get()
    if cfg.logger.group is None and hydra_config.mode.name == "MULTIRUN":
        cfg.logger.group = os.path.basename(hydra_config.sweep.dir)
    if hydra_config.mode.name == "MULTIRUN" and hydra_config.job.override_dirname:
        cfg.run_name = hydra_config.job.override_dirname  # the point's overrides name its W&B run


def say(message: str) -> None:
    """Print on global rank 0 only (every rank torchrun or srun started runs this file)."""
    if writes_run_files():
        print(f"[layerwise] {message}", flush=True)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    if RAISE_COMPOSITION_ERRORS and not FAILED_POINTS:  # after a failed point: still raised at the end
        os.environ.pop("HYDRA_FULL_ERROR", None)
    started = time.time()  # a summary.json older than this is a previous run's
    finish_config(cfg)
    try:
        world_size = validate(cfg)  # before any process starts
        problems = external_world_errors(world_size, sweep=HydraConfig.get().mode.name == "MULTIRUN")
        if problems:
            raise ConfigError(problems)
    except ConfigError as error:
        print(f"layerwise: {error}", file=sys.stderr)
        sys.exit(2)
    run_directory = HydraConfig.get().runtime.output_dir
    try:
        return run(cfg, run_directory, world_size)
    except RunDirectoryLocked as error:  # another live run holds it: refused before anything started
        print(f"layerwise: {error}", file=sys.stderr)
        sys.exit(2)
    except RunInterrupted as stop:  # a stop signal: saved at the step boundary (docs/faults.md)
        from layerwise.run.faults import resume_command
        print(f"layerwise: {stop.line(resume_command(HydraConfig.get()))}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)  # 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM
    except Exception as error:  # noqa: BLE001 - every failure of the run becomes one paragraph
        from layerwise.run.faults import exit_with, interrupted, report_failure
        if interrupted(error):  # the interruption path's own ending (status "interrupted")
            raise
        failure = report_failure(error, run_directory, started, cfg, world_size)
        failure.__cause__ = error
        if HydraConfig.get().mode.name == "RUN":  # one run: end here, as a configuration error does
            exit_with(failure, not RAISE_COMPOSITION_ERRORS)
        # A sweep's other points still run (Hydra's launchers catch a point's exception); Hydra then
        # prints the failed point's overrides and, with HYDRA_FULL_ERROR set, raises the exception
        # instead of printing its traceback: __main__ prints the paragraph and exits with its code.
        FAILED_POINTS.append(failure)
        os.environ["HYDRA_FULL_ERROR"] = "1"
        raise failure from error


def run(cfg, run_directory: str, world_size: int):
    """What `mode` asks for, on a validated config; its failures reach main as exceptions."""
    if cfg.mode == "fit" and writes_run_files():  # a live run holds this directory: write nothing into it
        check_run_directory_free(run_directory)
    if writes_run_files():  # under srun/torchrun every rank gets here: one writes
        OmegaConf.save(cfg, os.path.join(run_directory, "config.yaml"), resolve=True)
    say(f"{cfg.strategy.name} × {cfg.model.name} × {cfg.hardware.name}: {world_size} rank(s), "
        f"run directory {run_directory}")
    if cfg.mode == "check":
        if writes_run_files():  # what was checked: the memory fit per role, printed and kept in check.json
            from layerwise.planning.mode import check
            for line in check(cfg, world_size, run_directory):
                say(line)
        say("configuration is valid; mode=check starts nothing")
        return 0.0
    if cfg.mode == "calibrate":  # measure this machine, write a hardware profile; no run
        from layerwise.tools.calibrate import calibrate
        return calibrate(cfg)["peak_flops"]["fp32"] if writes_run_files() else None
    if cfg.mode == "reproduce":  # a paper's headline claim (layerwise/reproduce/): verdicts, tables, plots
        from layerwise.reproduce import reproduce
        return len(reproduce(cfg, run_directory).verdicts) if writes_run_files() else None
    if cfg.mode == "plan":  # the analytic plan of this layout; nothing is built or started
        from layerwise.planning.mode import plan
        from layerwise.tools.cross_check import annotate  # plan.dry_run=true: the second estimator
        return plan(cfg, world_size, run_directory, annotate)["step_time_s"] if writes_run_files() else None
    from layerwise.run.evidence import outcome  # imports Lightning: not needed by --help, check or plan
    from layerwise.run.fit import train
    summary = train(cfg, run_directory, world_size)
    if summary is None:  # a rank other than global rank 0: rank 0 reports
        return None
    say(f"{outcome(summary)}; evidence in {run_directory}")
    if cfg.logger.name == "wandb" and cfg.logger.mode == "offline":
        say(f"upload the W&B run with: wandb sync {run_directory}/wandb/offline-run-*")
    return summary["final_val_loss"]


if __name__ == "__main__":
    if launched_externally() and not writes_run_files():
        sys.argv += SILENT_RANK_OVERRIDES
    if RAISE_COMPOSITION_ERRORS:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        if not RAISE_COMPOSITION_ERRORS:
            raise
        print(f"layerwise: {ConfigError([composition_problem(error)])}", file=sys.stderr)
        sys.exit(2)
    except Exception as error:  # a run's failure: one paragraph and the exit code of its kind
        from layerwise.run.faults import RunFailure, exit_with
        if isinstance(error, RunFailure):
            exit_with(error, not RAISE_COMPOSITION_ERRORS)
        if FAILED_POINTS:  # hydra/launcher=local's SweepFailed, naming every failed point's paragraph
            print(f"layerwise: {error}", file=sys.stderr, flush=True)
            sys.exit(FAILED_POINTS[0].code)
        raise
