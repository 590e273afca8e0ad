"""Sweeps on a cluster: Hydra launchers that validate every point first, and the Slurm job side.

`python train.py -m strategy=ddp,modular_pipeline hardware.nodes=2 hydra/launcher=slurm` does:

1. submission (this machine, `SlurmLauncher.launch`): every point's config composed and validated
   (the strategy's checks, and launcher vs Trainer: nodes, tasks per node, GPUs) — one invalid
   point rejects the whole sweep before anything is submitted, naming the point and the field.
   The check is layerwise/sweep.py's, done for every launcher before the first point (the
   `sweep_check` callback); the launcher takes its checked points. Each point's resources follow
   from its hardware profile (nodes = hardware.nodes, tasks per node = GPUs per node =
   hardware.devices_per_node; one task for single-process strategies); one Slurm job array is
   submitted per distinct resource shape;
2. job (every task of every job, `SlurmLauncher.__call__`): each Slurm task is one rank. Rank 0
   alone writes Hydra's files and the job log; the ranks run `train.py`'s task function, which
   sees `launched_externally()` and fits in place with Lightning's `SLURMEnvironment(auto_requeue=
   False)`. The run directory is the sweep directory plus the point's number and overrides, the
   same for every requeue of that job, so a requeued job resumes from its `last` checkpoint and
   its W&B run id;
3. preemption: this module is the one owner of the preemption signal (SIGUSR2, which Slurm sends
   `signal_delay_s` before the time limit, or on `scancel --signal=USR2`). Its handler only sets a
   flag; at the next step boundary all ranks agree on it (an all-reduce), all save the checkpoint,
   the run unwinds (metrics flushed, summary "interrupted", W&B closed), rank 0 runs `scontrol
   requeue` and the ranks exit without a result. submitit's own USR2 handler is replaced and
   Lightning's USR1 auto-requeue is off: one save, one requeue;
4. failure: Slurm runs the tasks with `SLURM_KILL_BAD_EXIT=1`, so when one rank dies (exception,
   SIGKILL, OOM kill) Slurm ends the others at once; a rank that raises prints `[layerwise] rank R
   failed: reason` first. The launcher waits for every job, prints one line per point, writes a
   failed `summary.json` (with `failed_rank`) for a point whose ranks could not, and reports the
   sweep as failed while the other points complete.

`LocalLauncher` (hydra/launcher=local) is the laptop equivalent: the points, checked the same way,
run one after another in this process (each forks its ranks), then one line per point.
"""

import dataclasses
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurm
from omegaconf import OmegaConf, open_dict, read_write

from layerwise.config.machine import rank_threads
from layerwise.run.preemption import PREEMPTION, exit_after_requeue, install_preemption_handler

OWN_KEYS = ("max_requeues",)  # launcher keys of ours, not submitit's
# Slurm's RealMemory of a node sits below its physical memory (OS, daemons): a job asking for all of
# hardware.host_memory_bytes would pend forever, so a derived mem_gb asks for this fraction of it.
SCHEDULABLE_MEMORY_FRACTION = 0.9
SUBMITIT_KEYS = tuple(f.name for f in dataclasses.fields(SlurmQueueConf))
PLUGIN_ROOT = Path(__file__).resolve().parents[2]  # holds hydra_plugins/layerwise_launchers
FAILURE_LINE = re.compile(r"\[layerwise\] rank (\d+) failed: (.*)")
SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.*)")


# ============================================================== submission side: every point first

class SweepFailed(RuntimeError):
    """At least one point failed; the others ran to their end. The message lists the failures."""


def _is_interpolation(value) -> bool:
    return isinstance(value, str) and value.startswith("${")


def job_resources(cfg, world_size: int) -> tuple:
    """(resources for this point's job, problems): the launcher values checked against the Trainer.

    Lightning stops a Slurm job whose tasks per node differ from `devices` or whose node count
    differs from `num_nodes`; both follow from the hardware profile, so an explicit launcher value
    must agree. Single-process strategies get one task on one node.
    """
    hardware = cfg.hardware
    raw = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    resolved = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    single = world_size == 1
    expected = {"nodes": 1 if single else hardware.nodes,
                "tasks_per_node": 1 if single else hardware.devices_per_node}
    source = {"nodes": "hardware.nodes", "tasks_per_node": "hardware.devices_per_node"}
    problems = []
    for key, value in expected.items():
        if raw.get(key) is None or _is_interpolation(raw.get(key)):
            resolved[key] = value
        elif resolved[key] != value:
            why = (f"strategy={cfg.strategy.name} runs one process" if single else
                   f"the Trainer runs {source[key]}={value}")
            problems.append(f"hydra.launcher.{key}={resolved[key]} but {why}; Lightning would stop "
                            f"the job. Fix: drop hydra.launcher.{key} (it follows {source[key]}) or "
                            f"set {source[key]}={resolved[key]}.")
    problems += slurm_memory_errors(raw, resolved, hardware)
    gpus = resolved.get("gpus_per_node")
    if hardware.accelerator == "gpu":
        if gpus is None or _is_interpolation(raw.get("gpus_per_node")):
            resolved["gpus_per_node"] = expected["tasks_per_node"]
        elif gpus != expected["tasks_per_node"]:
            problems.append(f"hydra.launcher.gpus_per_node={gpus} but each node runs "
                            f"{expected['tasks_per_node']} ranks (one GPU each). Fix: drop "
                            f"hydra.launcher.gpus_per_node or set hardware.devices_per_node={gpus}.")
    elif gpus:
        problems.append(f"hydra.launcher.gpus_per_node={gpus} but hardware={hardware.name} runs on "
                        f"{hardware.accelerator}. Fix: drop hydra.launcher.gpus_per_node or choose "
                        f"a GPU hardware profile.")
    return resolved, problems + gpu_binding_problems(resolved)


