"""Every kind of bad input a user can type is refused before any process starts, naming the field
and the fix. docs/reliability.md's table is generated from BAD_INPUTS (scripts/bad_inputs_table.py)
and a test here keeps it equal to the messages the code gives today.
"""

import json
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from layerwise.config.errors import ConfigError
from layerwise.config.validate import composition_problem
from layerwise.preflight import validate
from tests.ranks import compose_config
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent

# Paths a data.path may point at, made fresh under a temporary directory: {name} in an override.
PLACES = {"empty": "an empty directory", "file": "a file", "odd_bin": "a directory whose train.bin has 3 bytes",
          "stale": "a config directory whose hardware/stale.yaml sets gather_overlapp",
          "text": "a directory of text", "tokenizer_300": "a tokenizer of 300 ids, EOS 299, BOS 298",
          "hf_64": "a Hugging Face Llama directory: vocab_size 256, max_position_embeddings 64"}

# (overrides, the field the message must name, a phrase of the message). Composition errors (wrong
# type, unknown key or option, unparsable) are Hydra's, reported as train.py reports them.
BAD_INPUTS = [
    # ----- Hydra: types, unknown keys and options, syntax
    ("model.layers=abc", "model.layers", "Value 'abc' of type 'str' could not be converted to Integer"),
    ("model.dropout=high", "model.dropout", "Fix: a number, e.g. model.dropout="),
    ("model.tie_embeddings=maybe", "model.tie_embeddings", "Fix: true or false"),
    ("model.layers=null", "model.layers", "is not Optional"),
    ("seed=abc", "seed", "Fix: an integer, e.g. seed=1234"),
    ("hardware.peak_flops=3", "hardware.peak_flops", "Fix: a mapping"),
    ("strategy=ddp strategy.micro_batches=4", "strategy.micro_batches",
     "Could not override 'strategy.micro_batches': strategy=ddp (schema DataParallelStrategyConfig) has no such setting"),
    ("model.nonexistent=1", "model.nonexistent", "Fix: remove model.nonexistent=1"),
    ("trainer.max_step=3", "trainer.max_step", "Fix: trainer.max_steps=3"),
    ("foo=1", "foo", "Could not override 'foo'"),
    ("+foo=1", "foo", "foo=1 is not a setting of this config"),
    ("+model.foo=1", "model.foo", "model.foo=1 is not a setting of model=gpt_tiny"),
    ("strategy=nonexistent", "strategy", "strategy=nonexistent is not an option of conf/strategy/"),
    ("optimizer=adam", "optimizer", "Fix: optimizer=adamw"),
    ("model.layers=[", "model.layers", "Hydra cannot parse this override"),
    # ----- numbers out of range
    ("optimizer.lr=-1", "optimizer.lr", "optimizer.lr=-1.0 must be > 0. Fix: optimizer.lr=3e-4."),
    ("optimizer.lr=0", "optimizer.lr", "optimizer.lr=0.0 must be > 0"),
    ("model.dropout=1.5", "model.dropout", "model.dropout=1.5 must be in [0, 1)"),
    ("model.dropout=-0.1", "model.dropout", "model.dropout=-0.1 must be in [0, 1)"),
    ("seed=-1", "seed", "seed=-1 must be in [0, 4294967295]"),
    ("seed=4294967296", "seed", "Fix: seed=1234"),
    ("model.layers=0", "model.layers", "model.layers=0 must be at least 1"),
    ("model.hidden=-64", "model.hidden", "model.hidden=-64 must be at least 1"),
    ("model.heads=0", "model.heads", "model.heads=0 must be at least 1"),
    ("model.mlp_ratio=0", "model.mlp_ratio", "model.mlp_ratio=0 must be at least 1"),
    ("model.max_sequence_length=0", "model.max_sequence_length", "must be at least 1"),
    ("data.global_batch_size=0", "data.global_batch_size", "data.global_batch_size=0 must be at least 1"),
    ("data.sequence_length=0", "data.sequence_length", "data.sequence_length=0 must be at least 1"),
    ("data.vocab_size=0", "data.vocab_size", "data.vocab_size=0 must be at least 1"),
    ("data.max_bytes=0", "data.max_bytes", "data.max_bytes=0 must be at least 1"),
    ("data.validation_fraction=0", "data.validation_fraction", "must be strictly between 0 and 1"),
    ("data.validation_fraction=1.5", "data.validation_fraction", "must be strictly between 0 and 1"),
    ("hardware.devices_per_node=0", "hardware.devices_per_node", "must be at least 1"),
    ("hardware.nodes=0", "hardware.nodes", "hardware.nodes=0 must be at least 1"),
    ("hardware.device_memory_bytes=-1", "hardware.device_memory_bytes", "must be >= 0"),
    ("hardware.host_memory_bytes=-1", "hardware.host_memory_bytes", "must be >= 0"),
    ("hardware.peak_flops.fp32=-5e10", "hardware.peak_flops.fp32", "hardware.peak_flops.fp32=-50000000000.0 must be >= 0"),
    ("hardware.inter_node_bandwidth=-1", "hardware.inter_node_bandwidth", "must be >= 0"),
    ("plan.efficiency=0", "plan.efficiency", "plan.efficiency=0.0 must be in (0, 1]"),
    ("hardware.relative_matmul_efficiency=0", "hardware.relative_matmul_efficiency", "must be > 0"),
    ("plan.allocator_margin=1", "plan.allocator_margin", "must be in [0, 1)"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay", "must be >= 0"),
    ("optimizer.beta1=1.5", "optimizer.beta1", "optimizer.beta1=1.5 must be in [0, 1)"),
    ("optimizer.beta2=-0.1", "optimizer.beta2", "optimizer.beta2=-0.1 must be in [0, 1)"),
    ("optimizer.eps=0", "optimizer.eps", "optimizer.eps=0.0 must be > 0"),
    ("optimizer=sgd optimizer.momentum=1", "optimizer.momentum", "optimizer.momentum=1.0 must be in [0, 1)"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps", "must be >= 0"),
    ("optimizer.min_lr_ratio=2", "optimizer.min_lr_ratio", "optimizer.min_lr_ratio=2.0 must be in [0, 1]"),
    ("trainer.max_steps=0", "trainer.max_steps", "trainer.max_steps=0 must be at least 1"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval", "must be at least 1"),
    ("trainer.limit_val_batches=-1", "trainer.limit_val_batches", "must be >= 0"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps", "must be at least 1"),
    ("trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_steps", "must be at least 1"),
    ("strategy=ddp trainer.gradient_clip_val=-1", "trainer.gradient_clip_val", "must be >= 0"),
    ("trainer.measure_every_n_steps=0", "trainer.measure_every_n_steps", "must be at least 1"),
    ("trainer.collective_timeout_s=-5", "trainer.collective_timeout_s", "must be >= 0"),
    ("trainer.long_timeout_factor=0.5", "trainer.long_timeout_factor", "must be at least 1"),
    ("trainer.straggler_window=-1", "trainer.straggler_window", "must be >= 0"),
    ("hardware.collective_timeout_s=0", "hardware.collective_timeout_s", "must be > 0"),
    # ----- strategy knobs
    ("strategy.micro_batches=0", "strategy.micro_batches", "strategy.micro_batches=0 must be at least 1"),
    ("strategy.pipeline_degree=0", "strategy.pipeline_degree", "must be at least 1"),
    ("strategy.layers_per_stage=0", "strategy.layers_per_stage", "must be at least 1"),
    ("strategy=zero_layered strategy.data_degree=0", "strategy.data_degree", "must be at least 1"),
    ("strategy.breadth_first_micro_batches=0", "strategy.breadth_first_micro_batches", "must be at least 1"),
    ("strategy.tensor_grid=0", "strategy.tensor_grid", "strategy.tensor_grid=0 must be at least 1"),
    ("strategy.schedule=pipedream", "strategy.schedule", "strategy.schedule='pipedream' is unknown"),
    ("strategy=ddp strategy.bucket_mb=-1", "strategy.bucket_mb", "strategy.bucket_mb=-1.0 must be >= 0"),
    ("strategy=kfac strategy.damping=0", "strategy.damping", "strategy.damping=0.0 must be > 0"),
    ("strategy=kfac strategy.refresh_interval=0", "strategy.refresh_interval", "must be at least 1"),
    ("strategy=pipefisher strategy.bubble_margin=1", "strategy.bubble_margin", "must be in [0, 1)"),
    ("strategy.activation_recompute=partial", "strategy.activation_recompute", "is unknown"),
    ("strategy.tensor_parallel=4d", "strategy.tensor_parallel", "need one of none, 1d, 2d, 3d"),
    ("strategy.name=pipedream", "strategy", "strategy='pipedream' is unknown"),
    # ----- choices
    ("mode=train", "mode", "mode='train' is unknown. Fix: one of fit, check"),
    ("mode=reproduce reproduce.claim=gpipe", "reproduce.claim",
     "reproduce.claim='gpipe' is unknown. Fix: one of training_time, pipefisher, l2l, three_d"),
    ("mode=reproduce reproduce.scale=medium", "reproduce.scale", "Fix: one of paper, small"),
    ("mode=plan strategy=kfac", "strategy", "not kfac yet. Fix: strategy=zero_layered plans ZeRO-3"),
    ("mode=plan strategy=l2l hardware.host_device_bandwidth=0", "hardware.host_device_bandwidth",
     "L2L's relay cannot be priced. Fix: hardware.host_device_bandwidth=1.6e10"),
    ("model.architecture=t5", "model.architecture", "is unknown. Fix: one of gpt, bert"),
    ("data.corpus=web", "data.corpus", "data.corpus='web' is unknown"),
    ("hardware.accelerator=tpu", "hardware.accelerator", "hardware.accelerator='tpu' is unknown"),
    ("hardware.precision=fp32", "hardware.precision", "hardware.precision='fp32' is unknown"),
    ("hardware.process_group_backend=mpi", "hardware.process_group_backend", "is unknown"),
    ("optimizer.name=adagrad", "optimizer.name", "optimizer.name='adagrad' is unknown"),
    ("optimizer.lr_schedule=linear", "optimizer.lr_schedule", "is unknown. Fix: one of cosine, constant"),
    ("logger.name=mlflow", "logger.name", "logger.name='mlflow' is unknown"),
    ("logger.mode=cloud", "logger.mode", "logger.mode='cloud' is unknown"),
    ("trainer.progress=verbose", "trainer.progress", "trainer.progress='verbose' is unknown"),
    # ----- names that must not be empty
    ("run_name=", "run_name", "run_name is empty. Fix: run_name=my-run."),
    ("logger.project=", "logger.project", "logger.project is empty"),
    # ----- files
    ("data=token_bin", "data.path", "data.path is not set"),
    ("data=token_bin data.path=/nonexistent/tokens", "data.path", "does not exist"),
    ("data=token_bin data.path={empty}", "data.path", "has no train.bin"),
    ("data=token_bin data.path={file}", "data.path", "is a file, not a directory"),
    ("data=token_bin data.path={odd_bin}", "data.path", "train.bin holds 3 bytes"),
    ("data=text_files data.path={empty}", "data.path", "holds no non-empty files"),
    ("data=text data.path={text} data.tokenizer={file}", "data.tokenizer", "holds no tokenizer.json"),
    ("data=text_files data.path={text} data.encoding=utf-9", "data.encoding", "data.encoding='utf-9' is not an encoding"),
    ("resume_from=/nonexistent/run/checkpoints/last", "resume_from", "does not exist"),
    ("resume_from={empty}", "resume_from", "is not a portable checkpoint"),
    # ----- across groups
    ("model=gpt3_175b mode=check", "hardware.host_memory_bytes", "at least 1391.8 GB per rank"),
    ("model=gpt3_175b mode=check hardware=dgx_a100_80g hardware.nodes=64 strategy.pipeline_degree=16 "
     "strategy.layers_per_stage=6 strategy.tensor_parallel=1d strategy.tensor_grid=8 strategy.micro_batches=64 "
     "data.global_batch_size=1536 data.sequence_length=2048", "hardware.device_memory_bytes",
     "the plan of this layout does not fit"),
    ("model.layers=400 model.hidden=4096 model.heads=32", "hardware.host_memory_bytes", "more than hardware.host_memory_bytes"),
    ("model=gpt3_175b", "model=gpt3_175b", "planning-only shape"),
    ("model.hidden=100 model.heads=3", "model.heads", "model.hidden=100 is not divisible by model.heads=3"),
    ("model=llama_tiny model.kv_heads=3", "model.kv_heads", "model.kv_heads=3 does not divide model.heads=4"),
    ("model=llama_tiny strategy=tp_1d strategy.tensor_grid=4 hardware.devices_per_node=4", "model.kv_heads",
     "model.kv_heads=2 is not divisible by strategy.tensor_grid=4"),
    ("data.sequence_length=512", "data.sequence_length", "data.sequence_length=512 exceeds"),
    # issue 55 item 8: model=hf's bound is its config.json's, not model.max_sequence_length (which it sets)
    ("model=hf model.path={hf_64} data.sequence_length=128", "data.sequence_length",
     "max_position_embeddings=64 in"),
    # issue 55 item 5: the tokenizer's ids, its EOS/BOS and the model's vocabulary agree before launch
    ("data=text data.path={text} data.tokenizer={tokenizer_300} model.vocab_size=256", "model.vocab_size",
     "gives token ids 0..299 (EOS 299, BOS 298; 300 tokens + 0 added) but model.vocab_size=256"),
    ("model=hf model.path={hf_64} data=text data.path={text} data.tokenizer={tokenizer_300} data.sequence_length=32",
     "data.tokenizer", "but the model's vocabulary is 256 (vocab_size in"),
    ("data=token_bin data.path={odd_bin} model.vocab_size=256", "model.vocab_size",
     "data=token_bin gives token ids 0..50303 (data.vocab_size=50304) but model.vocab_size=256"),
    ("strategy=ddp data.global_batch_size=3", "data.global_batch_size", "does not split into 2 data-parallel"),
    ("model.layers=3", "model.layers", "not a multiple of strategy.pipeline_degree=2"),
    ("model.tie_embeddings=true", "model.tie_embeddings", "puts one weight on the first and the last stage"),
    ("hardware.precision=16-mixed", "hardware.precision", "is not supported on CPU"),
    ("hardware.process_group_backend=nccl", "hardware.process_group_backend", "must be gloo on CPU"),
    ("hardware=dgx_a100_80g", "hardware=dgx_a100_80g", "needs CUDA GPUs and this machine has none"),
    ("trainer.gradient_clip_val=1.0", "trainer.gradient_clip_val", "runs its own optimizer step"),
    # ----- dynamic depth (issue 34): LayerDrop and progressive stacking
    ("strategy=gpipe strategy.layer_drop=0.2", "strategy.layer_drop", "cannot vary its depth per step"),
    ("strategy=l2l strategy.layer_drop=1", "strategy.layer_drop", "strategy.layer_drop=1.0 must be in [0, 1)"),
    ("strategy=single model.layers=2 strategy.layer_drop=0.1", "strategy.layer_drop", "drops nothing: the first and last blocks"),
    ("strategy=ddp strategy.grow_at=[2]", "strategy.grow_at", "DDP registers its parameters once"),
    ("strategy=single strategy.grow_at=[3,2]", "strategy.grow_at", "must be increasing steps"),
    # ----- context parallelism (issue 57): strategy.context_parallel (c) and strategy.context_parallel_comm
    ("strategy=ddp strategy.context_parallel=3", "strategy.context_parallel",
     "strategy.context_parallel=3 × 1 pipeline × tensor ranks does not divide the world size 2"),
    ("strategy=ddp strategy.context_parallel=2 data.sequence_length=30", "data.sequence_length",
     "data.sequence_length=30 does not split into 2 × strategy.context_parallel=2 chunks"),
    ("strategy=ddp strategy.context_parallel_comm=p2p", "strategy.context_parallel_comm",
     "strategy.context_parallel_comm=p2p: need ring"),
    ("strategy=ddp strategy.context_parallel=2 model=bert_tiny", "model.architecture",
     "strategy.context_parallel=2 with model.architecture=bert: a masked-LM row scores only its masked positions"),
    ("strategy=ddp strategy.context_parallel=2 strategy.activation_recompute=selective", "strategy.activation_recompute",
     "selective reruns the core attention, which under context parallelism is the key/value exchange itself"),
    ("strategy=tp_2d strategy.context_parallel=2 hardware.devices_per_node=8", "strategy.context_parallel",
     "strategy.context_parallel=2 with strategy=tp_2d (2d)"),
    ("strategy=one_f_one_b strategy.schedule=zero_bubble_h1 strategy.context_parallel=2 hardware.devices_per_node=4",
     "strategy.schedule", "strategy.context_parallel=2 with strategy.schedule=zero_bubble_h1"),
    ("strategy=modular_pipeline strategy.context_parallel=2 strategy.data_degree=2 hardware.devices_per_node=4",
     "strategy.data_degree", "strategy.data_degree=2 but world 4 / (pipeline 2 × tensor 1 × context 2) = 1"),
    # ----- expert parallelism (issue 58): strategy.expert_parallel (e)
    ("strategy=ddp strategy.expert_parallel=2", "strategy.expert_parallel",
     "strategy.expert_parallel=2 splits the experts of a mixture of experts, and model=gpt_tiny has none"),
    ("strategy=ddp strategy.expert_parallel=0 model=llama_tiny model.experts=4", "strategy.expert_parallel",
     "strategy.expert_parallel=0: need e >= 1"),
    ("strategy=ddp strategy.expert_parallel=3 model=llama_tiny model.experts=6 hardware.devices_per_node=4",
     "strategy.expert_parallel", "strategy.expert_parallel=3 must divide the 4 data-parallel ranks"),
    ("strategy=ddp strategy.expert_parallel=2 model=llama_tiny model.experts=3", "strategy.expert_parallel",
     "strategy.expert_parallel=2 must divide model.experts=3"),
    ("strategy=ddp strategy.expert_parallel=2 strategy.context_parallel=2 model=llama_tiny model.experts=4 "
     "hardware.devices_per_node=8", "strategy.context_parallel",
     "strategy.expert_parallel=2 with strategy.context_parallel=2 is refused"),
    ("strategy=ddp strategy.expert_parallel=2 trainer.gradient_clip_val=1.0 model=llama_tiny model.experts=4",
     "trainer.gradient_clip_val", "strategy.expert_parallel=2 with trainer.gradient_clip_val=1.0"),
    ("strategy=modular_pipeline strategy.expert_parallel=2 strategy.tensor_parallel=1d strategy.tensor_grid=2 "
     "model=llama_tiny model.experts=4 hardware.devices_per_node=8", "strategy.tensor_parallel",
     "strategy.expert_parallel=2 with strategy.tensor_parallel=1d"),
    # ----- a key the schema lacks, in an option's file (a typo; a profile mode=calibrate wrote under another version)
    ("hardware=stale hydra.searchpath=[file://{stale}]", "hardware=stale",
     "its file sets 'gather_overlapp', which schema HardwareConfig has no setting for. Fix: rename it to gather_overlap"),
]


def write_tokenizer(directory: Path, size: int) -> Path:
    """A word-level tokenizer of `size` ids whose last two are BOS and EOS (not transformers' 1 and 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {f"w{index}": index for index in range(size - 3)} | {"<unk>": size - 3, "<s>": size - 2, "</s>": size - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def make_places(root: Path) -> dict:
    """The PLACES under `root`: {name: path}."""
    (root / "empty").mkdir()
    (root / "file").write_text("not a directory\n")
    (root / "odd_bin").mkdir()
    (root / "odd_bin" / "train.bin").write_bytes(b"abc")
    (root / "odd_bin" / "val.bin").write_bytes(b"ab")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text("Some words of text, enough for a corpus. " * 40)
    write_tokenizer(root / "tokenizer_300", 300)
    (root / "hf_64").mkdir()
    (root / "hf_64" / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)))
    (root / "stale" / "hardware").mkdir(parents=True)  # a profile's key the schema lacks (a typo, another version)
    (root / "stale" / "hardware" / "stale.yaml").write_text(
        "defaults:\n  - /schema_hardware_hardware@_here_\n  - _self_\nname: stale\ngather_overlapp: 0.6\n")
    return {name: str(root / name) for name in PLACES}


PROBLEMS = {}  # (overrides, places) -> problems: the doc test reuses what the kinds' tests found


def problems_of(overrides: str, places: dict) -> list:
    """What train.py would report for these overrides: Hydra's composition error, or validation's."""
    key = (overrides, tuple(sorted(places.items())))
    if key not in PROBLEMS:
        PROBLEMS[key] = composed_problems(overrides, places)
    return PROBLEMS[key]


def composed_problems(overrides: str, places: dict) -> list:
    try:
        cfg = compose_config(*overrides.format(**places).split())
    except (HydraException, OmegaConfBaseException) as error:
        return [composition_problem(error)]
    try:
        validate(cfg)
    except ConfigError as error:
        return error.problems
    return []


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    return make_places(tmp_path_factory.mktemp("places"))


@pytest.mark.parametrize("overrides, field, phrase", BAD_INPUTS, ids=[o for o, _, _ in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_field_and_the_fix(overrides, field, phrase, places):
    problems = problems_of(overrides, places)
    matching = [problem for problem in problems if phrase in problem]
    assert matching, f"{overrides}: no problem says {phrase!r}; got {problems}"
    assert field in matching[0] and "Fix:" in matching[0], matching[0]


def test_at_least_forty_kinds_each_once():
    assert len(BAD_INPUTS) >= 40
    assert len({overrides for overrides, _, _ in BAD_INPUTS}) == len(BAD_INPUTS)


def test_the_sound_neighbours_are_accepted(places):
    """The limits are where they should be: values at the edge of each range pass."""
    for overrides in ["model.dropout=0 optimizer.weight_decay=0 seed=0 trainer.limit_val_batches=0",
                      "optimizer=sgd optimizer.momentum=0 optimizer.min_lr_ratio=1 optimizer.warmup_steps=0",
                      "strategy=ddp strategy.bucket_mb=0 trainer.gradient_clip_val=0.5 seed=4294967295",
                      # a planning shape fits where its plan does: 64 DGX A100 nodes, 1F1B p16 × 1-D 8, recomputed
                      # (batch 512: every send is kept until the step's end, 2 × a data rank's tokens × h × 4 B)
                      "model=gpt3_175b mode=check hardware=dgx_a100_80g hardware.nodes=64 strategy=one_f_one_b "
                      "strategy.pipeline_degree=16 strategy.layers_per_stage=6 strategy.tensor_parallel=1d "
                      "strategy.tensor_grid=8 strategy.micro_batches=64 strategy.activation_recompute=full "
                      "data.global_batch_size=512 data.sequence_length=2048"]:
        assert problems_of(overrides, places) == [], overrides


def test_reliability_doc_matches_the_code(places):
    """docs/reliability.md's table is what scripts/bad_inputs_table.py prints from BAD_INPUTS now."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bad_inputs_table import TABLE_BEGIN, TABLE_END, table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    document = (ROOT / "docs" / "reliability.md").read_text()
    current = document.split(TABLE_BEGIN)[1].split(TABLE_END)[0]
    assert current.strip() == table(places).strip(), "regenerate: .venv/bin/python scripts/bad_inputs_table.py"


# ----- the user's view: train.py itself, exit code 2 before any process starts (a few: ~5 s each)

@pytest.mark.parametrize("arguments, field", [
    (["model.layers=abc"], "model.layers=abc"),
    (["strategy=ddp", "strategy.micro_batches=4"], "Could not override 'strategy.micro_batches'"),
    (["-m", "strategy=single,ddp", "model.nonexistent=1"], "Could not override 'model.nonexistent'"),
], ids=["type error", "unknown key", "unknown key in a sweep"])
def test_train_py_reports_hydra_errors_as_invalid_configuration(arguments, field, tmp_path):
    result = python([sys.executable, "train.py", *arguments, "mode=check",
                             f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"],
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("layerwise: invalid configuration (1 problem):"), result.stderr[-2000:]
    assert field in result.stderr and "Fix:" in result.stderr
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").rglob("*.yaml"))
