"""trainer.profile_steps (issue 59): a Chrome trace and a memory record per rank for the chosen steps.

A 2-rank pipeline profiles step 2: each rank's trace is a Chrome/Perfetto JSON of that step (its
forward and backward operators, the sends between the stages), its CPU memory record is the
compute-memory meter's, and summary.json links all four files. The CUDA paths (the allocator's
history, its snapshot at a profiled step and on an out-of-memory) cannot run on this machine: the
out-of-memory one is driven with the allocator's dump replaced, to show it writes before the run fails.
"""

import json
from types import SimpleNamespace

import torch

from layerwise.preflight import validate
from layerwise.run.fit import train
from layerwise.run.profile import StepProfiler
from tests.ranks import QUICK, compose_config

PIPELINE = ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.layers_per_stage=1",
            "strategy.micro_batches=2"]


def test_profile_steps_write_a_trace_and_a_memory_record_per_rank(tmp_path):
    cfg = compose_config(*QUICK, *PIPELINE, "trainer.max_steps=3", "trainer.limit_val_batches=0",
                         "trainer.profile_steps=[2]")
    summary = train(cfg, tmp_path, validate(cfg))
    assert summary["status"] == "completed", summary["error"]
    assert summary["profile"] == {"traces": ["profile/rank0_step2.json", "profile/rank1_step2.json"],
                                  "memory": ["profile/rank0_step2_memory.json", "profile/rank1_step2_memory.json"]}
    assert sorted(path.name for path in (tmp_path / "profile").iterdir()) == sorted(
        name.removeprefix("profile/") for name in summary["profile"]["traces"] + summary["profile"]["memory"])
    for rank in (0, 1):
        events = json.loads((tmp_path / f"profile/rank{rank}_step2.json").read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert "aten::mm" in names or "aten::addmm" in names, sorted(names)[:50]  # the blocks' products
        assert any("Backward" in name for name in names)  # autograd's nodes: the backward ran inside
        memory = json.loads((tmp_path / f"profile/rank{rank}_step2_memory.json").read_text())
        assert memory["peak_compute_bytes"] > 0 and memory["matrix_product_dtypes"]["float32"] > 0


def test_an_out_of_memory_on_cuda_writes_the_allocator_snapshot(tmp_path, monkeypatch):
    """StepProfiler.on_exception dumps the allocator's snapshot on torch.OutOfMemoryError on CUDA only
    (the dump replaced: this build has no CUDA allocator)."""
    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dumped.append)
    profiler = StepProfiler(tmp_path, [1], evidence=None)
    for device, exception, expected in (("cuda", torch.OutOfMemoryError("CUDA out of memory"), 1),
                                        ("cuda", RuntimeError("other"), 0),
                                        ("cpu", torch.OutOfMemoryError("out of memory"), 0)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), global_rank=3)
        before = len(dumped)
        profiler.on_exception(trainer, None, exception)
        assert len(dumped) - before == expected, (device, exception)
    assert dumped == [str(tmp_path / "profile" / "rank3_oom_memory.pickle")]


def test_validation_refuses_profile_steps_outside_the_run():
    import pytest

    from layerwise.config.errors import ConfigError
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=\[0, 4\]: \[0, 4\] are not optimizer steps"):
        validate(compose_config(*QUICK, "trainer.max_steps=3", "trainer.profile_steps=[0,4]"))
    validate(compose_config(*QUICK, "trainer.max_steps=3", "trainer.profile_steps=[1,3]"))
