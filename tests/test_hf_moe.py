"""Qwen3 (dense), Mixtral and Qwen3-MoE through models/hf.py and models/hf_moe.py, against transformers
itself: tiny random models built with transformers' own config classes (nothing downloaded) give the
same logits when loaded by layerwise; layerwise's export is bit-identical to the checkpoint it read
and loads back into transformers with no missing or unexpected keys; an expert-parallel rank reads
only its own experts' tensors from the files.

Tolerance of the logits (fp32): the two implementations compute the same products in another order
(SDPA kernels, fused or separate projections, the experts' outputs summed in another order), a few
ulp (2^-23 ≈ 1.2e-7 relative) per operation, as tests/tolerances.py argues for the strategies. A
forward of L = 2 blocks is ~15 dependent operations (norms, 4 attention products, softmax, the router's
softmax, 3 expert products, the weighted sum, the head), so |Δlogit| ≲ 15 · 4 ulp · max|logit| ≈
7e-6 · max|logit|; LOGITS_RTOL = 1e-5 sits above that. A mapping bug (one expert's gate swapped with
its up, a transposed weight, a missing q/k norm, unnormalised top-k weights) moves the logits by an
order-1 fraction of their scale (≥ 1e4 × this; test_mapping_bugs_are_seen shows two).
"""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from models.hf import load_pretrained, save_pretrained  # noqa: E402

LOGITS_RTOL = 1e-5
VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
DENSE = {
    # head_dim 16 ≠ hidden/heads = 8, as every published Qwen3 (hidden 1024..5120, head_dim 128)
    "qwen3_head_dim_16": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=16)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=8, tie_word_embeddings=True,
                                                           rope_theta=1e6)),
}
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    # block 0 dense (mlp_only_layers: intermediate_size 48), block 1 sparse (4 experts of 24); q/k norms
    "qwen3_moe_mlp_only_0": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[0], head_dim=16)),
    # top-k weights not renormalised (norm_topk_prob false, the Qwen3MoeConfig default), tied embeddings
    "qwen3_moe_unnormalised_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        BASE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False,
        tie_word_embeddings=True)),
}
CASES = dict(DENSE, **MOE)


def hf_model(case: str, path, **changes):
    """A random transformers model of `case` saved in `path`; norm weights drawn away from 1 so that
    a mapping that dropped one would show; routers drawn N(0, 0.3) (Qwen3-MoE's start at zero, where
    every expert ties and top-k picks by index: a swapped router row would not show)."""
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**dict(fields, **changes))).eval()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if value.dim() == 1:
                value.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight") and "experts" not in name:
                value.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


