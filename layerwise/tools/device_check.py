"""The first contact with a GPU: one script, one GPU, every recent piece of the code in one table.

    scripts/device_check.sh OUTDIR           on the GPU node (one H100/H200, 16 cores): ≤ 8 minutes
    scripts/device_check.sh --cpu OUTDIR     the same steps on the `cpu` profile, tiny sizes: proves
                                             the script end to end before a GPU minute is spent on it
    python -m layerwise.tools.device_check [--cpu] [--subset] [--sections a,b] [--budget-s S] OUTDIR

Six sections, each a function returning rows (`Row`), run in this order:
1. environment: the device, torch, and a bf16 matrix product's rate (the roofline's ceiling);
2. equality: `single` on the device against `single` on the CPU (the reference itself), then `kfac`
   (against kfac on CPU), `l2l` (constant_memory false/true × dropout 0/0.1; with dropout its masks
   come from the CPU generator, so it is held to `single` on CPU with the same dropout), `fsdp2` on
   one rank, zero-bubble schedules on one pipeline rank (zero_bubble_h1, zbv), a resume (2 steps,
   stop, resume to 4, against 4 uninterrupted) of `single` and of `l2l`, and a Hugging Face import
   (fp32 and bf16 safetensors) against the same seeded Llama;
3. precision: bf16-mixed and 16-mixed steps against fp32 and each other, and the agreed loss
   scaler (strategies/precision.py) skipping an injected inf;
4. speed: tokens/s and MFU of gpt_small, llama_small and a ~1B Llama at sequence 2048 in bf16-mixed,
   each beside a plain PyTorch loop of the same model class (AdamW, autocast, the same batch, timed
   with CUDA events after warm-up); goal ours ≥ 0.95× the plain loop;
5. plan: plan mode's predicted step (goal ±15%) and memory (goal ±5% of the CUDA allocator's peak)
   against measured runs of three one-GPU configurations;
6. held_out: issue 31's two held-out rows (`tp_2d` q2 on 4 ranks, `three_d` q2 on 8 ranks) on the
   node's CPU cores, a core per rank, after `mode=calibrate` (docs/plan.md, "Where issue 31 stops").

Every run is a subprocess (train.py as a user runs it, or this module's own helpers), with a
timeout from the time left: a step that fails or runs out of time is a row with its reason and the
next step still runs. After every section the results are rewritten: OUTDIR/device_check.json (every
row and number) and OUTDIR/results.md (the table), so a run cut off by the wall clock still leaves
what it measured.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from layerwise.tools.device_helpers import HELPER_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("environment", "equality", "precision", "speed", "plan", "held_out")

# Tolerances (the same reasoning as tests/tolerances.py, which library code does not import):
# fp32 losses of one computation whose sums run in another order differ by a few ulp per operation,
# ~1e-7 relative; under AdamW a rounding-sized gradient may move one element by one lr, which moves the
# loss at second order. 1e-5 relative is the suite's bound for "equals single".
FP32_LOSS_RTOL = 1e-5
# bf16 keeps 8 bits of mantissa (2^-8 ≈ 4e-3 relative): two equal computations round differently in a
# few products per step. fp16 keeps 11, so the same bound holds it too.
BF16_LOSS_RTOL = 1e-2
SPEED_GOAL = 0.95  # ours ≥ 0.95 × the plain loop's tokens/s (issue 54)
STEP_GOAL = 0.15  # plan mode's step within ±15% of the measured median step
MEMORY_GOAL = 0.05  # plan mode's peak within ±5% of the CUDA allocator's peak


# ----------------------------------------------------------------------------- the two modes

@dataclass(frozen=True)
class Mode:
    """What one run of the check uses: the GPU node's sizes and profile, or --cpu's tiny ones."""

    name: str  # gpu | cpu
    device: tuple  # overrides that put a one-process run on the checked device
    speed_models: dict  # label -> model and data overrides of the speed section
    speed_precision: str
    speed_steps: int
    plan_configs: dict  # label -> overrides of the plan section
    parallel_runs: int  # equality points run at once (they time nothing)
    budget_s: float  # the whole check's wall clock
    point_timeout_s: float  # one small train.py run
    calibrate_quick: bool  # held_out: mode=calibrate's quick sizes (seconds) or full (~1-2 min)


# The equality and precision runs: small enough to start in seconds, 4 blocks (zbv puts 2 on each
# of its 2 stages), a learning rate that moves the loss measurably in 4 steps, a constant schedule
# so a resumed run's steps have the uninterrupted run's learning rates.
EQUALITY = ("model.layers=4", "model.hidden=64", "model.heads=4", "data.sequence_length=64",
            "data.global_batch_size=8", "data.max_bytes=2000000", "trainer.max_steps=4",
            "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.checkpoint_every_n_steps=1000",
            "trainer.charts=false", "logger=none", "trainer.progress=none", "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0", "optimizer.lr_schedule=constant", "hardware.precision=32-true")
GPT = "model=gpt_tiny"
CPU_REFERENCE = ("hardware=cpu", "hardware.devices_per_node=1")
SPEED_COMMON = ("logger=none", "trainer.progress=none", "trainer.charts=false", "trainer.limit_val_batches=0",
                "trainer.checkpoint_every_n_steps=100000", "trainer.measure_every_n_steps=100000",
                "data.max_bytes=4000000")
# A ~1B Llama (Llama 3.2 1B's shape: 16 blocks of width 2048, 32 heads, 8 key/value heads, SwiGLU 8192):
# 0.97 B weights in matrix products with the byte vocabulary; batch 4 × 2048 tokens: ~16 GB of weights and
# AdamW state and ~17 GB of bf16 activations, ~5.4e13 FLOPs a step (~0.1 s at 50% of the H100's bf16 peak).
LLAMA_1B = ("model=llama_small", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=8192", "model.rope_theta=500000", "model.max_sequence_length=2048",
            "data.sequence_length=2048", "data.global_batch_size=4")
TINY_SHAPE = ("model.layers=2", "model.hidden=64", "model.heads=4", "data.sequence_length=64",
              "data.global_batch_size=8")

GPU = Mode(
    name="gpu", device=("hardware=dgx_h100", "hardware.devices_per_node=1"),
    speed_models={"gpt_small": ("model=gpt_small", "data.sequence_length=256", "data.global_batch_size=64"),
                  "llama_small": ("model=llama_small", "data.sequence_length=256", "data.global_batch_size=64"),
                  "llama_1b": LLAMA_1B},
    speed_precision="bf16-mixed", speed_steps=14,
    plan_configs={"single gpt_small": ("strategy=single", "model=gpt_small", "data.sequence_length=256",
                                       "data.global_batch_size=64"),
                  "single llama_small recompute": ("strategy=single", "model=llama_small", "data.sequence_length=256",
                                                   "data.global_batch_size=64", "strategy.activation_recompute=full"),
                  "l2l gpt_small": ("strategy=l2l", "model=gpt_small", "data.sequence_length=256",
                                    "data.global_batch_size=64")},
    parallel_runs=6, budget_s=450, point_timeout_s=150, calibrate_quick=False)
# --cpu: 32-true (this CPU has no bf16 units: autocast's products run ~50× slower), stand-ins of the
# same families at tiny sizes.
CPU = Mode(
    name="cpu", device=CPU_REFERENCE,
    speed_models={"gpt_small": ("model=gpt_small", *TINY_SHAPE),
                  "llama_small": ("model=llama_tiny", *TINY_SHAPE),
                  "llama_1b": ("model=llama_tiny", "model.max_sequence_length=128",
                               *TINY_SHAPE[:-2], "data.sequence_length=128", "data.global_batch_size=4")},
    speed_precision="32-true", speed_steps=6,
    plan_configs={"single gpt_tiny": ("strategy=single", *TINY_SHAPE),
                  "single llama_tiny recompute": ("strategy=single", "model=llama_tiny", *TINY_SHAPE,
                                                  "strategy.activation_recompute=full"),
                  "l2l gpt_tiny": ("strategy=l2l", *TINY_SHAPE)},
    parallel_runs=2, budget_s=1800, point_timeout_s=300, calibrate_quick=True)


# ----------------------------------------------------------------------------- rows and the report

@dataclass
class Row:
    """One line of the results: `value` judged against `goal` gives `status`:
    ok (ran, within the goal), missed (ran, outside it), failed (an error), skipped (with `detail`)."""

    section: str
    name: str
    status: str
    value: Optional[float] = None
    goal: str = ""
    detail: str = ""
    numbers: dict = field(default_factory=dict)


def judged(section: str, name: str, value: Optional[float], within: bool, goal: str, detail: str = "",
           **numbers) -> Row:
    return Row(section, name, "ok" if within else "missed", value, goal, detail, numbers)


def failed(section: str, name: str, summary: dict) -> Row:
    return Row(section, name, "failed", detail=str(summary.get("error") or summary.get("status")))


def skipped(section: str, name: str, reason: str) -> Row:
    return Row(section, name, "skipped", detail=reason)


class Report:
    """The rows so far, rewritten to OUTDIR after every section (a cut-off run keeps them)."""

    def __init__(self, directory: Path, mode: Mode, started: float):
        self.directory, self.mode, self.started = Path(directory), mode, started
        self.rows, self.environment = [], {}

    def add(self, rows) -> None:
        self.rows.extend(rows)
        for row in rows:
            print(f"device_check: {row.section}: {row.name}: {row.status} {format_value(row.value)} {row.detail}",
                  flush=True)
        self.write()

    def write(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        document = {"mode": self.mode.name, "environment": self.environment,
                    "elapsed_s": round(time.time() - self.started, 1), "rows": [asdict(row) for row in self.rows]}
        write_atomically(self.directory / "device_check.json", json.dumps(document, indent=1))
        write_atomically(self.directory / "results.md", markdown(self.rows, self.mode, self.environment))


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def format_value(value) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def markdown(rows, mode: Mode, environment: dict) -> str:
    """results.md: the device, then one table (section, check, status, value, goal, detail)."""
    device = environment.get("device", "not read")
    lines = [f"# device_check ({mode.name} mode): {device}", "",
             f"torch {environment.get('torch', '?')}, {environment.get('cpu_count', '?')} CPU cores", "",
             "| section | check | status | value | goal | detail |", "|---|---|---|---|---|---|"]
    for row in rows:
        detail = row.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {row.section} | {row.name} | {row.status} | {format_value(row.value)} | {row.goal} | {detail} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- time and subprocesses

class Budget:
    """The wall clock left to the check; each subprocess gets the smaller of its own limit and it."""

    def __init__(self, seconds: float):
        self.deadline = time.time() + seconds

    def left(self) -> float:
        return self.deadline - time.time()

    def timeout(self, limit: float) -> float:
        return max(1.0, min(limit, self.left() - 5))


def child_environment(threads: Optional[int] = None) -> dict:
    """`threads`: OMP_NUM_THREADS of a run that shares the cores with others (torch's intra-op
    threads; several runs of 16 spinning threads each on 16 cores wait on each other's barriers)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
            **({"OMP_NUM_THREADS": str(threads)} if threads else {})}


