"""Export (issue 18 item 2): a run's model as one plain safetensors file, from any strategy's checkpoint.

The exported file rebuilt with `models.build_model` gives the run's last validation loss on the
same validation batches, and its tensors are exactly the consolidated checkpoint's.
"""

import json
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


# ----- issue 55 item 6: the Hugging Face export is a complete directory

def special_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of 300 ids whose pad, BOS and EOS are ids 0, 3 and 4: not the 1 and 2
    transformers falls back to, nor GPT-2's 50256."""
    import sysconfig
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<mask>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(stdlib / name) for name in ("textwrap.py", "shlex.py")], trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "pad_token": "<pad>"}))
    return directory


def test_hf_export_has_the_special_tokens_a_generation_config_and_the_users_file_modes(tmp_path):
    """config.json and generation_config.json carry the run's tokenizer's BOS/EOS/pad ids, the
    tokenizer's files are beside the weights, every file's mode follows the umask (safetensors
    writes 0600), and transformers' generate() stops on the real EOS (id 4)."""
    import os
    import stat
    import sysconfig
    transformers = pytest.importorskip("transformers")
    from layerwise.tools.export import export_hf
    tokenizer = special_tokenizer(tmp_path / "tokenizer")
    text = tmp_path / "text"
    text.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py", "string.py", "glob.py"):
        (text / f"{name}.txt").write_text((stdlib / name).read_text())
    cfg = compose_config(*QUICK, "strategy=single", "data=text", f"data.path={text}", f"data.tokenizer={tokenizer}",
                         f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2",
                         "trainer.checkpoint_every_n_steps=2", "trainer.val_check_interval=2")
    run = tmp_path / "run"
    run.mkdir()
    train(cfg, run, validate(cfg))
    OmegaConf.save(cfg, run / "config.yaml", resolve=True)  # as train.py saves it
    previous = os.umask(0o027)
    try:
        export_hf(run, tmp_path / "hf")
    finally:
        os.umask(previous)
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (3, 4, 0), config
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (3, 4, 0)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {file.name for file in out.iterdir()}
    modes = {file.name: oct(stat.S_IMODE(file.stat().st_mode)) for file in out.iterdir()}
    assert set(modes.values()) == {oct(0o640)}, modes  # 0o666 & ~0o027; safetensors alone: 0o600
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == 4
    with torch.no_grad():  # whatever the input, the last norm gives ones and the head scores only EOS
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[4].fill_(1.0)
        generated = model.generate(torch.tensor([[10, 11, 12]]), max_new_tokens=8, do_sample=False)
    assert generated[0].tolist() == [10, 11, 12, 4]  # stopped at the first EOS


def test_model_hf_export_takes_its_ids_from_the_source_config_and_save_pretrained_follows_the_umask(tmp_path):
    """model=hf with byte data: the source directory's ids (config.json over generation_config.json);
    save_pretrained writes them into both files, each file 0o666 & ~umask."""
    import os
    import stat
    from layerwise.tools.export import special_tokens
    from models import build_model
    from models.hf import save_pretrained
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 7}))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "pad_token_id": 6}))
    cfg = OmegaConf.create({"data": {"corpus": "stdlib"}, "model": {"path": str(source)}})
    assert special_tokens(cfg) == {"bos": 5, "eos": 7, "pad": 6}
    cfg = OmegaConf.create({"data": {"corpus": "stdlib"}, "model": {"path": None}})
    assert special_tokens(cfg) == {"bos": None, "eos": None, "pad": None}  # bytes: none, written as null
    model = build_model("llama", vocab_size=16, sequence_length=8, layers=1, hidden=8, heads=2)
    previous = os.umask(0o002)
    try:
        written = save_pretrained(model, tmp_path / "out", special_tokens={"bos": 5, "eos": 7, "pad": None})
    finally:
        os.umask(previous)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (5, 7, None)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"bos_token_id": 5, "eos_token_id": 7}
    assert {file.name for file in written} == {"config.json", "generation_config.json", "model.safetensors"}
    assert {oct(stat.S_IMODE(file.stat().st_mode)) for file in written} == {oct(0o664)}
