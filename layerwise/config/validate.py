"""Cross-group checks, run once after composition and before any process starts.

Every message names the field, what is wrong, and the fix. All problems are collected and reported
together, so a user fixes a config in one round instead of one error per launch.
"""

import codecs
import dataclasses
import difflib
import math
import re
from pathlib import Path

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from cost.inputs import OPTIMIZER_STATE
from layerwise.config.layout import layout_of
from layerwise.config import schema as schema_module
from layerwise.config.schema import Config
from strategies import REGISTRY, strategy_entry
from strategies.checks import divisors, fp16_errors, gradient_clipping_errors, nearest_multiples
from strategies.float8 import PRECISION as FP8_PRECISION, RECIPES as FP8_RECIPES, float8_errors
from strategies.schedule.generators import SCHEDULES

CHOICES = {
    "mode": ("fit", "check", "plan", "calibrate", "reproduce"),
    "model.architecture": ("gpt", "bert", "llama"),
    "model.router": ("softmax_topk", "sigmoid_bias"),  # models/moe.py ROUTERS
    "data.corpus": ("stdlib", "text_files", "token_bin", "text"),
    "hardware.accelerator": ("cpu", "gpu"),
    "hardware.process_group_backend": ("gloo", "nccl"),
    "optimizer.name": ("adamw", "lamb", "sgd"),
    "optimizer.lr_schedule": ("cosine", "constant"),
    "logger.name": ("wandb", "csv", "tensorboard", "none"),
    "logger.mode": ("offline", "online", "disabled"),
    "trainer.progress": ("auto", "bar", "lines", "none"),
    "hardware.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "fp8-mixed"),
    "hardware.fp8_recipe": FP8_RECIPES,
}
CHOICES_STRATEGY = {"schedule": SCHEDULES}  # where the strategy's schema has the field
CPU_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")

