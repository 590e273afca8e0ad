"""The cpu profile's peaks come from the machine, and the MFU audit that holds every run to ≤ 1 can fail."""

import json
import tempfile
from pathlib import Path

import pytest

from layerwise.config.machine import core_peak_flops, cpu_flags_and_clock, isa_core_flops, machine_cores, \
    measured_core_flops
from layerwise.config.store import compose
from layerwise.planning.inputs import device_of
from tests.mfu_audit import audit

GENOA = "processor\t: 0\ncpu MHz\t\t: 2596.138\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16\n"


def test_the_instruction_set_bound_reads_flags_and_clock():
    flags, hertz = cpu_flags_and_clock(GENOA)
    assert hertz == pytest.approx(2596.138e6)
    assert isa_core_flops(flags, hertz, "fp32") == pytest.approx(64 * 2596.138e6)
    assert isa_core_flops(flags, hertz, "bf16") == pytest.approx(128 * 2596.138e6)  # AVX-512 BF16: 2×
    assert isa_core_flops(flags, hertz, "fp16") == pytest.approx(64 * 2596.138e6)  # no FP16 unit: fp32's
    _, maximum = cpu_flags_and_clock(GENOA, max_freq_khz="3700000")  # cpufreq's maximum wins
    assert maximum == 3.7e9
    amx = {"avx512f", "amx_bf16"}
    assert isa_core_flops(amx, 2e9, "bf16") == 1024 * 2e9
    assert isa_core_flops({"sse2"}, 1e9, "fp32") == 8e9 and isa_core_flops(set(), 1e9, "fp32") == 0


def test_the_cpu_profile_peak_is_never_below_a_measured_product():
    """The peak is at least what one thread measurably does, so no run's MFU can pass 1 on it."""
    cfg = compose(["hardware=cpu"])
    assert cfg.hardware.peak_flops.fp32 == core_peak_flops("fp32") >= measured_core_flops("fp32") * 0.5
    assert cfg.hardware.compute_units_per_node == machine_cores()
    # the node's cores are shared by its ranks: 2 ranks on this node get cores/2 each, 1 rank all of them
    assert device_of(cfg, 1).flops_per_second == pytest.approx(core_peak_flops("fp32") * machine_cores())
    ranks = cfg.hardware.devices_per_node
    assert device_of(cfg, ranks).flops_per_second * ranks == pytest.approx(core_peak_flops("fp32") * machine_cores())


def test_the_mfu_audit_finds_a_value_above_one():
    with tempfile.TemporaryDirectory() as root:  # outside the session's tmp: the real audit must not see it
        _planted_run_is_caught(Path(root))


def _planted_run_is_caught(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"mfu": 0.4}))
    (run / "plan.json").write_text(json.dumps({"roles": [{"mfu": 0.3}, {"mfu": 1.02}]}))
    (run / "metrics.csv").write_text("step,mfu\n1,0.5\n2,\n3,1.5\n")
    files, values, above = audit(tmp_path)
    assert (files, values) == (3, 5)
    assert sorted(line.split(": ", 1)[1] for line in above) == ["metrics.csv:4 = 1.500",
                                                                 "plan.json.roles[1] = 1.020"]
