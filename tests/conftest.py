import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("WANDB_MODE", "disabled")

# LAYERWISE_DETERMINISTIC=1 runs the session under torch.use_deterministic_algorithms(True) (forked
# ranks inherit it): with OMP_NUM_THREADS=1 and the default threads, the three settings under which
# the numerics tests must pass alike, to show their tolerances do not depend on kernel choice (#28).
DETERMINISTIC = os.environ.get("LAYERWISE_DETERMINISTIC", "") not in ("", "0")
if DETERMINISTIC:
    import torch
    torch.use_deterministic_algorithms(True)


# A pytest-xdist worker (`make test` runs two) computes on one thread: two workers then use this
# machine's 2 cores, where two workers of 2 OpenMP threads each spun against the other's ranks (an
# in-process test took 31 s beside another worker's 8-rank test, 2.5 s alone). The suite passes with
# OMP_NUM_THREADS=1 by requirement.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch
    torch.set_num_threads(1)


def pytest_report_header(config):
    import torch
    return (f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
            f"deterministic algorithms {torch.are_deterministic_algorithms_enabled()}")


@pytest.fixture(scope="session", autouse=True)
def mfu_never_above_one(tmp_path_factory, request):
    """At the session's end, every MFU any run of the suite wrote (summary.json, plan.json, metrics.csv,
    sweep_summary.csv) is at most 1: a fraction of the machine's true peak (#31, tests/mfu_audit.py)."""
    yield
    from tests.mfu_audit import audit
    files, values, above = audit(tmp_path_factory.getbasetemp())
    request.config._mfu_audit = (files, values)
    if hasattr(request.config, "workeroutput"):  # a pytest-xdist worker: the controller adds up the workers'
        request.config.workeroutput["mfu_audit"] = (files, values)
    assert not above, "MFU above 1 (the hardware profile's peak is too low):\n" + "\n".join(above[:20])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker ended; its MFU audit's counts join the session's."""
    files, values = node.workeroutput.get("mfu_audit", (0, 0))
    before = getattr(node.config, "_mfu_audit", None) or (0, 0)
    node.config._mfu_audit = (before[0] + files, before[1] + values)


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "_mfu_audit", None):
        files, values = config._mfu_audit
        terminalreporter.write_line(f"MFU audit: {values} values in {files} run files, none above 1")


# ----- the local Slurm cluster (scripts/local_slurm.sh) for tests marked `slurm` (-m slurm)

def pytest_unconfigure(config):
    from tests.warm_python import stop  # the warm interpreter of the suite's `python train.py` commands
    stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (scripts/local_slurm.sh); "
                                       "skipped with the reason when it cannot start")


def _slurm_is_up() -> bool:
    import shutil
    import subprocess
    if shutil.which("sinfo") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    if result.returncode != 0 or "node1" not in result.stdout or "node2" not in result.stdout:
        return False
    # Nodes that answer are not enough: a cluster whose accounting database died (an earlier run
    # killed mid-suite took MariaDB with it) answers sinfo but not sacct, which submitit and the
    # fault tests poll. Then `up` restarts what is missing (scripts/local_slurm.sh is idempotent).
    return subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True).returncode == 0


@pytest.fixture(scope="session")
def local_slurm():
    """A running 2-node Slurm with accounting: reuse one that runs, else install/start one and stop
    it at the end. Not root / no apt: skip, printing why (pytest -ra lists the reason)."""
    import subprocess
    script = Path(__file__).resolve().parent.parent / "scripts" / "local_slurm.sh"
    if _slurm_is_up():
        yield "already running"
        return
    result = subprocess.run([str(script), "up"], capture_output=True, text=True, timeout=600)
    if result.returncode == 2:
        pytest.skip(f"local Slurm cannot start here: {result.stderr.strip().splitlines()[-1]}")
    if result.returncode != 0:  # stop what did start: no daemon outlives the suite
        subprocess.run([str(script), "stop"], capture_output=True, text=True, timeout=120)
        pytest.fail(f"scripts/local_slurm.sh up failed ({result.returncode}):\n{result.stderr[-3000:]}")
    try:
        yield "started"
    finally:
        subprocess.run([str(script), "stop"], capture_output=True, text=True, timeout=120)