# Allowed values of every number a user can mistype: rule name -> (test, words for the message).
# A null (an Optional field left to its default) is never range-checked.
RULES = {
    "count": (lambda value: value >= 1, "at least 1"),
    "positive": (lambda value: value > 0, "> 0"),
    "non_negative": (lambda value: value >= 0, ">= 0"),
    "probability": (lambda value: 0 <= value < 1, "in [0, 1)"),
    "share": (lambda value: 0 < value < 1, "strictly between 0 and 1"),
    "ratio": (lambda value: 0 <= value <= 1, "in [0, 1]"),
    "fraction": (lambda value: 0 < value <= 1, "in (0, 1]"),
    # Lightning's seed_everything (run.py) refuses what numpy cannot seed: it would fail in every rank
    "seed": (lambda value: 0 <= value <= 2**32 - 1, "in [0, 4294967295] (numpy's seed range)"),
}
# field -> (rule, the value a "Fix:" offers, as the user would type it)
RANGES = {
    "seed": ("seed", 1234),
    "model.layers": ("count", 2), "model.hidden": ("count", 64), "model.heads": ("count", 4),
    "model.mlp_ratio": ("count", 4), "model.max_sequence_length": ("count", 256),
    "model.dropout": ("probability", 0.1),
    "model.experts": ("non_negative", 8), "model.experts_per_token": ("count", 2),
    "model.shared_experts": ("non_negative", 1), "model.moe_ffn_hidden": ("count", 256),
    "model.aux_loss_coefficient": ("non_negative", 0.01), "model.bias_update_rate": ("non_negative", 0.001),
    "model.capacity_factor": ("positive", 1.25),
    "data.global_batch_size": ("count", 16), "data.sequence_length": ("count", 64),
    "data.vocab_size": ("count", 50304), "data.max_bytes": ("count", 16777216),
    "data.validation_fraction": ("share", 0.05),
    "hardware.devices_per_node": ("count", 2), "hardware.nodes": ("count", 1),
    # 0 = unknown (plan mode then cannot price that part).
    "hardware.device_memory_bytes": ("non_negative", "8e9"),
    "hardware.host_memory_bytes": ("non_negative", "2.4e10"),
    "hardware.peak_flops": ("non_negative", "5e10"),  # each dtype's entry
    "hardware.intra_node_bandwidth": ("non_negative", "5e9"),
    "hardware.inter_node_bandwidth": ("non_negative", "1.25e9"),
    "hardware.matmul_overhead_s": ("non_negative", "1e-5"),
    "hardware.collective_latency_s": ("non_negative", "2e-5"),
    "hardware.block_overhead_s": ("non_negative", "1e-4"),
    "hardware.activation_seconds_per_element": ("non_negative", "1e-9"),
    "hardware.optimizer_seconds_per_parameter": ("non_negative", "2e-9"),
    "hardware.compute_units_per_node": ("non_negative", 2),
    "hardware.point_to_point_latency_s": ("non_negative", "5e-5"),
    "hardware.step_overhead_s": ("non_negative", "5e-3"), "hardware.action_overhead_s": ("non_negative", "1e-4"),
    "hardware.host_device_bandwidth": ("non_negative", "1.6e10"),
    "hardware.matmul_efficiency": ("fraction", 1.0), "hardware.relative_matmul_efficiency": ("positive", 1.0),
    "hardware.gather_overlap": ("ratio", 0.6),
    "calibrate.repeats": ("count", 5),
    "plan.efficiency": ("fraction", 0.5), "plan.allocator_margin": ("probability", 0.1),
    "plan.expert_load_imbalance": ("count", 1.25),  # the busiest expert over the mean: never below 1
    "plan.search_top": ("count", 10), "plan.search_replan": ("non_negative", 3),
    "plan.search_max_tensor_ranks": ("non_negative", 8),
    "plan.search_max_context": ("count", 16),
    "optimizer.lr": ("positive", "3e-4"), "optimizer.weight_decay": ("non_negative", 0.1),
    "optimizer.beta1": ("probability", 0.9), "optimizer.beta2": ("probability", 0.95),
    "optimizer.eps": ("positive", "1e-8"), "optimizer.momentum": ("probability", 0.9),
    "optimizer.warmup_steps": ("non_negative", 10), "optimizer.min_lr_ratio": ("ratio", 0.1),
    "trainer.max_steps": ("count", 200), "trainer.val_check_interval": ("count", 50),
    "trainer.limit_val_batches": ("non_negative", 4), "trainer.log_every_n_steps": ("count", 1),
    "trainer.checkpoint_every_n_steps": ("count", 50), "trainer.gradient_clip_val": ("non_negative", 1.0),
    "trainer.measure_every_n_steps": ("count", 50),
    "trainer.collective_timeout_s": ("non_negative", 60), "trainer.long_timeout_factor": ("count", 10),
    "trainer.straggler_window": ("non_negative", 20),
    "hardware.collective_timeout_s": ("positive", 300), "hardware.nccl_trace_buffer_size": ("non_negative", 2000),
}
RANGES_STRATEGY = {  # where the strategy's schema has the field
    "micro_batches": ("count", 4), "pipeline_degree": ("count", 2), "data_degree": ("count", 1),
    "layers_per_stage": ("count", 1), "breadth_first_micro_batches": ("count", 2),
    "tensor_grid": ("count", 2), "bucket_mb": ("non_negative", 25), "refresh_interval": ("count", 1),
    "damping": ("positive", "1e-3"), "bubble_margin": ("probability", 0.05), "layer_drop": ("probability", 0.1),
    "grow_by": ("non_negative", 1),
}
NOT_EMPTY = {"run_name": "my-run", "logger.project": "layerwise"}  # names of directories and W&B projects
DYNAMIC_DEPTH = ("layer_drop", "grow_at", "grow_by")  # schema DynamicDepthConfig: single, ddp, l2l only
SCHEMA_GROUPS = ("strategy", "model", "hardware", "data", "optimizer", "logger", "trainer")
WEIGHT_AND_GRADIENT_BYTES = 8  # fp32 weight and gradient; the optimizer's state: cost.inputs.OPTIMIZER_STATE


