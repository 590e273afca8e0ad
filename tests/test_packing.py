"""Packed documents (models/documents.py, data.packing): a packed row's logits equal its documents
run one by one; the FlexAttention block mask equals the exact boolean mask (forward, CPU); the
batches carry document ids and restarted positions; unsupported strategies are refused.

Tolerance: fp32, one softmax over at most s keys per layer; the packed and lone runs differ only in
the order of the reductions (masked keys add exact zeros), so each logit differs by a few ulps of
its magnitude per layer: 1e-5 absolute on logits of order 1 with 2 layers leaves a wide margin."""

import pytest
import torch

from models import build_model
from models.documents import Documents, documents_of, exact_attention, flex_attention

EOS = 0
LOGIT_ATOL = 1e-5


def packed_row(lengths, vocab=32, seed=0) -> torch.Tensor:
    """One row of documents of the given lengths, each ending in EOS (=0), other tokens in 1..vocab-1."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.cat((torch.randint(1, vocab, (n - 1,), generator=generator), torch.tensor([EOS])))
              for n in lengths]
    return torch.cat(pieces)


def test_document_ids_and_positions_restart_after_each_eos():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [0, 0, 3, 4, 5, 6]])
    documents = documents_of(tokens, EOS)
    assert documents.ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert documents.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


MODELS = {
    "gpt": dict(architecture="gpt", heads=4),
    "llama_gqa": dict(architecture="llama", heads=4, kv_heads=2),
}


@pytest.mark.parametrize("name", MODELS)
def test_packed_logits_equal_the_documents_run_one_by_one(name):
    torch.manual_seed(0)
    shape = dict(MODELS[name])
    model = build_model(shape.pop("architecture"), vocab_size=32, sequence_length=48, layers=2,
                        hidden=32, seed=1, **shape).eval()
    lengths = [(7, 12, 5, 24), (30, 18)]  # two rows, 48 tokens each; documents of uneven length
    tokens = torch.stack([packed_row(row, seed=index) for index, row in enumerate(lengths)])
    with torch.no_grad():
        model.set_documents(documents_of(tokens, EOS))
        packed = model(tokens)
        model.set_documents(None)
        worst = 0.0
        for row, row_lengths in enumerate(lengths):
            start = 0
            for length in row_lengths:
                alone = model(tokens[row : row + 1, start : start + length])
                worst = max(worst, (packed[row, start : start + length] - alone[0]).abs().max().item())
                start += length
        unpacked = model(tokens)
    print(f"{name}: packed vs one by one, worst |logit difference| {worst:.2e}")
    assert worst <= LOGIT_ATOL
    # the mask matters: without it the later documents see the earlier ones
    assert (unpacked - packed).abs().max().item() > 1e-3


def test_flex_block_mask_equals_the_exact_mask_forward_on_cpu():
    """FlexAttention's forward runs on CPU (its backward is refused there): equal to the boolean mask,
    with grouped-query heads. The CUDA path (packed_attention picks flex on cuda) is not run here."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.stack([packed_row((40, 60, 28), seed=1), packed_row((100, 28), seed=2)])
    documents = documents_of(tokens, EOS)
    query = torch.randn(2, 4, 128, 16, generator=generator)
    key, value = (torch.randn(2, 2, 128, 16, generator=generator) for _ in range(2))
    exact = exact_attention(query, key, value, documents)
    flex = flex_attention(query, key, value, documents)
    difference = (exact - flex).abs().max().item()
    print(f"flex vs exact mask: {difference:.2e}")
    assert difference <= LOGIT_ATOL


# ----- the run: batches, the config check, single against a pipeline under SGD

