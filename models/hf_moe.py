"""Mixtures of experts in and out of Hugging Face checkpoints: MixtralForCausalLM and Qwen3MoeForCausalLM.

models/hf.py reads and writes everything a dense Llama-family block has (attention, q/k norms, norms,
embedding, head); this module adds what an MoE block (models/moe.py `MoE`) has beyond it:

- config.json -> model fields (`moe_shape`): num_local_experts (Qwen3-MoE on the Hub: num_experts) ->
  experts; num_experts_per_tok -> experts_per_token; Qwen3-MoE's moe_intermediate_size ->
  moe_ffn_hidden (Mixtral: intermediate_size, the experts' width, as there are no dense MLPs);
  norm_topk_prob -> router_normalize (Mixtral always renormalises its top k); router_aux_loss_coef ->
  aux_loss_coefficient; Qwen3-MoE's decoder_sparse_step and mlp_only_layers -> moe_layers (block i
  is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0: transformers'
  Qwen3MoeDecoderLayer). output_router_logits is a training switch of transformers (whether its aux
  loss is added): ignored, the aux loss is model.aux_loss_coefficient's. Mixtral's
  router_jitter_noise (multiplicative noise on the router's input in training) is refused unless 0.
- weights: the files keep one Linear per expert, as every checkpoint on the Hub does and as
  transformers writes them (5.x fuses them in memory, gate_up_proj [E, 2f, h], and splits them back
  on save: its conversion_mapping.py "mixtral" and "qwen2_moe" entries), [out, in] each:
      Mixtral    model.layers.{i}.block_sparse_moe.gate.weight [E, h]       our mlp.router.weight
                 model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight    mlp.experts.gate[e]ᵀ
                                                            .w3.weight      mlp.experts.up[e]ᵀ
                                                            .w2.weight      mlp.experts.down[e]ᵀ
      Qwen3-MoE  model.layers.{i}.mlp.gate.weight, mlp.experts.{e}.gate_proj / up_proj / down_proj
  Experts stacks them as [E, in, out] (gate, up [E, h, f], down [E, f, h]): each expert's stored
  matrix is transposed in and out, so a round trip is bit-identical. A file holding transformers'
  fused in-memory layout instead (`safetensors.torch.save_file(model.state_dict())`: router
  model.layers.{i}.mlp.gate.weight, mlp.experts.gate_up_proj [E, 2f, h] with gate the first f rows of
  each expert, mlp.experts.down_proj [E, h, f]) is read too; export writes the per-expert layout.
- rank-local loading (`read_experts`): a block's experts [first, first + count) are read one
  per-expert tensor at a time, so an expert-parallel rank never reads another rank's experts' bytes.
"""

import re

import torch

from models.moe import MoE

MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
ROUTER = {"mixtral": "model.layers.{i}.block_sparse_moe.gate.weight", "qwen3_moe": "model.layers.{i}.mlp.gate.weight"}
EXPERT = {"mixtral": "model.layers.{i}.block_sparse_moe.experts.{e}.{which}.weight",
          "qwen3_moe": "model.layers.{i}.mlp.experts.{e}.{which}.weight"}
WHICH = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
         "qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
FUSED = {"router": "model.layers.{i}.mlp.gate.weight", "gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
         "down": "model.layers.{i}.mlp.experts.down_proj"}  # transformers 5's modules, both families
OURS = re.compile(r"blocks\.(\d+)\.mlp\.(router\.weight|experts\.(gate|up|down)|expert_bias|shared\..+)")


def _refuse(field: str, value, why: str):
    raise ValueError(f"model.path: config.json field {field}={value!r} is not supported: {why}")


# ----------------------------------------------------------------------------- config.json in


def moe_shape(config: dict) -> dict:
    """The model fields of an MoE config.json (beside hf.py's dense ones), or a ValueError naming
    the field layerwise cannot honour."""
    family = config["model_type"]
    experts = config.get("num_local_experts") or config.get("num_experts")
    layers = config["num_hidden_layers"]
    shape = dict(experts=experts, experts_per_token=config["num_experts_per_tok"], shared_experts=0,
                 router="softmax_topk", aux_loss_coefficient=float(config.get("router_aux_loss_coef", 0.001)),
                 capacity_factor=None)
    if family == "mixtral":
        if config.get("router_jitter_noise", 0.0):
            _refuse("router_jitter_noise", config["router_jitter_noise"],
                    "layerwise's router has no input noise. Fix: set it to 0.0 in config.json")
        return dict(shape, moe_ffn_hidden=None, moe_layers=None, router_normalize=True)
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return dict(shape, moe_ffn_hidden=config["moe_intermediate_size"],
                moe_layers=None if len(sparse) == layers else sparse,
                router_normalize=bool(config.get("norm_topk_prob", False)))