def lookup(cfg, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node


def world_size(cfg) -> int:
    """Processes in the job: nodes × devices per node; one-process strategies always use one."""
    if strategy_entry(cfg.strategy.name).one_process:
        return 1
    return cfg.hardware.nodes * cfg.hardware.devices_per_node


def check_choices(cfg, choices: dict = CHOICES) -> list:
    """Every named option against its allowed values (`choices`: the preflight adds other rooms')."""
    errors = []
    for field, allowed in choices.items():
        value = lookup(cfg, field)
        if value not in allowed:
            errors.append(f"{field}={value!r} is unknown. Fix: one of {', '.join(allowed)}.")
    if cfg.strategy.name not in REGISTRY:
        errors.append(f"strategy={cfg.strategy.name!r} is unknown. Fix: one of "
                      f"{', '.join(sorted(REGISTRY))}.")
    for name, allowed in CHOICES_STRATEGY.items():
        if name in cfg.strategy and cfg.strategy[name] not in allowed:
            errors.append(f"strategy.{name}={cfg.strategy[name]!r} is unknown. Fix: one of "
                          f"{', '.join(allowed)}.")
    return errors


def check_ranges(cfg) -> list:
    """Every number against its RULES entry, and names that must not be empty."""
    fields = {**RANGES, **{f"strategy.{name}": entry for name, entry in RANGES_STRATEGY.items()
                           if name in cfg.strategy}}
    errors = []
    for field, (rule, example) in fields.items():
        value = lookup(cfg, field)
        admits, words = RULES[rule]
        # a mapping (peak FLOP/s per dtype): each entry against the rule
        entries = ({f"{field}.{key}": item for key, item in value.items()} if OmegaConf.is_dict(value)
                   else {field: value})
        errors += [f"{name}={item} must be {words}. Fix: {name}={example}."
                   for name, item in entries.items() if item is not None and not admits(item)]
    for field, example in NOT_EMPTY.items():
        if not str(lookup(cfg, field)).strip():
            errors.append(f"{field} is empty. Fix: {field}={example}.")
    return errors


def check_schema_keys(cfg) -> list:
    """Keys a schema does not declare. Hydra rejects `strategy.micro_batches=4` for a strategy
    without micro-batches, and its message suggests `+strategy.micro_batches=4`, which would be
    accepted and then ignored: reject that here."""
    errors = [f"{key}={cfg[key]} is not a setting of this config (schema Config), so it would be "
              f"ignored. Fix: remove +{key}; `python train.py --cfg job` lists every setting."
              # a sweep point's config (layerwise/cluster/slurm.py) still holds Hydra's own node
              for key in sorted(set(cfg) - {f.name for f in dataclasses.fields(Config)} - {"hydra"})]
    for group in SCHEMA_GROUPS:
        schema = OmegaConf.get_type(cfg[group])
        if not dataclasses.is_dataclass(schema):
            continue
        owner = f"{group}={cfg[group].name}" if "name" in cfg[group] else group
        declared = {field.name for field in dataclasses.fields(schema)}
        for key in sorted(set(cfg[group]) - declared):
            errors.append(f"{group}.{key}={cfg[group][key]} is not a setting of {owner} (schema "
                          f"{schema.__name__}), so it would be ignored. Fix: remove {group}.{key}.")
    return errors


def check_model(cfg) -> list:
    model, data, errors = cfg.model, cfg.data, []
    if model.heads >= 1 and model.hidden % model.heads:
        closest = sorted(divisors(model.hidden), key=lambda h: abs(h - model.heads))[:2]
        errors.append(f"model.hidden={model.hidden} is not divisible by model.heads={model.heads}. "
                      f"Fix: model.heads={' or '.join(map(str, sorted(closest)))}.")
    kv_heads = model.kv_heads or model.heads
    if model.heads >= 1 and (kv_heads < 1 or model.heads % kv_heads):
        closest = sorted(divisors(model.heads), key=lambda k: abs(k - kv_heads))[:2]
        errors.append(f"model.kv_heads={model.kv_heads} does not divide model.heads={model.heads} "
                      f"(each kv head serves a group of query heads). Fix: model.kv_heads="
                      f"{' or '.join(map(str, sorted(closest)))}.")
    if model.architecture != "llama" and (model.kv_heads or model.ffn_hidden):
        errors.append(f"model.kv_heads / model.ffn_hidden are llama settings; model.architecture="
                      f"{model.architecture} ignores them. Fix: model.kv_heads=null model.ffn_hidden=null, "
                      f"or model.architecture=llama.")
    errors += moe_errors(cfg)
    if data.sequence_length > model.max_sequence_length:
        errors.append(sequence_length_problem(cfg))
    if model.planning_only and cfg.mode == "fit":
        errors.append(f"model={model.name} is a planning-only shape ({model.layers} layers × "
                      f"{model.hidden} wide): it cannot be trained on this machine. Fix: "
                      f"mode=check, or a trainable model such as model=gpt_small.")
    return errors


def moe_errors(cfg) -> list:
    """The mixture-of-experts fields (models/moe.py) against each other and the model: Llama blocks
    only, k ≤ E, MoE layer indices inside the model, and no fp16 loss scaling (the aux loss's gradient
    is attached with α·loss_scale and would miss the scaler's factor)."""
    model, errors = cfg.model, []
    experts, layers = model.get("experts") or 0, model.layers
    if experts <= 0:
        if model.get("moe_layers") is not None:
            errors.append(f"model.moe_layers={list(model.moe_layers)} is set but model.experts=0 (a dense "
                          f"model): it would be ignored. Fix: model.moe_layers=null, or model.experts=8.")
        return errors
    if model.architecture != "llama":
        errors.append(f"model.experts={experts}: mixture-of-experts blocks replace Llama's SwiGLU, and "
                      f"model.architecture={model.architecture} has none. Fix: model.architecture=llama "
                      f"(e.g. model=moe_tiny), or model.experts=0.")
    k = model.experts_per_token
    if k > experts:
        errors.append(f"model.experts_per_token={k} exceeds model.experts={experts} (each token picks k "
                      f"distinct experts). Fix: model.experts_per_token={min(2, experts)}.")
    outside = [index for index in (model.get("moe_layers") or []) if not 0 <= index < layers]
    if outside:
        errors.append(f"model.moe_layers holds {outside}, outside the model's blocks [0, {layers}). "
                      f"Fix: model.moe_layers={[index for index in model.moe_layers if 0 <= index < layers]} "
                      f"(or null: every block).")
    if model.get("moe_layers") is not None and len(set(model.moe_layers)) != len(model.moe_layers):
        errors.append(f"model.moe_layers={list(model.moe_layers)} names a block twice. "
                      f"Fix: model.moe_layers={sorted(set(model.moe_layers))}.")
    if cfg.hardware.precision in ("16-mixed", "16"):
        errors.append(f"hardware.precision={cfg.hardware.precision} with model.experts={experts}: fp16 loss "
                      f"scaling would not reach the auxiliary loss's gradient (models/moe.py attaches it "
                      f"unscaled). Fix: hardware.precision=bf16-mixed (or 32-true).")
    if cfg.mode != "plan":  # what a run cannot do yet; plan mode prices these layouts all the same
        errors += moe_strategy_errors(cfg.strategy, experts)
        if (cfg.strategy.get("context_parallel") or 1) > 1 and model.aux_loss_coefficient:
            errors.append(f"strategy.context_parallel={cfg.strategy.context_parallel} with "
                          f"model.aux_loss_coefficient={model.aux_loss_coefficient}: the balance loss is a mean "
                          f"over whole sequences, and a context rank holds chunks of each (its per-sequence counts "
                          f"would need a sum over the context group). Fix: model.aux_loss_coefficient=0 (with "
                          f"model.router=sigmoid_bias: DeepSeek-V3's balancing without the loss), or "
                          f"strategy.context_parallel=1.")
        if cfg.trainer.get("compile"):
            errors.append(f"trainer.compile=true with model.experts={experts}: routing has data-dependent "
                          f"sizes (tokens per expert), which a whole-block compile (fullgraph) cannot trace "
                          f"('GuardOnDataDependentSymNode'). Fix: trainer.compile=false.")
    return errors


def moe_strategy_errors(strategy, experts: int) -> list:
    """Strategies whose layer form has no MoE block yet: K-FAC (its factors come from nn.Linear hooks;
    the router runs as a float32 product and the experts are stacked weights), the 2-D/3-D tensor grids
    (they cut the block's input features; the MoE block expects whole rows), and sequence parallelism
    (its norms hand the MLP s/t tokens). tp_1d without it replicates the MoE block over the tensor ranks."""
    head, errors = f"model.experts={experts} with strategy={strategy.name}", []
    if strategy.name in ("kfac", "pipefisher"):
        errors.append(f"{head}: K-FAC has no curvature factors for the MoE router and stacked experts. "
                      f"Fix: strategy=ddp (or a pipeline such as strategy=modular_pipeline), or model.experts=0.")
    if strategy.name in ("tp_2d", "three_d") or strategy.get("tensor_parallel") in ("2d", "3d"):
        errors.append(f"{head}: the 2-D/3-D tensor grids cut a block's input features, and an MoE block "
                      f"routes whole rows. Fix: strategy=tp_1d, or strategy.tensor_parallel=1d (or none).")
    if strategy.get("sequence_parallel"):
        errors.append(f"{head}: sequence parallelism hands the MLP 1/t of the tokens, which the MoE block "
                      f"does not gather. Fix: strategy.sequence_parallel=false.")
    return errors


def sequence_length_problem(cfg) -> str:
    """data.sequence_length past the model's positions. model=hf sets model.max_sequence_length from
    its config.json (layerwise/run/rules.py fill_hf_model), so raising it there changes nothing:
    the fix names the field of that file (GPT-2: n_positions, the others: max_position_embeddings)."""
    model, length = cfg.model, cfg.data.sequence_length
    if not model.get("path"):
        return (f"data.sequence_length={length} exceeds the model's model.max_sequence_length="
                f"{model.max_sequence_length}. Fix: lower data.sequence_length or raise model.max_sequence_length.")
    field = "n_positions" if model.architecture == "gpt" else "max_position_embeddings"
    config = Path(str(model.path)).expanduser() / "config.json"
    return (f"data.sequence_length={length} exceeds the {field}={model.max_sequence_length} in {config}, "
            f"the positions model=hf's model was built for (model.max_sequence_length is read from that file, "
            f"so setting it changes nothing). Fix: data.sequence_length={model.max_sequence_length} or lower, "
            f"or a model whose config.json allows {length} positions.")


def check_encoding(cfg) -> list:
    """data.encoding names a codec Python knows (layerwise/run/text.py decodes with it)."""
    try:
        codecs.lookup(cfg.data.encoding)
    except LookupError:
        return [f"data.encoding={cfg.data.encoding!r} is not an encoding Python knows. Fix: data.encoding=utf-8 "
                f"(the default), or latin-1 for Latin-1 text (any name of Python's codecs module)."]
    return []


def check_vocabulary(cfg) -> list:
    """The ids the data gives fit the model's embedding, before any rank starts: data=text's tokenizer
    (its largest id, EOS and BOS; models/hf.py tokenizer_facts), data=token_bin's data.vocab_size, the
    256 bytes of stdlib/text_files, each against the model's vocabulary (model.vocab_size, or for
    model=hf its config.json's; null: the corpus's own, which fits unless the tokenizer's ids leave
    holes). An id past it fails the first step in every rank (IndexError: index out of range in
    self; a device-side assert on a GPU)."""
    data, model = cfg.data, cfg.model
    hf = bool(model.get("path"))
    if data.corpus == "text":
        tokenizer = data.get("tokenizer")
        if not tokenizer or not (Path(str(tokenizer)).expanduser() / "tokenizer.json").is_file():
            return []  # layerwise/run/rules.py check_data names what is missing
        from models.hf import tokenizer_facts
        facts = tokenizer_facts(tokenizer)
        vocabulary = model.get("vocab_size") or facts["count"]
        specials = [f"{kind.upper()} {facts[kind]}" for kind in ("eos", "bos") if facts[kind] is not None]
        beyond = [name for name in specials if int(name.split()[1]) >= vocabulary]
        if facts["size"] <= vocabulary and not beyond:
            return []
        given = (f"data.tokenizer={tokenizer} gives token ids 0..{facts['size'] - 1} ({', '.join(specials) or 'no EOS/BOS'}; "
                 f"{facts['vocabulary']:,} tokens + {facts['added']:,} added)")
    elif data.corpus == "token_bin" and not hf:  # model=hf: fill_hf_model compares them
        vocabulary, facts, given = model.get("vocab_size"), {"size": data.vocab_size},             f"data=token_bin gives token ids 0..{data.vocab_size - 1} (data.vocab_size={data.vocab_size})"
    elif not hf:
        vocabulary, facts, given = model.get("vocab_size"), {"size": 256}, f"data={data.name} gives byte ids 0..255"
    else:
        return []
    if not vocabulary or facts["size"] <= vocabulary and data.corpus != "text":
        return []
    wrong = "an id" if facts["size"] > vocabulary else "its " + " and ".join(beyond)
    if hf:
        config = Path(str(model.path)).expanduser() / "config.json"
        return [f"{given} but the model's vocabulary is {vocabulary} (vocab_size in {config}): {wrong} >= {vocabulary} "
                f"would index past its token embedding, failing the first step in every rank (IndexError: index out "
                f"of range in self). Fix: data.tokenizer={model.path} (the model's own tokenizer), or a model "
                f"whose vocab_size is at least {facts['size']}."]
    where = "model.vocab_size" if model.get("vocab_size") else "the tokenizer's count of ids, model.vocab_size=null"
    return [f"{given} but {where}={vocabulary}: {wrong} >= {vocabulary} would index past the model's token "
            f"embedding, failing the first step in every rank (IndexError: index out of range in self). Fix: "
            f"model.vocab_size={facts['size']}"
            + (" (or null: the corpus's own size)" if data.corpus != "text" or facts["size"] == facts["count"] else "")
            + (f", or a tokenizer of at most {vocabulary} ids in data.tokenizer." if data.corpus == "text" else ".")]


def approximate_parameters(model) -> int:
    """12·L·h² for the blocks (attention 4h², MLP 2·r·h²) plus embeddings: a lower bound for a
    memory limit (the exact count is cost/traffic.py's model_parameters; the messages quote this)."""
    blocks = model.layers * (4 + 2 * model.mlp_ratio) * model.hidden ** 2
    return blocks + (256 + model.max_sequence_length) * model.hidden


def check_hardware(cfg) -> list:
    hardware, errors = cfg.hardware, []
    # fp8-mixed on CPU: float8_errors says why (no FP8 products) and names the emulation
    if hardware.accelerator == "cpu" and hardware.precision not in (*CPU_PRECISIONS, FP8_PRECISION):
        errors.append(f"hardware.precision={hardware.precision!r} is not supported on CPU. "
                      f"Fix: hardware.precision=32-true (or bf16-mixed).")
    if hardware.accelerator == "cpu" and hardware.process_group_backend != "gloo":
        errors.append("hardware.process_group_backend must be gloo on CPU. Fix: "
                      "hardware.process_group_backend=gloo.")
    return errors


def memory_errors(cfg, world: int) -> list:
    """A lower bound no strategy beats, in every mode (check too): the fp32 weights, gradients and
    optimizer state, sharded evenly over all ranks (ZeRO-3) with host memory counted (L2L), must fit
    each rank's share of its node. mode=plan is left to plan mode's full memory model, which says
    how far over it is and where."""
    if cfg.mode == "plan":
        return []
    bound = memory_lower_bound(cfg, world)
    if bound is None or bound["needed_per_rank_bytes"] <= bound["available_per_rank_bytes"]:
        return []
    hardware, gpu = cfg.hardware, cfg.hardware.accelerator == "gpu"
    node_memory, ranks_per_node = bound["node_memory_bytes"], bound["ranks_per_node"]
    per_rank, parameters, total = bound["available_per_rank_bytes"], bound["parameters"], bound["total_bytes"]
    share = (f"hardware.device_memory_bytes={hardware.device_memory_bytes / 1e9:.1f} GB plus a 1/"
             f"{ranks_per_node} share of " if gpu else "")
    nodes = math.ceil(total / node_memory)
    return [f"model={cfg.model.name} has about {parameters / 1e9:.1f} billion parameters: their fp32 weights, "
            f"gradients and {cfg.optimizer.name} state take {total / 1e9:.1f} GB, at least "
            f"{total / world / 1e9:.1f} GB per rank even if sharded evenly over all {world} rank(s), "
            f"more than {share}hardware.host_memory_bytes={hardware.host_memory_bytes / 1e9:.1f} GB "
            f"per node allows each of its {ranks_per_node} rank(s) ({per_rank / 1e9:.1f} GB). Fix: "
            f"hardware.nodes={nodes} or more with a sharding strategy (strategy=zero_layered), a "
            f"hardware profile with more memory, or a smaller model."]


def memory_lower_bound(cfg, world: int):
    """memory_errors' numbers (mode=check prints and keeps them): the fp32 weights, gradients and
    optimizer state (`total_bytes`), their even share over `world` ranks (`needed_per_rank_bytes`) and
    what each rank has (`available_per_rank_bytes`: its share of its node's host memory, plus its
    device on a GPU); None for a profile without memory figures or an unknown optimizer."""
    hardware = cfg.hardware
    gpu = hardware.accelerator == "gpu"
    node_memory = hardware.host_memory_bytes + (hardware.devices_per_node * hardware.device_memory_bytes
                                                if gpu else 0)
    if not node_memory or cfg.optimizer.name not in OPTIMIZER_STATE:
        return None  # a profile without memory figures, or an unknown optimizer (reported already)
    ranks_per_node = 1 if strategy_entry(cfg.strategy.name).one_process else hardware.devices_per_node
    parameters = approximate_parameters(cfg.model)
    total = parameters * (WEIGHT_AND_GRADIENT_BYTES + 4 * OPTIMIZER_STATE[cfg.optimizer.name])
    return {"parameters": parameters, "total_bytes": total, "needed_per_rank_bytes": total / world,
            "available_per_rank_bytes": hardware.host_memory_bytes / ranks_per_node
            + (hardware.device_memory_bytes if gpu else 0),
            "node_memory_bytes": node_memory, "ranks_per_node": ranks_per_node}


def micro_batches(strategy) -> int:
    """Micro-batches per optimizer step. The one generic reader of a field not every schema has:
    a strategy without `micro_batches` (single, ddp, tensor parallel) runs its batch in one pass."""
    return strategy.micro_batches if "micro_batches" in strategy else 1


def dynamic_depth_errors(cfg) -> list:
    """LayerDrop and progressive stacking (schema DynamicDepthConfig; docs/strategies/l2l.md)."""
    strategy, errors = cfg.strategy, []
    if "grow_at" not in strategy:
        return errors
    if strategy.layer_drop > 0 and cfg.model.layers <= 2 and not strategy.grow_at:
        errors.append(f"strategy.layer_drop={strategy.layer_drop} with model.layers={cfg.model.layers} drops "
                      f"nothing: the first and last blocks are always kept (Fan et al. 2019). Fix: model.layers=4 "
                      f"or more, or strategy.layer_drop=0.")
    if not strategy.grow_at:
        return errors
    steps = list(strategy.grow_at)
    if strategy.grow_by == 0 and cfg.trainer.max_steps and len(steps) > 8:
        errors.append(f"strategy.grow_at={steps} with strategy.grow_by=0 doubles the depth {len(steps)} times "
                      f"(model.layers × {2 ** len(steps)}). Fix: fewer grow_at steps, or strategy.grow_by=k.")
    if steps != sorted(set(steps)) or steps[0] < 1:  # steps past trainer.max_steps: a later resume's
        errors.append(f"strategy.grow_at={steps} must be increasing steps, each at least 1 (step 0's depth "
                      f"is model.layers). Fix: e.g. strategy.grow_at=[{max(1, cfg.trainer.max_steps // 2)}].")
    if strategy.name == "ddp":
        errors.append(f"strategy.grow_at={steps}: DDP registers its parameters once, when it wraps the model, "
                      f"so a grown block would never be all-reduced. Fix: strategy=l2l (data parallel too), "
                      f"or strategy=single.")
    if strategy.get("activation_recompute", "none") != "none":
        errors.append(f"strategy.grow_at={steps} with strategy.activation_recompute={strategy.activation_recompute}: "
                      f"the grown blocks would not be recomputed. Fix: strategy.activation_recompute=none.")
    return errors


def profile_errors(trainer_config) -> list:
    """trainer.profile_steps (layerwise/run/profile.py) names 1-based optimizer steps of this run;
    any other would never be profiled."""
    steps, last = list(trainer_config.get("profile_steps") or []), trainer_config.max_steps
    wrong = [step for step in steps if not isinstance(step, int) or not 1 <= step <= last]
    if not wrong:
        return []
    return [f"trainer.profile_steps={steps}: {wrong} are not optimizer steps of this run (1 … trainer.max_steps="
            f"{last}), so they would never be profiled. Fix: trainer.profile_steps=[{min(2, last)}]."]


PACKING_STRATEGIES = ("single", "ddp", "modular_pipeline", "gpipe", "one_f_one_b", "interleaved_1f1b")


def packing_errors(cfg) -> list:
    """data.packing (docs/packing.md): the documents reach the blocks through a per-micro-batch context
    (LanguageModel.set_documents) that the strategies above set and test (a recomputed block reruns with
    the documents its forward read: strategies/recompute.py), and a masked (BERT) model has no EOS rows."""
    if not cfg.data.get("packing", False):
        return []
    errors = []
    if cfg.strategy.name not in PACKING_STRATEGIES:
        errors.append(f"data.packing=true is not supported by strategy={cfg.strategy.name} (the packed documents "
                      f"reach the blocks of {', '.join(PACKING_STRATEGIES)} only). Fix: one of those strategies, "
                      f"or data.packing=false.")
    if cfg.model.architecture == "bert" or cfg.data.corpus != "text":
        errors.append(f"data.packing=true needs EOS-ended documents and a causal model (data.corpus="
                      f"{cfg.data.corpus}, model.architecture={cfg.model.architecture}). Fix: data=text with "
                      f"model=gpt or llama, or data.packing=false.")
    return errors


def check_strategy(cfg, world: int) -> list:
    if cfg.strategy.name not in REGISTRY:
        return []
    entry = strategy_entry(cfg.strategy.name)
    errors = (entry.check(cfg, world) + gradient_clipping_errors(cfg.strategy.name, cfg.trainer.gradient_clip_val)
              + fp16_errors(cfg.strategy.name, cfg.hardware.precision) + float8_errors(cfg) + dynamic_depth_errors(cfg)
              + profile_errors(cfg.trainer) + packing_errors(cfg))
    if errors:
        return errors
    data_degree, micro = layout_of(cfg, world).data, micro_batches(cfg.strategy)
    batch = cfg.data.global_batch_size
    if batch % (data_degree * micro):
        errors.append(f"data.global_batch_size={batch} does not split into {data_degree} data-parallel "
                      f"ranks × {micro} micro-batches. Fix: data.global_batch_size="
                      f"{nearest_multiples(batch, data_degree * micro)}.")
    return errors


# ----- Hydra's own errors: raised while composing, before train.py's main runs ---------------------

TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
              dict: "a mapping such as {key:value}", list: "a list such as [a,b]"}