def tokens(length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def logits_difference(reference, ours) -> tuple:
    """(max |ours − transformers|, max |transformers|) on the same tokens."""
    with torch.no_grad():
        expected, got = reference(tokens()).logits, ours(tokens())
    return float((got - expected).abs().max()), float(expected.abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_imported_logits_equal_transformers(case, tmp_path):
    reference = hf_model(case, tmp_path)
    ours = load_pretrained(tmp_path).eval()
    difference, scale = logits_difference(reference, ours)
    print(f"{case}: max |Δlogit| = {difference:.3g}, max |logit| = {scale:.3g}, ratio {difference / scale:.3g}")
    assert scale > 1.0  # logits of a size that a missing norm would change
    assert difference <= LOGITS_RTOL * scale


@pytest.mark.parametrize("case", list(CASES))
def test_import_then_export_is_bit_identical_and_loads_in_transformers(case, tmp_path):
    hf_model(case, tmp_path / "in")
    save_pretrained(load_pretrained(tmp_path / "in"), tmp_path / "out")
    before, after = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(reloaded).__name__ == CASES[case][1]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    difference, scale = logits_difference(reloaded.eval(), load_pretrained(tmp_path / "out").eval())
    assert difference <= LOGITS_RTOL * scale


def test_mapping_bugs_are_seen(tmp_path):
    """The tolerance is sharp: one expert's gate and up swapped, or the top-k weights left
    unnormalised, moves the logits by ≥ 1e3 × LOGITS_RTOL of their scale."""
    reference = hf_model("mixtral", tmp_path)
    for bug in ("swap_gate_up", "unnormalised"):
        ours = load_pretrained(tmp_path).eval()
        mlp = ours.blocks["1"].mlp
        with torch.no_grad():
            if bug == "swap_gate_up":
                mlp.experts.gate[1], mlp.experts.up[1] = mlp.experts.up[1].clone(), mlp.experts.gate[1].clone()
            else:
                mlp.normalize = False
        difference, scale = logits_difference(reference, ours)
        assert difference > 1e3 * LOGITS_RTOL * scale, bug


# ----- configuration: what is mapped, what is refused by name


def test_config_fields_become_the_moe_fields(tmp_path):
    from models.hf import hf_shape, read_config
    hf_model("qwen3_moe_mlp_only_0", tmp_path / "qwen", decoder_sparse_step=1, router_aux_loss_coef=0.02)
    shape = hf_shape(read_config(tmp_path / "qwen"))
    assert {key: shape[key] for key in ("experts", "experts_per_token", "moe_ffn_hidden", "moe_layers",
                                        "router_normalize", "aux_loss_coefficient", "qk_norm", "head_dim",
                                        "ffn_hidden")} == dict(
        experts=4, experts_per_token=2, moe_ffn_hidden=24, moe_layers=[1], router_normalize=True,
        aux_loss_coefficient=0.02, qk_norm=True, head_dim=16, ffn_hidden=48)
    hf_model("mixtral", tmp_path / "mixtral")
    shape = hf_shape(read_config(tmp_path / "mixtral"))
    assert (shape["experts"], shape["moe_layers"], shape["moe_ffn_hidden"], shape["router_normalize"],
            shape["qk_norm"]) == (4, None, None, True, False)


def test_router_jitter_is_refused_by_name(tmp_path):
    from models.hf import hf_shape, read_config
    config_class, model_class, fields = CASES["mixtral"]
    getattr(transformers, config_class)(**fields, router_jitter_noise=0.1, architectures=[model_class]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config.json field router_jitter_noise=0.1 is not supported"):
        hf_shape(read_config(tmp_path))


@pytest.mark.parametrize("changes, message", [
    (dict(router="sigmoid_bias"), "model.router=sigmoid_bias"),
    (dict(shared_experts=1), "model.shared_experts > 0"),
    (dict(router_normalize=False), "model.router_normalize=false without qk_norm"),
    (dict(moe_layers=[1]), r"model.moe_layers=\[1\] without qk_norm"),
])
def test_export_refuses_what_no_transformers_class_computes(changes, message, tmp_path):
    from models import build_model
    model = build_model("llama", vocab_size=VOCAB, sequence_length=64, layers=2, hidden=32, heads=4, kv_heads=2,
                        ffn_hidden=48, experts=4, experts_per_token=2, **changes)
    with pytest.raises(ValueError, match=message):
        save_pretrained(model, tmp_path)


def test_a_layerwise_moe_model_exports_to_the_class_that_computes_it(tmp_path):
    """A model built by layerwise (seeded, not imported): with q/k norms and a dense first block it is
    a Qwen3MoeForCausalLM, which gives the logits layerwise gives."""
    from models import build_model
    model = build_model("llama", vocab_size=VOCAB, sequence_length=64, layers=2, hidden=32, heads=4, kv_heads=2,
                        ffn_hidden=48, experts=4, experts_per_token=2, moe_ffn_hidden=24, moe_layers=[1],
                        qk_norm=True, head_dim=16, router_normalize=False).eval()
    save_pretrained(model, tmp_path)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    difference, scale = logits_difference(reloaded.eval(), model)
    assert difference <= LOGITS_RTOL * scale


# ----- rank-local expert loading: an expert-parallel rank reads its experts' tensors and no other's


class CountingFiles:
    """A SafetensorsFiles that records the name and bytes of every tensor read from the files."""

    def __new__(cls, path):
        from models.hf import SafetensorsFiles

        class Counting(SafetensorsFiles):
            def read(self, name, rows=None, columns=None):
                value = super().read(name, rows, columns)
                self.reads.append((name, value.numel() * value.element_size()))
                return value
        files = Counting(path)
        files.reads = []
        return files


@pytest.mark.parametrize("case, family", [("mixtral", "mixtral"), ("qwen3_moe_mlp_only_0", "qwen3_moe")])
def test_an_expert_parallel_rank_reads_only_its_experts(case, family, tmp_path):
    """e = 2 over E = 4: rank 1 holds experts 2 and 3 of block 1; filling its MoE reads the router and
    3 × 2 expert matrices (gate, up, down of experts 2 and 3), never experts 0 and 1, and holds
    exactly the whole model's experts 2 and 3."""
    from models.hf_moe import expert_name, fill_moe
    from models.moe import MoE
    hf_model(case, tmp_path)
    whole = load_pretrained(tmp_path).blocks["1"].mlp
    block = torch.nn.Module()
    block.mlp = MoE(32, whole.experts.width, 4, 2, first=2, local_experts=2)
    files = CountingFiles(tmp_path)
    filled = fill_moe(files, family, "blocks.1", block)
    names = [name for name, _ in files.reads]
    experts = {expert_name(family, 1, which, e) for which in ("gate", "up", "down") for e in (2, 3)}
    assert set(names) - experts == {("model.layers.1.block_sparse_moe.gate.weight" if family == "mixtral"
                                     else "model.layers.1.mlp.gate.weight")}
    assert len(names) == 7 and experts <= set(names)
    width = whole.experts.width
    assert sum(size for name, size in files.reads if name in experts) == 2 * 3 * 32 * width * 4  # fp32 bytes
    assert filled == {"mlp.router.weight", "mlp.experts.gate", "mlp.experts.up", "mlp.experts.down"}
    for which in ("gate", "up", "down"):
        assert torch.equal(getattr(block.mlp.experts, which), getattr(whole.experts, which)[2:4])
    assert torch.equal(block.mlp.router.weight, whole.router.weight)


def test_read_experts_across_shards_stacks_them_transposed(tmp_path):
    """read_experts over an index of several shards: expert e's [out, in] matrices, stacked [count, in, out]."""
    from models.hf import SafetensorsFiles
    from models.hf_moe import expert_name, read_experts
    hf_model("mixtral", tmp_path / "in")
    save_pretrained(load_pretrained(tmp_path / "in"), tmp_path / "out", shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    files, original = SafetensorsFiles(tmp_path / "out"), load_file(tmp_path / "in" / "model.safetensors")
    got = read_experts(files, "mixtral", 0, first=1, count=3)
    for which in ("gate", "up", "down"):
        assert torch.equal(got[which], torch.stack([original[expert_name("mixtral", 0, which, e)].t() for e in (1, 2, 3)]))


# ----- model=hf model.path=DIR in a run: a tiny Mixtral trains, its initial validation loss is
# transformers', and the trained model exported with `--format hf` is a Mixtral transformers loads

RUN_MIXTRAL = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, num_local_experts=4,
                   num_experts_per_tok=2)


def test_a_mixtral_trains_from_its_checkpoint_and_exports_to_transformers(tmp_path):
    from layerwise.tools.export import export_hf
    from tests.test_hf import hf_run, transformers_validation_loss
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**RUN_MIXTRAL)).save_pretrained(tmp_path / "in")
    (tmp_path / "run").mkdir()
    cfg, summary = hf_run(tmp_path / "run", tmp_path / "in", "strategy=single", "trainer.max_steps=2",
                          "trainer.checkpoint_every_n_steps=2")
    assert (cfg.model.experts, cfg.model.experts_per_token, cfg.model.moe_layers) == (4, 2, None)
    expected = transformers_validation_loss(cfg, tmp_path / "in")
    assert abs(summary["initial_val_loss"] - expected) <= 1e-5 * expected
    assert summary["losses"][-1] < summary["losses"][0]
    export_hf(tmp_path / "run", tmp_path / "out")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert not torch.equal(trained[name], load_file(tmp_path / "in" / "model.safetensors")[name])  # trained
    batch = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = reloaded.eval()(batch).logits, load_pretrained(tmp_path / "out").eval()(batch)
    assert (got - expected).abs().max() <= LOGITS_RTOL * expected.abs().max()


def test_initial_validation_loss_of_an_imported_mixtral_under_expert_parallelism_is_transformers(tmp_path):
    """ddp with e = 2: each rank builds and reads experts 2i, 2i + 1 of every block only (its blocks are
    cut on meta before the weights hook fills them: fill_moe reads experts [first, first + count))."""
    from tests.test_hf import hf_run, transformers_validation_loss
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**RUN_MIXTRAL)).save_pretrained(tmp_path / "in")
    (tmp_path / "run").mkdir()
    cfg, summary = hf_run(tmp_path / "run", tmp_path / "in", "strategy=ddp", "strategy.expert_parallel=2",
                          "trainer.max_steps=1")
    expected = transformers_validation_loss(cfg, tmp_path / "in")
    assert abs(summary["initial_val_loss"] - expected) <= 1e-5 * expected