def shared_cores(parallel: int) -> int:
    return max(1, (os.cpu_count() or 1) // parallel)


def run_point(overrides, directory: Path, timeout_s: float, keep_checkpoints: bool = False,
              threads: Optional[int] = None) -> dict:
    """train.py as a user runs it; its summary.json, or a failed one naming the last error line."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={directory}"]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                                env=child_environment(threads))
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        (directory / "device_check.log").write_text(str(expired.stdout or "") + str(expired.stderr or ""))
        return {"status": "failed", "error": f"no result within {timeout_s:.0f} s (time budget)"}
    (directory / "device_check.log").write_text(" ".join(command) + "\n" + output)
    if not keep_checkpoints:  # every run saves one at its end (12 GB for the 1B Llama): disk, not evidence
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
    summary_path = directory / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    if "mode=plan" in overrides and (directory / "plan.json").exists():
        return {"status": "completed", **json.loads((directory / "plan.json").read_text())}
    if "mode=calibrate" in overrides and result.returncode == 0:
        return {"status": "completed"}
    return {"status": "failed", "error": last_error(output)}


def last_error(output: str) -> str:
    """The last exception line of a failed run's output (Hydra ends with a hint about
    HYDRA_FULL_ERROR after it), else its last line."""
    lines = output.strip().splitlines() or ["no output"]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or lines)[-1]


def run_helper(name: str, arguments: dict, timeout_s: float) -> dict:
    """One of this module's helpers in a subprocess of its own (a CUDA error or an out-of-memory stays
    there); its JSON result, or a failed one."""
    command = [sys.executable, "-m", "layerwise.tools.device_helpers", name, json.dumps(arguments)]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                                env=child_environment())
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"helper {name}: no result within {timeout_s:.0f} s"}
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(HELPER_PREFIX):
            return {"status": "completed", **json.loads(line[len(HELPER_PREFIX):])}
    return {"status": "failed", "error": f"helper {name}: " + last_error(result.stderr or result.stdout)}


def run_all(jobs: dict, parallel: int) -> dict:
    """{key: job()} with up to `parallel` jobs at once (each waits on its own subprocess)."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def relative_gap(actual: list, expected: list) -> float:
    """The largest |a − e| / |e| over the steps (inf when the step counts differ)."""
    if len(actual) != len(expected) or not expected:
        return float("inf")
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


