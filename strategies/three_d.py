"""3-D tensor parallelism (Bian et al. 2021) and its 1-D / 2-D baselines, as Lightning strategies.

    strategy=three_d strategy.tensor_grid=2   # 8 ranks per tensor block, × data replicas
    strategy=tp_2d   strategy.tensor_grid=2   # 4 ranks (SUMMA)
    strategy=tp_1d   strategy.tensor_grid=8   # 8 ranks (Megatron)

Lightning's automatic optimisation runs forward and backward; the parallel layers' collectives
run inside them. `optimizer_step` then sums the gradients of replicated parameters over the
groups holding copies and every gradient over the data group, and steps (docs/strategies/three_d.md).
"""

from typing_extensions import override

from parallel.dims import Layout, tensor_ranks
from strategies.base import LayerwiseStrategy
from strategies.buckets import sum_over_groups
from strategies.checks import grid_errors
from strategies.recompute import apply_activation_recompute, recompute_errors
from strategies.compile import TENSOR_GRID, always_eager
from strategies.context_layout import ContextParallelHooks, context_errors, context_of
from strategies.registry import StrategyEntry
from strategies.tensor_parallel import consolidate as consolidate_form
from strategies.tensor_parallel import parallelize_1d, parallelize_2d, parallelize_3d
from strategies.tensor_parallel.grids import DIMENSION, layout_arguments
from strategies.tensor_parallel.sequence import sequence_errors

PARALLELIZE = {"1d": parallelize_1d, "2d": parallelize_2d, "3d": parallelize_3d}
MODES = {"three_d": "3d", "tp_1d": "1d", "tp_2d": "2d"}


class TensorParallelStrategy(ContextParallelHooks, LayerwiseStrategy):
    """Tensor-parallel training on a 1-D, 2-D or 3-D grid, times data replicas.

    1. `setup_environment`: the layout with the grid's group families;
    2. `materialise_model`: one plain part at a time (embedding, block, head), materialise it from
       the seed, cut this rank's shards, drop it; replicas over data start bit-identical;
    3. `training_step`: parallel forward, vocabulary-parallel loss (a live tensor; Lightning
       runs the backward, whose collectives are in the layers);
    4. `optimizer_step`: closure, sum replicated and data-parallel gradients, step.
    With context parallelism (1-D only, `degrees.context` c > 1) each tensor block is one of c holding
    a sequence's head and tail chunks (`context_batch`), its attention exchanges keys and values over
    the context group on this rank's heads, and the loss's count and the gradient sums run over the
    data_context group (strategies/context_layout.py).
    """

    def __init__(self, degrees: Layout, tensor_grid: str, activation_recompute: str = "none",
                 sequence_parallel: bool = False, tensor_overlap: bool = False,
                 tensor_collective_dtype: str = "compute", context_comm: str = "ring", **kwargs):
        super().__init__(degrees, **kwargs)
        self.context_degree, self.context_comm = degrees.context, context_comm  # ContextParallelHooks'
        self.tensor_grid = tensor_grid
        self.activation_recompute = activation_recompute
        # 1-D only: the residual stream split along the sequence, its collectives chunked under the products
        self.sequence_options = {"sequence_parallel": sequence_parallel, "tensor_overlap": tensor_overlap} \
            if sequence_parallel else {}
        if tensor_grid == "1d":  # 2-D/3-D grids keep fp32 sums (schema.py tensor_collective_dtype)
            self.sequence_options["tensor_collective_dtype"] = tensor_collective_dtype
        self.form = None

    @override
    def layout_arguments(self) -> dict:
        return layout_arguments(self.tensor_grid, self.degrees.tensor)

    @override
    def materialise_model(self, model) -> None:
        """Before the optimizers are built over the model's parameters: this rank's shards only,
        on its device, then broadcast over the data group (NCCL moves only device tensors)."""
        self.form = PARALLELIZE[self.tensor_grid](model, self.layout, self.root_device, **self.sequence_options)
        self.synchronise_replicas(model, "data_context")  # context shards hold the same parameters too
        self.install_context_parallel(model)
        # Every rank recomputes its blocks in the same backward order, so the collectives inside a
        # recomputed block are issued in the same order on every rank of its groups.
        apply_activation_recompute(model, self.activation_recompute)

    def _loss(self, batch):
        model = self.lightning_module.model
        batch = self.context_batch(model, batch)  # this rank's chunks under context parallelism
        return self.form.loss(model(batch["tokens"]), batch["targets"])

    @override
    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():  # autocast under bf16-mixed
            loss = self._loss(args[0])  # every rank returns the global-batch loss's value
        return self.loss_ready(loss)

    @override
    def validation_step(self, *args, **kwargs):
        with self.precision_plugin.val_step_context():
            return self._loss(args[0]).detach()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        def closure_then_synchronise():
            result = closure()  # training_step, zero_grad, backward
            self.synchronise_gradients()
            return result
        return self.precision_plugin.optimizer_step(optimizer, model=model or self.lightning_module,
                                                    closure=closure_then_synchronise, **kwargs)

    def synchronise_gradients(self) -> None:
        """Sum each gradient over the groups holding copies of its parameter, then over data (× context:
        the loss is already normalised over the data_context group's whole batch)."""
        data = self.layout.group("data_context")
        sum_over_groups([(parameter.grad, self.form.gradient_groups.get(name, ()) + (data,))
                         for name, parameter in self.lightning_module.model.named_parameters()],
                        self.layout.communicator)


