"""Non-finite losses: stop naming the step, the rank and the first layer that went non-finite, or skip.

`NonFiniteGuard` looks at each step's loss just before the optimizer steps (Lightning's
`on_before_optimizer_step`, which every strategy stepping through its precision plugin reaches:
`single`, `ddp`, the pipelines, ZeRO, tensor parallel). Every rank decides alike, from the sum of
all ranks' losses that the evidence's one per-step exchange carries (a sum is non-finite when any
term is). Then, by `trainer.skip_nonfinite_steps`:

- false (default): the weights are still those the step's forward used, so the step's forward is
  re-run once with a finiteness check on every module's output (nothing is checked on healthy
  steps); the earliest module in model order over all ranks is named, and the run stops with
  `NonFiniteLoss` before any update or checkpoint: the `last` checkpoint stays good.
- true: every gradient is dropped, so the optimizer leaves every parameter and its state as they
  were (the learning-rate schedule still advances with the step); the step is printed and counted
  in summary.json `skipped_steps`.

Strategies that update inside their own step (l2l, kfac) never reach that hook: their loss is
checked after the step, before the checkpoint callback, and they cannot skip.

Cost on a healthy step: one finiteness test of a number the evidence gathers anyway (the wait for
its exchange, which was issued before the backward); no collective of its own.
"""

import json
import math
import re
import shlex
import sys
import traceback
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from strategies.checkpoint.per_rank import checkpoint_exists

HEAD_ORDER = 10 ** 9  # the head comes after every block, however many


class NonFiniteLoss(FloatingPointError):
    """A step's loss is NaN or infinite; the message names the step, the rank and the layer."""


def model_parts(model) -> list:
    """(order in the model, name, module) of this rank's embed, blocks and head."""
    parts = [(0, "embed", getattr(model, "embed", None))]
    blocks = getattr(model, "blocks", None) or {}
    parts += [(1 + int(name), f"blocks.{name}", block) for name, block in blocks.items()]
    parts.append((HEAD_ORDER, "head", getattr(model, "head", None)))
    return [part for part in parts if part[2] is not None]


def first_nonfinite_part(model, rerun) -> tuple:
    """(order, name) of the earliest part whose output is non-finite while `rerun()` runs, or None."""
    found = []

    def watch(order, name):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor) and not bool(torch.isfinite(output).all()):
                found.append((order, name))
        return hook
    handles = [module.register_forward_hook(watch(order, name)) for order, name, module in model_parts(model)]
    try:
        rerun()
    finally:
        for handle in handles:
            handle.remove()
    return min(found) if found else None