def one_sgd_step_equals_single(tmp_path, model_path, overrides) -> float:
    """One SGD step (lr 0.1: a step well above fp32 rounding of the weights) of the imported model
    under `single` and under `overrides`, each exported with
    --format hf: every tensor equal within the first-step gradient tolerance of tests/tolerances.py.
    With p1 = p0 − lr·g, two correct runs differ by lr·Δg, |Δg| ≤ GRADIENT_RTOL·|g| +
    GRADIENT_SCALE_ATOL·max|g| per tensor, plus one fp32 rounding of p1 on each side
    (GRADIENT_RECOVERY_EPS·|p0|). Returns the worst |Δp| / bound."""
    from layerwise.tools.export import export_hf
    from tests.test_hf import hf_run
    from tests.tolerances import GRADIENT_RECOVERY_EPS, GRADIENT_RTOL, GRADIENT_SCALE_ATOL
    exported = {}
    for name, chosen in (("single", ["strategy=single"]), ("other", overrides)):
        (tmp_path / name).mkdir()
        cfg, _ = hf_run(tmp_path / name, model_path, *chosen, "optimizer.name=sgd", "optimizer.lr=0.1", "trainer.max_steps=1",
                        "trainer.checkpoint_every_n_steps=1")
        export_hf(tmp_path / name, tmp_path / f"{name}_hf")
        exported[name] = load_file(tmp_path / f"{name}_hf" / "model.safetensors")
    initial, lr, worst = load_file(Path(model_path) / "model.safetensors"), cfg.optimizer.lr, 0.0
    assert sorted(exported["other"]) == sorted(exported["single"]) == sorted(initial)
    for key, p0 in initial.items():
        single, other = exported["single"][key], exported["other"][key]
        gradient = (p0 - single) / lr
        assert gradient.abs().max() > 0, key  # every tensor moved (each expert, each q/k norm)
        bound = lr * (GRADIENT_RTOL * gradient.abs() + GRADIENT_SCALE_ATOL * gradient.abs().max()) \
            + GRADIENT_RECOVERY_EPS * p0.abs()
        worst = max(worst, float(((other - single).abs() / bound).max()))
        assert ((other - single).abs() <= bound).all(), key
    return worst


