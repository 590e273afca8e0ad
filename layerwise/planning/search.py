"""mode=plan plan.search=true: every valid layout for a model, hardware and global batch, ranked.

    python train.py mode=plan plan.search=true model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=128 \
        data.global_batch_size=1536 data.sequence_length=2048

1. enumerate: strategy family (the pipeline schedules, zero-bubble ZB-H1/ZBV without recomputation,
   ZeRO-layered and depth-first ZeRO), tensor
   grid (none, 1-D q, 2-D q², 3-D q³ ranks, at most plan.search_max_tensor_ranks), pipeline degree,
   context-parallel degree c and exchange (powers of two up to plan.search_max_context, ring and
   all_gather), layers per stage, micro-batches and recomputation; data = world / (pipeline ×
   context × tensor). Placement
   follows the schedule (contiguous or looping, the tensor axis innermost). Only what validation
   accepts is produced: the same divisibility rules, the schedules' own `_check_combination`, the
   grids' splits and the strategies' precision/optimizer rules;
2. evaluate each in closed form from cost/step_time.py's formulas (`stage_memory` with
   `closed_form_in_flight`, `closed_form_step`): no config composed, and no plan built but the split
   schedules', whose buffers are read off one per (p, m capped at its steady state) and whose
   step (ZBV's, ZB-H2's) is simulated on one per (p, m);
3. keep those whose largest role fits the device after the allocator margin, rank by step time,
   print the top plan.search_top with memory and MFU, write plan_search.csv (every fitting layout);
4. re-plan the first plan.search_replan through the full path (validate, the strategy's plan, the
   simulator) and print both predictions side by side; print the `python train.py -m` line that
   launches them as a sweep.
"""

import csv
import dataclasses
import itertools
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from layerwise.config.schema import PipelineStrategyConfig, ZeroLayeredStrategyConfig
from layerwise.planning.inputs import communication_of, compute_bytes, device_of, efficiency_of, moe_share_of, shape_of
from cost.context import sharded_shape
from layerwise.planning.result import plan_result
from layerwise.planning.context import pipeline_context
from layerwise.planning.experts import expert_points
from models import blocks_of
from models.transformer import model_flops_per_token
from strategies.checks import divisors, fp16_errors, gradient_clipping_errors, model_grid_errors
from cost.inputs import Workload
from cost.step_time import closed_form_step, model_flops_utilization, step_lower_bound
from cost.memory import closed_form_held, closed_form_in_flight, closed_form_moments, closed_form_pending, stage_memory
from strategies.schedule.generators import ONE_STAGE_PER_RANK, ZERO_BUBBLE, _check_combination, stage_placement
from parallel.dims import Layout
from strategies.tensor_parallel.grids import DIMENSION, grid_of

GIB = 2 ** 30
# family -> (schedule, ZeRO, breadth_first_micro_batches); conf/strategy/<family>.yaml sets the same
FAMILIES = {"modular_pipeline": ("looped_breadth_first", False, None),
            "gpipe": ("gpipe", False, None),
            "one_f_one_b": ("one_f_one_b", False, None),
            "interleaved_1f1b": ("interleaved_one_f_one_b", False, None),
            "zero_layered": ("looped_breadth_first", True, None),
            "zero_depth_first": ("looped_breadth_first", True, 1),
            "zero_bubble_h1": ("zero_bubble_h1", False, None),  # split backward (Qi et al. 2023)
            "zbv": ("zbv", False, None),
            "zero_bubble_h2": ("zero_bubble_h2", False, None)}  # priced by simulating its plan
# families without a conf/strategy file of their own: the strategy that runs their schedule
STRATEGY_OF = {"zero_bubble_h1": "modular_pipeline", "zbv": "modular_pipeline", "zero_bubble_h2": "modular_pipeline"}
TWO_STAGES_PER_RANK = ("zbv",)  # the V: layers_per_stage = layers / 2p


