"""Plain nn.Module language models. Nothing here knows about ranks or process groups.

    from models import GPT, BERT, build_model
    model = build_model("gpt", vocab_size=256, sequence_length=128, layers=4, hidden=128, heads=4)
    shapes = build_model("gpt", ..., device="meta")   # no storage: a process then materialises
    shapes.materialise("cuda", ["embed", "blocks.0"])  # only the parts it owns, with seeded values
"""

from models.bert import BERT
from models.gpt import GPT
from models.llama import Llama
from models.transformer import (
    Block,
    LanguageModel,
    build_block,
    initialize_block,
    model_flops_per_token,
    on_meta,
    parameter_count,
)

ARCHITECTURES = {"gpt": GPT, "bert": BERT, "llama": Llama}


def build_model(architecture: str, **kwargs) -> LanguageModel:
    """The model named by `architecture` ("gpt" | "bert" | "llama"), built from the keyword arguments."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model.architecture: unknown {architecture!r}; "
            f"choose one of {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture](**kwargs)


__all__ = [
    "ARCHITECTURES", "BERT", "Block", "GPT", "Llama", "LanguageModel", "build_block", "build_model",
    "initialize_block", "model_flops_per_token", "on_meta", "parameter_count",
]