def gather_objects(mine) -> list:
    """Every rank's `mine` (only after a non-finite loss: pickles, two collectives)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


class NonFiniteGuard(pl.Callback):
    """Checks each step's loss; stops with its origin or skips the update (see the module docstring).

    Place it before the checkpoint callback: the after-step check of l2l/kfac must stop the run
    before a non-finite state is saved.
    """

    def __init__(self, skip: bool, evidence, checkpoint_path):
        self.skip = skip
        self.evidence = evidence  # RunEvidence: its checkpointed history counts skipped steps
        self.checkpoint_path = checkpoint_path
        self._batch = None
        self._checked = False

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        self._batch, self._checked = batch, False

    # ----- the check: the world's loss sum, from the evidence's exchange of this step
    def _nonfinite(self, trainer) -> bool:
        return not math.isfinite(self.evidence.world_loss_sum(trainer))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._checked = True
        if not self._nonfinite(trainer):
            return
        step = trainer.global_step + 1
        if self.skip:
            return self._skip(trainer, optimizer, step)
        raise NonFiniteLoss(self._message(trainer, step, self._locate(trainer, module), applied=False))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if self._checked:
            return
        if self.skip:  # a configuration error found at the first step: validate.py cannot see hooks
            raise ValueError(f"trainer.skip_nonfinite_steps=true, but strategy="
                             f"{self.evidence.cfg.strategy.name} updates the weights inside its own "
                             f"step, where no update can be skipped. Fix: set "
                             f"trainer.skip_nonfinite_steps=false for this strategy.")
        if self._nonfinite(trainer):
            where = "(not located: this strategy has already updated the weights of the step)"
            raise NonFiniteLoss(self._message(trainer, trainer.global_step, self._origin(None, where),
                                              applied=True))

    # ----- skip
    def _skip(self, trainer, optimizer, step: int) -> None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None  # optimizers leave a parameter without a gradient (and its state) as is
        skipped = self.evidence.history.setdefault("skipped_steps", [])
        skipped.append(step)
        if trainer.is_global_zero:
            print(f"[layerwise] step {step}: non-finite loss ({self._value() or 'on another replica'}); "
                  f"skipped, no optimizer "
                  f"update (trainer.skip_nonfinite_steps=true; {len(skipped)} skipped so far)", flush=True)

    # ----- stop: where did it start?
    def _locate(self, trainer, module) -> tuple:
        """Re-run the step's forward (same batch, same dropout seed, same weights) watching outputs."""
        def rerun():
            module.on_train_batch_start(self._batch, 0)  # the task re-seeds dropout for this step
            with torch.no_grad():
                trainer.strategy.validation_step(self._batch, 0)
        found = first_nonfinite_part(module.model, rerun)
        parameters_finite = found is None or all(
            bool(torch.isfinite(p).all()) for p in module.model.get_submodule(found[1]).parameters())
        return self._origin(found, "nowhere in a re-run of the step's forward", parameters_finite)

    def _origin(self, found, nowhere: str, parameters_finite: bool = True) -> tuple:
        """(rank, description, loss value) of the earliest non-finite part over all ranks; the
        value is the first rank's non-finite loss (a data replica's own loss may be finite)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        hits = gather_objects((found, rank, parameters_finite, self._value()))
        value = next((h[3] for h in hits if h[3]), "unknown")
        located = sorted((h[0], h[1], h[2]) for h in hits if h[0] is not None)
        if not located:
            return min((h[1] for h in hits if h[3]), default=0), nowhere, value
        (_, name), rank, finite = located[0]
        state = "finite" if finite else "non-finite too"
        return rank, f"the output of {name} (its parameters are {state})", value

    def _message(self, trainer, step: int, origin: tuple, applied: bool) -> str:
        rank, where, value = origin
        saved = (f"{self.checkpoint_path} holds the last good state, and a rerun resumes from it"
                 if checkpoint_exists(self.checkpoint_path) else "no checkpoint was written before it")
        done = "its update was applied but not saved" if applied else "nothing of it was applied or saved"
        return (f"non-finite training loss ({value}) at step {step}: first non-finite value on rank "
                f"{rank}{self._stage(trainer, rank)}, {where}. The step stopped the run and {done}: "
                f"{saved}. Fix: lower optimizer.lr or set trainer.gradient_clip_val, then rerun; or "
                f"set trainer.skip_nonfinite_steps=true to skip such steps.")

    @staticmethod
    def _stage(trainer, rank: int) -> str:
        layout = trainer.strategy.layout
        if layout is None or layout.degrees.pipeline == 1:
            return ""
        stage = gather_objects(layout.index("pipeline"))[rank]
        return f" (pipeline rank {stage} of {layout.degrees.pipeline})"

    def _value(self):
        """This rank's loss as text if it is non-finite, else None."""
        loss = self.evidence.local_loss
        if loss is None or bool(torch.isfinite(loss).all()):
            return None
        return str(float(loss.float().mean()))


# ======================================================= a failed run in one paragraph, with its exit code

# `python train.py`'s exit code by what failed (docs/faults.md, "Exit codes"). 2 and 124 were already
# documented (configuration errors; every rank of a hung run, as coreutils' `timeout`); 130 and 143
# (interrupted by SIGINT/SIGTERM) belong to the interruption path, not to this table.
EXIT_CODES = {"unknown": 1, "configuration": 2, "data": 3, "checkpoint": 4, "non-finite loss": 5,
              "rank": 6, "hang": 124}
# The last exception's class name -> kind. Names, not classes: a rank's exception reaches the
# launcher as its formatted traceback (layerwise/run/launch.py _rank_entry), and torchrun/Slurm
# ranks raise their own in place.
KIND_OF_TYPE = {"NonFiniteLoss": "non-finite loss", "CheckpointError": "checkpoint",
                "UnsafeCheckpointError": "checkpoint", "CheckpointException": "checkpoint",
                "DataError": "data", "TokenCacheError": "data", "ConfigError": "configuration"}
# A plain ValueError is ours when its message starts with the field it names (errors name the field)
KIND_OF_PREFIX = (("data.", "data"), ("checkpoint ", "checkpoint"), ("resume_from", "checkpoint"),
                  ("trainer.", "configuration"), ("strategy", "configuration"), ("model.", "configuration"),
                  ("optimizer.", "configuration"), ("hardware.", "configuration"))