# Requests that bind GPUs per task or ask for them a second time. Lightning's SLURMEnvironment puts
# each rank on cuda:SLURM_LOCALID of the GPUs its task sees, so every task must see all of its
# node's GPUs: with one bound per task, local rank 1 finds no cuda:1.
GPU_BINDING_KEYS = {"gpus_per_task": "binds GPUs per task", "gres": "requests GPUs beside gpus_per_node",
                    "additional_parameters.gpus-per-task": "binds GPUs per task",
                    "additional_parameters.gpu-bind": "binds GPUs per task"}


def gpu_binding_problems(resolved: dict) -> list:
    """Launcher values that would hide a node's other GPUs from a task (see GPU_BINDING_KEYS)."""
    problems = []
    for key, what in GPU_BINDING_KEYS.items():
        section, _, name = key.rpartition(".")
        value = (resolved.get(section) or {}).get(name) if section else resolved.get(key)
        if value is not None and not (key == "gres" and "gpu" not in str(value)):
            problems.append(f"hydra.launcher.{key}={value} {what}, but each rank selects "
                            f"cuda:SLURM_LOCALID among the GPUs its task sees, so every task must see "
                            f"its node's GPUs. Fix: drop hydra.launcher.{key} (GPUs follow "
                            f"hardware.devices_per_node through gpus_per_node).")
    return problems


def node_memory_gb(hardware):
    """mem_gb (GiB per node, Slurm's G) from the profile's host memory; None if it states none."""
    if not hardware.host_memory_bytes:
        return None
    return int(SCHEDULABLE_MEMORY_FRACTION * hardware.host_memory_bytes / 2 ** 30)


def slurm_memory_errors(raw: dict, resolved: dict, hardware) -> list:
    """Fill mem_gb from the hardware profile unless set; an explicit one must fit the node."""
    derived = node_memory_gb(hardware)
    if raw.get("mem_gb") is None or _is_interpolation(raw.get("mem_gb")):
        resolved["mem_gb"] = derived
        return []
    node = hardware.host_memory_bytes / 2 ** 30
    if hardware.host_memory_bytes and resolved["mem_gb"] > node:
        return [f"hydra.launcher.mem_gb={resolved['mem_gb']} but hardware={hardware.name} nodes have "
                f"{node:.0f} GiB (hardware.host_memory_bytes): Slurm would never start the job. Fix: "
                f"drop hydra.launcher.mem_gb (it follows the profile: {derived}) or lower it."]
    return []


def point_directory(cfg) -> Path:
    return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)


def report(points: list, outcomes: list, title: str) -> None:
    failed = [o for o in outcomes if o["status"] != "completed"]
    print(f"[layerwise] {title}: {len(points) - len(failed)} of {len(points)} points completed",
          flush=True)
    for point, outcome in zip(points, outcomes):
        detail = outcome.get("reason") or ""
        job = f"  job {outcome['job']}" if outcome.get("job") else ""
        print(f"[layerwise]   #{point['number']} {point['name']}: {outcome['status']}{job}  "
              f"{outcome['directory']}{'  ' + detail if detail else ''}", flush=True)


def sweep_result(points: list, outcomes: list, returns: list) -> list:
    """Hydra's sweeper raises the first failed point's value: make it name every failed point."""
    failed = [(p, o) for p, o in zip(points, outcomes) if o["status"] != "completed"]
    if failed:
        message = "; ".join(f"point #{p['number']} ({p['name']}) {o['status']}: {o.get('reason', '')}"
                            for p, o in failed)
        first = next(i for i, o in enumerate(outcomes) if o["status"] != "completed")
        returns[first].status = JobStatus.FAILED
        returns[first]._return_value = SweepFailed(
            f"{len(failed)} of {len(points)} sweep points failed: {message}")
    return returns


