"""The documented commands and how each runs here: the table tests/test_documented_commands.py runs.

- DOCUMENTED: every command a user may copy from README.md and docs/**/*.md (fenced blocks, `$ `
  prompts dropped, `\\` continuations joined, the trailing `# comment` kept apart) and
  `python train.py experiment=<name>` for every conf/experiment/*.yaml;
- HOW: for each, keyed by its text, how it runs here (`real`, `capped`, `check`, `plan`) and what it
  must leave (the expectations below); `why` says why not as typed, `mark` why it cannot run here.
"""

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXPERIMENTS = sorted((ROOT / "conf" / "experiment").glob("*.yaml"))
# A command a user types: the interpreter (python, python3, .venv/bin/python) then train.py or a
# layerwise module; or the Makefile's run target.
COMMAND = re.compile(r"^((\S*/)?python3?\s+(train\.py|-m\s+layerwise)\b|make\s+run\b)")
# train.py without an interpreter, followed by an override: not what a user can type as is.
BARE_TRAIN_PY = re.compile(r"^train\.py\s+(-\S+|\S+=)")
PROMPT = re.compile(r"^\$\s+")
CAP_STEPS = 2
TRAINING_CAP = (f"trainer.max_steps={CAP_STEPS}", f"trainer.val_check_interval={CAP_STEPS}",
                "trainer.limit_val_batches=1", f"trainer.checkpoint_every_n_steps={CAP_STEPS}",
                "data.max_bytes=2000000")  # a slice of the corpus: reading all of it dominates 2 steps
QUICK_CALIBRATION = ("calibrate.quick=true", "calibrate.repeats=3")  # the same terms at small sizes
GPU = "(needs a GPU)"
SLURM = "(needs Slurm)"

# ================================================================ what the documents say

@dataclass
class Documented:
    text: str  # as typed: continuation lines joined, whitespace collapsed, no prompt, no comment
    where: List[str]  # "README.md:57", one per occurrence
    comments: List[str]  # each occurrence's trailing comment(s): where its mark stands
    output: Tuple[str, ...] = ()  # what the document shows it prints (a `$ ` command's block)


def fenced_blocks(text: str):
    """(first line number, lines) of every fenced block."""
    inside, start, lines = False, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            if inside:
                yield start, lines
            inside, start, lines = not inside, number + 1, []
        elif inside:
            lines.append(line)


def split_comment(line: str) -> Tuple[str, str]:
    code, _, comment = line.partition(" #")
    if line.lstrip().startswith("#"):
        return "", line.strip().lstrip("#").strip()
    return code.rstrip(), comment.strip()


def commands_in_block(start: int, lines: List[str]):
    """(text, line number, comment, shown output) of each command in one fenced block."""
    index = 0
    while index < len(lines):
        number, prompted = start + index, bool(PROMPT.match(lines[index].strip()))
        code, comment = split_comment(PROMPT.sub("", lines[index].strip()))
        parts, comments = [], [comment]
        while code.endswith("\\") and index + 1 < len(lines):  # a continuation line
            parts.append(code[:-1])
            index += 1
            code, comment = split_comment(lines[index].strip())
            comments.append(comment)
        parts.append(code)
        index += 1
        # its comment continued on indented comment lines (an unindented one introduces what follows)
        while index < len(lines) and lines[index][:1].isspace() and lines[index].strip().startswith("#"):
            comments.append(split_comment(lines[index])[1])
            index += 1
        output = []
        while prompted and index < len(lines) and not PROMPT.match(lines[index].strip()):
            output.append(lines[index].strip())
            index += 1
        text = " ".join(" ".join(parts).split())
        if COMMAND.match(text) or BARE_TRAIN_PY.match(text):
            yield text, number, " ".join(c for c in comments if c), tuple(o for o in output if o)


