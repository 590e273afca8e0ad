"""A sweep ends with its answer (layerwise/tools/report.py): sweep_summary.csv, sweep_report.md, the W&B
report run, MFU in every run's evidence. Two sweeps run once for the module, side by side:

- SWEEP: strategy=modular_pipeline,zero_layered × strategy.micro_batches=2,4 (4 points, 2 ranks
  each, W&B offline), whose files every test reads;
- FAILING: one point, strategy=single optimizer.lr=1e30, that stops on a NaN loss (the sweep
  raises before Hydra's on_multirun_end; the report is written at exit). A mixed sweep is then
  made by copying: this point beside two of SWEEP's, and one point that left no summary at all.

Values are compared with each point's own summary.json / metrics.csv / plan.json, and MFU with the
formula written out here (6·N + 12·L·h·s per token, docs/evidence.md).
"""

import csv
import json
import os
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from layerwise.run.charts import log_run_evidence
from layerwise.tools import report
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
TINY = ["debug=fast", "model.layers=2", "data.global_batch_size=8", "data.max_bytes=2000000",
        "trainer.max_steps=4", "trainer.val_check_interval=2"]
SWEEP = ["strategy=modular_pipeline,zero_layered", "strategy.micro_batches=2,4", "logger.name=wandb"]
FAILING = ["strategy=single", "optimizer.lr=1e30"]


def rank_peak_fp32(directory: Path, ranks: int) -> float:
    """The peak one of `ranks` ranks was given: conf/hardware/cpu.yaml's peak per core (this machine's,
    as the run's config.yaml resolved it) × the node's cores shared among its ranks."""
    hardware = yaml.safe_load((directory / "config.yaml").read_text())["hardware"]
    return hardware["peak_flops"]["fp32"] * hardware["compute_units_per_node"] / ranks