WHAT_FAILED = {"unknown": "the run stopped on an unexpected error",
               "configuration": "the run stopped on a configuration error found at run time",
               "data": "the run stopped on a data error", "checkpoint": "the run stopped on a checkpoint error",
               "non-finite loss": "the run stopped on a non-finite loss", "rank": "the run stopped: a rank failed",
               "hang": "the run stopped: a rank hung"}
GENERIC_FIX = {
    "data": "Fix: correct the data.* setting or the file the message names, then rerun the same command.",
    "checkpoint": "Fix: resume from another checkpoint (resume_from=, or delete the damaged one), then rerun.",
    "configuration": "Fix: change the setting the message names, then rerun the same command.",
    "unknown": "Fix: none is known for this error; the traceback shows where it came from. A rerun of the "
               "same command resumes from the last checkpoint, if the cause was passing.",
}
TRACEBACK_START = re.compile(r"^Traceback \(most recent call last\):$", re.MULTILINE)
ENOSPC = "No space left on device"


class RunFailure(Exception):
    """A run that failed, described once: `paragraph` for the console and summary.json, `code` to exit with."""

    traceback_on_console = False  # set when train.log could not be written

    def __init__(self, kind: str, rank: Optional[int], paragraph: str):
        super().__init__(paragraph)
        self.kind, self.rank, self.paragraph = kind, rank, paragraph

    @property
    def code(self) -> int:
        return EXIT_CODES[self.kind]


def last_exception(text: str) -> tuple:
    """(class name, message) of the exception a formatted traceback ends with.

    The last "Traceback (most recent call last):" section is the exception raised (a chained one's
    cause comes first); its frames are indented, and the exception starts at the first line that
    is not. A nested traceback inside a message (DCP's "Traceback ... (RANK 1)") is not a section."""
    starts = [match.end() for match in TRACEBACK_START.finditer(text)]
    lines = text[starts[-1] if starts else 0:].splitlines()
    body = next((index for index, line in enumerate(lines) if line and not line[0].isspace()), None)
    if body is None:
        return "", text.strip()
    name, _, message = "\n".join(lines[body:]).partition(": ")
    return name.rsplit(".", 1)[-1].strip(), message.strip()


def kind_of(name: str, message: str) -> str:
    """What failed, from the exception's class name and message (see KIND_OF_TYPE, KIND_OF_PREFIX)."""
    if name in KIND_OF_TYPE:
        return KIND_OF_TYPE[name]
    if ENOSPC in message:  # a full disk outside a checkpoint write (CheckpointError names those)
        return "checkpoint"
    if name in ("ValueError", "FileNotFoundError", "IndexError"):
        for prefix, kind in KIND_OF_PREFIX:
            if message.startswith(prefix):
                return kind
    return "unknown"


def one_paragraph(text: str) -> str:
    """A message's lines as one paragraph (a list of problems becomes "- a - b"), without a traceback
    nested in it (DCP's CheckpointException carries each failed rank's; train.log keeps them)."""
    text = text.split("Traceback (most recent call last)")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def interrupted(error: BaseException) -> bool:
    """An interruption every rank agreed on (SIGINT, SIGTERM, preemption): not a failure."""
    if isinstance(error, KeyboardInterrupt):
        return True
    detail = getattr(error, "detail", None)
    return detail is not None and last_exception(detail)[0] in ("KeyboardInterrupt", "Terminated", "Preempted")