# ================================================================================ the launchers

class LocalLauncher(BasicLauncher):
    """hydra/launcher=local: the checked points run here one after another, then one line each."""

    # (config_loader, config, job_overrides, first number) -> the checked points: layerwise.sweep's
    # check_points, set by hydra_plugins/layerwise_launchers (the sweep check runs the pre-flight,
    # which is above every room of layerwise/, this one included)
    check_points = None

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # checked already by the sweep_check callback (layerwise/sweep.py): this returns its result
        points = self.check_points(self.hydra_context.config_loader, self.config, job_overrides, initial_job_idx)
        returns = list(super().launch(job_overrides, initial_job_idx))
        outcomes = []
        for point, returned in zip(points, returns):
            status = "completed" if returned.status == JobStatus.COMPLETED else "failed"
            reason = "" if status == "completed" else _one_line(returned._return_value)
            outcomes.append({"status": status, "reason": reason,
                             "directory": str(point_directory(point["cfg"]))})
        report(points, outcomes, f"sweep {self.config.hydra.sweep.dir}")
        return sweep_result(points, outcomes, returns)


class SlurmLauncher(_SubmititSlurm):
    """hydra/launcher=slurm: hydra-submitit-launcher's Slurm launcher, made safe for multi-rank runs.

    Submission: every point validated first; resources per point from its hardware profile; one
    array per resource shape; wait for all, report each point. Job: see `__call__`.
    """

    check_points = None  # as LocalLauncher's

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(SUBMITIT_KEYS) - set(OWN_KEYS) - {"_target_"})
        if unknown:
            raise ValueError(f"hydra.launcher has unknown key(s) {unknown}. Known: "
                             f"{', '.join(sorted(SUBMITIT_KEYS + OWN_KEYS))}.")
        self.max_requeues = params.pop("max_requeues", None)
        if self.max_requeues is not None and (not isinstance(self.max_requeues, int) or self.max_requeues < 0):
            raise ValueError(f"hydra.launcher.max_requeues={self.max_requeues!r}: a preempted job is "
                             f"requeued at most this many times. Fix: a whole number ≥ 0 (0: never "
                             f"requeue), or null for no limit.")
        super().__init__(**params)

    # ----- submission
    def _executor(self, resources: dict):
        import submitit

        params = {k: v for k, v in resources.items() if k in SUBMITIT_KEYS and k != "_target_"}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
        # Slurm ends every task of a job as soon as one exits badly: no rank waits on a dead peer.
        # The job unpickles this launcher: hydra_plugins/ (next to train.py) must be importable.
        setup = ["export SLURM_KILL_BAD_EXIT=1",
                 f"export PYTHONPATH={PLUGIN_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"]
        setup += list(params.pop("setup", None) or [])
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(slurm_setup=setup, **{
            k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # checked already by the sweep_check callback (layerwise/sweep.py), the job resources too
        points = self.check_points(self.hydra_context.config_loader, self.config, job_overrides, initial_job_idx)
        sweep_directory = Path(str(self.config.hydra.sweep.dir))
        sweep_directory.mkdir(parents=True, exist_ok=True)
        shapes: Dict[str, list] = {}
        for point in points:
            shapes.setdefault(json.dumps(point["resources"], sort_keys=True, default=str), []).append(point)
        jobs: Dict[int, Any] = {}
        for group in shapes.values():
            executor = self._executor(dict(group[0]["resources"]))
            arguments = [(p["overrides"], "hydra.sweep.dir", p["number"], f"job_id_for_{p['number']}",
                          Singleton.get_state()) for p in group]
            for point, job in zip(group, executor.map_array(self, *zip(*arguments))):
                jobs[point["number"]] = job
                resources = point["resources"]
                print(f"[layerwise] submitted #{point['number']} {point['name']}: job {job.job_id}, "
                      f"{resources['nodes']} node(s) × {resources['tasks_per_node']} task(s)",
                      flush=True)
        returns, outcomes = [], []
        self.submitted = time.time() - 1.0  # a hang diagnosis older than this is a previous job's
        for point in points:
            returned, outcome = self._wait(point, jobs[point["number"]])
            returns.append(returned)
            outcomes.append(outcome)
        report(points, outcomes, f"sweep {sweep_directory}")
        return sweep_result(points, outcomes, returns)

    def _wait(self, point: dict, job) -> tuple:
        directory = point_directory(point["cfg"])
        outcome = {"job": job.job_id, "directory": str(directory)}
        try:
            returned = job.results()[0]
        except Exception as error:  # UncompletedJobError / FailedJobError: the job died
            returned = JobReturn(overrides=point["overrides"], status=JobStatus.FAILED,
                                 _return_value=error)
        if returned.status == JobStatus.COMPLETED:
            outcome["status"] = "completed"
            return returned, outcome
        verdict = hang_diagnosis(directory, getattr(self, "submitted", 0.0))
        if verdict is not None:  # the ranks' watchdogs ended the job and wrote summary.json "hung"
            print(f"[layerwise] #{point['number']}: {verdict['paragraph']}", file=sys.stderr, flush=True)
            outcome.update(status="hung", reason=f"rank {verdict['stuck_rank']}: hung (hang/diagnosis.json)")
            return returned, outcome
        rank, reason = failing_rank(job, returned._return_value)
        outcome.update(status="failed", reason=f"rank {rank}: {reason}" if rank is not None else reason)
        record_job_failure(directory, point["cfg"], rank, outcome["reason"])
        return returned, outcome

    # ----- job side: runs in every Slurm task (rank) of the point's job
    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        import submitit
        import torch

        rank = int(os.environ.get("SLURM_PROCID", "0"))
        install_preemption_handler()  # before anything slow: submitit's USR2 handler is replaced
        # SLURM_CPUS_PER_TASK where set; else CPU ranks 1, GPU ranks their share of the node
        torch.set_num_threads(rank_threads(self.config.hardware.accelerator,
                                           int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))))
        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        with read_write(sweep_config.hydra), open_dict(sweep_config.hydra):
            sweep_config.hydra.job.id = submitit.JobEnvironment().job_id
            sweep_config.hydra.job.num = job_num
            if rank != 0:  # only rank 0 writes .hydra/ and the job log
                sweep_config.hydra.output_subdir = None
        try:
            returned = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                               config=sweep_config, job_dir_key=job_dir_key,
                               job_subdir_key="hydra.sweep.subdir", configure_logging=rank == 0)
        except SystemExit:
            if PREEMPTION.saved:
                exit_after_requeue(rank, self.max_requeues)
            raise
        if PREEMPTION.saved:
            exit_after_requeue(rank, self.max_requeues)
        if returned.status == JobStatus.FAILED:
            error = returned._return_value
            print(f"[layerwise] rank {rank} failed: {_one_line(error)}", file=sys.stderr, flush=True)
            traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
            if rank == 0:
                raise error  # submitit records it as the job's error
            sys.exit(1)  # a bad exit: Slurm ends the other ranks now
        return returned