def compared(section: str, name: str, summary: dict, reference: dict, tolerance: float, against: str,
             precision: Optional[str] = None) -> Row:
    """A row holding `summary`'s losses to `reference`'s within `tolerance` (relative, every step)."""
    for run, label in ((summary, name), (reference, against)):
        if run.get("status") != "completed":
            return failed(section, name, {"error": f"{label}: {run.get('error') or run.get('status')}"})
    gap = relative_gap(summary["losses"], reference["losses"])
    within = gap <= tolerance and (precision is None or summary.get("precision") == precision)
    detail = f"against {against}; {len(summary['losses'])} steps; precision {summary.get('precision')}"
    return judged(section, name, gap, within, f"≤ {tolerance:g} relative", detail,
                  losses=summary["losses"], reference_losses=reference["losses"])


# ----------------------------------------------------------------------------- 1. environment

def environment_section(mode: Mode, budget: Budget, report: Report, subset: bool) -> list:
    """The device, the versions, and the measured bf16 product rate (the MFU tables' ceiling is the
    profile's datasheet peak; this says how far under it the card's own best product runs)."""
    info = run_helper("environment", {"gpu": mode.name == "gpu"}, budget.timeout(120))
    if info.get("status") != "completed":
        return [failed("environment", "device and versions", info)]
    report.environment = {key: value for key, value in info.items() if key != "status"}
    rows = [Row("environment", "device and versions", "ok", detail=f"{info['device']}; torch {info['torch']}, "
                f"lightning {info['lightning']}, hydra {info['hydra']}, python {info['python']}")]
    rows.append(Row("environment", "largest bf16 product rate (TFLOP/s)", "ok", info["matmul_tflops"],
                    detail=f"{info['matmul_edge']}³ bf16 products, median of {info['matmul_repeats']}"))
    return rows