# ----------------------------------------------------------------------------- weights in


def expert_name(family: str, block: int, which: str, expert: int) -> str:
    """The Hugging Face name of expert `expert`'s `which` (gate | up | down) matrix in block `block`."""
    return EXPERT[family].format(i=block, e=expert, which=WHICH[family][which])


@torch.no_grad()
def read_experts(files, family: str, block: int, first: int, count: int, into: dict = None) -> dict:
    """{"gate": [count, h, f], "up": [count, h, f], "down": [count, f, h]}: experts [first, first +
    count) of MoE block `block`, read from `files` (models.hf.SafetensorsFiles: one file or the
    shards an index names) one per-expert tensor at a time, 3·count tensors and no other expert's
    bytes, each transposed from the file's [out, in]. `into` (the same keys: tensors of those shapes,
    an `Experts`' Parameters) is filled in place (cast to its dtype) and returned; else new tensors
    of the file's dtype are."""
    if not _holds(files, expert_name(family, block, "gate", first)) and _holds(files, FUSED["down"].format(i=block)):
        return _read_fused(files, block, first, count, dict(into or {}))
    out = dict(into or {})
    for which in ("gate", "up", "down"):
        for local in range(count):
            value = files.get(expert_name(family, block, which, first + local)).t()
            if which not in out:
                out[which] = torch.empty((count,) + tuple(value.shape), dtype=value.dtype)
            out[which][local].copy_(value)
    return out


def _holds(files, name: str) -> bool:
    return name in files.files


def _read_fused(files, block: int, first: int, count: int, out: dict) -> dict:
    """read_experts from transformers' fused layout: rows [first, first + count) of gate_up_proj
    [E, 2f, h] and down_proj [E, h, f] (their leading dimension: only those experts' bytes are read)."""
    names = FUSED["gate_up"].format(i=block), FUSED["down"].format(i=block)
    _, hidden, width = files.shape(names[1])
    gate_up = files.read(names[0], rows=(first, first + count)).reshape(count, 2 * width, hidden)
    down = files.read(names[1], rows=(first, first + count)).reshape(count, hidden, width)
    values = {"gate": gate_up[:, :width].transpose(1, 2), "up": gate_up[:, width:].transpose(1, 2),
              "down": down.transpose(1, 2)}
    for which, value in values.items():
        if which in out:
            out[which].copy_(value)
        else:
            out[which] = value.contiguous()
    return out


def router_name(files, family: str, block: int) -> str:
    """The router's name in `files`: the family's, or transformers' fused layout's."""
    name = ROUTER[family].format(i=block)
    return name if _holds(files, name) else FUSED["router"].format(i=block)


@torch.no_grad()
def fill_moe(files, family: str, part: str, module: torch.nn.Module) -> set:
    """Fill the MoE parts of block `part` ("blocks.<i>", empty storage): its router, the experts it
    holds (`experts.first` .. + count: an expert-parallel rank's own), and a zero expert_bias
    (sigmoid_bias's; Mixtral and Qwen3-MoE route by softmax). Returns the local names filled."""
    mlp = getattr(module, "mlp", None)
    if not isinstance(mlp, MoE):
        return set()
    if mlp.shared is not None:
        raise ValueError(f"model.shared_experts: {family} has no shared experts; the checkpoint cannot fill them")
    block = int(part.removeprefix("blocks."))
    mlp.router.weight.copy_(files.get(router_name(files, family, block)))
    experts = mlp.experts
    read_experts(files, family, block, experts.first, experts.count,
                 into={"gate": experts.gate, "up": experts.up, "down": experts.down})
    mlp.expert_bias.zero_()
    return {"mlp.router.weight", "mlp.experts.gate", "mlp.experts.up", "mlp.experts.down"}


# ----------------------------------------------------------------------------- out


