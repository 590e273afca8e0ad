"""A bf16 Hugging Face checkpoint (how Llama, Mistral and Qwen2 ship) under tensor parallelism: each
rank's shards, read from the file by `PartWeights.read_cut`, are fp32 master weights equal to the
whole-part load's (`load_pretrained`, which casts) cut the same way — bitwise, since every bf16 value
is an fp32 value — and a run under `32-true` trains. transformers writes the checkpoint."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.ranks import QUICK, compose_config, run_on_ranks  # noqa: E402

CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def save_bf16(path, model):
    """`model` saved in bf16; norms (and biases) drawn away from 1 (0) so that a dropped cast shows."""
    with torch.no_grad():
        for name, value in model.named_parameters():
            if value.dim() == 1:
                value.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(path)
    header = (path / "model.safetensors").read_bytes()
    entries = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
    assert {entry["dtype"] for name, entry in entries.items() if name != "__metadata__"} == {"BF16"}
    return path


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    torch.manual_seed(0)
    return save_bf16(tmp_path_factory.mktemp("bf16_llama"),
                     transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)))


@pytest.fixture(scope="module")
def bf16_gpt2(tmp_path_factory):
    """GPT-2 untied (tensor parallelism refuses tied embeddings): its fused, transposed c_attn is
    read whole and cut (read_cut's other branch)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     tie_word_embeddings=False)
    return save_bf16(tmp_path_factory.mktemp("bf16_gpt2"), transformers.GPT2LMHeadModel(config))


def shards_on_rank(rank, path, grid, edge):
    """This rank's parameters after `parallelize`: read shard by shard from the file, and cut from
    the whole-part load; as (name, dtype, equal) rows."""
    from models.hf import load_pretrained
    from parallel.dims import Layout
    from parallel.layout import ParallelLayout
    from strategies.tensor_parallel.grids import layout_arguments
    from strategies.tensor_parallel.parallelize import parallelize
    from models import build_model
    from models.hf import PartWeights, build_arguments, hf_shape, read_config

    torch.distributed.init_process_group("gloo")
    degrees = Layout(tensor_grid=grid, edge=edge)
    layout = ParallelLayout(degrees, rank=rank, **layout_arguments(grid, degrees.tensor))
    shape = hf_shape(read_config(path))
    sliced = build_model(shape["architecture"], device="meta", **build_arguments(shape),
                         weights=PartWeights(path, shape["architecture"], shape["tie_embeddings"]))
    parallelize(sliced, layout, "cpu")  # each shard read from the file (read_cut)
    whole = load_pretrained(path)  # whole parts, cast to fp32 as they are copied in
    whole.weights = None  # parallelize now cuts the materialised fp32 tensors
    parallelize(whole, layout, "cpu")
    expected = dict(whole.named_parameters())
    return [(name, str(value.dtype), torch.equal(value, expected[name]))
            for name, value in sliced.named_parameters()]


@pytest.mark.parametrize("model, grid, edge", [("llama", "1d", 2), ("llama", "2d", 2), ("gpt2", "1d", 2)],
                         ids=["llama_tp_1d_p2", "llama_tp_2d_q2", "gpt2_tp_1d_p2"])
def test_sharded_bf16_checkpoint_gives_fp32_master_weights_equal_to_the_whole_part_load(model, grid, edge, request):
    path = request.getfixturevalue(f"bf16_{model}")
    for rows in run_on_ranks(shards_on_rank, 2 if grid == "1d" else 4, path, grid, edge):
        assert len(rows) > 10
        assert [row for row in rows if row[1] != "torch.float32"] == []
        assert [row for row in rows if not row[2]] == []


def test_whole_part_load_of_a_bf16_checkpoint_is_its_values_in_fp32(bf16_llama):
    from models.hf import load_pretrained
    reference = transformers.LlamaForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16)
    ours = load_pretrained(bf16_llama)
    assert all(value.dtype == torch.float32 for value in ours.parameters())
    assert torch.equal(ours.blocks["1"].attention.k.weight,
                       reference.model.layers[1].self_attn.k_proj.weight.float())


@pytest.mark.parametrize("overrides", [
    ["strategy=tp_1d", "strategy.tensor_grid=2"],
    ["strategy=tp_2d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
], ids=["tp_1d_p2", "tp_2d_q2"])
def test_a_32_true_run_trains_from_a_bf16_checkpoint_under_tensor_parallelism(overrides, bf16_llama, tmp_path):
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    cfg = compose_config(*QUICK, "model=hf", f"model.path={bf16_llama}", "trainer.max_steps=1",
                         "hardware.precision=32-true", *overrides)
    summary = train(cfg, tmp_path, validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    # what the matrix products ran in and what the optimizer updates (layerwise/run/evidence.py)
    assert summary["precision"] == "32-true"
