"""Packed documents: several documents in one sequence, each attending only to itself.

A packed row holds documents joined by EOS (layerwise/run/text.py ends every document with one).
`documents_of(tokens, eos)` gives each token its document number inside the row (the number rises
on the token *after* an EOS: the EOS belongs to the document it ends) and its position inside that
document (0 at each document's first token). `Documents` carries the two [b, s] tensors; a model
holds one (`LanguageModel.set_documents`) while a micro-batch runs, and reads it in three places:
GPT's learned position table and Llama's RoPE take the restarted positions, and `CoreAttention`
masks block-causally:

    token i may attend to token j  <=>  document[i] == document[j] and position[i] >= position[j]

Two ways to apply the mask, equal by construction (tests/test_packing.py checks them):
- exact, any device: scaled_dot_product_attention with the boolean mask [b, 1, s, s]
  (memory s² per row; GQA through enable_gqa);
- FlexAttention's block mask (torch.nn.attention.flex_attention), chosen on CUDA: whole blocks
  outside every document are skipped. Its backward is refused on CPU (torch 2.11/2.13:
  "FlexAttention does not support backward on CPU"), so on CPU only its forward is checked; it has
  not been run on a GPU here.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Documents:
    """Per-token document number and position inside the document, LongTensor [b, s] each."""

    ids: torch.Tensor
    positions: torch.Tensor


def documents_of(tokens: torch.Tensor, eos: int) -> Documents:
    """Document numbers and restarted positions of the EOS-joined rows tokens[b, s].

    ids[b, i] = number of EOS among tokens[b, :i] (so an EOS closes its own document);
    positions[b, i] = i - (index of the first token of i's document).
    """
    ends = (tokens == eos).long()
    ids = torch.cumsum(ends, dim=1) - ends  # EOS before i, not counting i itself
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    # The first token of document k is where ids first reaches k: a running max of its index.
    starts = torch.where(torch.cat((torch.ones_like(ids[:, :1], dtype=torch.bool),
                                    ids[:, 1:] != ids[:, :-1]), dim=1), index, torch.zeros_like(index))
    first = torch.cummax(starts, dim=1).values
    return Documents(ids=ids, positions=index - first)


def document_mask(documents: Documents) -> torch.Tensor:
    """The block-causal mask, bool [b, 1, s, s]: True where query i may attend to key j."""
    ids, positions = documents.ids, documents.positions
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    earlier = positions.unsqueeze(2) >= positions.unsqueeze(1)
    return (same & earlier).unsqueeze(1)


def exact_attention(query, key, value, documents: Documents) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v with the document mask as a boolean attn_mask (every device)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=document_mask(documents),
                                          enable_gqa=key.shape[1] != query.shape[1])


def flex_attention(query, key, value, documents: Documents) -> torch.Tensor:
    """The same attention through FlexAttention with a document block mask (the CUDA path).

    mask_mod(b, h, q, k) = ids[b, q] == ids[b, k] and positions[b, q] >= positions[b, k], the mask of
    `document_mask` as a function; create_block_mask turns it into per-block (128×128) lists, so
    blocks no document spans are never computed."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex

    ids, positions = documents.ids, documents.positions

    def mask_mod(b, h, q, k):
        return (ids[b, q] == ids[b, k]) & (positions[b, q] >= positions[b, k])

    batch, _, length, _ = query.shape
    block_mask = create_block_mask(mask_mod, batch, None, length, length, device=query.device)
    return flex(query, key, value, block_mask=block_mask, enable_gqa=key.shape[1] != query.shape[1])


def packed_attention(query, key, value, documents: Documents) -> torch.Tensor:
    """FlexAttention on CUDA, the exact boolean-mask path elsewhere (flex has no CPU backward)."""
    if query.device.type == "cuda":
        return flex_attention(query, key, value, documents)
    return exact_attention(query, key, value, documents)


def batch_documents(batch: dict, index: int = None):
    """The Documents of a packed batch (keys "documents", "positions": data.packing), of its
    micro-batch `index` when the batch's values are tuples of chunks; None for a plain batch."""
    if "documents" not in batch:
        return None
    ids, positions = batch["documents"], batch["positions"]
    if index is not None:
        ids, positions = ids[index], positions[index]
    return Documents(ids=ids, positions=positions)