def composition_problem(error) -> str:
    """One problem naming the field and the fix for an error Hydra or OmegaConf raised while
    composing (train.py reports it like a ConfigError): an option a group lacks, a key a schema
    lacks, a value of the wrong type, an override it cannot parse."""
    cause = error.__cause__
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        close = difflib.get_close_matches(option, error.options, n=1)
        fix = (f"{group}={close[0]} (options: {', '.join(error.options)})" if close
               else f"{group}=<one of {', '.join(error.options)}>")
        return f"{group}={option} is not an option of conf/{group}/. Fix: {fix}."
    if isinstance(error, OverrideParseException):
        return (f"{error.override}: Hydra cannot parse this override ({error.message.splitlines()[0]}). "
                f"Fix: write key=value; quote values holding spaces or brackets, e.g. 'key=\"a b\"'.")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return unknown_key_problem(str(error), cause)
    if isinstance(cause, ValidationError) and cause.full_key:
        return wrong_type_problem(str(error), cause)
    in_file = re.match(r"In '([^']+)/([^']+)': ConfigKeyError.*?Key '([^']+)' not in '([^']+)'", str(error), re.S)
    if in_file:
        return unknown_key_in_file_problem(*in_file.groups())
    return (f"{str(error).splitlines()[0]}. Fix: `python train.py --cfg job` shows every setting "
            f"and its value; `python train.py --help` lists every option.")


