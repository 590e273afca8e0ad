"""Loading a checkpoint never runs code from it (issue 36; strategies/checkpoint/safe_load.py, docs/reliability.md).

Each test plants a payload — a pickled object whose `__reduce__` creates a marker file when it is
unpickled — in one kind of file layerwise reads back, and checks the read is refused with an error
naming the file and the payload's callable, and that the marker was never created. A control shows
the payload is live: plain pickle creates the marker. Legitimate checkpoints of every format resume
and export in tests/test_resume_matrix.py, test_export.py, test_faults.py and below (fsdp2).
"""

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from layerwise.tools.export import export, merged_state
from layerwise.run.launch import RankError
from layerwise.run.fit import train
from layerwise.preflight import validate
from strategies.checkpoint.portable import read_portable, resume_errors
from strategies.checkpoint.safe_load import UnsafeCheckpointError, dcp_metadata, load_torch_file
from tests.ranks import QUICK, compose_config
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
CALLABLE = "pathlib.Path"  # what the payload names (Path.touch; protocol 2 spells it getattr(Path, "touch"))


class Payload:
    """Unpickling this calls Path(marker).touch(): a harmless stand-in for os.system."""

    def __init__(self, marker: Path):
        self.marker = Path(marker)

    def __reduce__(self):
        return Path.touch, (self.marker,)


def plant_in_torch_file(file: Path, marker: Path) -> None:
    """Add the payload to a torch.save file's dict (read safely: the file is ours)."""
    checkpoint = load_torch_file(file)
    checkpoint["extra"] = Payload(marker)
    torch.save(checkpoint, file)


def plant_in_metadata(directory: Path, marker: Path) -> None:
    """Add the payload to a DCP checkpoint's `.metadata` (a plain pickle)."""
    metadata = dcp_metadata(directory)
    metadata.planner_data = Payload(marker)
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def assert_refused(error_text: str, file: Path, marker: Path) -> None:
    assert f"refused to load {file}" in error_text, error_text
    assert CALLABLE in error_text and "Fix:" in error_text, error_text
    assert not marker.exists(), "the payload ran"


def run(directory: Path, *overrides: str, steps: int = 1):
    """train() as train.py calls it, config.yaml included (export reads it); validation decides
    the world size, except for a `resume_from` (its refusal there is tested on its own)."""
    cfg = compose_config(*QUICK, f"trainer.max_steps={steps}", *overrides)
    world_size = 1 if cfg.get("resume_from") else validate(cfg)
    Path(directory).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(directory) / "config.yaml", resolve=True)
    return train(cfg, directory, world_size)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """A legitimate one-step `single` run: last.ckpt and the portable last/ beside it."""
    directory = tmp_path_factory.mktemp("single")
    assert run(directory, "strategy=single")["status"] == "completed"
    return directory


