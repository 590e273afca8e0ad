"""What the claims measure at small scale, shared with the benchmarks that print the same numbers:
L2L's compute-side peaks (benchmarks/l2l_memory.py), the tensor-parallel runs' overrides
(benchmarks/tensor_parallel.py) and an all-gather / reduce-scatter counter independent of
parallel/comm.py's (benchmarks/zero_layered.py, tests/test_zero_layered.py)."""

import inspect
from contextlib import contextmanager

import torch
from omegaconf import OmegaConf

from layerwise.run.optim import build_optimizer
from models import build_model
from models.transformer import IGNORE_INDEX
from parallel import compat
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


# ----- an independent counter: torch.distributed's collectives tallied from their raw tensors

# torch.distributed's names for them differ across the torch versions we accept: parallel/compat.py
COUNTED = ((compat.ALL_GATHER_SINGLE, "all_gather", 0),  # (output, input, group, async_op): output is full
           (compat.REDUCE_SCATTER_SINGLE, "reduce_scatter", 1))  # (output, input, op, group, ...): input is full


@contextmanager
def counted_collectives():
    """Inside the block, every all-gather / reduce-scatter through torch.distributed adds its ring
    bytes, full tensor × (n − 1)/n, to the yielded tally by kind: read from the tensors the call is
    given, not from parallel/comm.py's Communicator, so the two counts check each other. The
    functions are wrapped for the block only and restored on leaving it."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    tally = {kind: 0.0 for _, kind, _ in COUNTED}
    originals = {name: (getattr(c10d, name), getattr(dist, name)) for name, _, _ in COUNTED}

    def counting(name, kind, full_argument):
        original, signature = originals[name][0], inspect.signature(originals[name][0])

        def counted(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            full = list(arguments.values())[full_argument]
            size = dist.get_world_size(arguments.get("group"))
            tally[kind] += full.numel() * full.element_size() * (size - 1) / size
            return original(*args, **kwargs)
        return counted
    try:
        for name, kind, full_argument in COUNTED:
            wrapped = counting(name, kind, full_argument)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        yield tally
    finally:
        for name, (in_c10d, in_dist) in originals.items():
            setattr(c10d, name, in_c10d)
            setattr(dist, name, in_dist)


def counted_fit(rank, cfg, directory, world) -> dict:
    """`fit_rank` (one forked rank of a run) under `counted_collectives`; returns the rank's tally."""
    from layerwise.run.fit import fit_rank
    with counted_collectives() as tally:
        fit_rank(rank, cfg, directory, world)
    return tally
