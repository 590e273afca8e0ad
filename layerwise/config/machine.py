"""This machine's peak FLOP/s per core and its core count, for the `cpu` hardware profile.

conf/hardware/cpu.yaml reads them through the resolvers `${machine_peak_flops:DTYPE}` and
`${machine_cores:}` (registered in layerwise/config/store.py), so MFU on a laptop is measured against
what its cores can do rather than a guess (a guess of 50 GFLOP/s once gave `make run` an MFU of 1.02).

The peak of one core is the larger of two figures, so that no run can beat it:
- the instruction set's bound: clock × FLOPs per cycle, the FLOPs per cycle read from the CPU's flags
  (`FLOPS_PER_CYCLE`, two fused multiply-add pipes of the widest vector unit, the most any x86 core
  issues; AMX's tile unit for bf16/fp16 where present) and the clock from cpufreq's maximum or, in a
  virtual machine without cpufreq, the highest `cpu MHz` in /proc/cpuinfo;
- one thread's measured rate on a matrix product (best of five; 1024³, or smaller where that dtype is
  slow on this CPU), a lower bound on the true peak that covers turbo clocks above the ones the system
  reports.
"""

import functools
import os
import time
from pathlib import Path

DTYPES = ("fp32", "bf16", "fp16")

# FLOPs per cycle per core of the fp32 vector units: 2 FMA pipes × lanes × 2 FLOPs (multiply, add).
# Intel's optimisation reference manual (Skylake-SP onwards: two 512-bit FMA units) and AMD's Zen 4/5
# software optimisation guides (two 256-bit pipes issuing 512-bit work over two cycles on Zen 4, so 64 is
# an upper bound there). The widest flag present wins.
FLOPS_PER_CYCLE = (("avx512f", 64), ("fma", 32), ("avx", 16), ("sse2", 8))
# bf16/fp16 products: AMX multiplies 16×32 bf16/fp16 tiles at 1,024 FLOPs per cycle per core (Intel
# Architecture Instruction Set Extensions reference, ch. 3); AVX-512 BF16/FP16 do two products per fp32
# lane (VDPBF16PS, VFMADDPH): twice the fp32 rate. Without either, torch computes them in fp32.
HALF_FLOPS_PER_CYCLE = {"bf16": (("amx_bf16", 1024), ("avx512_bf16", 2)),
                        "fp16": (("amx_fp16", 1024), ("avx512_fp16", 2))}


def cpu_flags_and_clock(cpuinfo: str, max_freq_khz: str = None):
    """(the CPU's flags, its clock in Hz) from /proc/cpuinfo's text and cpufreq's maximum if known."""
    flags, megahertz = set(), 0.0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags |= set(value.split())
        elif key.strip() == "cpu MHz":
            megahertz = max(megahertz, float(value))
    hertz = float(max_freq_khz) * 1e3 if max_freq_khz else megahertz * 1e6
    return flags, hertz


def isa_core_flops(flags: set, hertz: float, dtype: str) -> float:
    """The instruction set's bound for one core: clock × FLOPs per cycle (0 if nothing is known)."""
    fp32 = next((flops for flag, flops in FLOPS_PER_CYCLE if flag in flags), 0) * hertz
    for flag, factor in HALF_FLOPS_PER_CYCLE.get(dtype, ()):
        if flag in flags:
            return factor * hertz if factor > 2 else factor * fp32
    return fp32


def measured_core_flops(dtype: str, repeats: int = 5, budget_s: float = 0.05) -> float:
    """One thread's best rate on a square matrix product in `dtype` (3 significant digits).

    The side is the largest of 256, 512 and 1024 whose product a 256³ trial predicts to take at most
    `budget_s`. Why: every `python train.py` on the cpu profile runs this probe, and a CPU without
    bf16/fp16 vector units computes those products ~100× slower than fp32 (an AVX2-only EPYC: 1024³ in
    bf16 took 7 s per product, so 14.6 s of every run's start-up). The rate is a lower bound on the
    peak either way (core_peak_flops takes the larger of it and the instruction set's bound)."""
    import torch

    kind = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trial = _best_product_time(256, kind, repeats=1)  # also the warm-up: page faults, kernel choice
        size = max((s for s in (256, 512, 1024) if trial * (s / 256) ** 3 <= budget_s), default=256)
        best = _best_product_time(size, kind, repeats)
    finally:
        torch.set_num_threads(threads)
    return float(f"{2 * size ** 3 / best:.3g}")


def _best_product_time(size: int, kind, repeats: int) -> float:
    """The shortest of `repeats` timings of one size³ product (after one untimed product)."""
    import torch

    a, b = torch.randn(size, size).to(kind), torch.randn(size, size).to(kind)  # host: the probe times this CPU
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=None)
def core_peak_flops(dtype: str) -> float:
    """The peak FLOP/s of one of this machine's cores in `dtype`: the larger of the instruction set's
    bound and one thread's measured matrix-product rate (see the module's docstring)."""
    if dtype not in DTYPES:
        raise ValueError(f"machine_peak_flops: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    cpuinfo = Path("/proc/cpuinfo")
    maximum = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    flags, hertz = cpu_flags_and_clock(cpuinfo.read_text() if cpuinfo.exists() else "",
                                       maximum.read_text().strip() if maximum.exists() else None)
    return max(isa_core_flops(flags, hertz, dtype), measured_core_flops(dtype))


def machine_cores() -> int:
    """The cores this process may run on (its affinity, which a batch scheduler may narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_threads(accelerator: str, ranks_on_node: int, cores: int = None, environ=None) -> int:
    """torch's intra-op threads for one rank of a run (every launcher sets them from here).

    1. Slurm's SLURM_CPUS_PER_TASK, where set: the cores Slurm gave this task
       (`hydra.launcher.cpus_per_task`), whatever the device;
    2. a CPU rank: 1. The ranks of a node share its cores for their compute; more threads per
       rank only contend (two intra-op threads on 2 shared cores mostly spin-wait:
       layerwise/reproduce/l2l.py);
    3. a GPU rank: its share of the node's cores, `cores // ranks_on_node`, at least 1. Its compute
       is on the GPU; the host runs its data loading and, under L2L, the AdamW update of the host
       store, which on one thread would use 1 of the 16 or more cores a node has per GPU.
    `cores`: the node's cores this process may use (default `machine_cores()`); `environ`: the
    process's environment (default os.environ).
    """
    environ = os.environ if environ is None else environ
    slurm = environ.get("SLURM_CPUS_PER_TASK")
    if slurm:
        return max(1, int(slurm))
    if accelerator != "gpu":
        return 1
    cores = machine_cores() if cores is None else cores
    return max(1, cores // max(1, ranks_on_node))