# ----- the registry interface (see strategies/__init__.py)

def _mode(cfg) -> str:
    return MODES.get(cfg.strategy.name, cfg.strategy.tensor_parallel)


def _tensor_degree(cfg) -> int:
    return tensor_ranks(_mode(cfg), cfg.strategy.tensor_grid)


def degrees(cfg, world_size: int) -> Layout:
    """One tensor grid × context (strategy.context_parallel) × data (strategy.data_degree, or the rest
    of the world)."""
    tensor, context = _tensor_degree(cfg), max(1, context_of(cfg.strategy)[0])
    return Layout(data=cfg.strategy.data_degree or max(1, world_size // (tensor * context)), tensor_grid=_mode(cfg),
                  edge=cfg.strategy.tensor_grid, context=context)


def check(cfg, world_size: int) -> list:
    """Config errors before launch: world, batch, hidden and heads against the grid (§4)."""
    mode, q = _mode(cfg), cfg.strategy.tensor_grid
    if mode not in DIMENSION or q < 1:
        return [f"strategy.tensor_parallel={mode!r}, strategy.tensor_grid={q}: need a mode in "
                f"1d, 2d, 3d and q >= 1. Fix: strategy.tensor_parallel=3d strategy.tensor_grid=2."]
    context = context_of(cfg.strategy)[0]
    refused = {} if mode == "1d" else {
        f"with strategy={cfg.strategy.name} ({mode}): the {mode} grid splits each block's activations over "
        f"rows of the grid, and the key/value exchange would have to run inside its attention (not built)":
        "strategy=tp_1d"}
    errors = context_errors(cfg, world_size, _tensor_degree(cfg), refused=refused, tensor=_tensor_degree(cfg))
    if errors:
        return errors
    errors = _check_world(cfg, world_size, _tensor_degree(cfg) * context, mode) + recompute_errors(cfg.strategy)
    errors += sequence_errors(cfg, mode, _tensor_degree(cfg))
    data = degrees(cfg, world_size).data
    return errors + grid_errors(cfg, mode, q, batch_splits=data if not errors else 1,
                                splitter=f"each of the {data} data-parallel ranks")


def _check_world(cfg, world_size: int, tensor: int, mode: str) -> list:
    data = cfg.strategy.data_degree
    if world_size % tensor == 0 and (data is None or data * tensor == world_size):
        return []
    fits = [tensor * n for n in (1, 2, 4)]
    return [f"strategy.tensor_grid={cfg.strategy.tensor_grid}: {cfg.strategy.name} ({mode}) needs "
            f"data × {tensor} ranks, but the world has {world_size} (hardware.nodes × "
            f"hardware.devices_per_node"
            f"{'' if data is None else f', strategy.data_degree={data}'}). Fix: "
            f"hardware.devices_per_node={' or '.join(map(str, fits))}, or another "
            f"strategy.tensor_grid."]


def build(cfg, world_size: int):
    return TensorParallelStrategy(degrees(cfg, world_size), _mode(cfg),
                                  context_comm=context_of(cfg.strategy)[1],
                                  activation_recompute=cfg.strategy.activation_recompute,
                                  sequence_parallel=cfg.strategy.sequence_parallel,
                                  tensor_overlap=cfg.strategy.tensor_overlap,
                                  tensor_collective_dtype=cfg.strategy.tensor_collective_dtype,
                                  process_group_backend=cfg.hardware.process_group_backend)


TENSOR_PARALLEL = StrategyEntry(check=check, degrees=degrees, build=build, consolidate=consolidate_form,
                                planned_as="tensor_grid", eager_blocks=always_eager(TENSOR_GRID))
