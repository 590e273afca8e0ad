"""What the claims measure at small scale, shared with the benchmarks that print the same numbers:
L2L's compute-side peaks (benchmarks/l2l_memory.py) and the tensor-parallel runs' overrides
(benchmarks/tensor_parallel.py)."""

import torch
from omegaconf import OmegaConf

from layerwise.run.optim import build_optimizer
from models import build_model
from models.transformer import IGNORE_INDEX
from parallel.memory import ComputeMemoryMeter
from strategies.l2l import relay_peak_bytes


OPTIMIZER = OmegaConf.create(dict(name="adamw", lr=1e-4, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                                  momentum=0.9))


def model_of(architecture, layers, hidden, heads, sequence, dropout=0.1):
    return build_model(architecture, vocab_size=256, sequence_length=sequence, layers=layers, hidden=hidden,
                       heads=heads, mlp_ratio=4, dropout=dropout, seed=0)


def batch(size, sequence, masked):
    """A seeded byte batch (BERT: 15% of positions scored) for the CPU meters."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (size, sequence), generator=generator)  # host: the CPU meters' batch
    if not masked:
        return tokens, tokens
    scored = torch.rand(size, sequence, generator=generator) < 0.15  # host: BERT's 15% of positions
    return tokens, torch.where(scored, tokens, torch.full_like(tokens, IGNORE_INDEX))


def relay_peak(model, tokens, targets, micro_batches, constant_memory, warm_up=True):
    """Peak compute-side bytes of one relay step (the host store is never counted)."""
    optimizer = build_optimizer(OPTIMIZER, model.named_parameters())
    return relay_peak_bytes(model, optimizer, tokens, targets, micro_batches, constant_memory, warm_up)


def single_peak(model, tokens, targets):
    """`single`: weights and Adam state resident on the device, then forward + backward + step."""
    optimizer = build_optimizer(OPTIMIZER, model.named_parameters())
    warm_tokens, warm_targets = tokens[:1], targets[:1]
    model.loss(model(warm_tokens), warm_targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    meter = ComputeMemoryMeter()
    meter.resident(list(model.parameters()) + [value for state in optimizer.state.values()
                                               for value in state.values() if torch.is_tensor(value)])
    with meter:
        model.loss(model(tokens), targets).backward()
        optimizer.step()
    return meter.peak_bytes


GRIDS = {"tp_1d": "strategy.tensor_grid=8", "tp_2d": "strategy.tensor_grid=2",
         "three_d": "strategy.tensor_grid=2"}


def overrides(arguments, strategy: str, devices: int) -> list:
    shape = [f"model.hidden={arguments.hidden}", "model.heads=8", f"model.layers={arguments.layers}",
             f"data.global_batch_size={arguments.batch}", f"data.sequence_length={arguments.sequence}"]
    return (["logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
             f"trainer.max_steps={arguments.steps}", "data.max_bytes=2000000",
             f"strategy={strategy}", f"hardware.devices_per_node={devices}"]
            + shape + ([GRIDS[strategy]] if strategy in GRIDS else []))
