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

import math

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
