"""models/hf.py against transformers itself: tiny random models built with transformers' own config
classes and saved into a temporary directory (nothing is downloaded) give the same logits when
loaded by layerwise, and layerwise's export loads back into transformers with no missing or
unexpected keys and bit-identical tensors."""

import json
import re

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tests.ranks import compose_config  # noqa: E402
from models.hf import SafetensorsFiles, load_pretrained, read_config, save_pretrained, hf_shape  # noqa: E402

VOCAB = 97
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, initializer_range=0.3)
CASES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(LLAMA, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500000.0)),
    "llama_tied_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        LLAMA, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, num_key_value_heads=2, sliding_window=64)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3)),
}


def hf_model(case: str, path, **changes):
    """A random transformers model of `case` saved in `path`; norms and biases drawn away from their
    init (1, 0) so that a mapping that dropped them would show."""
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**dict(fields, **changes))).eval()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if value.dim() == 1:
                value.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(path)
    return model


def tokens(length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_imported_logits_equal_transformers(case, tmp_path):
    reference = hf_model(case, tmp_path)
    ours = load_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected, got = reference(tokens()).logits, ours(tokens())
    scale = expected.abs().max()
    assert scale > 1.0  # logits of a size that a missing norm or bias would change
    # fp32: the two compute the same products in a different order (fused q/k/v, SDPA kernels).
    assert (got - expected).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("case", list(CASES))
def test_import_then_export_is_bit_identical_and_loads_in_transformers(case, tmp_path):
    hf_model(case, tmp_path / "in")
    ours = load_pretrained(tmp_path / "in")
    save_pretrained(ours, tmp_path / "out")
    before, after = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        expected, got = reloaded.eval()(tokens()).logits, load_pretrained(tmp_path / "out").eval()(tokens())
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_sharded_export_writes_an_index_transformers_loads(tmp_path):
    hf_model("llama_gqa", tmp_path / "in")
    ours = load_pretrained(tmp_path / "in")
    save_pretrained(ours, tmp_path / "out", shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(SafetensorsFiles(tmp_path / "out").names()) == set(load_file(tmp_path / "in" / "model.safetensors"))
    again = load_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("case, changes, field", [
    ("mistral", dict(sliding_window=16), "sliding_window=16"),
    ("llama_gqa", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)), "rope_parameters.rope_type='yarn'"),
    ("llama_gqa", dict(attention_bias=True), "attention_bias=True"),
    ("llama_gqa", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("gpt2", dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
    ("gpt2", dict(activation_function="relu"), "activation_function='relu'"),
])
def test_fields_that_change_the_computation_are_refused_by_name(case, changes, field, tmp_path):
    config_class, model_class, fields = CASES[case]
    getattr(transformers, config_class)(**dict(fields, **changes), architectures=[model_class]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"config.json field {field}") + ".* is not supported"):
        hf_shape(read_config(tmp_path), sequence_length=32)


def test_a_window_longer_than_the_sequences_changes_nothing_and_is_accepted(tmp_path):
    hf_model("mistral", tmp_path, sliding_window=16)
    assert hf_shape(read_config(tmp_path), sequence_length=16)["architecture"] == "llama"


# ----- model=hf model.path=DIR in a run: the initial validation loss is transformers', and a trained
# model exported with `--format hf` gives transformers the logits layerwise's own model gives

RUN_MODEL = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**RUN_MODEL)).save_pretrained(path)
    return path


def hf_run(directory, model_path, *overrides):
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from tests.ranks import QUICK
    cfg = compose_config(*QUICK, "model=hf", f"model.path={model_path}", "trainer.limit_val_batches=2",
                         *overrides)
    summary = train(cfg, directory, validate(cfg))
    OmegaConf.save(cfg, directory / "config.yaml", resolve=True)  # as train.py does: export reads it
    assert summary["status"] == "completed", summary.get("error")
    return cfg, summary


def transformers_validation_loss(cfg, model_path) -> float:
    """The mean loss transformers computes on the validation batches layerwise evaluates."""
    from layerwise.run import data as data_lib
    from layerwise.run.fit import load_corpus
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path).eval()
    losses = []
    for index in range(cfg.trainer.limit_val_batches):
        batch = data_lib.language_model_batch(load_corpus(cfg), split="validation", index=index,
                                              global_batch_size=cfg.data.global_batch_size,
                                              sequence_length=cfg.data.sequence_length, seed=cfg.seed,
                                              objective="causal")
        with torch.no_grad():
            logits = model(batch["tokens"]).logits
        losses.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("overrides", [
    ["strategy=single"],
    # each rank reads only its shards (get_slice): a wrong rectangle would change the loss; this case
    # runs under torch 2.11 too (make smoke-torch211): the Hugging Face import
    pytest.param(["strategy=tp_1d", "strategy.tensor_grid=2"], marks=pytest.mark.smoke),
    ["strategy=tp_2d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
], ids=["single", "tp_1d_p2", "tp_2d_q2"])
def test_initial_validation_loss_of_an_imported_model_is_transformers(overrides, hf_llama, tmp_path):
    cfg, summary = hf_run(tmp_path, hf_llama, "trainer.max_steps=1", *overrides)
    assert cfg.model.layers == 4 and cfg.model.kv_heads == 2 and cfg.model.vocab_size == 300
    expected = transformers_validation_loss(cfg, hf_llama)
    assert abs(summary["initial_val_loss"] - expected) <= 1e-5 * expected


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["strategy=modular_pipeline", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
    ["strategy=zero_layered", "optimizer.name=sgd"],
], ids=["modular_pipeline_pp2_p2", "zero_layered_dp2_sgd"])
def test_trained_then_exported_model_gives_transformers_layerwise_logits(overrides, hf_llama, tmp_path):
    from layerwise.tools.export import export_hf, load_exported, export
    (tmp_path / "run").mkdir()
    cfg, summary = hf_run(tmp_path / "run", hf_llama, "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=3",
                          *overrides)
    export_hf(tmp_path / "run", tmp_path / "hf")
    state = {"blocks.0.mlp.up.weight": load_file(tmp_path / "hf" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]}
    export(tmp_path / "run", tmp_path / "plain.safetensors")
    ours, _ = load_exported(tmp_path / "plain.safetensors")
    assert not torch.equal(state["blocks.0.mlp.up.weight"], load_pretrained(hf_llama).blocks["0"].mlp.up.weight)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = ours.eval()(batch), reloaded.eval()(batch).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