def moe_family(qk_norm: bool = False, qkv_bias: bool = False, experts: int = 0, shared_experts: int = 0,
               router: str = "softmax_topk", router_normalize: bool = True, moe_layers=None,
               moe_ffn_hidden: int = None, ffn_hidden: int = None, capacity_factor: float = None, **_) -> str:
    """"mixtral" | "qwen3_moe": the transformers class that computes what our MoE model computes
    (q/k norms: Qwen3-MoE; none: Mixtral), or a ValueError naming the field neither has."""
    problems = []
    if shared_experts:
        problems.append("model.shared_experts > 0 (neither has shared experts). Fix: model.shared_experts=0")
    if router != "softmax_topk":
        problems.append(f"model.router={router} (both route by softmax top-k). Fix: model.router=softmax_topk")
    if capacity_factor is not None:
        problems.append(f"model.capacity_factor={capacity_factor} (both are dropless; the exported model would "
                        f"compute without drops). Fix: model.capacity_factor=null")
    if qkv_bias:
        problems.append("model.qkv_bias=true (neither has q/k/v biases). Fix: model.qkv_bias=false")
    if not qk_norm:  # Mixtral: every block sparse, renormalised top k, the experts ffn_hidden wide
        if not router_normalize:
            problems.append("model.router_normalize=false without qk_norm (Mixtral renormalises its top k; "
                            "Qwen3-MoE, which need not, has q/k norms). Fix: model.router_normalize=true")
        if moe_layers is not None:
            problems.append(f"model.moe_layers={list(moe_layers)} without qk_norm (every Mixtral block is sparse). "
                            f"Fix: model.moe_layers=null")
        if moe_ffn_hidden not in (None, ffn_hidden):
            problems.append(f"model.moe_ffn_hidden={moe_ffn_hidden} != ffn_hidden={ffn_hidden} without qk_norm "
                            f"(Mixtral's experts are intermediate_size wide). Fix: model.moe_ffn_hidden=null")
    if problems:
        raise ValueError(f"model: a mixture of {experts} experts has no Hugging Face class here: " + "; ".join(problems))
    return "qwen3_moe" if qk_norm else "mixtral"


def moe_config(config: dict, family: str, layers: int, experts: int, experts_per_token: int, ffn_hidden: int,
               moe_ffn_hidden: int = None, moe_layers=None, router_normalize: bool = True,
               aux_loss_coefficient: float = 0.01, **_) -> dict:
    """hf.py's dense config.json (a Llama's or a Qwen3's) made `family`'s: the class, the expert
    fields, and the sparse blocks (Qwen3-MoE: mlp_only_layers = the dense ones, decoder_sparse_step 1)."""
    config = {key: value for key, value in config.items() if key not in ("mlp_bias", "layer_types")}
    config.update(num_experts_per_tok=experts_per_token, router_aux_loss_coef=aux_loss_coefficient,
                  output_router_logits=False)
    if family == "mixtral":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      router_jitter_noise=0.0, sliding_window=None)
        return config
    sparse = set(range(layers) if moe_layers is None else moe_layers)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                  moe_intermediate_size=moe_ffn_hidden or ffn_hidden, norm_topk_prob=bool(router_normalize),
                  decoder_sparse_step=1, mlp_only_layers=sorted(set(range(layers)) - sparse))
    return config


def moe_tensors(family: str, name: str, tensor: torch.Tensor):
    """(Hugging Face name, contiguous tensor) pairs for our MoE tensor `name` ("blocks.<i>.mlp...."):
    the router's weight as it is, each expert's matrix transposed to [out, in], none for
    expert_bias (a softmax router never reads it); None when `name` is not an MoE tensor."""
    match = OURS.fullmatch(name)
    if match is None:
        return None
    block, local, which = int(match.group(1)), match.group(2), match.group(3)
    if local == "router.weight":
        return [(ROUTER[family].format(i=block), tensor.detach().contiguous())]
    if local == "expert_bias":  # only sigmoid_bias reads it, and moe_family refuses that router
        return []
    if which is None:
        raise ValueError(f"{name}: {family} has no shared experts. Fix: model.shared_experts=0")
    return [(expert_name(family, block, which, expert), tensor[expert].detach().t().contiguous())
            for expert in range(tensor.shape[0])]


def model_moe_fields(model) -> dict:
    """The MoE fields (schema names) read off a built model's MoE modules; {} for a dense model."""
    sparse = [int(name) for name, block in model.blocks.items() if hasattr(getattr(block, "mlp", None), "experts")]
    if not sparse:
        return {}
    moe = model.blocks[str(sparse[0])].mlp
    return dict(experts=moe.total, experts_per_token=moe.k, shared_experts=0 if moe.shared is None else 1,
                moe_ffn_hidden=moe.experts.width, router=moe.kind, router_normalize=moe.normalize,
                aux_loss_coefficient=moe.aux_loss_coefficient, capacity_factor=moe.capacity_factor,
                moe_layers=None if len(sparse) == len(model.blocks) else sparse)