# ----------------------------------------------------------------------------- 2. equality

def equality_points(mode: Mode, subset: bool) -> dict:
    """key -> overrides of every run the equality rows read (references included)."""
    device, cpu = [*EQUALITY, *mode.device], [*EQUALITY, *CPU_REFERENCE]
    llama = [*device, "strategy=single", "model=llama_tiny", "model.vocab_size=256"]
    device, cpu = [GPT, *device], [GPT, *cpu]
    points = {"single cpu": [*cpu, "strategy=single"], "single device": [*device, "strategy=single"]}
    if subset:
        return points
    points.update({
        "single cpu dropout 0.1": [*cpu, "strategy=single", "model.dropout=0.1"],
        "kfac cpu": [*cpu, "strategy=kfac"], "kfac device": [*device, "strategy=kfac"],
        "fsdp2 1 rank": [*device, "strategy=fsdp2"],
        "zero_bubble_h1 1 rank": [*device, "strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                  "strategy.pipeline_degree=1", "strategy.layers_per_stage=4"],
        "zbv 1 rank": [*device, "strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.pipeline_degree=1",
                       "strategy.layers_per_stage=2"],
        "llama device": llama,
    })
    for constant in ("false", "true"):
        for dropout in ("0", "0.1"):
            points[f"l2l constant_memory={constant} dropout={dropout}"] = [
                *device, "strategy=l2l", f"strategy.constant_memory={constant}", f"model.dropout={dropout}"]
    return points


def equality_section(mode: Mode, budget: Budget, report: Report, subset: bool, directory: Path) -> list:
    """Run every point (several at once: nothing here is timed), then each row against its reference."""
    points = equality_points(mode, subset)
    point = shared_point(mode, budget)
    jobs = {key: (lambda key=key: point(points[key], directory / slug(key))) for key in points}
    if not subset:
        for strategy, uninterrupted in (("single", "single device"), ("l2l", "l2l constant_memory=true dropout=0")):
            jobs[f"resume {strategy}"] = lambda strategy=strategy, uninterrupted=uninterrupted: resumed(
                points[uninterrupted], directory / f"resume-{strategy}", point)
        for dtype in ("float32", "bfloat16"):
            jobs[f"hf {dtype}"] = lambda dtype=dtype: hf_import(points["llama device"], dtype, directory / f"hf-{dtype}",
                                                                 point, budget.timeout(mode.point_timeout_s))
    summaries = run_all(jobs, mode.parallel_runs)
    return equality_rows(summaries, mode, subset)


def equality_rows(summaries: dict, mode: Mode, subset: bool) -> list:
    row = lambda name, reference, tolerance=FP32_LOSS_RTOL: compared(
        "equality", name, summaries[name], summaries[reference], tolerance, reference)
    rows = [row("single device", "single cpu")]
    if subset:
        return rows
    rows.append(row("kfac device", "kfac cpu"))
    for name in [key for key in summaries if key.startswith("l2l")]:
        # dropout > 0: l2l draws its masks from the CPU generator in single's order (docs/strategies/l2l.md)
        rows.append(row(name, "single cpu dropout 0.1" if name.endswith("0.1") else "single device"))
    rows += [row("fsdp2 1 rank", "single device"), row("zero_bubble_h1 1 rank", "single device"),
             row("zbv 1 rank", "single device"),
             row("resume single", "single device"),
             row("resume l2l", "l2l constant_memory=true dropout=0"),
             row("hf float32", "llama device"),
             # the file's weights are the fp32 ones rounded to bf16 (2^-9 relative): a bf16-sized change
             row("hf bfloat16", "hf float32", BF16_LOSS_RTOL)]
    rows.append(skipped("equality", "hang diagnosis", "one GPU: a hang needs two ranks and NCCL refuses two "
                        "ranks on one device; tests/test_hangs.py emulates NCCL's work on CPU"))
    return rows


def slug(text: str) -> str:
    return "".join(character if character.isalnum() or character in "._-" else "-" for character in text)


def shared_point(mode: Mode, budget: Budget) -> Callable:
    """run_point for runs that share the node (several at once, timing nothing): each reads its
    timeout when it starts (a later wave gets the time left) and gets its share of the cores."""
    threads = shared_cores(mode.parallel_runs)
    return lambda overrides, directory, **options: run_point(
        overrides, directory, budget.timeout(mode.point_timeout_s), threads=threads, **options)


def resumed(overrides: list, directory: Path, point: Callable) -> dict:
    """2 steps with a checkpoint at step 2, the process ends, then the same run directory to 4 steps:
    train.py resumes from its own `last` checkpoint (resume=true) and its summary covers all 4."""
    first = point([*overrides, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2",
                   "trainer.val_check_interval=2"], directory, keep_checkpoints=True)
    if first.get("status") != "completed":
        return first
    return point([*overrides, "trainer.checkpoint_every_n_steps=2"], directory)


def hf_import(llama: list, dtype: str, directory: Path, point: Callable, helper_timeout_s: float) -> dict:
    """The seeded Llama of `llama` written as a Hugging Face directory in `dtype`, then trained with
    model=hf model.path=DIR: equal to the seeded run when the file is fp32."""
    model_directory = directory / "model"
    written = run_helper("export_hf", {"overrides": llama, "dtype": dtype, "path": str(model_directory)},
                         helper_timeout_s)
    if written.get("status") != "completed":
        return written
    shaped = [o for o in llama if not o.startswith("model") or o.startswith("model.dropout")]  # config.json's shape
    return point([*shaped, "model=hf", f"model.path={model_directory}"], directory / "run")


# ----------------------------------------------------------------------------- 3. precision

def precision_section(mode: Mode, budget: Budget, report: Report, subset: bool, directory: Path) -> list:
    """bf16-mixed (and on a GPU 16-mixed) runs against fp32 and each other; the agreed scaler's skip."""
    scaler = run_helper("scaler", {"gpu": mode.name == "gpu"}, budget.timeout(120))
    rows = [scaler_row(scaler)]
    if subset:
        return rows + [skipped("precision", "bf16-mixed and 16-mixed runs", "--subset")]
    device = [GPT, *EQUALITY, *mode.device]
    points = {"single 32-true": [*device, "strategy=single"],
              "single bf16-mixed": [*device, "strategy=single", "hardware.precision=bf16-mixed"],
              "l2l bf16-mixed": [*device, "strategy=l2l", "hardware.precision=bf16-mixed"],
              "zero_bubble_h1 bf16-mixed": [*device, "strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                            "strategy.pipeline_degree=1", "strategy.layers_per_stage=4",
                                            "hardware.precision=bf16-mixed"]}
    if mode.name == "gpu":
        points.update({"single 16-mixed": [*device, "strategy=single", "hardware.precision=16-mixed"],
                       "zero_bubble_h1 16-mixed": [*points["zero_bubble_h1 bf16-mixed"][:-1],
                                                   "hardware.precision=16-mixed"]})
    point = shared_point(mode, budget)
    summaries = run_all({key: (lambda key=key: point(points[key], directory / slug(key)))
                         for key in points}, mode.parallel_runs)
    row = lambda name, reference, precision: compared("precision", name, summaries[name], summaries[reference],
                                                      BF16_LOSS_RTOL, reference, precision)
    rows += [row("single bf16-mixed", "single 32-true", "bf16-mixed"),
             row("l2l bf16-mixed", "single bf16-mixed", "bf16-mixed"),
             row("zero_bubble_h1 bf16-mixed", "single bf16-mixed", "bf16-mixed")]
    if mode.name == "gpu":
        rows += [row("single 16-mixed", "single 32-true", "16-mixed"),
                 row("zero_bubble_h1 16-mixed", "single 16-mixed", "16-mixed")]
    else:
        rows.append(skipped("precision", "16-mixed runs", "GPU only: validation refuses 16-mixed on CPU "
                            "(tests/test_precision.py emulates it with CPU autocast)"))
    return rows


def scaler_row(result: dict) -> Row:
    if result.get("status") != "completed":
        return failed("precision", "agreed scaler skips an injected inf", result)
    within = result["skipped_unchanged"] and result["scale_after"] == result["scale_before"] / 2 and result["clean_moved"]
    detail = (f"{result['device']}, fp16 autocast: poisoned step left the weights "
              f"{'unchanged' if result['skipped_unchanged'] else 'CHANGED'}, scale {result['scale_before']:g} → "
              f"{result['scale_after']:g}; the next clean step {'updated' if result['clean_moved'] else 'did NOT update'}")
    return judged("precision", "agreed scaler skips an injected inf", None, within,
                  "weights kept, scale halved", detail)


# ----------------------------------------------------------------------------- 4. speed

def speed_section(mode: Mode, budget: Budget, report: Report, subset: bool, directory: Path) -> list:
    """Per model: our `single` run's median step (train.py) and a plain loop's (one at a time: timed)."""
    models = dict(list(mode.speed_models.items())[:1]) if subset else mode.speed_models
    rows = []
    for label, overrides in models.items():
        if budget.left() < 30:
            rows.append(skipped("speed", label, f"time budget: {budget.left():.0f} s left"))
            continue
        run = [*SPEED_COMMON, "strategy=single", *mode.device, *overrides, f"hardware.precision={mode.speed_precision}",
               f"trainer.max_steps={mode.speed_steps}", f"trainer.val_check_interval={mode.speed_steps}"]
        ours = run_point(run, directory / slug(label), budget.timeout(240))
        plain = run_helper("plain_loop", {"overrides": run, "steps": mode.speed_steps}, budget.timeout(180))
        rows.append(speed_row(label, ours, plain))
        report.add(rows[-1:])
    if mode.name == "gpu" and not subset:  # Hopper only: a CPU refuses fp8-mixed (strategies/float8.py)
        report.add(fp8_rows(mode, budget, directory))
        report.add(compile_rows(mode, budget, directory))  # issue 59: the eager/compiled ratio on the GPU
    return []  # added one by one above: each model is minutes on the 1B


def fp8_rows(mode: Mode, budget: Budget, directory: Path) -> list:
    """hardware.precision=fp8-mixed (torchao's Float8Linear in the blocks, each recipe) against bf16-mixed:
    `single`'s median step on the ~1B Llama (products large enough for FP8 to pay), and the loss after
    the same steps. Not a pass/fail of the speed: the ratio is reported (torchtitan reports ~1.2-1.5x
    on H100 for 8B models); the losses must agree within FP8's rounding (tests/test_fp8.py: 2^-3)."""
    variants = {"bf16-mixed": ["hardware.precision=bf16-mixed"],
                "fp8-mixed rowwise": ["hardware.precision=fp8-mixed", "hardware.fp8_recipe=rowwise"],
                "fp8-mixed tensorwise": ["hardware.precision=fp8-mixed", "hardware.fp8_recipe=tensorwise"]}
    return versus_rows(mode, budget, directory, variants, loss_rtol=2.0 ** -3)


def compile_rows(mode: Mode, budget: Budget, directory: Path) -> list:
    """trainer.compile=true (each block compiled, strategies/compile.py) against eager, bf16-mixed, on the
    ~1B Llama's `single` step: the ratio reported, the losses within 2^-6 (compiled and eager kernels
    round bf16 differently), and no graph after the first step (summary.json compile)."""
    variants = {"eager": ["hardware.precision=bf16-mixed"],
                "compiled": ["hardware.precision=bf16-mixed", "trainer.compile=true"]}
    return versus_rows(mode, budget, directory, variants, loss_rtol=2.0 ** -6)


def versus_rows(mode: Mode, budget: Budget, directory: Path, variants: dict, loss_rtol: float) -> list:
    """The first variant is the baseline; one row per other variant: baseline step / its step."""
    run = [*SPEED_COMMON, "strategy=single", *mode.device, *LLAMA_1B, f"trainer.max_steps={mode.speed_steps}",
           f"trainer.val_check_interval={mode.speed_steps}"]
    summaries = {}
    for name, overrides in variants.items():
        if budget.left() < 60:
            return [skipped("speed", f"llama_1b {name}", f"time budget: {budget.left():.0f} s left")]
        summaries[name] = run_point([*run, *overrides], directory / slug(f"versus {name}"), budget.timeout(240))
    (base_name, base), rows = next(iter(summaries.items())), []
    for name, other in list(summaries.items())[1:]:
        if other.get("status") != "completed" or base.get("status") != "completed":
            rows.append(failed("speed", f"llama_1b {name} / {base_name} step",
                               other if base.get("status") == "completed" else base))
            continue
        ratio = base["step_time_s_median"] / other["step_time_s_median"]
        loss = abs(other["losses"][-1] - base["losses"][-1]) / abs(base["losses"][-1])
        later_graphs = (other.get("compile") or {}).get("graphs_after_first_step", 0)
        rows.append(judged("speed", f"llama_1b: {base_name} step / {name} step", ratio,
                           loss <= loss_rtol and later_graphs == 0, f"losses within {loss_rtol:.3g}, no later graph",
                           f"step {base['step_time_s_median']:.4g} s {base_name}, {other['step_time_s_median']:.4g} s "
                           f"{name}; last loss {other['losses'][-1]:.4f} vs {base['losses'][-1]:.4f}; MFU "
                           f"{other.get('mfu') or 0:.1%} (against the bf16 peak); compile "
                           f"{(other.get('compile') or {}).get('compile_s', 0):.1f} s",
                           base_step_s=base["step_time_s_median"], step_s=other["step_time_s_median"]))
    return rows


def speed_row(label: str, ours: dict, plain: dict) -> Row:
    for run, name in ((ours, "our run"), (plain, "plain loop")):
        if run.get("status") != "completed":
            return failed("speed", label, {"error": f"{name}: {run.get('error') or run.get('status')}"})
    ratio = ours["tokens_per_s_median"] / plain["tokens_per_s"]
    # both MFUs against the peak the run's summary used (hardware profile, the precision's dtype)
    peak = ours["tokens_per_s_median"] * plain["flops_per_token"] / ours["mfu"] if ours.get("mfu") else None
    plain_mfu = plain["tokens_per_s"] * plain["flops_per_token"] / peak if peak else None
    detail = (f"ours {ours['tokens_per_s_median']:.4g} tokens/s (MFU {ours.get('mfu') or 0:.1%}), plain loop "
              f"{plain['tokens_per_s']:.4g} tokens/s (MFU {plain_mfu or 0:.1%}); {plain['parameters'] / 1e6:.1f} M "
              f"parameters, batch {plain['batch']}×{plain['sequence']}, {plain['precision']}")
    return judged("speed", f"{label}: ours / plain loop", ratio, ratio >= SPEED_GOAL, f"≥ {SPEED_GOAL}", detail,
                  ours_tokens_per_s=ours["tokens_per_s_median"], plain_tokens_per_s=plain["tokens_per_s"],
                  ours_mfu=ours.get("mfu"), plain_mfu=plain_mfu, peak_flops=peak,
                  ours_step_s=ours.get("step_time_s_median"), plain_step_s=plain["step_s"],
                  allocator_peak_bytes=ours.get("allocator_peak_bytes"), plain_peak_bytes=plain["peak_bytes"])


# ----------------------------------------------------------------------------- 5. plan mode

def plan_section(mode: Mode, budget: Budget, report: Report, subset: bool, directory: Path) -> list:
    """Plan mode's step and memory against a measured run of the same one-device configuration.
    On the GPU the plan prices with the spec-sheet profile (dgx_h100): `mode=calibrate` measures the
    host's CPU and gloo (layerwise/tools/calibrate.py), not the GPU, so it cannot price GPU runs."""
    configs = dict(list(mode.plan_configs.items())[:1]) if subset else mode.plan_configs
    rows = [] if subset or mode.name != "gpu" else [skipped(
        "plan", "mode=calibrate of the GPU", "layerwise/tools/calibrate.py measures the host's CPU and gloo only "
        "(no CUDA path): the GPU rows price with dgx_h100's datasheet figures; held_out runs mode=calibrate for "
        "the CPU rows")]
    for label, overrides in configs.items():
        if budget.left() < 30:
            rows.append(skipped("plan", label, f"time budget: {budget.left():.0f} s left"))
            continue
        common = [*SPEED_COMMON, *mode.device, f"hardware.precision={mode.speed_precision}", *overrides]
        steps = 12
        planned = run_point([*common, "mode=plan"], directory / slug(label) / "plan", budget.timeout(90))
        measured = run_point([*common, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"],
                             directory / slug(label) / "run", budget.timeout(mode.point_timeout_s))
        rows += plan_rows(label, planned, measured, mode)
    return rows


def plan_rows(label: str, planned: dict, measured: dict, mode: Mode) -> list:
    for run, name in ((planned, "plan"), (measured, "run")):
        if run.get("status") != "completed":
            return [failed("plan", label, {"error": f"{name}: {run.get('error') or run.get('status')}"})]
    step_ratio = planned["step_time_s"] / measured["step_time_s_median"]
    rows = [judged("plan", f"{label}: predicted / measured step", step_ratio, abs(step_ratio - 1) <= STEP_GOAL,
                   f"1 ± {STEP_GOAL}", f"{planned['step_time_s'] * 1e3:.2f} ms predicted, "
                   f"{measured['step_time_s_median'] * 1e3:.2f} ms measured",
                   predicted_s=planned["step_time_s"], measured_s=measured["step_time_s_median"])]
    predicted = max(role["peak_compute_bytes"] for role in planned["roles"])
    allocator = measured.get("allocator_peak_bytes")
    if allocator is None:
        rows.append(skipped("plan", f"{label}: predicted / allocator peak", "CUDA only: no allocator off a GPU "
                            f"(predicted {predicted / 2**20:.1f} MiB, metered {measured['peak_compute_bytes'] / 2**20:.1f} MiB)"))
    else:
        ratio = predicted / allocator
        rows.append(judged("plan", f"{label}: predicted / allocator peak", ratio, abs(ratio - 1) <= MEMORY_GOAL,
                           f"1 ± {MEMORY_GOAL}", f"{predicted / 2**20:.1f} MiB predicted, "
                           f"{allocator / 2**20:.1f} MiB allocator peak", predicted_bytes=predicted,
                           allocator_peak_bytes=allocator))
    return rows


# ----------------------------------------------------------------------------- 6. issue 31's held-out rows

# benchmarks/plan_vs_measured.py's COMMON and its two held-out grid rows (TIME_CONFIGS), measured as it
# measures them (12 steps, the meter on the first 2 and the last); library code does not import benchmarks/.
HELD_OUT_COMMON = ("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0", "model.layers=8",
                   "trainer.check_point_to_point_order=true")
HELD_OUT = {"tp_2d q2 (4 ranks)": ("strategy=tp_2d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"),
            "three_d q2 (8 ranks)": ("strategy=three_d", "strategy.tensor_grid=2", "hardware.devices_per_node=8")}
HELD_OUT_PROFILE = "device_check_calibrated"  # written under OUTDIR, found through hydra.searchpath


def held_out_section(mode: Mode, budget: Budget, report: Report, subset: bool, directory: Path) -> list:
    """mode=calibrate on this node's cores, then each grid planned and trained with that profile,
    a core per rank where the node has enough cores (docs/plan.md, "Where issue 31 stops")."""
    if subset:
        return [skipped("held_out", name, "--subset") for name in HELD_OUT]
    conf = (directory / "conf").resolve()  # hydra.searchpath takes an absolute file:// path
    calibration = run_point(["mode=calibrate", "logger=none", "calibrate.silent=true", f"calibrate.name={HELD_OUT_PROFILE}",
                             f"calibrate.directory={conf / 'hardware'}", f"calibrate.quick={str(mode.calibrate_quick).lower()}"],
                            directory / "calibrate", budget.timeout(200))
    if calibration.get("status") != "completed":
        return [failed("held_out", "mode=calibrate", calibration)]
    rows = [Row("held_out", "mode=calibrate", "ok", detail=f"{'quick' if mode.calibrate_quick else 'full'} "
                f"profile of this node's {os.cpu_count()} cores")]
    for name, overrides in HELD_OUT.items():
        ranks = int(overrides[-1].rsplit("=", 1)[1])
        if budget.left() < 30:
            rows.append(skipped("held_out", name, f"time budget: {budget.left():.0f} s left"))
            continue
        common = [*HELD_OUT_COMMON, *overrides, f"hardware={HELD_OUT_PROFILE}", f"hydra.searchpath=[file://{conf}]"]
        planned = run_point([*common, "mode=plan"], directory / slug(name) / "plan", budget.timeout(90))
        measured = run_point([*common, "trainer.max_steps=12", "trainer.measure_every_n_steps=12"],
                             directory / slug(name) / "run", budget.timeout(240))
        rows.append(held_out_row(name, ranks, planned, measured))
    return rows


def held_out_row(name: str, ranks: int, planned: dict, measured: dict) -> Row:
    for run, label in ((planned, "plan"), (measured, "run")):
        if run.get("status") != "completed":
            return failed("held_out", name, {"error": f"{label}: {run.get('error') or run.get('status')}"})
    ratio = planned["step_time_s"] / measured["step_time_s_median"]
    cores = os.cpu_count() or 1
    regime = "a core per rank" if cores >= ranks else f"{ranks / cores:g} ranks per core (not the regime priced)"
    return judged("held_out", f"{name}: predicted / measured step", ratio, abs(ratio - 1) <= STEP_GOAL,
                  f"1 ± {STEP_GOAL}", f"{planned['step_time_s'] * 1e3:.1f} ms predicted, "
                  f"{measured['step_time_s_median'] * 1e3:.1f} ms measured; {regime}",
                  predicted_s=planned["step_time_s"], measured_s=measured["step_time_s_median"], cores=cores)


# ----------------------------------------------------------------------------- the driver

SECTION_FUNCTIONS = {"environment": environment_section, "equality": equality_section,
                     "precision": precision_section, "speed": speed_section, "plan": plan_section,
                     "held_out": held_out_section}


def check(directory: Path, mode: Mode, sections=SECTIONS, subset: bool = False,
          budget_s: Optional[float] = None, functions: Optional[dict] = None, runs: Optional[Path] = None) -> list:
    """Every section in order; a section that raises is a failed row, and the next one runs.
    `functions`: section name -> function (default SECTION_FUNCTIONS); `runs`: where the run
    directories go (default OUTDIR/runs)."""
    functions = functions or SECTION_FUNCTIONS
    started = time.time()
    budget, report = Budget(budget_s or mode.budget_s), Report(directory, mode, started)
    runs = Path(runs or Path(directory) / "runs")
    for section in sections:
        function = functions[section]
        if budget.left() < 20:
            report.add([skipped(section, "section", f"time budget: {budget.left():.0f} s left")])
            continue
        print(f"device_check: {section} ({budget.left():.0f} s left)", flush=True)
        try:
            arguments = (mode, budget, report, subset) if section == "environment" else \
                (mode, budget, report, subset, runs / section)
            report.add(function(*arguments))
        except Exception as error:  # one section's bug must not cost the others their minutes
            report.add([Row(section, "section", "failed", detail=f"{type(error).__name__}: {error}")])
    report.write()
    return report.rows


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="device_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", help="where device_check.json and results.md go")
    parser.add_argument("--cpu", action="store_true", help="the same steps on the cpu profile, tiny sizes")
    parser.add_argument("--subset", action="store_true", help="one row or a skip per section (tests)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in this order")
    parser.add_argument("--budget-s", type=float, default=None, help="wall clock of the whole check")
    parser.add_argument("--runs", default=None, help="where the run directories go (default OUTDIR/runs)")
    arguments = parser.parse_args(argv)
    if not arguments.directory:
        parser.error("give OUTDIR: where device_check.json and results.md go")
    unknown = [name for name in arguments.sections.split(",") if name not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return arguments


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    rows = check(Path(arguments.directory), CPU if arguments.cpu else GPU, arguments.sections.split(","),
                 arguments.subset, arguments.budget_s, runs=arguments.runs)
    print((Path(arguments.directory) / "results.md").read_text(), flush=True)
    return 0 if all(row.status in ("ok", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
