"""Export (issue 18 item 2): a run's model as one plain safetensors file, from any strategy's checkpoint.

The exported file rebuilt with `models.build_model` gives the run's last validation loss on the
same validation batches, and its tensors are exactly the consolidated checkpoint's.
"""

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from layerwise.run import data as data_lib
from layerwise.tools.export import export, load_exported
from layerwise.run.fit import load_corpus, train
from layerwise.run.task import objective_of
from layerwise.preflight import validate
from tests.ranks import QUICK, compose_config
from tests.references import consolidated_parameters
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "modular_pipeline_pp2_p2": ["strategy=modular_pipeline", "strategy.tensor_parallel=1d",
                                "hardware.devices_per_node=4", "model.layers=4"],
    "zero_layered_dp2": ["strategy=zero_layered"],
}


def validation_loss(model, cfg) -> float:
    """The run's definition: the mean over trainer.limit_val_batches global batches of the batch loss."""
    corpus = load_corpus(cfg)
    batches = data_lib.ValidationBatches(corpus, batches=cfg.trainer.limit_val_batches,
                                         global_batch_size=cfg.data.global_batch_size,
                                         sequence_length=cfg.data.sequence_length, seed=cfg.seed,
                                         objective=objective_of(cfg.model))
    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(model(batch["tokens"]), batch["targets"])) for batch in batches]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_gives_the_runs_last_validation_loss(case, tmp_path):
    cfg = compose_config(*QUICK, "trainer.max_steps=3", "trainer.val_check_interval=3", *CASES[case])
    summary = train(cfg, tmp_path, validate(cfg))
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)  # as train.py saves it
    state = export(tmp_path, tmp_path / "model.safetensors")
    consolidated = consolidated_parameters(tmp_path, cfg.strategy.name)
    assert state.keys() == {name.removeprefix("model.") for name in consolidated}
    assert all(torch.equal(state[name.removeprefix("model.")], value) for name, value in consolidated.items())
    model, _ = load_exported(tmp_path / "model.safetensors")
    loss = validation_loss(model, cfg)
    print(f"{case}: run's last validation loss {summary['final_val_loss']:.6f}, exported model {loss:.6f}")
    assert loss == pytest.approx(summary["final_val_loss"], rel=1e-5)


def test_export_command_writes_the_file_and_names_a_missing_checkpoint(tmp_path):
    result = python([sys.executable, "-m", "layerwise.tools.export", str(tmp_path), "--out",
                             str(tmp_path / "model.safetensors")], cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2 and "checkpoints/last.ckpt does not exist" in result.stderr


def test_an_edited_config_with_an_interpolation_is_refused(tmp_path, monkeypatch):
    """config.yaml is written resolved: `${oc.env:...}` in it means an edit that would copy an
    environment variable (a W&B key) into the export's metadata."""
    from layerwise.tools.export import run_config
    monkeypatch.setenv("PRETEND_SECRET", "do-not-export")
    cfg = compose_config(*QUICK)
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    assert run_config(tmp_path).run_name == cfg.run_name  # the file as train.py writes it reads back
    (tmp_path / "config.yaml").write_text((tmp_path / "config.yaml").read_text().replace(
        f"run_name: {cfg.run_name}", "run_name: ${oc.env:PRETEND_SECRET}"))
    with pytest.raises(ValueError, match="holds an interpolation"):
        run_config(tmp_path)