def unknown_key_problem(message: str, cause) -> str:
    """`model.layer=4`: the schema has no such key. Hydra's text suggests appending it with `+`,
    which validation would then refuse: offer the key meant, or the keys there are."""
    value = re.search(r"use \+\S+?=(\S*)", message)
    value = value.group(1) if value else "..."
    group, _, key = cause.full_key.rpartition(".")
    prefix = f"{group}." if group else ""
    declared = ([str(name) for name in cause.parent_node if name != "hydra"]
                if cause.parent_node is not None else [])
    close = difflib.get_close_matches(str(cause.key), declared, n=1)
    owner = f"schema {cause.object_type.__name__}" if cause.object_type else "the config"
    if "name" in declared and group in SCHEMA_GROUPS:
        owner = f"{group}={cause.parent_node.name} ({owner})"
    if group == "strategy" and str(cause.key) in DYNAMIC_DEPTH:
        return (f"Could not override '{cause.full_key}': {owner} cannot vary its depth per step: its blocks "
                f"are cut into pipeline stages or split over a tensor grid once, before training, and a "
                f"dropped or added block would unbalance them. Fix: strategy=l2l (or single, ddp) with "
                f"{cause.full_key}={value}, or remove it.")
    if group == "strategy" and str(cause.key) == "distributed_optimizer" and "name" in declared:
        from strategies.distributed_optimizer import not_composed  # its reasons live with the technique
        return f"Could not override '{cause.full_key}': {not_composed(cause.parent_node.name)}"
    fix = (f"{prefix}{close[0]}={value}" if close
           else f"remove {cause.full_key}={value} (the settings here: {', '.join(declared)})")
    return f"Could not override '{cause.full_key}': {owner} has no such setting. Fix: {fix}."


