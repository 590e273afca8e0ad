"""GPT: a causal decoder that predicts the next token (Radford et al. 2019, pre-LayerNorm)."""

import torch
import torch.nn as nn

from models.transformer import LanguageModel


class GPTHead(nn.Module):
    """x[b, s, h] -> logits[b, s, V]: final LayerNorm, bias-free projection to the vocabulary."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class GPT(LanguageModel):
    """Causal language model: embed, L causal pre-LayerNorm blocks, GPTHead.

    Trained with targets = tokens shifted left by one, so position t predicts token t+1.
    """

    causal = True

    def make_head(self, hidden: int, vocab_size: int) -> nn.Module:
        return GPTHead(hidden, vocab_size)
