"""Bucketed gradient reductions (`strategy.bucket_mb`): one all-reduce per bucket, the same numbers.

The pipeline stages' data-parallel all-reduce and L2L's host-side all-reduce run once per flat
bucket of at most bucket_mb MiB instead of once per parameter tensor (bucket_mb=0). Each run is
compared with the per-tensor one: losses and parameters bit-identical (two replicas sum the same
two addends), logical bytes equal, and the collectives per step (metrics.csv `comm_calls`) equal to
the number of buckets the model's stages cut into.
"""

import csv

import pytest
import torch

from layerwise.run.fit import train
from layerwise.run.task import model_arguments
from layerwise.preflight import validate
from models import build_model
from strategies.buckets import bucket_bytes, parameter_buckets
from strategies.l2l import stage_modules
from strategies.stages import stage_parameters
from tests.ranks import QUICK, compose_config
from tests.references import consolidated_parameters

STEPS = 2
BYTE_VOCABULARY = 256  # the stdlib corpus is read as bytes
# bucket_mb values: per tensor (the comparator), the default (one bucket per stage here), and
# 10 KiB, which cuts a block of this model into several buckets.
BUCKET_SIZES = (0, 25, 0.01)


def meta_model(cfg):
    return build_model(cfg.model.architecture, device="meta",
                       **model_arguments(cfg.model, BYTE_VOCABULARY, cfg.seed))


def pipeline_buckets(cfg) -> int:
    """Buckets of a one-rank pipeline: every stage's parameters, as StageWork.reduce_gradient cuts them."""
    model, per_stage = meta_model(cfg), cfg.strategy.layers_per_stage
    stages = cfg.model.layers // per_stage
    return sum(len(parameter_buckets(stage_parameters(model, stage, stages, per_stage)[::-1],
                                     bucket_bytes(cfg.strategy.bucket_mb))) for stage in range(stages))


def l2l_buckets(cfg) -> int:
    """Buckets of L2L's host store: each relay stage's parameters (untied model: each owns its own)."""
    return sum(len(parameter_buckets(list(module.parameters()), bucket_bytes(cfg.strategy.bucket_mb)))
               for module in stage_modules(meta_model(cfg)))


CASES = {  # id: overrides, expected all-reduces per step from the config
    "modular_pipeline_dp2_m4": (["strategy=modular_pipeline", "strategy.pipeline_degree=1"], pipeline_buckets),
    "l2l_dp2_m4": (["strategy=l2l"], l2l_buckets),
}


def run(directory, *overrides):
    cfg = compose_config(*QUICK, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", *overrides)
    summary = train(cfg, directory, validate(cfg))
    rows = list(csv.DictReader((directory / "metrics.csv").open()))
    return cfg, summary, [row for row in rows if row["comm_calls"]]


def test_parameters_fill_buckets_in_order_up_to_the_capacity():
    parameters = [torch.empty(n, device="meta") for n in (10, 10, 30, 5, 5)]  # 4 bytes each
    sizes = lambda capacity: [[p.numel() for p in bucket] for bucket in parameter_buckets(parameters, capacity)]
    assert sizes(0) == [[10], [10], [30], [5], [5]]
    assert sizes(80) == [[10, 10], [30], [5, 5]]
    assert sizes(10 ** 6) == [[10, 10, 30, 5, 5]]
    mixed = [torch.empty(4, device="meta"), torch.empty(4, device="meta", dtype=torch.bfloat16)]
    assert len(parameter_buckets(mixed, 10 ** 6)) == 2  # one flat buffer holds one dtype


@pytest.mark.parametrize("case", list(CASES))
def test_one_all_reduce_per_bucket_and_the_same_numbers(case, tmp_path):
    overrides, expected_buckets = CASES[case]
    strategy = overrides[0].removeprefix("strategy=")
    runs = {size: run(tmp_path / str(size), *overrides, f"strategy.bucket_mb={size}") for size in BUCKET_SIZES}
    per_tensor_cfg, per_tensor, per_tensor_rows = runs[0]
    per_tensor_parameters = consolidated_parameters(tmp_path / "0", strategy)
    calls = {}
    for size, (cfg, summary, rows) in runs.items():
        calls[size] = [int(row["comm_calls"]) for row in rows]
        assert calls[size] == [expected_buckets(cfg)] * STEPS, f"bucket_mb={size}"
        assert [row["comm_bytes_all_reduce"] for row in rows] == [row["comm_bytes_all_reduce"] for row in per_tensor_rows]
        assert summary["losses"] == per_tensor["losses"]
        parameters = consolidated_parameters(tmp_path / str(size), strategy)
        assert all(torch.equal(parameters[name], value) for name, value in per_tensor_parameters.items())
    print(f"{case}: all-reduces per step by bucket_mb: {({size: c[0] for size, c in calls.items()})}")
    parameter_tensors = sum(1 for _ in meta_model(per_tensor_cfg).parameters())
    assert calls[0][0] == parameter_tensors > calls[0.01][0] > calls[25][0]