def documented_commands() -> Dict[str, Documented]:
    found: Dict[str, Documented] = {}
    for document in DOCUMENTS:
        name = str(document.relative_to(ROOT))
        for start, lines in fenced_blocks(document.read_text()):
            for text, number, comment, output in commands_in_block(start, lines):
                entry = found.setdefault(text, Documented(text, [], []))
                entry.where.append(f"{name}:{number}")
                entry.comments.append(comment)
                entry.output = entry.output or output
    for experiment in EXPERIMENTS:
        text = f"python train.py experiment={experiment.stem}"
        entry = found.setdefault(text, Documented(text, [], []))
        entry.where.append(str(experiment.relative_to(ROOT)))
    return found


DOCUMENTED = documented_commands()


# ================================================================ what a run must leave

@dataclass
class Outcome:
    command: str
    argv: List[str]
    cwd: Path
    code: int
    stdout: str
    stderr: str
    seconds: float
    started: float  # time.time() when it started

    def tail(self) -> str:
        return (f"$ {' '.join(self.argv)}   (in {self.cwd}, exit {self.code}, {self.seconds:.0f} s)\n"
                f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")


def exits(outcome: Outcome, code: int = 0) -> None:
    assert outcome.code == code, f"expected exit {code}\n{outcome.tail()}"


def one(pattern: str, cwd: Path) -> Path:
    found = sorted(cwd.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {cwd}, found {[str(p) for p in found]}"
    return found[0]


def completed_summary(directory: Path, steps: int) -> dict:
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["steps"] == steps and len(summary["losses"]) == steps, summary
    with (directory / "metrics.csv").open() as handle:
        assert [int(row["step"]) for row in csv.DictReader(handle)] == list(range(1, steps + 1))
    return summary


def trained(steps: int = CAP_STEPS) -> Callable:
    """One training run that completed its steps: summary.json and metrics.csv say so."""
    def check(outcome: Outcome) -> None:
        exits(outcome)
        completed_summary(one("runs/*/summary.json", outcome.cwd).parent, steps)
        assert "completed: validation loss" in outcome.stdout
    return check


def swept(points: int, steps: int = CAP_STEPS) -> Callable:
    """A multirun: every point completed, and the sweep's own report written."""
    def check(outcome: Outcome) -> None:
        exits(outcome)
        sweep = one("runs/multirun/*", outcome.cwd)
        summaries = sorted(sweep.glob("*/summary.json"))
        assert len(summaries) == points, summaries
        for summary in summaries:
            completed_summary(summary.parent, steps)
        assert (sweep / "sweep_summary.csv").exists() and (sweep / "sweep_report.md").exists()
    return check


def nothing_trained(cwd: Path) -> None:
    assert not list(cwd.rglob("metrics.csv")) and not list(cwd.rglob("summary.json")), "mode=check ran something"


def valid(outcome: Outcome) -> None:
    """mode=check: the configuration is valid and nothing started."""
    exits(outcome)
    assert "configuration is valid" in outcome.stdout
    nothing_trained(outcome.cwd)


def valid_sweep(points: int) -> Callable:
    """mode=check over a multirun (layerwise/sweep.py): every point valid, nothing run or submitted."""
    def check(outcome: Outcome) -> None:
        exits(outcome)
        assert f"{points} of {points} points valid" in outcome.stdout
        nothing_trained(outcome.cwd)
    return check


def planned_sweep(points: int) -> Callable:
    """A mode=plan multirun: each point's plan.json, and the sweep report of the predictions."""
    def check(outcome: Outcome) -> None:
        exits(outcome)
        sweep = one("runs/multirun/*", outcome.cwd)
        assert len(list(sweep.glob("*/plan.json"))) == points
        with (sweep / "sweep_summary.csv").open() as handle:
            assert [row["status"] for row in csv.DictReader(handle)] == ["planned"] * points
        nothing_trained(outcome.cwd)
    return check


def planned(outcome: Outcome) -> None:
    """mode=plan: plan.json with every role's memory, nothing trained."""
    exits(outcome)
    plan = json.loads(one("runs/*/plan.json", outcome.cwd).read_text())
    assert plan["roles"] and all(role["peak_with_margin_bytes"] > 0 and "fits" in role for role in plan["roles"])
    assert plan["step_time_s"] > 0
    nothing_trained(outcome.cwd)


def dry_run_planned(outcome: Outcome) -> None:
    """plan.dry_run=true: each role's dry run beside its analytic plan."""
    planned(outcome)
    plan = json.loads(one("runs/*/plan.json", outcome.cwd).read_text())
    assert all("dry_run" in role for role in plan["roles"]), plan["roles"]


def searched(outcome: Outcome) -> None:
    """plan.search=true: plan_search.csv ranks the layouts that fit."""
    exits(outcome)
    with one("runs/*/plan_search.csv", outcome.cwd).open() as handle:
        assert list(csv.DictReader(handle)), "no layout fits"


def calibrated(outcome: Outcome) -> None:
    """mode=calibrate: the profile and its measurements, under conf/hardware of the working directory."""
    exits(outcome)
    assert (outcome.cwd / "conf/hardware/calibrated.yaml").exists()
    assert (outcome.cwd / "conf/hardware/calibrated.calibration.json").exists()


def reproduced(run_name: str) -> Callable:
    """mode=reproduce: the claim's results.json and results.md in runs/<run_name>."""
    def check(outcome: Outcome) -> None:
        exits(outcome)
        results = outcome.cwd / "runs" / run_name
        assert json.loads((results / "results.json").read_text()), "empty results.json"
        assert (results / "results.md").exists()
    return check


def checked_memory(outcome: Outcome) -> None:
    """mode=check: valid, each role's memory fit printed as the document shows it, kept in check.json."""
    valid(outcome)
    for line in DOCUMENTED[outcome.command].output:
        if "memory" in line:
            assert line in outcome.stdout + outcome.stderr, f"documented line not printed: {line!r}\n{outcome.tail()}"
    one("runs/*/check.json", outcome.cwd)


def stopped_on_nonfinite_loss(outcome: Outcome) -> None:
    """A run-time error ends in one paragraph and its kind's exit code (docs/faults.md, 5)."""
    exits(outcome, 5)
    assert "layerwise: the run stopped on a non-finite loss (rank 0, after step 1)" in outcome.stderr, outcome.tail()
    assert "Traceback" not in outcome.stderr, outcome.tail()
    summary = json.loads(one("runs/*/summary.json", outcome.cwd).read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 5, summary


def rejected(outcome: Outcome) -> None:
    """Bad input: exit 2 and the very lines the document shows."""
    exits(outcome, 2)
    documented = DOCUMENTED[outcome.command].output
    assert documented, "the document shows no output for this command"
    for line in documented:
        assert line in outcome.stderr, f"documented line not printed: {line!r}\n{outcome.tail()}"
    nothing_trained(outcome.cwd)


def helped(outcome: Outcome) -> None:
    """--help lists every config group with its options."""
    exits(outcome)
    for group in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name != "hydra"):
        options = ", ".join(sorted(option.stem for option in group.glob("*.yaml")))
        assert f"{group.name}: {options}" in outcome.stdout, group.name


def my_llama_and_text(cwd: Path) -> None:
    """README's "Your model, your text": my-llama/ (a tiny random transformers Llama with a BPE
    tokenizer trained on stdlib text) and my-text/ (stdlib modules as .txt documents)."""
    import sysconfig

    import torch
    import transformers

    from tests.test_text_data import train_tokenizer
    tokenizer = train_tokenizer(cwd / "my-llama", vocab_size=512)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tokenizer)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (cwd / "my-text").mkdir()
    for name in ("textwrap.py", "shlex.py", "string.py", "glob.py", "fnmatch.py", "colorsys.py"):
        (cwd / "my-text" / f"{name}.txt").write_text((stdlib / name).read_text())


def exported_hf(outcome: Outcome) -> None:
    """layerwise.export --format hf: a directory transformers loads with no missing or unexpected keys."""
    import transformers
    exits(outcome)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(outcome.cwd / "my-llama-tuned",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (outcome.cwd / "my-llama-tuned" / "tokenizer.json").is_file()


def exported(outcome: Outcome) -> None:
    """layerwise.tools.export: a safetensors file that loads into the plain model."""
    from layerwise.tools.export import load_exported
    exits(outcome)
    model, model_config = load_exported(outcome.cwd / "model.safetensors")
    assert model_config.name == "gpt_tiny" and sum(p.numel() for p in model.parameters()) > 0


def reported(outcome: Outcome) -> None:
    """layerwise.tools.report regenerates the sweep's table and report (written again by this run)."""
    exits(outcome)
    sweep = one("runs/multirun/*", outcome.cwd)
    for name in ("sweep_summary.csv", "sweep_report.md"):
        assert (sweep / name).stat().st_mtime >= outcome.started, f"{name} not written again"
    with (sweep / "sweep_summary.csv").open() as handle:
        assert [row["status"] for row in csv.DictReader(handle)] == ["completed"] * 3


# ================================================================ how each command runs here

@dataclass(frozen=True)
class How:
    run: str  # real | capped | check | plan
    expect: Callable[[Outcome], None]
    why: str = ""  # why not as typed, and what runs it for real
    mark: str = ""  # cannot run here: this must stand in the command's comment in its document
    after: str = ""  # a documented command whose working directory this one reads
    cap: Tuple[str, ...] = TRAINING_CAP  # for run="capped"
    extra: Tuple[str, ...] = ()  # appended to every run; {cwd} is the working directory
    prepare: Callable[[Path], None] = None  # makes the files the command reads in its directory


TRAINS_FOR_MINUTES = "trains 600 steps (minutes): capped at 2"
SMALL_CLAIM = "trains here for minutes and has no step knob; {test} tests its module on tiny inputs"


def more_ranks(ranks: int, test: str) -> str:
    return f"{ranks} ranks on this 2-core machine; {test} trains layouts of this kind against single"


HOW: Dict[str, How] = {
    "python train.py mode=check": How("real", checked_memory),
    "python train.py strategy=single debug=fast optimizer.lr=1e30": How("real", stopped_on_nonfinite_loss),
    # ----- README: quick start and "Choosing what to run"
    "make run": How("capped", trained(), why="Makefile `run`: .venv/bin/python train.py $(ARGS); "
                    + TRAINS_FOR_MINUTES),
    "python train.py --help": How("real", helped),
    "python train.py strategy=ddp": How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py strategy=gpipe model=bert_tiny data.global_batch_size=32":
        How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py strategy=modular_pipeline hardware.devices_per_node=4 strategy.pipeline_degree=4 "
    "model.layers=8 strategy.micro_batches=8":
        How("check", valid, why=more_ranks(4, "tests/test_modular_pipeline.py")),
    "python train.py -m strategy=single,ddp,modular_pipeline":
        How("capped", swept(3), why=TRAINS_FOR_MINUTES + " (each point)"),
    "python train.py mode=check model=gpt3_175b data.sequence_length=2048 hardware=dgx_a100_80g "
    "hardware.nodes=16 data.global_batch_size=256 strategy=zero_layered strategy.tensor_parallel=2d "
    "strategy.tensor_grid=2 strategy.micro_batches=2 strategy.activation_recompute=full": How("real", valid),
    "python train.py mode=plan model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=64 strategy=one_f_one_b "
    "strategy.pipeline_degree=16 strategy.layers_per_stage=6 strategy.tensor_parallel=1d strategy.tensor_grid=8 "
    "strategy.micro_batches=64 strategy.activation_recompute=full data.global_batch_size=1536 "
    "data.sequence_length=2048": How("real", planned),
    "python train.py mode=plan plan.search=true model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=128 "
    "data.global_batch_size=1536 data.sequence_length=2048": How("real", searched),
    "python train.py strategy=one_f_one_b strategy.layers_per_stage=4 model=llama_small":
        How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py mode=plan model=llama3_70b hardware=dgx_h100 hardware.nodes=8 strategy=one_f_one_b "
    "strategy.pipeline_degree=4 strategy.layers_per_stage=20 strategy.tensor_parallel=1d strategy.tensor_grid=8 "
    "strategy.micro_batches=32 strategy.activation_recompute=full data.global_batch_size=256 "
    "data.sequence_length=8192 data=token_bin data.vocab_size=128256": How("real", planned),
    "python train.py mode=plan plan.search=true model=llama3_405b hardware=dgx_h100 hardware.nodes=64 "
    "data.global_batch_size=512 data.sequence_length=8192 data=token_bin data.vocab_size=128256": How("real", searched),
    # ----- docs/plan.md: context parallelism against Llama 3 405B's long-context stage (16,384 H100s, planned)
    "python train.py mode=plan model=llama3_405b model.layers=128 model.max_sequence_length=131072 hardware=dgx_h100 "
    "hardware.nodes=2048 strategy=interleaved_1f1b strategy.pipeline_degree=16 strategy.layers_per_stage=1 "
    "strategy.tensor_parallel=1d strategy.tensor_grid=8 strategy.sequence_parallel=true "
    "strategy.distributed_optimizer=true strategy.context_parallel=16 strategy.context_parallel_comm=all_gather "
    "strategy.micro_batches=16 data.global_batch_size=128 data.sequence_length=131072 data=token_bin "
    "data.vocab_size=128256": How("real", planned),
    "python train.py mode=plan model=llama3_405b model.layers=128 model.max_sequence_length=131072 hardware=dgx_h100 "
    "hardware.nodes=2048 strategy=interleaved_1f1b strategy.pipeline_degree=16 strategy.layers_per_stage=1 "
    "strategy.tensor_parallel=1d strategy.tensor_grid=8 strategy.sequence_parallel=true "
    "strategy.distributed_optimizer=true strategy.context_parallel=16 strategy.context_parallel_comm=all_gather "
    "strategy.micro_batches=16 strategy.activation_recompute=full data.global_batch_size=128 "
    "data.sequence_length=131072 data=token_bin data.vocab_size=128256": How("real", planned),
    "python train.py mode=plan plan.search=true plan.search_max_context=128 model=llama3_405b "
    "model.max_sequence_length=131072 hardware=dgx_h100 hardware.nodes=2048 data.global_batch_size=128 "
    "data.sequence_length=131072 data=token_bin data.vocab_size=128256": How("real", searched),
    "python train.py mode=plan plan.search=true model=llama3_405b model.layers=128 model.max_sequence_length=131072 "
    "hardware=dgx_h100 hardware.nodes=2048 data.global_batch_size=128 data.sequence_length=131072 "
    "data=token_bin data.vocab_size=128256": How("real", searched),
    # ----- docs/plan.md: mixtures of experts (issue 58 item 6)
    "python train.py mode=plan plan.efficiency=0.64 model=qwen3_30b_a3b hardware=dgx_h100 strategy=zero_depth_first "
    "strategy.micro_batches=16 strategy.expert_parallel=8 data.global_batch_size=512 data.sequence_length=4096 "
    "data=token_bin data.vocab_size=151936": How("real", planned),
    "python train.py mode=plan plan.efficiency=0.64 model=qwen3_30b_a3b hardware=dgx_h100 strategy=zero_depth_first "
    "strategy.micro_batches=16 strategy.expert_parallel=8 strategy.activation_recompute=full "
    "data.global_batch_size=512 data.sequence_length=4096 data=token_bin data.vocab_size=151936": How("real", planned),
    "python train.py mode=plan plan.search=true model=qwen3_235b_a22b hardware=dgx_h100 hardware.nodes=32 "
    "data.global_batch_size=2048 data.sequence_length=4096 data=token_bin data.vocab_size=151936": How("real", searched),
    "python train.py mode=plan model=moe_small strategy=single": How("real", planned),
    "python train.py model=moe_small strategy=ddp strategy.expert_parallel=2 hardware.devices_per_node=2 "
    "trainer.max_steps=4": How("real", trained(4)),
    "python train.py mode=plan model=moe_small strategy=ddp strategy.expert_parallel=2 hardware.devices_per_node=2":
        How("real", planned),
    "python train.py model=moe_small strategy=single trainer.max_steps=100":
        How("capped", trained(), why="trains 100 steps (minutes): capped at 2"),
    "python train.py mode=calibrate": How("capped", calibrated, cap=QUICK_CALIBRATION,
                                          why="~15 s of measurements; quick: the same terms at small sizes"),
    "python train.py mode=plan hardware=calibrated strategy=tp_1d strategy.tensor_grid=2":
        How("real", planned, after="python train.py mode=calibrate",
            extra=("hydra.searchpath=[file://{cwd}/conf]",)),  # the profile calibrate wrote there
    "python train.py mode=plan plan.dry_run=true strategy=one_f_one_b": How("real", dry_run_planned),
    "python train.py experiment=repro_l2l": How("real", reproduced("repro_l2l")),
    "python train.py experiment=repro_l2l_small":
        How("check", valid, why=SMALL_CLAIM.format(test="tests/test_reproduce_l2l.py")),
    "python train.py debug=fast": How("real", trained(5)),
    "python -m layerwise.export runs/modular_pipeline-gpt_tiny-cpu --out model.safetensors":
        How("real", exported, after="make run"),
    "python train.py strategy=ddp data.global_batch_size=3 model.heads=3": How("real", rejected),
    # ----- README: your model, your text (a tiny random Llama and its BPE made here: nothing downloaded)
    "python train.py model=hf model.path=my-llama data=text data.path=my-text data.tokenizer=my-llama "
    "strategy=modular_pipeline strategy.pipeline_degree=2 data.sequence_length=64":
        How("capped", trained(), why=TRAINS_FOR_MINUTES, prepare=lambda cwd: my_llama_and_text(cwd),
            extra=("data.cache_dir={cwd}/token_cache",)),
    "python -m layerwise.export runs/modular_pipeline-hf-cpu --format hf --out my-llama-tuned":
        How("real", exported_hf, after="python train.py model=hf model.path=my-llama data=text data.path=my-text "
            "data.tokenizer=my-llama strategy=modular_pipeline strategy.pipeline_degree=2 data.sequence_length=64"),
    # ----- README: sweeps
    "python train.py -m strategy=modular_pipeline,zero_layered strategy.micro_batches=2,4 debug=fast "
    "data.global_batch_size=8":
        How("check", valid_sweep(4), why="4 training runs; the quick start's sweep runs for real"),
    "python train.py -m strategy=modular_pipeline,zero_layered strategy.micro_batches=2,4 debug=fast "
    "data.global_batch_size=8 mode=check": How("real", valid_sweep(4)),
    "python train.py -m strategy=modular_pipeline,gpipe strategy.micro_batches=2,4 mode=plan "
    "data.global_batch_size=8": How("real", planned_sweep(4)),
    "python train.py -m strategy=modular_pipeline,zero_layered strategy.micro_batches=2,4 debug=fast":
        How("real", rejected),
    "python -m layerwise.report runs/multirun/<date>_<time>":
        How("real", reported, after="python train.py -m strategy=single,ddp,modular_pipeline"),
    # ----- README: GPUs and clusters
    "python train.py hardware=dgx_a100_80g strategy=modular_pipeline":
        How("plan", planned, mark=GPU, why="8 A100 ranks, planned on their profile"),
    "python train.py -m strategy=modular_pipeline,zero_layered model=gpt_small data.global_batch_size=128 "
    "hardware=dgx_a100_80g hardware.nodes=4 hydra/launcher=slurm hydra.launcher.partition=gpu "
    "hydra.launcher.account=myproject hydra.launcher.timeout_min=240":
        How("check", valid_sweep(2), mark=SLURM, why="a GPU cluster; every point checked as for submission"),
    "python train.py -m strategy=ddp,modular_pipeline hardware.nodes=2 data.global_batch_size=8 debug=fast "
    "hydra/launcher=slurm":
        How("check", valid_sweep(2), mark=SLURM,
            why="the local Slurm of scripts/local_slurm.sh (root, apt); tests/test_slurm.py "
                "(pytest -m slurm) runs such sweeps on it"),
    # ----- docs/reliability.md
    "python train.py optimizer.lr=-1 model.dropout=1.5": How("real", rejected),
    # ----- docs/results/: the papers' claims (paper scale: plan mode; small scale: trains here)
    "python train.py experiment=repro_pipefisher": How("real", reproduced("repro_pipefisher")),
    "python train.py experiment=repro_pipefisher_small":
        How("check", valid, why=SMALL_CLAIM.format(test="tests/test_reproduce_pipefisher.py")),
    "python train.py experiment=repro_three_d": How("real", reproduced("repro_three_d")),
    "python train.py experiment=repro_three_d_small":
        How("check", valid, why=SMALL_CLAIM.format(test="tests/test_reproduce_three_d.py")),
    "python train.py experiment=repro_three_d model.hidden=6144":
        How("check", valid, why="the same module as experiment=repro_three_d at another width (~15 s)"),
    "python train.py experiment=repro_training_time":
        How("check", valid, why="paper scale: ~19 min of plan mode over 1B-1T models; "
            "tests/test_reproduce_training_time.py tests its module"),
    "python train.py experiment=repro_training_time_small":
        How("check", valid, why=SMALL_CLAIM.format(test="tests/test_reproduce_training_time.py")),
    "python train.py experiment=repro_training_time_small hardware.devices_per_node=4 strategy.pipeline_degree=4 "
    "run_name=repro_training_time_small_4":
        How("check", valid, why=SMALL_CLAIM.format(test="tests/test_reproduce_training_time.py")),
    # ----- docs/strategies/
    "python train.py strategy=modular_pipeline strategy.pipeline_degree=2 strategy.tensor_parallel=1d "
    "strategy.tensor_grid=2 hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_composed_layouts.py")),
    "python train.py strategy=modular_pipeline strategy.tensor_parallel=2d strategy.tensor_grid=2 "
    "hardware.devices_per_node=8 model.layers=4":
        How("check", valid, why=more_ranks(8, "tests/test_composed_layouts.py")),
    "python train.py strategy=zero_layered strategy.pipeline_degree=2 strategy.tensor_parallel=1d "
    "strategy.tensor_grid=2 hardware.devices_per_node=8":
        How("check", valid, why=more_ranks(8, "tests/test_composed_layouts.py")),
    "python train.py strategy=one_f_one_b strategy.tensor_parallel=3d strategy.tensor_grid=2 "
    "hardware.devices_per_node=16":
        How("check", valid, why=more_ranks(16, "tests/test_composed_layouts.py")),
    "python train.py strategy=l2l hardware.devices_per_node=1 strategy.micro_batches=4":
        How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py strategy=l2l strategy.constant_memory=true": How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py strategy=three_d strategy.tensor_grid=2 hardware.devices_per_node=8":
        How("check", valid, why=more_ranks(8, "tests/test_three_d.py")),
    "python train.py strategy=tp_1d strategy.tensor_grid=2 strategy.sequence_parallel=true strategy.tensor_overlap=true":
        How("capped", trained(), why=TRAINS_FOR_MINUTES),
    "python train.py strategy=modular_pipeline strategy.tensor_parallel=1d strategy.sequence_parallel=true "
    "hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_sequence_parallel.py")),
    "python train.py strategy=tp_2d strategy.tensor_grid=2 hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_three_d.py")),
    "python train.py strategy=tp_1d strategy.tensor_grid=8 hardware.devices_per_node=8 model.heads=8":
        How("check", valid, why=more_ranks(8, "tests/test_three_d.py")),
    "python train.py strategy=zero_layered strategy.micro_batches=4 hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_zero_layered.py")),
    "python train.py strategy=zero_depth_first strategy.micro_batches=4 hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_zero_layered.py")),
    "python train.py strategy=zero_layered strategy.pipeline_degree=2 model.layers=4 hardware.devices_per_node=4":
        How("check", valid, why=more_ranks(4, "tests/test_zero_layered.py")),
    "python train.py strategy=fsdp2 strategy.sync_every_micro_batch=false":
        How("capped", trained(), why=TRAINS_FOR_MINUTES),
    # ----- conf/experiment/ (those not named in a document)
    "python train.py experiment=default": How("check", valid, why="composes to `make run`'s config, "
                                              "which runs above"),
    "python train.py experiment=long_context": How("check", valid, why="10 steps of 2,048-token rows on 2 context "
                                                   "ranks (minutes); tests/test_context_parallel_strategies.py "
                                                   "trains ddp with context parallelism against single"),
}
