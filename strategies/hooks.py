"""What the run asks of every strategy besides Lightning's interface, with the defaults most need.

Every strategy class mixes in `RunHooks` (first in its bases), so layerwise/ calls these methods
directly instead of probing attributes. A technique overrides only what it has: a pipeline its
bubble fraction and Gantt charts, ZeRO the shards it keeps resident, each technique that owns less
than the whole model what it materialises.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from parallel.memory import ComputeMemoryMeter
from strategies.compile import apply_compile
from parallel.timing import allocator_peak_bytes, reset_allocator_peak


class RunHooks:
    """Defaults for the run's questions to a strategy.

    1. `layout`: the ParallelLayout (groups and the counted communicator), or None without one;
    2. `owns_step`: training_step runs the backward too, so the task must not zero gradients after it;
    3. `data_parallel()`: (rank, degree) of this process along the data axis, for the data module;
    4. `compute_resident_tensors()`: what the compute side holds between steps (the memory meter's floor);
    5. `materialise_model(model)`: give the parts of the meta model this rank owns their storage and
       seeded values (default: the whole model on the device), measured as `setup_peak_bytes`;
    6. `bubble_fraction`, `write_evidence`: nothing unless overridden;
    7. `measure_this_step(measuring, metered)`: the evidence callback says, before each step, whether
       the step is timed (a sampled one, trainer.measure_every_n_steps, or the step after one) and
       whether the compute-memory meter watches it; a technique collects its costly evidence (a
       pipeline's gathered timeline) only on timed steps, and keeps apart what the meter slowed;
    8. `loss_ready(output)`: every training_step returns its output through it, so the run's
       evidence (`listen_to_step_loss`) sees the step's loss before Lightning's backward;
    9. `context_batch(model, batch)`: the rows this rank computes (identity; this rank's chunks of
       them under context parallelism), called by the task before each forward.
    """

    layout = None
    owns_step = False
    model_materialised = False
    setup_peak_bytes = None  # most bytes live while materialising and placing this rank's part
    setup_allocator_peak_bytes = None  # the same from the CUDA caching allocator (None elsewhere)
    measuring = True  # whether this step is timed (RunEvidence sets it; outside a run every step is)
    metered = False  # whether the compute-memory meter watches this step (its dispatch mode slows the host)

    compile_blocks = False  # trainer.compile: the run says so through enable_compile
    compiled_blocks = 0  # blocks this rank compiled

    fp8_recipe = None  # hardware.precision=fp8-mixed: the run says so through enable_fp8
    fp8_emulate = False
    fp8_linears = 0  # Float8Linear layers this rank's blocks hold

    def enable_fp8(self, recipe: str | None, emulate: bool = False) -> None:
        """hardware.precision=fp8-mixed: the blocks' linears become torchao's Float8Linear with this
        recipe where the strategy materialises them (strategies/float8.py); None: bf16 as they are."""
        self.fp8_recipe, self.fp8_emulate = recipe, emulate

    def enable_compile(self, compile_blocks: bool) -> None:
        """trainer.compile: compile each block this rank materialises (false where the strategy's
        registry entry declares its blocks eager: the run states the reason, strategies/compile.py)."""
        self.compile_blocks = compile_blocks

    step_loss_listener = None  # output -> None: the run's evidence issues the step's exchange there

    def listen_to_step_loss(self, listener) -> None:
        """Lightning hands no hook the loss before its backward: the run's evidence listens here."""
        self.step_loss_listener = listener

    def loss_ready(self, output):
        """Every strategy's training_step returns through here (its loss, as Lightning gets it)."""
        if self.step_loss_listener is not None:
            self.step_loss_listener(output)
        return output

    def communicator(self):
        """The counted communicator every collective of this strategy passes through, if any."""
        return None if self.layout is None else self.layout.communicator

    def data_parallel(self) -> tuple:
        """(data-parallel rank, data-parallel degree)."""
        if self.layout is None:
            return 0, 1
        return self.layout.index("data"), self.layout.degrees.data

    def context_batch(self, model, batch: dict) -> dict:
        """The batch as this rank computes it, called by the task before each step's forward: the whole
        rows here; under context parallelism this rank's head and tail chunks of them, with the model's
        positions set (strategies/context_layout.py ContextParallelHooks)."""
        return batch

    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks that hold the same layers and see other tokens: the layout's
        "data_context" group (data replicas × context shards; the "data" group without context
        parallelism), through the counted communicator; `tensor` itself without a layout or where the
        group is this rank alone. The MoE blocks' step loads reach DeepSeek-V3's bias update here
        (models/moe.py update_expert_biases)."""
        if self.layout is None:
            return tensor
        group = self.layout.group("data_context")
        if group is None or group.size == 1:
            return tensor
        summed = tensor.clone()
        self.layout.communicator.all_reduce(summed, group)
        return summed

    def compute_resident_tensors(self) -> list:
        """Parameters, their gradients and the optimizer state: what a replicated model keeps."""
        parameters = list(self.lightning_module.parameters())
        tensors = parameters + [p.grad for p in parameters if p.grad is not None]
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        return tensors

    def set_collective_timeout(self, seconds: float) -> None:
        """Bound every collective of the process group (Slurm: a rank that hangs alive). Lightning's
        DDP and ModelParallel strategies read `_timeout` when they create the group; one-process
        strategies create none and ignore it."""
        self._timeout = timedelta(seconds=seconds)

    def shard_lightning_module(self, task) -> None:
        """Called from the task's configure_model: after the layout exists, before `setup` and the
        optimizers. Materialises this rank's part once per process (Lightning calls configure_model
        again for validate/test), counting live storages as the compute-side meter does."""
        if self.model_materialised:
            return
        reset_allocator_peak(self.root_device)
        meter = ComputeMemoryMeter()
        with meter:
            self.convert_to_fp8(task.model)  # the meta blocks: FSDP2 shards them in place
            self.materialise_model(task.model)
            self.convert_to_fp8(task.model)  # the blocks the others build afresh
        self.setup_peak_bytes = meter.peak_bytes
        self.setup_allocator_peak_bytes = allocator_peak_bytes(self.root_device)
        if self.compile_blocks:  # lazily: each block's first call traces it (strategies/compile.py)
            self.compiled_blocks = apply_compile(task.model, self.root_device.type)
        self.model_materialised = True

    def convert_to_fp8(self, model) -> None:
        """Under fp8-mixed, swap the blocks' nn.Linear for Float8Linear (idempotent; names kept)."""
        if self.fp8_recipe is None:
            return
        from strategies.float8 import check_device, convert_blocks
        check_device(self.root_device)
        self.fp8_linears = convert_blocks(model, self.fp8_recipe, self.fp8_emulate)

    def materialise_model(self, model) -> None:
        """Give the parts of the meta `model` this rank owns their storage and seeded values; a
        technique that owns less than the whole model materialises only that (default: all of it)."""
        model.materialise(self.root_device)

    def measure_this_step(self, measuring: bool, metered: bool = False) -> None:
        """Called by the evidence callback before each training step, with the same answer on every rank."""
        self.measuring, self.metered = measuring, metered

    def bubble_fraction(self) -> dict | None:
        """{"simulated": x, "measured": y} where the strategy runs a schedule; None otherwise."""
        return None

    def write_evidence(self, run_directory: Path, charts: bool = True) -> list:
        """Write technique-specific files (schedules; with `charts`, Gantt charts) on rank 0; returns the charts' paths."""
        return []
