"""Every config composes and validates; every kind of bad input fails before any rank starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from layerwise.validate import ConfigError, validate
from tests.harness import compose_config

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ["strategy", "model", "hardware", "data", "optimizer", "logger"]


def options(group):
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    for option in options(group):
        extra = ["data.path=/tmp"] if option in ("text_files", "token_bin") else []
        cfg = compose_config(f"{group}={option}", "mode=check", *extra)
        assert cfg[group].name == option


def test_default_config_is_valid():
    cfg = compose_config()
    assert validate(cfg) == 2 and cfg.strategy.name == "modular_pipeline"


def test_experiment_and_debug_presets_compose():
    cfg = compose_config("experiment=default", "debug=fast")
    assert cfg.trainer.max_steps == 5 and cfg.logger.name == "none"


def test_planning_shapes_compose_and_validate_in_check_mode():
    for shape in ("gpt3_175b", "gpt_1t"):
        cfg = compose_config(f"model={shape}", "mode=check", "data.sequence_length=2048")
        validate(cfg)
        assert cfg.model.planning_only


def test_typed_schema_rejects_misspelt_key():
    with pytest.raises(Exception, match="micro_bathces"):
        compose_config("strategy.micro_bathces=2")


def test_typed_schema_rejects_wrong_type():
    with pytest.raises(Exception, match="model.layers"):
        compose_config("model.layers=many")


BAD_INPUTS = [
    (["strategy.name=pipedream"], "strategy='pipedream' is unknown"),
    (["model.hidden=100", "model.heads=3"], "model.hidden=100 is not divisible by model.heads=3"),
    (["data.sequence_length=512"], "data.sequence_length=512 exceeds"),
    (["strategy=ddp", "data.global_batch_size=3"], "data.global_batch_size=3 does not split into 2 data-parallel"),
    (["model=gpt3_175b", "data.sequence_length=64"], "planning-only shape"),
    (["strategy=ddp", "strategy.micro_batches=4"], "strategy.micro_batches=4"),
    (["strategy=ddp", "strategy.data_degree=4"], "strategy.data_degree=4 but the world has 2"),
    (["data=text_files", "data.path=/nonexistent/texts"], "data.path='/nonexistent/texts' does not exist"),
    (["data=token_bin"], "data.path is not set"),
    (["hardware=dgx_a100_80g"], "needs CUDA GPUs and this machine has none"),
    (["hardware.precision=16-mixed"], "hardware.precision='16-mixed' is not supported on CPU"),
    (["optimizer.name=adagrad"], "optimizer.name='adagrad' is unknown"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be at least 1"),
    (["model.layers=400", "model.hidden=4096", "model.heads=32"], "more than hardware.host_memory_bytes"),
    (["strategy=ddp", "strategy.pipeline_degree=2"], "strategy.pipeline_degree=2"),
    (["hardware.process_group_backend=nccl"], "must be gloo on CPU"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[m[:30] for _, m in BAD_INPUTS])
def test_bad_input_names_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(*overrides))
    assert message in str(caught.value)
    assert all("Fix" in p or "must be" in p for p in caught.value.problems)


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as caught:
        validate(compose_config("model.heads=3", "data.sequence_length=512", "hardware.precision=16-mixed"))
    assert len(caught.value.problems) == 3


def test_train_py_rejects_bad_input_before_starting_ranks(tmp_path):
    """The user's view: exit code 2, the field in the message, no run directory content."""
    result = subprocess.run([sys.executable, "train.py", "data.global_batch_size=3",
                             f"hydra.run.dir={tmp_path}/run"], cwd=CONF.parent,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "data.global_batch_size=3" in result.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_help_lists_the_groups():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=CONF.parent,
                            capture_output=True, text=True, timeout=60)
    for group in GROUPS:
        assert f"{group}:" in result.stdout or f"{group}\n" in result.stdout
    assert "mode=check" in result.stdout


def test_sweep_point_directory_names_stay_short_and_distinct():
    from layerwise.config import MAX_DIRECTORY_NAME, point_directory
    long_a, long_b = "x=1," * 60 + "a=1", "x=1," * 60 + "a=2"
    assert point_directory(3, "strategy=ddp") == "3_strategy=ddp"
    names = {point_directory(0, long_a), point_directory(0, long_b)}
    assert len(names) == 2 and all(len(n) <= MAX_DIRECTORY_NAME for n in names)
