"""Hugging Face checkpoints in and out: a `config.json` + `*.safetensors` directory <-> our models.

    from models.hf import load_pretrained, save_pretrained
    model = load_pretrained("my-llama/")          # Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or GPT-2
    save_pretrained(model, "out/")                # transformers.AutoModelForCausalLM loads it

Import is exact, part by part: `config.json` becomes our architecture and shape (`hf_shape`), every
field that changes the computation honoured or refused by name; the weights fill each part from
the safetensors files (one file, or shards named by `model.safetensors.index.json`) when the part
is materialised (`PartWeights`, the `weights` hook of `LanguageModel.build_part`), so a process
reads only the tensors of the parts it owns. Names follow `NAMES`: GPT-2's Conv1D weights are
stored [in, out] and transposed; a tied output projection reads the token embedding. Mixtral's and
Qwen3-MoE's experts and routers are models/hf_moe.py's (one file per concern: the per-expert names,
the stacking, rank-local expert reads).
"""

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.hf_moe import MOE_ARCHITECTURES, fill_moe, model_moe_fields, moe_config, moe_family, moe_shape, moe_tensors
from models.transformer import LanguageModel

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
                 "Qwen3ForCausalLM": "llama", "GPT2LMHeadModel": "gpt",
                 **{name: "llama" for name in MOE_ARCHITECTURES}}
QK_NORM = ("qwen3", "qwen3_moe")  # model_type of the families with q_norm/k_norm (transformers' Qwen3Attention)
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
INDEX = "model.safetensors.index.json"
READ_ELEMENTS = 2**22  # at most this many elements of a weight read at once (16 MiB in fp32)

# our name -> (Hugging Face name, stored transposed). "{i}" is the block index.
NAMES = {
    "llama": {
        "embed.token.weight": ("model.embed_tokens.weight", False),
        "head.norm.weight": ("model.norm.weight", False),
        "head.output.weight": ("lm_head.weight", False),
        **{f"blocks.{{i}}.{ours}.{kind}": (f"model.layers.{{i}}.{theirs}.{kind}", False)
           for ours, theirs in (("attention.q", "self_attn.q_proj"), ("attention.k", "self_attn.k_proj"),
                                ("attention.v", "self_attn.v_proj"), ("attention.proj", "self_attn.o_proj"),
                                ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                                ("mlp.fc_out", "mlp.down_proj"), ("norm_attention", "input_layernorm"),
                                ("norm_mlp", "post_attention_layernorm"),
                                ("attention.q_norm", "self_attn.q_norm"), ("attention.k_norm", "self_attn.k_norm"))
           for kind in ("weight", "bias")},
    },
    "gpt": {
        "embed.token.weight": ("transformer.wte.weight", False),
        "embed.position.weight": ("transformer.wpe.weight", False),
        "head.norm.weight": ("transformer.ln_f.weight", False),
        "head.norm.bias": ("transformer.ln_f.bias", False),
        "head.output.weight": ("lm_head.weight", False),
        # GPT-2's Conv1D keeps its weight [in, out]: the transpose of nn.Linear's.
        **{f"blocks.{{i}}.{ours}.{kind}": (f"transformer.h.{{i}}.{theirs}.{kind}", kind == "weight" and conv)
           for ours, theirs, conv in (("norm_attention", "ln_1", False), ("attention.qkv", "attn.c_attn", True),
                                      ("attention.proj", "attn.c_proj", True), ("norm_mlp", "ln_2", False),
                                      ("mlp.fc_in", "mlp.c_fc", True), ("mlp.fc_out", "mlp.c_proj", True))
           for kind in ("weight", "bias")},
    },
}


def hf_name(architecture: str, name: str, tied: bool = False) -> tuple:
    """(Hugging Face tensor name, stored transposed) of our parameter `name`; a tied output
    projection is the token embedding."""
    if tied and name == "head.output.weight":
        name = "embed.token.weight"
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    key = f"blocks.{{i}}.{match.group(2)}" if match else name
    if key not in NAMES[architecture]:
        raise KeyError(f"{name}: no Hugging Face name for this {architecture} parameter")
    theirs, transposed = NAMES[architecture][key]
    return theirs.replace("{i}", match.group(1)) if match else theirs, transposed


