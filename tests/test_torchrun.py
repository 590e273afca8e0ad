"""Multi-node without Slurm: two `torchrun` node processes on this machine (c10d rendezvous, 2 nodes
× 2 ranks) train the same run as the local fork launcher, and only global rank 0 writes the run
directory's files.

The torchrun workers run tests/audited_train.py (train.py under a Python audit hook): every file a
process creates, writes, renames or removes in the run directory is logged with its RANK. The fork
run is made in this process with layerwise.run.fit.train (what train.py calls after validating).
"""

import csv
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from layerwise.run.launch import free_port
from layerwise.run.fit import train
from layerwise.preflight import validate
from tests.ranks import compose_config
from tests.tolerances import assert_same_losses

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUN = ["strategy=modular_pipeline", "hardware.nodes=2", "hardware.devices_per_node=2",
       "model.layers=2", "model.hidden=32", "model.heads=2", "data.sequence_length=32",
       "data.global_batch_size=8", "data.max_bytes=2000000", "trainer.max_steps=3",
       "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "logger.name=wandb",
       "trainer.progress=none", "trainer.check_point_to_point_order=true"]
# wall-clock (stragglers: flagged from compute times): never compared
TIMING_COLUMNS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "stragglers")


def read_summary(directory: Path) -> dict:
    import json
    return json.loads((directory / "summary.json").read_text())


def read_metrics(directory: Path) -> list:
    with (directory / "metrics.csv").open() as handle:
        return [{key: value for key, value in row.items() if key not in TIMING_COLUMNS}
                for row in csv.DictReader(handle)]


def run_two_torchrun_nodes(run_directory: Path, audit_directory: Path) -> list:
    """Start both node processes (each its own process group), wait; end any survivor in finally."""
    environment = {**os.environ, "WANDB_MODE": "disabled", "AUDIT_RUN_DIRECTORY": str(run_directory),
                   "AUDIT_LOG_DIRECTORY": str(audit_directory)}
    rendezvous = [f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={uuid.uuid4().hex[:8]}"]
    command = [TORCHRUN, "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", *rendezvous,
               "tests/audited_train.py", *RUN, f"hydra.run.dir={run_directory}"]
    # Each node writes to its own file, not a pipe: waiting on one node's pipe while the other's fills
    # up (64 KB of warnings) blocks that node mid-run and hangs both.
    logs = [(audit_directory.parent / f"node{index}.out").open("w+") for index in range(2)]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for log in logs]
    try:
        for node in nodes:
            node.wait(timeout=300)
        outputs = [Path(log.name).read_text() for log in logs]
        for node, output in zip(nodes, outputs):
            assert node.returncode == 0, output[-4000:]
        return outputs
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)  # the agent and its workers, if any is left
            except ProcessLookupError:
                pass
            node.wait(timeout=30)
        for log in logs:
            log.close()


def writes_by_rank(audit_directory: Path) -> dict:
    writes = {}
    for log in audit_directory.glob("*.log"):
        for line in log.read_text().splitlines():
            rank, event, path = line.split("\t")
            writes.setdefault(rank, set()).add((event, path))
    return writes


def test_two_torchrun_nodes_train_the_same_run_as_the_fork_launcher(tmp_path):
    fork_directory, torchrun_directory, audit = tmp_path / "fork", tmp_path / "torchrun", tmp_path / "audit"
    audit.mkdir()
    cfg = compose_config(*RUN)
    train(cfg, fork_directory, validate(cfg))
    outputs = run_two_torchrun_nodes(torchrun_directory, audit)

    fork, torchrun = read_summary(fork_directory), read_summary(torchrun_directory)
    assert torchrun["status"] == "completed" and torchrun["world_size"] == 4
    assert torchrun["layout"] == fork["layout"] == {"data": 2, "pipeline": 2, "tensor": 1,
                                                    "order": ["tensor", "pipeline", "data"]}
    assert len(torchrun["losses"]) == 3
    assert_same_losses(torchrun["losses"], fork["losses"])
    assert torchrun["final_val_loss"] == fork["final_val_loss"]
    assert read_metrics(torchrun_directory) == read_metrics(fork_directory)
    assert sum(output.count("[layerwise] completed") for output in outputs) == 1  # rank 0 reports

    writes = writes_by_rank(audit)
    written = {Path(path).relative_to(torchrun_directory).as_posix() for _, path in writes["0"]}
    assert {"config.yaml", "metrics.csv", "summary.json", "wandb_run_id", ".hydra/config.yaml",
            "train.log", "checkpoints/last.ckpt.tmp/layout.json"} <= written
    portable = torchrun_directory / "checkpoints" / "last.tmp"  # DCP: each rank writes its own file
    for rank in set(writes) - {"0"}:  # Hydra makes sure the run directory exists; its own shard files
        own_shard = ("open", str(torchrun_directory / "checkpoints" / "last.ckpt.tmp" / f"rank{rank}.pt"))
        own_pieces = ("open", str(portable / f"__{rank}_0.distcp"))
        allowed = {("os.mkdir", str(torchrun_directory)), own_shard, own_pieces, ("os.mkdir", str(portable))}
        # its own process record (the hang diagnosis reads its pid; docs/faults.md), written
        # atomically, and a stale hang record of its own removed at start
        records = torchrun_directory / "processes"
        allowed |= {("os.mkdir", str(records)), ("os.rename", str(records / f"rank-{rank}.json")),
                    ("os.remove", str(torchrun_directory / "hang" / f"rank-{rank}.json"))}
        allowed |= {write for write in writes[rank] if write[0] == "open"
                    and Path(write[1]).parent == records and Path(write[1]).name.startswith(f".rank-{rank}.json.")}
        assert writes[rank] <= allowed, (rank, writes[rank])
        assert ("os.mkdir", str(torchrun_directory)) in writes[rank]
    assert sorted(p.name for p in (torchrun_directory / "checkpoints" / "last.ckpt").iterdir()) == [
        "layout.json", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]  # each rank its own shard
    assert [p.name for p in torchrun_directory.glob("wandb_run_id*")] == ["wandb_run_id"]
