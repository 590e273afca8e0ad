"""Plain nn.Module language models. Nothing here knows about ranks or process groups.

    from models import GPT, BERT, build_model
    model = build_model("gpt", vocab_size=256, sequence_length=128, layers=4, hidden=128, heads=4)
    shapes = build_model("gpt", ..., device="meta")   # no storage: a process then materialises
    shapes.materialise("cuda", ["embed", "blocks.0"])  # only the parts it owns, with seeded values
"""

from models.bert import BERT
from models.gpt import GPT
from models.llama import Llama, describe_llama_block
from models.moe import MoE, describe_moe_block
from models.transformer import (
    Block,
    BlockDescription,
    CoreAttention,
    LinearShape,
    describe_gpt_block,
    LanguageModel,
    build_block,
    initialize_block,
    layer_drop_mask,
    model_flops_per_token,
    on_meta,
    parameter_count,
)

ARCHITECTURES = {"gpt": GPT, "bert": BERT, "llama": Llama}
DESCRIPTIONS = {"gpt": describe_gpt_block, "bert": describe_gpt_block, "llama": describe_llama_block}


def describe_block(architecture: str, **shape) -> BlockDescription:
    """One block of `architecture` as data (norms, linears with fan-in/out and role, heads):
    `shape` holds the model config's fields (hidden, heads, mlp_ratio, kv_heads, ffn_hidden, ...)."""
    return DESCRIPTIONS[architecture](**shape)


def dense_block_of(model_config) -> BlockDescription:
    """The dense block of a model config group (`cfg.model`) as data (experts ignored)."""
    fields = ("hidden", "heads", "mlp_ratio", "kv_heads", "ffn_hidden", "qkv_bias", "head_dim", "qk_norm")
    return describe_block(model_config.architecture,
                          **{name: model_config.get(name) for name in fields if model_config.get(name) is not None})


def block_of(model_config) -> BlockDescription:
    """The block of a model config group (`cfg.model`) as data: with model.experts > 0 the MoE
    block's (models/moe.py describe_moe_block), else the dense one."""
    dense = dense_block_of(model_config)
    if not model_config.get("experts"):
        return dense
    return describe_moe_block(dense, model_config.experts, model_config.experts_per_token,
                              model_config.get("shared_experts") or 0, model_config.get("moe_ffn_hidden"))


def blocks_of(model_config) -> list:
    """Every block of a model config group as data, in order: MoE blocks where `model.moe_layers`
    says (null: every block) when model.experts > 0, the dense block elsewhere."""
    block, layers = block_of(model_config), model_config.layers
    if not block.experts or model_config.get("moe_layers") is None:
        return [block] * layers
    dense, chosen = dense_block_of(model_config), set(model_config.moe_layers)
    return [block if index in chosen else dense for index in range(layers)]


def build_model(architecture: str, **kwargs) -> LanguageModel:
    """The model named by `architecture` ("gpt" | "bert" | "llama"), built from the keyword arguments."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model.architecture: unknown {architecture!r}; "
            f"choose one of {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture](**kwargs)


__all__ = [
    "ARCHITECTURES", "BERT", "Block", "MoE", "blocks_of", "dense_block_of", "describe_moe_block", "BlockDescription", "CoreAttention", "GPT", "Llama", "LinearShape", "block_of", "describe_block", "LanguageModel", "build_block", "build_model",
    "initialize_block", "layer_drop_mask", "model_flops_per_token", "on_meta", "parameter_count",
]