def test_the_hf_export_of_an_expert_parallel_run_equals_the_one_of_a_single_run(tmp_path):
    """ddp with e = 2: rank 1's experts 2 and 3 are gathered back into place; an expert written in
    another's place would differ by the weights' own scale (~0.1)."""
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**RUN_MIXTRAL)).save_pretrained(tmp_path / "in")
    one_sgd_step_equals_single(tmp_path, tmp_path / "in", ["strategy=ddp", "strategy.expert_parallel=2"])


RUN_QWEN3 = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.1)


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen3")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**RUN_QWEN3)).save_pretrained(path)
    return path


@pytest.mark.parametrize("overrides", [["strategy=single"], ["strategy=modular_pipeline"]], ids=["single", "pp2"])
def test_initial_validation_loss_of_an_imported_qwen3_is_transformers(overrides, hf_qwen3, tmp_path):
    from tests.test_hf import hf_run, transformers_validation_loss
    cfg, summary = hf_run(tmp_path, hf_qwen3, "trainer.max_steps=1", *overrides)
    assert (cfg.model.qk_norm, cfg.model.head_dim, cfg.model.hidden, cfg.model.heads) == (True, 16, 32, 4)
    expected = transformers_validation_loss(cfg, hf_qwen3)
    assert abs(summary["initial_val_loss"] - expected) <= 1e-5 * expected