@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A tokenizer and a .jsonl of 600 short documents (1-3 source lines, ~5-40 tokens): several per
    32-token row, so the masks and restarted positions change the losses."""
    import json
    pytest.importorskip("tokenizers")
    from tests.test_text_data import STDLIB, train_tokenizer
    tokenizer = train_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    root = tmp_path_factory.mktemp("documents")
    lines = [line for line in (STDLIB / "textwrap.py").read_text().splitlines() if line.strip()]
    documents = ["\n".join(lines[i : i + 1 + i % 3]) for i in range(0, min(len(lines), 1200), 2)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return ["data=text", f"data.path={root}", f"data.tokenizer={tokenizer}",
            f"data.cache_dir={tmp_path_factory.mktemp('cache')}", "data.validation_fraction=0.1"]


def test_packed_batches_carry_documents_and_keep_every_target(short_documents):
    from layerwise.run.data import configured_corpus, language_model_batch
    from tests.ranks import compose_config
    corpus = configured_corpus(compose_config(*short_documents))
    options = dict(split="train", index=0, global_batch_size=4, sequence_length=32, seed=0, objective="causal")
    plain, packed = language_model_batch(corpus, **options), language_model_batch(corpus, packing=True, **options)
    assert torch.equal(plain["tokens"], packed["tokens"]) and torch.equal(plain["targets"], packed["targets"])
    expected = documents_of(packed["tokens"], corpus.eos_id)
    assert torch.equal(packed["documents"], expected.ids) and torch.equal(packed["positions"], expected.positions)
    assert (packed["documents"][:, -1] >= 1).sum() >= 2  # most rows hold more than one document


@pytest.mark.parametrize("overrides, words", [
    (["strategy=three_d"], "not supported by strategy=three_d"),
    (["strategy=single", "data=stdlib"], "data=text"),
])
def test_packing_is_refused_where_it_is_not_covered(overrides, words):
    from layerwise.config.validate import packing_errors
    from tests.ranks import compose_config
    cfg = compose_config("data.packing=true", *overrides)
    errors = packing_errors(cfg)
    assert any(words in error and "data.packing" in error for error in errors), errors


def test_packed_training_single_equals_a_pipeline_under_sgd(short_documents, tmp_path_factory):
    """Two SGD steps with packing: `single` against modular_pipeline p=2 (m=4 micro-batches, each
    setting its own documents) agree on losses, first-step gradients and parameters; and packing
    changes the losses (the masks are in use)."""
    from tests.references import SgdComparison, SgdRun
    packed = [*short_documents, "data.packing=true"]
    single = SgdRun(tmp_path_factory.mktemp("single"), "strategy=single", *packed, initial=True)
    pipeline = SgdRun(tmp_path_factory.mktemp("pipeline"), "strategy=modular_pipeline",
                      "strategy.pipeline_degree=2", *packed)
    SgdComparison(pipeline, single).check()
    unpacked = SgdRun(tmp_path_factory.mktemp("unpacked"), "strategy=single", *short_documents)
    print("losses packed", single.summary["losses"], "unpacked", unpacked.summary["losses"])
    assert abs(single.summary["losses"][0] - unpacked.summary["losses"][0]) > 1e-4


def test_packed_pipeline_with_recomputation_equals_single_under_sgd(short_documents, tmp_path_factory):
    """Recomputation with packed rows and micro-batches in flight: 1F1B p=2 (m=4) with full and with
    selective recomputation equals packed `single` under SGD. A block (full) or core attention
    (selective) reruns in its micro-batch's backward after later micro-batches' forwards set their
    documents; strategies/recompute.py gives the rerun the documents its forward read."""
    from tests.references import SgdComparison, SgdRun
    packed = [*short_documents, "data.packing=true"]
    single = SgdRun(tmp_path_factory.mktemp("single"), "strategy=single", *packed, initial=True)
    for mode in ("full", "selective"):
        pipeline = SgdRun(tmp_path_factory.mktemp(mode), "strategy=one_f_one_b", "hardware.devices_per_node=2",
                          f"strategy.activation_recompute={mode}", *packed)
        assert pipeline.cfg.strategy.micro_batches == 4
        SgdComparison(pipeline, single).check()