def _one_line(error) -> str:
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if len(lines) == 1 or not lines else lines[0] + " … " + lines[-1]


def hang_diagnosis(directory: Path, since: float) -> Optional[dict]:
    """The diagnosis the job's ranks wrote when their watchdogs found a hang (layerwise/run/hangs.py),
    if this job wrote one."""
    from layerwise.run.hangs import fresh, hang_directory, read_json
    path = hang_directory(directory) / "diagnosis.json"
    return read_json(path) if fresh(path, since) else None


def failing_rank(job, error) -> tuple:
    """(rank, reason) from the job's logs. srun's first task error names the first rank that died
    (the others were ended because of it); a rank that raised also printed its own reason."""
    folder = Path(job.paths.folder)
    texts = []
    for path in sorted(folder.glob(f"{job.job_id}_*_log.*")):
        try:
            texts.append(path.read_text(errors="replace"))
        except OSError:
            continue
    own = {}
    for text in texts:
        for match in FAILURE_LINE.finditer(text):
            own.setdefault(int(match.group(1)), match.group(2).strip())
    for text in texts:
        match = SRUN_ERROR.search(text)
        if match:
            tasks = match.group(2)
            rank = int(re.split(r"[,\-]", tasks)[0])
            srun = f"{match.group(3).strip()} (srun: {match.group(1)} task {tasks})"
            return rank, f"{own[rank]}; {srun}" if rank in own else srun
    if own:
        rank = min(own)
        return rank, own[rank]
    return None, _one_line(error)


def record_job_failure(directory: Path, cfg, rank: Optional[int], reason: str) -> None:
    """Leave a failed summary.json when the ranks could not (SIGKILL); add the failing rank."""
    from layerwise.run.evidence import write_json_atomically
    from layerwise.config.validate import world_size

    path = directory / "summary.json"
    summary = {}
    if path.exists():
        try:
            summary = json.loads(path.read_text())
        except ValueError:
            summary = {}
    if summary.get("status") != "failed":
        summary.update(status="failed", error=reason, strategy=cfg.strategy.name,
                       model=cfg.model.name, hardware=cfg.hardware.name, data=cfg.data.name,
                       world_size=world_size(cfg))
    if rank is not None:  # Slurm's record of the task that died; a surviving rank 0 that wrote its own
        summary["failed_rank"] = rank  # summary named itself (its peer-loss error), not the cause
    summary.setdefault("failed_rank", None)
    summary["job_failure"] = reason
    directory.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, summary)


# ======================================================================= job side: preemption


# =========================================================== what layerwise.run.fit adds under Slurm