@pytest.mark.parametrize("overrides", [
    ["strategy=tp_1d", "strategy.tensor_grid=2"],
    ["strategy=tp_1d", "strategy.tensor_grid=2", "strategy.sequence_parallel=true"],
    ["strategy=modular_pipeline", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
], ids=["tp_1d_p2", "tp_1d_p2_sequence_parallel", "modular_pipeline_pp2_p2"])
def test_a_qwen3_under_the_1d_grid_sums_its_q_k_norm_gradients_over_the_tensor_group(overrides, hf_qwen3, tmp_path):
    """Each tensor rank holds half the heads, so its q/k norm weights see half the gradient: summed
    over "tensor" (grids.py Grid1D.replicated_over), one SGD step equals `single`'s: worst 0.36 of the
    bound; without the sum those weights miss the other rank's share, measured 99-371 × the bound.
    Each rank reads its shards."""
    from tests.test_hf import hf_run, transformers_validation_loss
    (tmp_path / "first").mkdir()
    cfg, summary = hf_run(tmp_path / "first", hf_qwen3, "trainer.max_steps=1", *overrides)
    expected = transformers_validation_loss(cfg, hf_qwen3)
    assert abs(summary["initial_val_loss"] - expected) <= 1e-5 * expected
    worst = one_sgd_step_equals_single(tmp_path, hf_qwen3, overrides)
    print(f"{overrides}: worst |Δp| / bound {worst:.3g}")


def test_the_2d_and_3d_grids_refuse_qk_norm_by_name(hf_qwen3):
    from layerwise.preflight import validate
    from layerwise.config.errors import ConfigError
    from tests.ranks import QUICK, compose_config
    cfg = compose_config(*QUICK, "model=hf", f"model.path={hf_qwen3}", "strategy=tp_2d", "strategy.tensor_grid=2",
                         "hardware.devices_per_node=4")
    with pytest.raises(ConfigError, match=r"model.qk_norm=true: the 2d grid does not place Qwen3's q/k norms yet"):
        validate(cfg)


@pytest.mark.parametrize("case, family", [("mixtral", "mixtral"), ("qwen3_moe_mlp_only_0", "qwen3_moe")])
def test_a_file_in_transformers_fused_layout_is_read_too(case, family, tmp_path):
    """transformers 5 holds experts fused (gate_up_proj [E, 2f, h], down_proj [E, h, f]); a file saved
    from its state_dict as it is gives the same model, and an expert-parallel rank reads rows
    [first, first + count) of each fused tensor only."""
    from safetensors.torch import save_file
    from models.hf_moe import FUSED, read_experts
    reference = hf_model(case, tmp_path / "split")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    state = {name: value.contiguous() for name, value in reference.state_dict().items()}
    assert FUSED["gate_up"].format(i=1) in state  # the installed transformers fuses
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    split, fused = load_pretrained(tmp_path / "split"), load_pretrained(tmp_path / "fused")
    assert all(torch.equal(a, b) for a, b in zip(split.state_dict().values(), fused.state_dict().values()))
    files = CountingFiles(tmp_path / "fused")
    got = read_experts(files, family, 1, first=2, count=2)
    assert [name for name, _ in files.reads] == [FUSED["gate_up"].format(i=1), FUSED["down"].format(i=1)]
    assert sum(size for _, size in files.reads) == 2 * 3 * 32 * split.blocks["1"].mlp.experts.width * 4
    for which in ("gate", "up", "down"):
        assert torch.equal(got[which], getattr(split.blocks["1"].mlp.experts, which)[2:4])


# ----- the published configurations: hf_shape of each config.json gives the parameter counts their
# model cards state and the planning-only shapes in conf/model/ (issue 58 item 5) block for block

PUBLISHED = {
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json; model card and Jiang et
    # al. 2024 (arXiv:2401.04088): 46.7B parameters, 12.9B active per token
    "mixtral_8x7b": (dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
        router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False, vocab_size=32000,
        hidden_act="silu", attention_dropout=0.0, output_router_logits=False), 46.7e9, 12.9e9),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json; Qwen3 Technical Report
    # (arXiv:2505.09388) table 2 and the model card: 30.5B parameters, 3.3B activated
    "qwen3_30b_a3b": (dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=None, max_window_layers=48,
        tie_word_embeddings=False, vocab_size=151936, hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, output_router_logits=False), 30.5e9, 3.3e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_published_config_gives_its_parameter_counts_and_our_planning_shape(name):
    from omegaconf import OmegaConf
    from models import blocks_of
    from models.hf import hf_shape
    from tests.ranks import compose_config
    config, total, active = PUBLISHED[name]
    shape = OmegaConf.create(hf_shape(config, sequence_length=4096))
    blocks = blocks_of(shape)
    outside = 2 * shape.vocab_size * shape.hidden + shape.hidden  # untied embedding and head, final norm
    counted = outside + sum(block.parameters() for block in blocks)
    activated = counted - sum((block.experts - block.experts_per_token) * block.expert_weights() for block in blocks)
    print(f"{name}: {counted:,} parameters, {activated:,} active")
    # the cards give 0.1B digits (Qwen3's 3.3B activated is 3.35B cut, not rounded): within one of them
    assert abs(counted - total) < 0.1e9 and abs(activated - active) < 0.1e9
    planned = compose_config(f"model={name}").model
    assert blocks_of(planned) == blocks
    for field in ("layers", "experts", "experts_per_token", "router", "router_normalize", "aux_loss_coefficient",
                  "rope_theta", "norm_eps", "max_sequence_length", "qk_norm", "head_dim", "kv_heads"):
        assert planned[field] == shape[field], field


@pytest.mark.parametrize("overrides", [
    ["strategy=tp_1d", "strategy.tensor_grid=2"],
    ["strategy=modular_pipeline", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
], ids=["tp_1d", "modular_pipeline_1d"])
def test_tensor_grids_refuse_experts_by_name(overrides, tmp_path):
    """An MoE layer has no tensor-parallel plan (it would stay whole on every rank, its input gradient
    summed t times, and a model.path checkpoint would never fill it): refused before launch."""
    from layerwise.preflight import validate
    from layerwise.config.errors import ConfigError
    from tests.ranks import QUICK, compose_config
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**RUN_MIXTRAL)).save_pretrained(tmp_path)
    cfg = compose_config(*QUICK, "model=hf", f"model.path={tmp_path}", *overrides)
    with pytest.raises(ConfigError, match=r"model.experts=4: a tensor grid does not shard mixtures of experts"):
        validate(cfg)