# plan_search.csv's first columns: a point under the strategy group's own field names
COLUMNS = ("family", "pipeline_degree", "tensor_parallel", "tensor_grid", "layers_per_stage", "micro_batches",
           "activation_recompute", "data_degree", "sequence_parallel", "distributed_optimizer", "context_parallel",
           "context_parallel_comm", "expert_parallel")  # e: the data ranks an MoE block's experts split over


@dataclass(frozen=True)
class Point:
    """One point of the search space: a family's schedule on a layout (parallel.dims.Layout, the one
    type every run and plan describes a layout with) and the stage size, micro-batches and
    recomputation. `of` builds one from the strategy group's fields, `row` reads them back."""

    family: str
    layout: Layout
    layers_per_stage: int
    micro_batches: int
    activation_recompute: str  # none | selective | full
    sequence_parallel: bool = False  # 1-D grids (Korthikanti et al. 2022 §4.2.2)
    distributed_optimizer: bool = False  # ZeRO-1 over the data ranks (the non-ZeRO families)
    context_parallel_comm: str = "ring"  # the exchange where layout.context > 1 (ring | all_gather)

    @property
    def schedule(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def breadth_first_micro_batches(self):
        return FAMILIES[self.family][2]

    @classmethod
    def of(cls, family: str, pipeline_degree: int, tensor_parallel: str, tensor_grid: int, layers_per_stage: int,
           micro_batches: int, activation_recompute: str, data_degree: int, sequence_parallel=False,
           distributed_optimizer=False, context_parallel=1, context_parallel_comm="ring", expert_parallel=1) -> "Point":
        """The point of these strategy fields (tensor_parallel none | 1d | 2d | 3d, tensor_grid q);
        ZeRO is the family's. The switches may come as a csv's strings."""
        grid = None if tensor_parallel == "none" else tensor_parallel
        layout = Layout(int(data_degree), int(pipeline_degree), grid, int(tensor_grid), FAMILIES[family][1],
                        context=int(context_parallel), expert=int(expert_parallel))
        return cls(family, layout, int(layers_per_stage), int(micro_batches), activation_recompute,
                   _flag(sequence_parallel), _flag(distributed_optimizer), context_parallel_comm)

    @property
    def pipeline_degree(self) -> int:
        return self.layout.pipeline

    @property
    def data_degree(self) -> int:
        return self.layout.data

    @property
    def tensor_parallel(self) -> str:
        return self.layout.tensor_grid or "none"

    @property
    def tensor_grid(self) -> int:
        """q, as strategy.tensor_grid names it."""
        return self.layout.edge

    @property
    def context_parallel(self) -> int:
        return self.layout.context

    @property
    def expert_parallel(self) -> int:
        return self.layout.expert

    def row(self) -> dict:
        return {name: getattr(self, name) for name in COLUMNS}

    def strategy_fields(self) -> dict:
        """What the point's `strategy` node holds (the family's yaml plus these; the switches of
        issue 56 the search does not range over keep their schema defaults)."""
        fields = {"name": STRATEGY_OF.get(self.family, self.family), "schedule": self.schedule,
                  "pipeline_degree": self.pipeline_degree,
                  "layers_per_stage": self.layers_per_stage, "micro_batches": self.micro_batches,
                  "breadth_first_micro_batches": self.breadth_first_micro_batches,
                  "activation_recompute": self.activation_recompute, "tensor_parallel": self.tensor_parallel,
                  "tensor_grid": self.tensor_grid if self.tensor_parallel != "none" else 2,
                  "sequence_parallel": self.sequence_parallel}
        if self.context_parallel > 1:  # (without it the schema's defaults: sweep lines stay as they were)
            fields.update(context_parallel=self.context_parallel, context_parallel_comm=self.context_parallel_comm)
        if self.expert_parallel > 1:  # (without it the schema's default: dense sweep lines stay as they were)
            fields["expert_parallel"] = self.expert_parallel
        if not self.layout.zero:  # ZeRO's families shard everything already: no such field
            fields["distributed_optimizer"] = self.distributed_optimizer
        return fields

    def switches(self) -> dict:
        """The strategy node's fields as `communication_of` reads them: the family's schema defaults
        (16-bit messages, scatter/gather, the overlapped reduction where the schema has it) and the
        point's own."""
        return {**SCHEMA_DEFAULTS[self.layout.zero], **self.strategy_fields()}

    def describe(self) -> str:
        grid = f"{self.tensor_parallel} q{self.tensor_grid}" if self.tensor_parallel != "none" else "-"
        recompute = {"full": " recompute", "selective": " selective"}.get(self.activation_recompute, "")
        switches = (" sp" if self.sequence_parallel else "") + (" dist-opt" if self.distributed_optimizer else "")
        switches += f" cp{self.context_parallel} {self.context_parallel_comm}" if self.context_parallel > 1 else ""
        switches += f" e{self.expert_parallel}" if self.expert_parallel > 1 else ""
        return (f"{self.family} d{self.data_degree} p{self.pipeline_degree} {grid}{switches} k{self.layers_per_stage} "
                f"m{self.micro_batches}{recompute}")


def _flag(value) -> bool:
    """A switch as a bool (plan_search.csv reads back 'True'/'False')."""
    return value in (True, "True", "true", 1)


def _schema_defaults(schema) -> dict:
    return {field.name: field.default for field in dataclasses.fields(schema)
            if field.default is not dataclasses.MISSING}


# ZeRO or not → the family's schema defaults of the switches (layerwise/config/schema.py)
SCHEMA_DEFAULTS = {False: _schema_defaults(PipelineStrategyConfig), True: _schema_defaults(ZeroLayeredStrategyConfig)}


# ----- 1. enumeration: only layouts validation accepts

def tensor_options(cfg, world: int) -> list:
    """(mode, q) of every grid whose block fits the bound and divides the world and the model."""
    bound = cfg.plan.search_max_tensor_ranks or cfg.hardware.devices_per_node
    options = [("none", 1)]
    for mode, dimension in DIMENSION.items():
        if model_grid_errors(cfg, mode):  # the strategies' own rule: an untied GPT or Llama, no experts, ...
            continue
        for q in range(2, int(round(bound ** (1 / dimension))) + 1):
            ranks = q ** dimension
            grid = grid_of(mode, ranks, 0)
            if ranks <= bound and world % ranks == 0 and cfg.model.hidden % grid.feature_parts == 0 \
                    and cfg.model.heads % grid.head_parts == 0 \
                    and (cfg.model.kv_heads or cfg.model.heads) % grid.head_parts == 0:  # null kv_heads = heads
                options.append((mode, q))
    return options


def families(cfg) -> list:
    """The families whose strategy-level checks (precision, clipping, optimizer) pass for this config."""
    kept = []
    for family, (_, zero, _) in FAMILIES.items():
        name = STRATEGY_OF.get(family, family)
        if fp16_errors(name, cfg.hardware.precision) or gradient_clipping_errors(name, cfg.trainer.gradient_clip_val):
            continue
        if zero and (cfg.optimizer.name == "lamb" or cfg.model.tie_embeddings):
            continue
        kept.append(family)
    return kept


def layouts(cfg, world: int):
    """Every valid layout (generator): the checks of strategies/modular_pipeline.py `check`,
    zero_layered.py `check`, layerwise/config/validate.py `check_strategy` and the schedules' own."""
    layers, batch, switches = cfg.model.layers, cfg.data.global_batch_size, Switches(cfg, world)
    for family in families(cfg):
        schedule, _, breadth_first = FAMILIES[family]
        for mode, q in tensor_options(cfg, world):
            tensor = q ** DIMENSION[mode] if mode != "none" else 1
            rows_split = grid_of(mode, tensor, 0).input_rows()[1] if mode != "none" else 1
            for pipeline, context, comm in pipeline_context(cfg, world // tensor):
                if pipeline > 1 and cfg.model.tie_embeddings:
                    continue
                data = world // (tensor * pipeline * context)
                for per_stage in stage_sizes(family, layers, pipeline):
                    for micro in divisors(batch // data) if batch % data == 0 else ():
                        if (batch // (data * micro)) % rows_split or not _schedule_accepts(
                                schedule, pipeline, layers // per_stage, micro, breadth_first):
                            continue
                        for recompute in recomputations(cfg, schedule, context):
                            point = switches.chosen(Point.of(family, pipeline, mode, q, per_stage, micro, recompute,
                                                             data, context_parallel=context,
                                                             context_parallel_comm=comm))
                            if point is not None:
                                yield from expert_points(point, cfg.model, switches.accepts)


def recomputations(cfg, schedule: str, context: int = 1) -> tuple:
    """strategy.activation_recompute values worth searching: none and full; selective (the core
    attention rerun) only where attention keeps its scores (plan.flash_attention=false): a flash
    kernel keeps none, so there it would cost a rerun and save nothing; and not under context
    parallelism, whose core attention is the exchange (strategies/context_layout.py refuses it). A
    split backward keeps the graph from I to W: no recomputation (modular_pipeline.check)."""
    if schedule in ZERO_BUBBLE:
        return ("none",)
    return ("none", "full") if cfg.plan.flash_attention or context > 1 else ("none", "selective", "full")


_ACCEPTED = {}  # Switches.accepts' answers


class Switches:
    """Issue 56's switches on each searched layout, where its strategy's own check accepts them
    (`check_strategy`, asked once per family, grid, data replication and recomputation):
    sequence parallelism on every 1-D grid and the distributed optimizer on every non-ZeRO layout
    with data replicas. The search does not range over them: in the cost model each only ever
    shortens the step (sequence parallelism: the same collective bytes, the residual stream's
    memory-bound operators and the boundary message split t ways; the distributed optimizer: a
    reduce-scatter, half an all-reduce's bytes, the gather hidden under the next forward) and needs
    no more memory, so the layout without one is never faster. Message dtype, scatter/gather and the
    overlapped reduction keep their schema defaults (on)."""

    def __init__(self, cfg, world: int):
        self.cfg, self.world = cfg, world
        model, data = cfg.model, cfg.data  # what a strategy's check reads besides the layout
        self.config_key = (model.name, model.layers, model.hidden, model.heads, model.get("kv_heads"),
                           data.sequence_length, cfg.hardware.name, cfg.hardware.precision, cfg.optimizer.name,
                           cfg.trainer.gradient_clip_val)

    def accepts(self, point: Point) -> bool:
        """Whether the strategy's check accepts the point, asked once per config and (family, grid,
        data replication, recomputation, switches): the first point `layouts` meets is its smallest
        (p = 1 and m = 1 where valid), whose plan the check builds fast; the answer is kept across
        searches (the training-time reproduction searches each model at many GPU counts)."""
        from layerwise.config.validate import check_strategy
        key = (self.config_key, point.family, point.tensor_parallel, point.tensor_grid, point.data_degree > 1,
               point.activation_recompute, point.sequence_parallel, point.distributed_optimizer,
               point.context_parallel, point.context_parallel_comm, point.expert_parallel > 1)
        if key not in _ACCEPTED:
            _ACCEPTED[key] = not check_strategy(point_config(self.cfg, point), self.world)
        return _ACCEPTED[key]

    def chosen(self, point: Point):
        """The point with each switch its strategy accepts; None where it refuses the point's
        recomputation (selective) or its context parallelism itself."""
        if (point.activation_recompute == "selective" or point.context_parallel > 1) and not self.accepts(point):
            return None
        if point.tensor_parallel == "1d" and self.accepts(dataclasses.replace(point, sequence_parallel=True)):
            point = dataclasses.replace(point, sequence_parallel=True)
        if not point.layout.zero and point.data_degree > 1 \
                and self.accepts(dataclasses.replace(point, distributed_optimizer=True)):
            point = dataclasses.replace(point, distributed_optimizer=True)
        return point


def stage_sizes(family: str, layers: int, pipeline: int) -> list:
    """layers_per_stage k: stages = layers / k a multiple of p; one stage per rank for GPipe/1F1B;
    at least two loops for interleaved 1F1B (one loop is plain 1F1B, searched already)."""
    if layers % pipeline:
        return []
    if family in ONE_STAGE_PER_RANK:
        return [layers // pipeline]
    if family in TWO_STAGES_PER_RANK:
        return [layers // (2 * pipeline)] if layers % (2 * pipeline) == 0 else []
    sizes = [k for k in divisors(layers) if (layers // k) % pipeline == 0]
    return [k for k in sizes if layers // k >= 2 * pipeline] if family == "interleaved_1f1b" else sizes


def _schedule_accepts(schedule: str, pipeline: int, stages: int, micro: int, breadth_first) -> bool:
    try:
        _check_combination(schedule, pipeline, stages, micro, breadth_first)
    except ValueError:
        return False
    return True


# ----- 2. the closed-form evaluation

class Evaluator:
    """Evaluates layouts of one config: model, hardware and batch fixed, the layout varying."""

    def __init__(self, cfg, world: int):
        self.cfg, self.world = cfg, world
        self.shape, self.device = shape_of(cfg), device_of(cfg)
        self.tokens = cfg.data.global_batch_size * cfg.data.sequence_length
        self.model_flops = model_flops_per_token(cfg.model.layers, cfg.model.hidden, cfg.data.sequence_length,
                                                 self.shape.vocabulary, cfg.model.mlp_ratio, self.shape.block,
                                                 blocks_of(cfg.model)) * self.tokens
        self.activation_bytes = compute_bytes(cfg)
        self.moe_share = moe_share_of(cfg.model)  # the model's, the same at every point
        self.workloads = {}

    def workload(self, point: Point) -> Workload:
        """The point's workload, its communication from its strategy fields as plan mode reads a config's
        (`communication_of`); kept per point (a row asks for it once per rank it bounds)."""
        if point not in self.workloads:
            self.workloads[point] = self._workload(point)
        return self.workloads[point]

    def _workload(self, point: Point) -> Workload:
        rows = self.cfg.data.global_batch_size // (point.data_degree * point.micro_batches)
        return Workload(sharded_shape(self.shape, point.context_parallel), self.cfg.model.layers, self.cfg.model.heads,
                        point.layout, point.layers_per_stage,
                        rows, self.cfg.optimizer.name, point.activation_recompute == "full", self.activation_bytes,
                        gloo=self.cfg.hardware.process_group_backend == "gloo",
                        expert_imbalance=self.cfg.plan.expert_load_imbalance, moe_share=self.moe_share,
                        **communication_of(point.switches(), self.cfg.hardware.precision, point.layout,
                                           self.cfg.plan.flash_attention))

    def __call__(self, layout: Point) -> dict:
        """One csv row: the layout's fields, the step, MFU and the largest role's bytes."""
        step = closed_form_step(self.workload(layout), self.device, layout.schedule, layout.micro_batches,
                                layout.breadth_first_micro_batches)
        worst_rank, total = self.largest_role(layout)
        seconds = step["step_seconds"]
        return {**layout.row(), "step_time_s": seconds, "tokens_per_s": self.tokens / seconds,
                "mfu": self.mfu(seconds),
                "bubble_fraction": step["bubble_fraction"], "exposed_data_s": step["exposed_data_seconds"],
                "worst_pipeline_rank": worst_rank, "worst_role_bytes": total,
                "fits": total <= self.device.memory_bytes}

    def largest_role(self, layout: Point) -> tuple:
        """(pipeline rank, bytes with the allocator margin) of the layout's largest role."""
        workload, p = self.workload(layout), layout.pipeline_degree
        stages = self.cfg.model.layers // layout.layers_per_stage
        breadth_first, flash = layout.breadth_first_micro_batches or layout.micro_batches, self.cfg.plan.flash_attention
        rank, worst = max(((rank, role_bytes(workload, layout, rank, stages, breadth_first, flash))
                           for rank in bounding_ranks(layout.schedule, p, breadth_first)),
                          key=lambda pair: sum(pair[1].values()))
        return rank, sum(worst.values()) * (1 + self.cfg.plan.allocator_margin)

    def step_lower_bound(self, layout: Point) -> float:
        """A step no schedule of this layout beats (cost/step_time.py `step_lower_bound`)."""
        placement = placement_of(layout.schedule, self.cfg.model.layers // layout.layers_per_stage, layout.pipeline_degree)
        return step_lower_bound(self.workload(layout), self.device, placement, layout.micro_batches)

    def mfu(self, step_seconds: float) -> float:
        """Model FLOPs utilisation of a step of this config taking `step_seconds`."""
        return model_flops_utilization(self.model_flops, step_seconds, self.device.flops_per_second, self.world)



def bounding_ranks(schedule: str, pipeline_degree: int, breadth_first: int) -> set:
    """The pipeline ranks whose bytes bound every role's: 0 (embedding, most in flight), 1 (a middle
    one) and p − 1 (head), since middle ranks hold equal parts and in-flight counts never grow with
    the rank. A split backward's pending Ws do (ZB-H1: r + 1, up to bf): its ranks bf − 1 and p − 2 too."""
    p = pipeline_degree
    split = {min(breadth_first, p) - 1, max(p - 2, 0)} if schedule in ZERO_BUBBLE else set()
    return {0, min(1, p - 1), p - 1} | split


def placement_of(schedule: str, stages: int, pipeline_degree: int) -> tuple:
    """Rank of every stage under `schedule`: the V for ZBV, else looping (contiguous at one stage per rank)."""
    return stage_placement(stages, pipeline_degree, "v" if schedule == "zbv" else "looping")


def role_bytes(workload: Workload, layout: Point, rank: int, stages: int, breadth_first: int, flash: bool) -> dict:
    """`cost.memory.memory` of pipeline rank `rank` without its plan row: the stages it holds (looping
    r, r + p, …; at v = 1 the contiguous placement's one stage r) and the closed-form in-flight counts."""
    loops = stages // layout.pipeline_degree
    placement = placement_of(layout.schedule, stages, layout.pipeline_degree)
    held = [stage for stage in range(stages) if placement[stage] == rank]
    alive = closed_form_in_flight(layout.schedule, layout.pipeline_degree, loops, breadth_first, rank)
    last_alive, later, posted = closed_form_moments(layout.schedule, layout.pipeline_degree, loops, breadth_first,
                                                    layout.micro_batches, rank)
    sends = closed_form_held(layout.schedule, layout.pipeline_degree, loops, breadth_first, layout.micro_batches, rank,
                             completes_when_received=not workload.gloo)  # NCCL frees a send once received
    pending = closed_form_pending(layout.schedule, layout.pipeline_degree, breadth_first, layout.micro_batches, rank)
    return stage_memory(workload, held, stages, alive, flash, later, last_alive, posted, sends, pending=pending)


# ----- 3. and 4. rank, print, write, re-plan, and the sweep line

def search(cfg, world: int, run_directory) -> dict:
    """Enumerate, evaluate, rank; print the top layouts, write plan_search.csv, re-plan the first few."""
    started = time.perf_counter()
    rows = evaluate_all(Evaluator(cfg, world), list(layouts(cfg, world)))
    seconds = time.perf_counter() - started
    fitting = sorted((row for row in rows if row["fits"]), key=lambda row: row["step_time_s"])
    directory = Path(run_directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(fitting, directory / "plan_search.csv")
    top = fitting[:cfg.plan.search_top]
    print(f"search: {cfg.model.name} × {cfg.hardware.name} × {world} devices, global batch "
          f"{cfg.data.global_batch_size} × {cfg.data.sequence_length} tokens: {len(rows)} valid layouts, "
          f"{len(fitting)} fit (efficiency {efficiency_of(cfg):.0%} assumed, not calibrated)")
    print(top_table(top))
    replanned = [replan(cfg, world, row) for row in top[:cfg.plan.search_replan]]
    if replanned:
        print(replan_table(replanned))
    if top:
        print("launch the top layouts as a sweep (GPU profiles: add hydra/launcher=slurm; add mode=check or "
              "mode=plan to check or plan each point here):\n  " + sweep_line(cfg, [point_of(row) for row in top[:3]]))
    rate = len(rows) / seconds * 60 if seconds else float("inf")
    print(f"searched {len(rows)} layouts in {seconds:.2f} s: {rate:,.0f} layouts per minute "
          f"(plan_search.csv in {directory})")
    return {"step_time_s": top[0]["step_time_s"] if top else float("nan"), "layouts": len(rows),
            "fitting": len(fitting), "search_seconds": seconds, "layouts_per_minute": rate, "top": top,
            "replanned": replanned}


_WORK = None  # (evaluate, layouts) of the search in progress: forked workers inherit it, nothing is pickled


def evaluate_all(evaluate, points: list) -> list:
    """Every point's row, in order, over this machine's cores: forked workers each take whole groups of
    points sharing a schedule and (p, m, bf), so a plan a group's points all read (a split backward's
    held sends, its simulated step) is built once, in one worker. A progress line per quarter."""
    global _WORK
    workers = min(len(os.sched_getaffinity(0)), 8)
    if workers < 2 or len(points) < 500:
        return [evaluate(point) for point in points]
    def key(index):  # what a plan depends on
        point = points[index]
        return point.schedule, point.pipeline_degree, point.micro_batches, point.breadth_first_micro_batches or 0

    order = sorted(range(len(points)), key=key)
    groups = [list(group) for _, group in itertools.groupby(order, key=key)]
    _WORK, rows, done = (evaluate, points), [None] * len(points), 0
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_one_thread) as pool:
            for part in pool.imap_unordered(_evaluate_group, groups):
                for index, row in part:
                    rows[index] = row
                done += len(part)
                if done * 4 // len(points) > (done - len(part)) * 4 // len(points):
                    print(f"[layerwise] search: {done}/{len(points)} layouts evaluated ({workers} processes)",
                          flush=True)
    finally:
        _WORK = None
    return rows


def _one_thread() -> None:
    """A forked worker runs no parallel region: GNU OpenMP hangs in a child forked after the parent ran one."""
    import torch
    torch.set_num_threads(1)


def _evaluate_group(indices: list) -> list:
    evaluate, points = _WORK
    return [(index, evaluate(points[index])) for index in indices]


def write_csv(rows: list, path: Path) -> None:
    fields = list(rows[0]) if rows else list(COLUMNS)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def point_of(row: dict) -> Point:
    """The point of a plan_search.csv row (one written before e was searched: e = 1)."""
    return Point.of(**{name: row.get(name, 1) if name == "expert_parallel" else row[name] for name in COLUMNS})


def top_table(rows: list) -> str:
    lines = [f"{'#':>3s} {'layout':58s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} {'bubble':>7s} "
             f"{'largest role GiB':>17s}"]
    for number, row in enumerate(rows, 1):
        lines.append(f"{number:3d} {point_of(row).describe():58s} {row['step_time_s']:8.4g} "
                     f"{row['tokens_per_s']:10.0f} {row['mfu']:6.1%} {row['bubble_fraction']:7.1%} "
                     f"{row['worst_role_bytes'] / GIB:17.3g}")
    return "\n".join(lines)


def point_config(cfg, layout: Point):
    """The config of one searched layout: the user's, with the strategy node replaced by the
    family's fields (an untyped copy: the families' schemas differ) and plan.search off."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container["strategy"] = {**layout.switches(), "data_degree": None}  # the schema's defaults too: plan mode reads them
    if not FAMILIES[layout.family][1]:
        container["strategy"]["bucket_mb"] = 25.0
    container["plan"]["search"] = False
    return OmegaConf.create(container)


def replan(cfg, world: int, row: dict) -> dict:
    """The full plan path for one searched layout: validation's strategy checks, the strategy's
    own plan and the simulator; returns both predictions."""
    from layerwise.config.validate import check_strategy
    from layerwise.config.errors import ConfigError
    point = point_config(cfg, point_of(row))
    problems = check_strategy(point, world)
    if problems:
        raise ConfigError([f"search produced a layout validation refuses ({point_of(row).describe()}): "
                           + "; ".join(problems)])
    full = plan_result(point, world)
    worst = max(role["peak_with_margin_bytes"] for role in full["roles"])
    return {"layout": point_of(row).describe(), "closed_form_step_time_s": row["step_time_s"],
            "simulated_step_time_s": full["step_time_s"], "closed_form_worst_role_bytes": row["worst_role_bytes"],
            "planned_worst_role_bytes": worst, "closed_form_mfu": row["mfu"], "simulated_mfu": full["mfu"]}


def replan_table(replanned: list) -> str:
    lines = ["re-planned through the full plan path (closed form | simulated plan):",
             f"{'layout':58s} {'step s':>19s} {'largest role GiB':>21s}"]
    for entry in replanned:
        lines.append(f"{entry['layout']:58s} {entry['closed_form_step_time_s']:8.4g} | "
                     f"{entry['simulated_step_time_s']:8.4g} {entry['closed_form_worst_role_bytes'] / GIB:9.3g} | "
                     f"{entry['planned_worst_role_bytes'] / GIB:9.3g}")
    return "\n".join(lines)


# ----- the sweep line

SEARCH_KEYS = ("strategy", "mode", "plan.search", "hydra")


def common_overrides(cfg) -> list:
    """What fixes the search's model, hardware and batch: the user's own overrides where Hydra has
    them (all but the strategy's and the search's), and the fields the search read otherwise."""
    explicit = {"model": cfg.model.name, "hardware": cfg.hardware.name, "hardware.nodes": cfg.hardware.nodes,
                "hardware.devices_per_node": cfg.hardware.devices_per_node, "data": cfg.data.name,
                "data.global_batch_size": cfg.data.global_batch_size,
                "data.sequence_length": cfg.data.sequence_length, "optimizer": cfg.optimizer.name}
    given = []
    try:
        from hydra.core.hydra_config import HydraConfig
        given = [item for item in HydraConfig.get().overrides.task
                 if not item.lstrip("+~").startswith(SEARCH_KEYS)]
    except ValueError:  # composed outside a Hydra app (tests, benchmarks)
        pass
    keys = {item.lstrip("+~").split("=", 1)[0] for item in given}
    return given + [f"{key}={value}" for key, value in explicit.items() if key not in keys]


def sweep_line(cfg, chosen: list) -> str:
    """`python train.py -m ...` running exactly these layouts: Hydra's basic sweeper takes a
    product of lists, so the points are one list of dictionaries merged into the strategy node
    (`'strategy={...},{...}'`), on the first point's family (its schema: the pipeline families
    share one, the ZeRO families another). Layouts of both schemas need two lines."""
    lines = []
    for zero in (False, True):
        points = [layout for layout in chosen if FAMILIES[layout.family][1] == zero]
        if points:
            lines.append(" ".join(["python train.py -m", *common_overrides(cfg), *strategy_overrides(points)]))
    return "\n  ".join(lines)


def strategy_overrides(points: list) -> list:
    dictionaries = ",".join("{" + ",".join(f"{key}:{_hydra_value(value)}" for key, value in
                                           point.strategy_fields().items()) + "}" for point in points)
    return [f"strategy={STRATEGY_OF.get(points[0].family, points[0].family)}", f"'strategy={dictionaries}'"]


def _hydra_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)