def unknown_key_in_file_problem(group: str, option: str, key: str, schema: str) -> str:
    """A key the group's schema lacks, set in an option's YAML file rather than on the command line
    (Hydra's text names neither as a fix): a hand-written typo, or a profile `mode=calibrate` wrote
    with another version of layerwise."""
    declared_by = getattr(schema_module, schema, None)  # the strategies' schemas are not there: no close match
    declared = [field.name for field in dataclasses.fields(declared_by)] if dataclasses.is_dataclass(declared_by) else []
    close = difflib.get_close_matches(key, declared, n=1)
    fix = f"rename it to {close[0]}" if close else "remove that line"
    return (f"{group}={option}: its file sets '{key}', which schema {schema} has no setting for. Fix: {fix} in "
            f"the {group} file {option}.yaml; if `python train.py mode=calibrate` wrote that file under another "
            f"version of layerwise, run it again instead.")


def wrong_type_problem(message: str, cause) -> str:
    """`model.layers=abc`, `model.layers=null`: the schema's type refuses it; offer a value of the
    right type (the current one)."""
    override = re.search(r"override (\S+)", message)
    current = None
    try:
        current = cause.parent_node[cause.key] if cause.parent_node is not None else None
    except Exception:  # the node itself may be what failed to convert
        pass
    if OmegaConf.is_config(current):
        current = OmegaConf.to_container(current)
    if isinstance(current, dict):  # an entry a resolver computes (cpu.yaml's peaks) is typed, not shown
        current = {k: "<value>" if str(v).startswith("${") else v for k, v in current.items()}
    words = TYPE_WORDS.get(type(current), "a value of the schema's type")
    example = ("{" + ",".join(f"{k}:{v}" for k, v in current.items()) + "}" if isinstance(current, dict)
               else str(current).lower() if isinstance(current, bool) else current)
    return (f"{override.group(1) if override else cause.full_key}: {str(cause).splitlines()[0]}. "
            f"Fix: {words}, e.g. {cause.full_key}={example}.")
