"""BERT: a bidirectional encoder trained to recover masked tokens (Devlin et al. 2019).

We use pre-LayerNorm blocks like GPT (so the same Block serves both), hence the final LayerNorm
in the head; the masked-LM transform and decoder follow the original.
"""

import torch
import torch.nn as nn

from models.transformer import LanguageModel


class BERTHead(nn.Module):
    """x[b, s, h] -> logits[b, s, V]: LayerNorm, transform (Linear, GELU, LayerNorm), decoder."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.transform = nn.Linear(hidden, hidden)
        self.activation = nn.GELU(approximate="tanh")
        self.transform_norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab_size)  # the decoder; its weight may be tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transform_norm(self.activation(self.transform(self.norm(x))))
        return self.output(x)


class BERT(LanguageModel):
    """Masked language model: embed, L bidirectional pre-LayerNorm blocks, BERTHead.

    Trained with targets = -100 except at the masked positions, which hold the original token.
    No next-sentence prediction (RoBERTa showed it is not needed).
    """

    causal = False

    def make_head(self, hidden: int, vocab_size: int) -> nn.Module:
        return BERTHead(hidden, vocab_size)