def copy_run(run_directory: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "run"
    shutil.copytree(run_directory, copied)
    return copied


def test_the_payload_is_live_under_plain_pickle(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_portable_sidecar_payload_is_refused_by_validation_and_by_resume(single_run, tmp_path):
    run_directory, marker = copy_run(single_run, tmp_path), tmp_path / "marker"
    portable = run_directory / "checkpoints" / "last"
    plant_in_torch_file(portable / "lightning.pt", marker)
    errors = resume_errors(portable, lambda vocabulary: {})
    assert len(errors) == 1
    assert_refused(errors[0], portable / "lightning.pt", marker)
    with pytest.raises(UnsafeCheckpointError) as refused:  # train() itself, past validation
        run(tmp_path / "resumed", "strategy=single", f"resume_from={portable}", steps=2)
    assert_refused(str(refused.value), portable / "lightning.pt", marker)
    assert not (tmp_path / "resumed" / "checkpoints").exists(), "a refused resume wrote a checkpoint"


def test_dcp_metadata_payload_is_refused(single_run, tmp_path):
    run_directory, marker = copy_run(single_run, tmp_path), tmp_path / "marker"
    portable = run_directory / "checkpoints" / "last"
    plant_in_metadata(portable, marker)
    assert_refused(resume_errors(portable, lambda vocabulary: {})[0], portable / ".metadata", marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        read_portable(portable)
    assert_refused(str(refused.value), portable / ".metadata", marker)


@pytest.mark.parametrize("which", ["last", "previous"])
def test_the_runs_own_checkpoint_payload_is_refused_on_rerun(single_run, tmp_path, which):
    """`last.ckpt`; and `previous.ckpt` reached by the fall-back from a truncated `last.ckpt`."""
    run_directory, marker = copy_run(single_run, tmp_path), tmp_path / "marker"
    checkpoints = run_directory / "checkpoints"
    planted = checkpoints / f"{which}.ckpt"
    if which == "previous":
        shutil.copy(checkpoints / "last.ckpt", planted)
        (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:1000])
    plant_in_torch_file(planted, marker)
    before = {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()}
    with pytest.raises(UnsafeCheckpointError) as refused:
        run(run_directory, "strategy=single", steps=2)
    assert_refused(str(refused.value), planted, marker)
    assert {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()} == before, "checkpoints changed"


def test_a_per_rank_shard_payload_is_refused(tmp_path):
    directory, marker = tmp_path / "zero", tmp_path / "marker"
    assert run(directory, "strategy=zero_layered")["status"] == "completed"
    shard = directory / "checkpoints" / "last.ckpt" / "rank1.pt"
    plant_in_torch_file(shard, marker)
    with pytest.raises(RankError) as refused:
        run(directory, "strategy=zero_layered", steps=2)
    assert "UnsafeCheckpointError" in refused.value.detail
    assert_refused(refused.value.detail, shard, marker)
    with pytest.raises(UnsafeCheckpointError) as exported:  # export reads the shards too
        merged_state(directory / "checkpoints" / "last.ckpt", "zero_layered")
    assert_refused(str(exported.value), shard, marker)


@pytest.mark.parametrize("planted", ["last.ckpt", "last/.metadata"])
def test_export_refuses_a_payload_and_writes_nothing(single_run, tmp_path, planted):
    """Export reads the portable `last/` when it is there, else `last.ckpt`."""
    run_directory, marker = copy_run(single_run, tmp_path), tmp_path / "marker"
    out = tmp_path / "model.safetensors"
    checkpoints = run_directory / "checkpoints"
    if planted == "last.ckpt":
        shutil.rmtree(checkpoints / "last")
        plant_in_torch_file(checkpoints / "last.ckpt", marker)
    else:
        plant_in_metadata(checkpoints / "last", marker)
    with pytest.raises(UnsafeCheckpointError) as refused:
        export(run_directory, out)
    assert_refused(str(refused.value), checkpoints / planted, marker)
    result = python([sys.executable, "-m", "layerwise.tools.export", str(run_directory), "--out", str(out)],
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert_refused(result.stderr, checkpoints / planted, marker)
    assert not out.exists()


def test_fsdp2_resumes_through_the_safe_reader_and_refuses_a_payload(tmp_path):
    """fsdp2's own DCP checkpoint (Lightning's format, read by Fsdp2Strategy.load_checkpoint): a
    resumed run ends where the uninterrupted one does; a payload in its `meta.pt` is refused."""
    whole, resumed, marker = tmp_path / "whole", tmp_path / "resumed", tmp_path / "marker"
    assert run(whole, "strategy=fsdp2", steps=2)["status"] == "completed"
    assert run(resumed, "strategy=fsdp2", steps=1)["status"] == "completed"
    shutil.copytree(resumed, tmp_path / "tampered")
    assert run(resumed, "strategy=fsdp2", steps=2)["steps"] == 2
    expected, actual = (merged_state(d / "checkpoints" / "last.ckpt", "fsdp2") for d in (whole, resumed))
    assert all(torch.equal(actual[name], value) for name, value in expected.items())
    meta = tmp_path / "tampered" / "checkpoints" / "last.ckpt" / "meta.pt"
    plant_in_torch_file(meta, marker)
    with pytest.raises(RankError) as refused:
        run(tmp_path / "tampered", "strategy=fsdp2", steps=2)
    assert_refused(refused.value.detail, meta, marker)


def test_the_wandb_key_lands_in_no_file_of_the_run_directory(tmp_path):
    """train.py with the W&B logger (offline) and a marker key: no file of the run holds it."""
    key = "0123456789abcdef0123456789abcdef" + "marker36"  # W&B keys are 40 characters
    run_directory = tmp_path / "run"
    quick = [item for item in QUICK if not item.startswith("logger=")]
    result = python([sys.executable, "train.py", *quick, "logger=wandb", "strategy=single",
                             "trainer.max_steps=2", f"hydra.run.dir={run_directory}"],
                            cwd=ROOT, timeout=300,
                            env={**os.environ, "WANDB_API_KEY": key, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-2000:]
    files = [path for path in run_directory.rglob("*") if path.is_file()]
    assert any("wandb" in path.parts for path in files), "W&B wrote no offline run"
    assert [path for path in files if key.encode() in path.read_bytes()] == []
    assert key not in result.stdout + result.stderr