# ----------------------------------------------------------------------------- config.json


def read_config(path) -> dict:
    """The directory's config.json as a dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"model.path: {file} does not exist; point model.path at a Hugging Face "
                                f"model directory (config.json + *.safetensors)")
    return json.loads(file.read_text())


# ----------------------------------------------------------------------------- tokenizer


SPECIAL_TOKENS = ("bos", "eos", "pad")
TOKENIZER_NAMING = ("tokenizer_config.json", "special_tokens_map.json")  # where transformers names them


def tokenizer_facts(directory) -> dict:
    """What a Hugging Face tokenizer directory means for a model's vocabulary: `size` (the largest id
    + 1, which the embedding must cover: ids may leave holes), `count` (ids defined, the `tokenizers`
    library's get_vocab_size, which data=text gives the model when model.vocab_size is null),
    `vocabulary` (the model's own tokens) and `added` (added tokens beyond them), and the ids of
    its `bos`, `eos` and `pad` tokens (None where it names none: `special_token_ids`)."""
    from tokenizers import Tokenizer  # data=text's dependency: imported only when a tokenizer is read
    tokenizer = Tokenizer.from_file(str(Path(directory).expanduser() / "tokenizer.json"))
    ids = tokenizer.get_vocab(with_added_tokens=True)
    vocabulary = tokenizer.get_vocab_size(with_added_tokens=False)
    return dict(size=max(ids.values(), default=-1) + 1, count=tokenizer.get_vocab_size(), vocabulary=vocabulary,
                added=len(ids) - vocabulary, **special_token_ids(directory, tokenizer.token_to_id))


def special_token_ids(directory, token_to_id) -> dict:
    """{"bos": id, "eos": id, "pad": id} of a tokenizer directory: the token tokenizer_config.json
    (else special_tokens_map.json) names as `<kind>_token`, looked up with `token_to_id`; else the
    `<kind>_token_id` of its config.json (a model directory); else None."""
    directory, found = Path(directory).expanduser(), {}
    files = [json.loads((directory / name).read_text()) for name in TOKENIZER_NAMING if (directory / name).is_file()]
    config = read_config(directory) if (directory / "config.json").is_file() else {}
    for kind in SPECIAL_TOKENS:
        found[kind] = None
        for named in files:
            token = named.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and token_to_id(token) is not None:
                found[kind] = token_to_id(token)
                break
        if found[kind] is None and isinstance(config.get(f"{kind}_token_id"), int):
            found[kind] = config[f"{kind}_token_id"]
    return found


def _refuse(field: str, value, why: str):
    raise ValueError(f"model.path: config.json field {field}={value!r} is not supported: {why}")


def _rope(config: dict) -> tuple:
    """(θ, Llama 3.1 scaling or None) from transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling`; other RoPE types (linear, dynamic, yarn, ...) refused."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return float(theta), {name: float(parameters[name]) for name in fields}
    _refuse("rope_parameters.rope_type", kind, "layerwise implements RoPE 'default' and 'llama3' "
            "(models/llama.py rotary_frequencies); use a checkpoint with one of those")


def _sliding_window(config: dict, sequence_length: int) -> None:
    """Mistral's/Qwen2's sliding-window attention changes the result only when the window is
    shorter than the sequences: refused then, ignored otherwise (full causal attention is equal)."""
    window = config.get("sliding_window")
    used = config.get("model_type") in ("mistral", "mixtral") or config.get("use_sliding_window", False) or \
        "sliding_attention" in (config.get("layer_types") or ())
    if used and window is not None and window < sequence_length:
        _refuse("sliding_window", window, f"layerwise attends over the whole sequence; with sequences of "
                f"{sequence_length} tokens a window of {window} would mask some. Fix: data.sequence_length "
                f"<= {window}")


def _llama_shape(config: dict, sequence_length: int) -> dict:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    checks = (("hidden_act", config.get("hidden_act", "silu"), "silu", "layerwise's SwiGLU uses SiLU"),
              ("attention_bias", config.get("attention_bias", False), False,
               "Llama's attention_bias also puts a bias on o_proj, which layerwise's Llama has not"),
              ("mlp_bias", config.get("mlp_bias", False), False, "layerwise's SwiGLU has no biases"),
              ("attention_dropout", config.get("attention_dropout", 0.0), 0.0,
               "layerwise's Llama has no attention dropout"))
    for field, value, wanted, why in checks:
        if value != wanted:
            _refuse(field, value, why)
    _sliding_window(config, sequence_length)
    theta, scaling = _rope(config)
    return dict(architecture="llama", layers=config["num_hidden_layers"], hidden=hidden, heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads, ffn_hidden=config["intermediate_size"],
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                qkv_bias=config.get("model_type") == "qwen2", qk_norm=config.get("model_type") in QK_NORM,
                head_dim=None if head_dim == hidden // heads else head_dim,
                tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def _gpt2_shape(config: dict) -> dict:
    hidden = config.get("n_embd", 768)
    inner = config.get("n_inner") or 4 * hidden
    checks = (("activation_function", config.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
               "layerwise's GPT uses the tanh GELU (gelu_new)"),
              ("layer_norm_epsilon", config.get("layer_norm_epsilon", 1e-5) == 1e-5, "layerwise's GPT LayerNorm has eps 1e-5"),
              ("n_inner", inner % hidden == 0, "layerwise's MLP width is an integer multiple of n_embd"),
              ("scale_attn_weights", config.get("scale_attn_weights", True), "layerwise scales scores by 1/sqrt(d)"),
              ("scale_attn_by_inverse_layer_idx", not config.get("scale_attn_by_inverse_layer_idx", False),
               "layerwise does not rescale scores per layer"),
              ("add_cross_attention", not config.get("add_cross_attention", False), "layerwise's GPT is decoder-only"))
    for field, fine, why in checks:
        if not fine:
            _refuse(field, config.get(field), why)
    return dict(architecture="gpt", layers=config.get("n_layer", 12), hidden=hidden, heads=config.get("n_head", 12),
                mlp_ratio=inner // hidden, tie_embeddings=bool(config.get("tie_word_embeddings", True)))


def hf_shape(config: dict, sequence_length: int = None) -> dict:
    """Our model config fields (architecture, layers, hidden, heads, ...; plus vocab_size and
    max_sequence_length) for a Hugging Face config.json, or a ValueError naming the field we cannot
    honour. Dropout probabilities are training choices (model.dropout), not read from the file."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        _refuse("architectures", architectures, f"layerwise imports one of {', '.join(ARCHITECTURES)}")
    if ARCHITECTURES[architectures[0]] == "gpt":
        shape = _gpt2_shape(config)
        shape["max_sequence_length"] = config.get("n_positions", 1024)
    else:
        maximum = config.get("max_position_embeddings", 2048)
        shape = _llama_shape(config, sequence_length or maximum)
        shape["max_sequence_length"] = maximum
        if architectures[0] in MOE_ARCHITECTURES:
            shape.update(moe_shape(config))
    shape["vocab_size"] = config["vocab_size"]
    return shape


def build_arguments(shape: dict, seed: int = 0, dropout: float = 0.0) -> dict:
    """`models.build_model` keyword arguments (without the architecture) for `hf_shape`'s fields."""
    arguments = {key: value for key, value in shape.items()
                 if key not in ("architecture", "max_sequence_length")}
    return dict(arguments, sequence_length=shape["max_sequence_length"], seed=seed, dropout=dropout)


# ----------------------------------------------------------------------------- weights in


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsFiles:
    """The tensors of a model directory by name: one `model.safetensors`, or the shards its
    `model.safetensors.index.json` maps names to. `read` takes rows [r0, r1) and columns [c0, c1)
    of a tensor by seeking in the file (the safetensors layout: an 8-byte header length, a JSON
    header of dtype/shape/data_offsets, then row-major data), so only those bytes are ever in
    memory: safe_open's get_slice returns a view of a storage the size of the whole tensor."""

    def __init__(self, path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"model.path: {self.path} holds neither model.safetensors nor {INDEX}")
            with safe_open(single, framework="pt") as handle:
                self.files = {name: "model.safetensors" for name in handle.keys()}

    def names(self) -> list:
        return list(self.files)

    def _open(self, name: str):
        if name not in self.files:
            raise KeyError(f"model.path: tensor {name} is missing from {self.path}")
        return safe_open(self.path / self.files[name], framework="pt")

    def _entry(self, name: str) -> tuple:
        """(file, byte offset of the data, dtype, shape) of tensor `name`."""
        if name not in self.files:
            raise KeyError(f"model.path: tensor {name} is missing from {self.path}")
        file = self.path / self.files[name]
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            entry = json.loads(handle.read(length))[name]
        return file, 8 + length + entry["data_offsets"][0], DTYPES[entry["dtype"]], tuple(entry["shape"])

    def shape(self, name: str) -> tuple:
        """Tensor `name`'s shape, from the file's header (nothing of its data read)."""
        return self._entry(name)[3]

    def get(self, name: str) -> torch.Tensor:
        return self.read(name)

    def read(self, name: str, rows: tuple = None, columns: tuple = None) -> torch.Tensor:
        """tensor[r0:r1, c0:c1] (a 1-D tensor: [r0:r1]), reading rows r0..r1 only; columns are
        cut from at most READ_ELEMENTS elements of rows at a time."""
        file, start, dtype, shape = self._entry(name)
        rows = rows or (0, shape[0] if shape else 1)
        width = math.prod(shape[1:])
        columns = columns or (0, width)
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        out = torch.empty((rows[1] - rows[0],) + ((columns[1] - columns[0],) if len(shape) > 1 else ()), dtype=dtype)
        step = max(1, READ_ELEMENTS // max(width, 1))
        with file.open("rb") as handle:
            for first in range(rows[0], rows[1], step):
                last = min(rows[1], first + step)
                handle.seek(start + first * row_bytes)
                buffer = bytearray((last - first) * row_bytes)
                handle.readinto(buffer)
                chunk = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
                if len(shape) > 1:
                    out[first - rows[0]:last - rows[0]] = chunk.view(last - first, width)[:, columns[0]:columns[1]]
                else:
                    out[first - rows[0]:last - rows[0]] = chunk
        return out.reshape(shape) if rows == (0, shape[0] if shape else 1) and columns == (0, width) else out

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """tensor[start:stop], read without reading the rest."""
        return self.read(name, rows=(start, stop))


class PartWeights:
    """The `weights` hook of `LanguageModel`: fills a part's (empty) parameters with the checkpoint's
    tensors, read from the files one tensor at a time, cast to the parameter's dtype."""

    def __init__(self, path, architecture: str, tied: bool):
        self.path, self.architecture, self.tied = str(path), architecture, tied
        self._files = self._family = None

    @property
    def family(self) -> str:
        """config.json's model_type (mixtral, qwen3_moe: how its experts are named), read once."""
        if self._family is None:
            self._family = read_config(self.path).get("model_type")
        return self._family

    @property
    def files(self) -> SafetensorsFiles:
        if self._files is None:  # opened lazily: the hook travels to every rank as three strings
            self._files = SafetensorsFiles(self.path)
        return self._files

    def __getstate__(self):
        return dict(self.__dict__, _files=None)

    @torch.no_grad()
    def __call__(self, part: str, module: torch.nn.Module) -> None:
        # An MoE block's router and experts (only those it holds: an expert-parallel rank's own)
        filled = fill_moe(self.files, self.family, part, module) if hasattr(getattr(module, "mlp", None), "experts") \
            else set()
        for local, parameter in module.named_parameters():
            if local in filled:
                continue
            name, transposed = hf_name(self.architecture, f"{part}.{local}", self.tied)
            if parameter.dim() == 1:
                parameter.copy_(self.files.get(name))
                continue
            # Stored rows [start, stop) at a time: a vocabulary-sized matrix never sits in memory
            # twice (once read, once in the parameter). Conv1D's rows are our columns.
            rows = parameter.shape[1] if transposed else parameter.shape[0]
            step = max(1, READ_ELEMENTS // (parameter.numel() // rows))
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                value = self.files.get_rows(name, start, stop)
                if transposed:
                    parameter[:, start:stop].copy_(value.t())
                else:
                    parameter[start:stop].copy_(value)


    @torch.no_grad()
    def read_cut(self, name: str, shape, cut, device, dtype: torch.dtype = None) -> torch.Tensor:
        """`cut(full)` for our parameter `name` of `shape`, reading only the rows and columns the
        cut covers (`get_slice`): the cut is applied to a meta tensor, and when it is a view (a
        chunk, as tensor parallelism's are) its strides and offset give the rectangle to read.

        The shard is cast to `dtype`, the master weights' (default: torch's default dtype, which
        build_part's parameters have), as `__call__`'s copy_ casts a whole part: checkpoints ship
        in bf16 (Llama, Mistral, Qwen2), and a shard left bf16 beside fp32 norms would train in
        bf16 under `32-true`. bf16 -> fp32 is exact, so shards equal the whole-part load's cut."""
        dtype = dtype or torch.get_default_dtype()
        theirs, transposed = hf_name(self.architecture, name, self.tied)
        full = torch.empty(shape, device="meta")
        view = cut(full)
        # Only a view of `full` itself is a rectangle of the file: a fused q/k/v cut views the
        # interleaved copy of `full` (grids.interleave_fused), whose offsets mean other elements.
        plain = view._is_view() and view._base is full
        rectangle = _rectangle(shape, view) if plain and not transposed else None
        if rectangle is None:  # not a plain slice (fused q/k/v interleaved, Conv1D): the whole tensor
            value = self.files.get(theirs)
            return cut(value.t() if transposed else value).to(device, dtype).contiguous()
        rows, columns, strides = rectangle
        value = self.files.read(theirs, rows, None if len(shape) == 1 else columns)
        return value.as_strided(view.shape, strides).to(device, dtype).contiguous()


def _rectangle(shape, view):
    """((rows), (columns), strides within the rectangle) of a view of a contiguous [R, C] or [R]
    tensor that covers a rectangle of it, else None."""
    offset, sizes, strides = view.storage_offset(), view.shape, view.stride()
    if len(shape) == 1:
        return ((offset, offset + view.numel()), (0, 1), strides) if strides in ((1,), ()) else None
    columns = shape[1]
    if any(stride % columns and stride >= columns for stride in strides):
        return None
    row0, column0 = divmod(offset, columns)
    rows = 1 + sum((size - 1) * (stride // columns) for size, stride in zip(sizes, strides) if stride % columns == 0)
    width = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides) if stride % columns)
    if column0 + width > columns:
        return None
    inner = tuple(stride // columns * width if stride % columns == 0 else stride for stride, size in zip(strides, sizes))
    return (row0, row0 + rows), (column0, column0 + width), inner


def load_pretrained(path, device="cpu", sequence_length: int = None, dropout: float = 0.0,
                    dtype=torch.float32) -> LanguageModel:
    """A plain `LanguageModel` (forward(tokens) -> logits) with the weights of the Hugging Face
    model directory `path`; `sequence_length` (default: its max_position_embeddings) decides
    whether a sliding window matters."""
    from models import build_model  # the package imports this module's siblings first

    shape = hf_shape(read_config(path), sequence_length)
    model = build_model(shape["architecture"], device="meta", **build_arguments(shape, dropout=dropout),
                        weights=PartWeights(path, shape["architecture"], shape["tie_embeddings"]))
    with torch.device("cpu"):
        model.materialise(device)
    return model.to(dtype)


# ----------------------------------------------------------------------------- weights out


def hf_config(architecture: str, vocab_size: int, max_sequence_length: int, layers: int, hidden: int,
              heads: int, mlp_ratio: int = 4, tie_embeddings: bool = False, kv_heads: int = None,
              ffn_hidden: int = None, norm_eps: float = 1e-5, rope_theta: float = 10000.0,
              rope_scaling=None, qkv_bias: bool = False, dtype: str = "float32", special_tokens: dict = None,
              head_dim: int = None, qk_norm: bool = False, experts: int = 0, **moe) -> dict:
    """The config.json transformers needs for our model's shape: GPT -> GPT2LMHeadModel; Llama ->
    LlamaForCausalLM, Qwen2ForCausalLM with q/k/v biases, Qwen3ForCausalLM with q/k norms (`head_dim`
    written whatever it is: transformers' classes default it differently, Qwen3's to 128); with
    `experts` (and `moe`'s model.* MoE fields) MixtralForCausalLM or, with q/k norms,
    Qwen3MoeForCausalLM (models/hf_moe.py).
    `special_tokens` ({"bos", "eos", "pad"}:
    ids or None) are written as bos_token_id, eos_token_id, pad_token_id, null included: a missing
    key lets transformers fall back to its class's defaults (Llama 1 and 2, GPT-2 50256), so
    generate() would stop on a token the run never used as EOS."""
    special = {f"{kind}_token_id": (special_tokens or {}).get(kind) for kind in SPECIAL_TOKENS}
    if architecture == "gpt":
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=vocab_size,
                    n_positions=max_sequence_length, n_embd=hidden, n_layer=layers, n_head=heads,
                    n_inner=mlp_ratio * hidden, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie_embeddings,
                    dtype=dtype, **special)
    if architecture != "llama":
        raise ValueError(f"model.architecture: {architecture} has no Hugging Face equivalent here "
                         f"(export gpt or llama)")
    if qkv_bias and qk_norm:
        raise ValueError("model.qkv_bias and model.qk_norm together have no Hugging Face class (Qwen2 has "
                         "the biases, Qwen3 the norms). Fix: export a model with one of them")
    rope = {"rope_type": "llama3", **rope_scaling} if rope_scaling else {"rope_type": "default"}
    family = "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"
    config = dict(architectures=[{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "llama": "LlamaForCausalLM"}[family]],
                  model_type=family, vocab_size=vocab_size,
                  max_position_embeddings=max_sequence_length, hidden_size=hidden,
                  intermediate_size=ffn_hidden or mlp_ratio * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads or heads, head_dim=head_dim or hidden // heads,
                  hidden_act="silu", rms_norm_eps=norm_eps, rope_theta=rope_theta,
                  rope_parameters={**rope, "rope_theta": rope_theta},
                  tie_word_embeddings=tie_embeddings, attention_dropout=0.0, dtype=dtype, **special)
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        config.update(attention_bias=False)
    if experts:
        config = moe_config(config, moe_family(qk_norm=qk_norm, qkv_bias=qkv_bias, experts=experts, ffn_hidden=ffn_hidden,
                                               **moe), layers=layers, experts=experts,
                            ffn_hidden=ffn_hidden or mlp_ratio * hidden, **moe)
    return config


def model_config(model: LanguageModel) -> dict:
    """hf_config's arguments read off a built model."""
    architecture = {"GPT": "gpt", "Llama": "llama"}.get(type(model).__name__, type(model).__name__)
    fields = dict(architecture=architecture, vocab_size=model.vocab_size, max_sequence_length=model.sequence_length,
                  layers=model.layers, hidden=model.hidden, heads=model.heads, mlp_ratio=model.mlp_ratio,
                  tie_embeddings=model.tie_embeddings)
    if architecture == "llama":
        fields.update(kv_heads=model.kv_heads, ffn_hidden=model.ffn_hidden, norm_eps=model.norm_eps,
                      rope_theta=model.rope_theta, rope_scaling=model.rope_scaling, qkv_bias=model.qkv_bias,
                      head_dim=model.head_dim, qk_norm=model.qk_norm, **model_moe_fields(model))
    return fields


def hf_tensors(architecture: str, named_tensors, tied: bool, moe: str = None):
    """(Hugging Face name, contiguous tensor) for our (name, tensor) pairs; a tied output projection
    is left out (transformers ties it to the embedding on load, as its own save does). `moe`
    (hf_moe.moe_family's "mixtral" | "qwen3_moe"): an MoE block's tensors are that family's, each
    stacked expert tensor one per expert."""
    for name, tensor in named_tensors:
        if tied and name == "head.output.weight":
            continue
        pairs = moe_tensors(moe, name, tensor) if moe else None
        if pairs is not None:
            yield from pairs
            continue
        theirs, transposed = hf_name(architecture, name)
        yield theirs, (tensor.t() if transposed else tensor).detach().contiguous()


class ShardWriter:
    """Writes tensors into model.safetensors, or into model-0000i-of-0000n.safetensors shards of at
    most `shard_bytes` with model.safetensors.index.json once a second shard is needed
    (transformers' layout). Tensors are written as they come: one part in memory at a time."""

    def __init__(self, path, shard_bytes: int = SHARD_BYTES):
        self.path, self.shard_bytes = Path(path), shard_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self.pending, self.pending_bytes, self.shards, self.total = {}, 0, [], 0
        self.written = []  # the files close() left, for follow_umask

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.cpu()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        file = self.path / f"model-shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        self.shards.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.path / "model.safetensors")
            self.written = [self.path / "model.safetensors"]
            return
        weight_map = {}
        for index, (file, names) in enumerate(self.shards):
            final = f"model-{index + 1:05d}-of-{len(self.shards):05d}.safetensors"
            file.rename(self.path / final)
            weight_map.update({name: final for name in names})
            self.written.append(self.path / final)
        (self.path / INDEX).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                   "weight_map": weight_map}, indent=2))
        self.written.append(self.path / INDEX)


def write_config(path, config: dict) -> Path:
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(path) / "config.json"


def write_generation_config(path, config: dict) -> Path:
    """generation_config.json beside config.json: the special-token ids generate() reads (it prefers
    this file to config.json), the known ones only."""
    ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(key) is not None}
    (Path(path) / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return Path(path) / "generation_config.json"


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc/self/status,
    kernel 4.7+); elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(files) -> None:
    """Give `files` the mode a plain open() would: 0o666 & ~umask. safetensors' save_file (and any
    writer through tempfile) creates them 0600, unreadable to the user's group even where the
    umask shares everything else."""
    mode = 0o666 & ~current_umask()
    for file in files:
        os.chmod(file, mode)


def save_pretrained(model: LanguageModel, path, shard_bytes: int = SHARD_BYTES, special_tokens: dict = None) -> list:
    """Write `model` (whole, plain) as a directory transformers loads: config.json (with
    `special_tokens`' ids, null where unknown), generation_config.json and model.safetensors
    (sharded with an index past `shard_bytes`), each file's mode following the umask; return the
    files written."""
    fields = model_config(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = hf_config(**fields, dtype=dtype, special_tokens=special_tokens)
    written = [write_config(path, config), write_generation_config(path, config)]
    writer = ShardWriter(path, shard_bytes)
    moe = moe_family(**fields) if fields.get("experts") else None
    for name, tensor in hf_tensors(fields["architecture"], model.state_dict().items(), model.tie_embeddings, moe):
        writer.add(name, tensor)
    writer.close()
    follow_umask(written + writer.written)
    return written + writer.written