def run_sweep(directory: Path, overrides: list, wandb_mode: str):
    return python([sys.executable, "train.py", "-m", *overrides, *TINY, f"hydra.sweep.dir={directory}"],
                  cwd=ROOT, env={**os.environ, "WANDB_MODE": wandb_mode}, timeout=240)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Both sweeps, run concurrently (each mostly waits on its ranks' start-up); their outputs
    (stdout then stderr)."""
    base = tmp_path_factory.mktemp("sweeps")
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {"sweep": pool.submit(run_sweep, base / "sweep", SWEEP, "offline"),
                   "failing": pool.submit(run_sweep, base / "failing", FAILING, "disabled")}
        results = {name: future.result() for name, future in running.items()}
    outputs = {name: result.stdout + result.stderr for name, result in results.items()}
    assert results["sweep"].returncode == 0, outputs["sweep"][-3000:]
    return {"sweep": base / "sweep", "failing": base / "failing", "output": outputs,
            "returncode": {name: result.returncode for name, result in results.items()}}


def csv_rows(path: Path) -> list:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def number(text: str):
    return None if text in ("", None) else float(text)


def point_summary(row: dict) -> dict:
    return json.loads((Path(row["directory"]) / "summary.json").read_text())


def flops_per_token(layers: int, hidden: int, sequence: int, vocabulary: int, mlp_ratio: int = 4) -> int:
    """6·N + 12·L·h·s, N = the blocks' matmul weights (4 + 2·mlp_ratio)·h² and the h·V head."""
    return 6 * (layers * (4 + 2 * mlp_ratio) * hidden ** 2 + hidden * vocabulary) + 12 * layers * hidden * sequence


def test_sweep_summary_has_one_row_per_point_equal_to_its_summary(sweeps):
    rows = csv_rows(sweeps["sweep"] / "sweep_summary.csv")
    assert [(int(row["point"]), row["strategy"]) for row in rows] == \
        list(enumerate(["modular_pipeline"] * 2 + ["zero_layered"] * 2))
    for row, micro_batches in zip(rows, [2, 4] * 2):
        assert f"strategy.micro_batches={micro_batches}" in row["overrides"]
        summary = point_summary(row)
        assert row["status"] == summary["status"] == "completed" and row["failure_reason"] == ""
        for key in ("final_val_loss", "step_time_s_median", "tokens_per_s_median", "tokens_per_s_per_device",
                    "mfu", "peak_compute_bytes"):
            assert number(row[key]) == pytest.approx(summary[key], rel=1e-12), key
        for kind, value in summary["comm_bytes_per_step"].items():
            assert number(row[f"comm_bytes_{kind}"]) == value
        assert number(row["bubble_fraction_simulated"]) == summary["bubble_fraction"]["simulated"]
        assert number(row["bubble_fraction_measured"]) == pytest.approx(summary["bubble_fraction"]["measured"], rel=1e-12)
        assert row["allocator_peak_bytes"] == ""  # CUDA only
    # ZeRO moves 3(n-1)/n·P bytes per step whatever m; the pipeline only activations
    zero = [number(r["comm_bytes_all_gather"]) + number(r["comm_bytes_reduce_scatter"]) for r in rows[2:]]
    assert zero[0] > 0 and zero == [zero[0]] * 2


def test_plan_prediction_stands_next_to_the_measurement(sweeps):
    """Both strategies are planned: each row carries plan mode's prediction for its own config, the
    same numbers the run's own plan.json holds (written at the end of the run, layerwise/planning/mode.py)."""
    for row in csv_rows(sweeps["sweep"] / "sweep_summary.csv"):
        planned = json.loads((Path(row["directory"]) / "plan.json").read_text())
        assert number(row["predicted_step_time_s"]) == pytest.approx(planned["step_time_s"], rel=1e-12)
        assert number(row["predicted_bubble_fraction"]) == pytest.approx(planned["bubble_fraction"], rel=1e-12)
        busiest = max(sum(role["memory_bytes"].values()) for role in planned["roles"])
        assert number(row["predicted_peak_compute_bytes"]) == pytest.approx(busiest, rel=1e-12)
        assert row["prediction"].startswith("plan mode, hardware=cpu")
        # the analytic traffic formulas are exact: prediction and counter agree to the byte
        measured = sum(number(row[f"comm_bytes_{kind}"]) for kind in report.KINDS)
        assert number(row["predicted_comm_bytes_per_step"]) == measured


def test_a_plan_json_written_before_issue_27_reports_as_a_new_one(tmp_path):
    """One vocabulary (docs/evidence.md, "Migration (issue 27)"): a mode=plan point whose plan.json
    has the old names (`step_seconds`, roles' `bytes`, ...) gives the same row as today's plan.json."""
    from omegaconf import OmegaConf
    from layerwise.planning.result import plan_result
    from layerwise.preflight import validate
    from tests.ranks import compose_config
    cfg = compose_config("mode=plan", "strategy=modular_pipeline", "strategy.pipeline_degree=2",
                         "strategy.micro_batches=4", "hardware.devices_per_node=2", "model.layers=4")
    current = plan_result(cfg, validate(cfg))
    old_names = {new: old for old, new in report.PLAN_NAMES_BEFORE_27.items()}
    old_role_names = {new: old for old, new in report.ROLE_NAMES_BEFORE_27.items()}
    old = {old_names.get(key, key): value for key, value in current.items()}
    old["roles"] = [{old_role_names.get(key, key): value for key, value in role.items() if key != "peak_compute_bytes"}
                    for role in current["roles"]]
    assert "step_seconds" in old and "bytes" in old["roles"][0] and "step_time_s" not in old
    rows = {}
    for number_, (name, written) in enumerate((("new", current), ("old", old))):
        point = tmp_path / "sweep" / f"{number_}_{name}"
        (point / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, point / "config.yaml")
        (point / "plan.json").write_text(json.dumps(written))
        rows[name] = report.point_row(point)
    for column in report.PREDICTED:
        assert rows["old"][column] == rows["new"][column] is not None, column
    assert rows["old"]["status"] == rows["new"]["status"] == "planned"
    assert rows["new"]["predicted_step_time_s"] == current["step_time_s"] > 0
    assert len(report.write_report(tmp_path / "sweep")) == 2


def test_mfu_and_tokens_per_device_follow_the_formula(sweeps):
    for row in csv_rows(sweeps["sweep"] / "sweep_summary.csv"):
        summary = point_summary(row)
        flops = flops_per_token(2, 128, 32, 256) * 8 * 32  # gpt_tiny, 2 layers, 8 × 32 tokens
        world = summary["world_size"]
        assert world == 2
        peak = rank_peak_fp32(Path(row["directory"]), world)
        assert summary["mfu"] == pytest.approx(flops / (peak * world * summary["step_time_s_median"]))
        assert 0 < summary["mfu"] < 1
        metrics = csv_rows(Path(row["directory"]) / "metrics.csv")
        assert len(metrics) == 4
        for step in metrics:
            assert number(step["mfu"]) == pytest.approx(flops / (peak * world * number(step["step_time_s"])))
            assert number(step["tokens_per_s_per_device"]) == pytest.approx(number(step["tokens_per_s"]) / world)


def test_report_markdown_figure_and_the_printed_table(sweeps):
    sweep = sweeps["sweep"]
    markdown = (sweep / "sweep_report.md").read_text()
    assert "4 of 4 points completed" in markdown and "](sweep_report.png)" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| ") and "completed" in line]
    assert len(table) == 4
    assert (sweep / "sweep_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = csv_rows(sweep / "sweep_summary.csv")
    output = sweeps["output"]["sweep"]
    assert "4 of 4 points completed" in output
    for row in rows:  # the launcher's table shows each point's measured validation loss
        assert f"{number(row['final_val_loss']):.4f}" in output


def wandb_records(path: Path):
    """The records of a W&B offline run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2
    data, position, pending = path.read_bytes(), 7, b""  # 7: ":W&B" + magic + version
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(run_directory: Path) -> dict:
    """One offline run: its run record, history keys, final summary values and files."""
    (path,) = run_directory.glob("offline-run-*/run-*.wandb")
    run, history, summary = None, set(), {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history |= {item.key or item.nested_key[0] for item in record.history.item}
        elif kind == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in record.summary.update if item.key})
    return {"run": run, "history": history, "summary": summary, "files": path.parent / "files"}


def test_wandb_offline_runs_hold_the_charts_metrics_summary_and_the_report(sweeps):
    sweep = sweeps["sweep"]
    rows = csv_rows(sweep / "sweep_summary.csv")
    for row in rows:
        logged = wandb_run(Path(row["directory"]) / "wandb")
        summary = point_summary(row)
        assert logged["run"].run_group == sweep.name
        assert {"mfu", "tokens_per_s_per_device", "schedule_planned", "schedule_executed", "plan_memory"} \
            <= logged["history"]
        images = {p.name.rsplit("_", 2)[0] for p in (logged["files"] / "media" / "images").glob("*.png")}
        assert {"schedule_planned", "schedule_executed", "plan_memory", "plan"} <= images
        for key in ("final_val_loss", "mfu", "tokens_per_s_per_device", "step_time_s_median", "status"):
            assert logged["summary"][key] == summary[key], key
        assert logged["summary"]["bubble_fraction"] == summary["bubble_fraction"]
    answer = wandb_run(sweep / "wandb")
    assert answer["run"].job_type == "report" and answer["run"].run_group == sweep.name
    assert "sweep_summary" in answer["history"] and "sweep_report" in answer["history"]
    assert list((answer["files"] / "media" / "images").glob("sweep_report_*.png"))
    (table_file,) = (answer["files"] / "media" / "table").glob("sweep_summary_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == report.COLUMNS and len(table["data"]) == 4
    for logged_row, row in zip(table["data"], rows):
        logged_row = dict(zip(table["columns"], logged_row))
        summary = point_summary(row)
        assert logged_row["status"] == summary["status"]
        for key in ("final_val_loss", "mfu", "step_time_s_median", "tokens_per_s_median"):
            assert logged_row[key] == summary[key], key


def test_a_sweep_with_a_failed_point_still_ends_with_its_answer(sweeps, tmp_path, capsys):
    failing = sweeps["failing"]
    assert sweeps["returncode"]["failing"] != 0, "the sweep reports its failed point"
    (failed,) = csv_rows(failing / "sweep_summary.csv")
    summary = point_summary(failed)
    assert failed["status"] == summary["status"] == "failed" and "optimizer.lr=1e+30" in failed["overrides"]
    assert summary["error"].startswith(failed["failure_reason"].rstrip("…"))  # one cell: cut at 240 characters
    assert failed["failure_reason"].startswith("the run stopped on a non-finite loss (rank 0, after step")  # the paragraph (docs/faults.md)
    assert failed["prediction"].startswith("none: plan mode does not cover strategy=single")
    assert "0 of 1 points completed" in sweeps["output"]["failing"]
    assert "sweep_report.md" in sweeps["output"]["failing"] and (failing / "sweep_report.png").exists()
    # mixed: two of SWEEP's points, this failed one, and one that died before its run wrote anything
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    sources = [Path(row["directory"]) for row in csv_rows(sweeps["sweep"] / "sweep_summary.csv")[:2]]
    for number_, source in enumerate(sources + [Path(failed["directory"])] * 2):
        subprocess.run(["cp", "-r", str(source), str(mixed / f"{number_}_{source.name.split('_', 1)[1]}")],
                       check=True)
    next(mixed.glob("3_*")).joinpath("summary.json").unlink()
    assert report.main([str(mixed)]) == 0
    rows = csv_rows(mixed / "sweep_summary.csv")
    assert [row["status"] for row in rows] == ["completed", "completed", "failed", "failed"]
    assert rows[3]["failure_reason"].startswith("no summary.json")
    assert rows[1]["final_val_loss"] == csv_rows(sweeps["sweep"] / "sweep_summary.csv")[1]["final_val_loss"]
    assert "2 of 4 points completed" in (mixed / "sweep_report.md").read_text()
    assert "failed" in capsys.readouterr().out


def test_two_sweeps_are_compared_and_a_wrong_directory_is_named(sweeps, tmp_path, capsys):
    out = tmp_path / "comparison"  # what `python -m layerwise.report A B --out DIR` adds to each one's report
    report.compare([sweeps["sweep"], sweeps["failing"]], out)
    rows = csv_rows(out / "sweep_summary.csv")
    assert (out / "sweep_report.png").exists()
    assert "4 of 5 points completed" in (out / "sweep_report.md").read_text()
    assert [row["sweep"] for row in rows] == ["sweep"] * 4 + ["failing"]
    assert [row["final_val_loss"] for row in rows[:4]] == \
        [row["final_val_loss"] for row in csv_rows(sweeps["sweep"] / "sweep_summary.csv")]
    point = Path(rows[0]["directory"])
    assert report.main([str(point)]) == 2
    error = capsys.readouterr().err
    assert f"{point} is not a sweep directory: it is one run's directory" in error and "Fix:" in error
    assert report.main([str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_run_charts_go_to_tensorboard(tmp_path):
    """logger=tensorboard gets the same images as W&B, keyed by file name."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from matplotlib.figure import Figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    figure = Figure(figsize=(2, 1))
    figure.add_subplot().plot([0, 1], [1, 0])
    figure.savefig(tmp_path / "schedule_planned.png", dpi=50)
    logger = TensorBoardLogger(str(tmp_path), name="tensorboard")
    log_run_evidence([logger], [tmp_path / "schedule_planned.png"], {"steps": 3})
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("schedule_planned")
    assert image.step == 3 and (image.width, image.height) == (100, 50)