def describe_failure(error: BaseException, run_directory, steps: Optional[int] = None) -> RunFailure:
    """The one paragraph of a failed run: what failed, where (rank, step), the error's own message
    (which names the file or field and its fix), the fix when it has none, and where the traceback is.

    `error` is what `train` raised: a `RankError` (local ranks: the rank and its traceback text; a
    killed rank: the launcher's diagnosis), a `HangError` (the watchdog's diagnosis), or the
    exception itself (one process; a torchrun/Slurm rank). `steps`: the steps done when it failed."""
    from layerwise.run.launch import HangError, RankError, global_rank, launched_externally
    if isinstance(error, HangError):
        kind, rank, message = "hang", error.rank, error.detail
    elif isinstance(error, RankError):
        rank = error.rank
        name, message = last_exception(error.detail)
        kind = kind_of(name, message)
        if error.detail.startswith("failure diagnosis:") or "without reporting an error" in error.detail:
            kind, message = "rank", error.detail.removeprefix("failure diagnosis: ")
        elif name:
            message = f"{name}: {message}" if kind == "unknown" else message
    else:
        rank = global_rank() if launched_externally() else 0
        name, message = type(error).__name__, str(error)
        kind = kind_of(name, message)
        message = f"{name}: {message}" if kind == "unknown" else message
    message = one_paragraph(message).rstrip(".") + "."
    where = f"rank {rank}" if rank is not None else "the launcher"
    when = "before the first step" if not steps else f"after step {steps}"
    fix = "" if "Fix:" in message or kind in ("rank", "hang", "non-finite loss") else " " + GENERIC_FIX[kind]
    if kind == "rank" and "SIGKILL" in message:
        fix = (" SIGKILL comes from outside the run: often the kernel's out-of-memory killer (dmesg names "
               "it), or a person or a scheduler.")
    log = Path(run_directory) / "train.log"
    return RunFailure(kind, rank, f"{WHAT_FAILED[kind]} ({where}, {when}): {message}{fix}"
                                  f"{resumes(kind, run_directory)} Full traceback: {log} (exit code "
                                  f"{EXIT_CODES[kind]}, docs/faults.md).")


def resumes(kind: str, run_directory) -> str:
    """For failures a rerun can get past: the checkpoint it resumes from."""
    if kind not in ("rank", "unknown"):
        return ""
    path = Path(run_directory) / "checkpoints" / "last.ckpt"
    if not checkpoint_exists(path):
        return " Nothing was checkpointed yet: a rerun starts over."
    return f" Fix: rerun the same command; it resumes from {path}." if kind == "rank" else ""


def report_failure(error: BaseException, run_directory, started: float, cfg, world_size: int) -> RunFailure:
    """Describe a failed run (describe_failure) and leave it in the run directory, on global rank 0:
    the full traceback appended to train.log, and summary.json's `error` (the paragraph),
    `failed_rank`, `failure_kind` and `exit_code`. A summary.json older than `started` (a previous
    run's) is not this run's: its step count is not used, and it is replaced."""
    from layerwise.run.evidence import write_json_atomically
    from layerwise.run.launch import writes_run_files
    run_directory = Path(run_directory)
    path = run_directory / "summary.json"
    summary = {}
    if path.exists() and path.stat().st_mtime >= started - 1.0:  # the file clock may lag time.time()
        try:
            summary = json.loads(path.read_text())
        except ValueError:
            summary = {}
    failure = describe_failure(error, run_directory, summary.get("steps"))
    if not writes_run_files():
        return failure
    if summary.get("status") not in ("hung", "failed"):
        summary = {"status": "failed", "strategy": cfg.strategy.name, "model": cfg.model.name,
                   "hardware": cfg.hardware.name, "data": cfg.data.name, "world_size": world_size}
    summary.update(error=failure.paragraph, failed_rank=failure.rank, failure_kind=failure.kind,
                   exit_code=failure.code)
    try:
        run_directory.mkdir(parents=True, exist_ok=True)
        with open(run_directory / "train.log", "a") as log:
            log.write(f"[layerwise] {failure.paragraph}\n{''.join(traceback.format_exception(error))}")
        write_json_atomically(path, summary)
    except OSError as unwritable:  # a full disk may be the failure itself: the console gets the traceback
        failure.paragraph += (f" The run directory could not be written ({unwritable.strerror or unwritable}): "
                              f"the traceback is printed above instead.")
        failure.traceback_on_console = True
    return failure


def exit_with(failure: RunFailure, full_error: bool) -> None:
    """A failed run's ending in train.py: its paragraph on stderr (the traceback before it only when
    the user set HYDRA_FULL_ERROR, `full_error`, or train.log could not take it) and the exit code of
    its kind (docs/faults.md, "Exit codes")."""
    if full_error or failure.traceback_on_console:
        traceback.print_exception(failure.__cause__ or failure)
    print(f"layerwise: {failure.paragraph}", file=sys.stderr, flush=True)
    sys.exit(failure.code)


def resume_command(hydra_config) -> str:
    """The command line that resumes an interrupted run: the same one (a sweep's, into the same sweep
    directory), from Hydra's runtime config `hydra_config`."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if hydra_config.mode.name == "MULTIRUN" and not any(a.startswith("hydra.sweep.dir=") for a in argv):
        argv.append(f"hydra.sweep.dir={hydra_config.sweep.dir}")
    return shlex.join(argv)
