"""How many intra-op threads each rank runs with (issue 54, item 8): one function decides, for the
local launcher and for Slurm's tasks (layerwise.config.machine.rank_threads).

CPU ranks share a node's cores for their compute: one thread each. A GPU rank computes on its GPU;
its host runs the data loading and, under L2L, the AdamW update of the whole host store, which on
one thread used 1 of the 16 or more cores a node has per GPU.
"""

import pytest
import torch

from layerwise.config.machine import rank_threads
from layerwise.run import launch


@pytest.mark.parametrize("accelerator, ranks, cores, threads", [
    ("cpu", 4, 16, 1),    # CPU ranks share the cores
    ("cpu", 1, 64, 1),
    ("gpu", 1, 16, 16),   # one H100 with 16 cores (issue 54's node)
    ("gpu", 8, 128, 16),  # a DGX: 8 GPUs, 128 cores
    ("gpu", 8, 96, 12),
    ("gpu", 3, 16, 5),    # the share rounds down: no core is oversubscribed
    ("gpu", 8, 4, 1),     # fewer cores than GPUs: at least one thread
])
def test_cpu_ranks_keep_one_thread_and_gpu_ranks_get_their_share_of_the_cores(accelerator, ranks, cores, threads):
    assert rank_threads(accelerator, ranks, cores=cores, environ={}) == threads


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_slurm_gives_each_task_its_cpus_per_task(accelerator):
    assert rank_threads(accelerator, 8, cores=128, environ={"SLURM_CPUS_PER_TASK": "14"}) == 14
    assert rank_threads(accelerator, 8, cores=128, environ={"SLURM_CPUS_PER_TASK": "0"}) == 1


def test_the_default_core_count_is_this_process_affinity(monkeypatch):
    import layerwise.config.machine as machine
    monkeypatch.setattr(machine, "machine_cores", lambda: 10)
    assert rank_threads("gpu", 2, environ={}) == 5


def threads_of_this_rank(rank):
    return torch.get_num_threads()


def test_the_local_launcher_sets_each_rank_threads_from_rank_threads(monkeypatch):
    """Forked (CPU) ranks: each runs with what rank_threads answers for its kind and node size."""
    asked = []

    def answer(accelerator, ranks_on_node, **keywords):
        asked.append((accelerator, ranks_on_node))
        return 3
    monkeypatch.setattr(launch, "rank_threads", answer, raising=False)
    assert launch.run_ranks(threads_of_this_rank, 2, timeout=120) == [3, 3]
    assert asked == [("cpu", 2)]


class Asked(Exception):
    pass


def test_spawned_ranks_are_asked_for_as_gpu_ranks_of_their_node(monkeypatch):
    """spawn is the start method of GPU ranks only (launch.start_method): they get a GPU rank's
    share of the cores of their (emulated) node. Nothing is started: the answer is refused."""
    asked = []

    def answer(accelerator, ranks_on_node, **keywords):
        asked.append((accelerator, ranks_on_node))
        raise Asked
    monkeypatch.setattr(launch, "rank_threads", answer, raising=False)
    with pytest.raises(Asked):
        launch.run_ranks(threads_of_this_rank, 4, method=launch.start_method("gpu"), ranks_per_node=2)
    assert asked == [("gpu", 2)]


def test_slurm_tasks_set_their_threads_from_rank_threads():
    """The Slurm job side (SlurmLauncher.__call__, run in every task) is not started here: it
    installs signal handlers and needs submitit's job environment. Its source must ask
    rank_threads, not compute a count of its own."""
    import inspect

    from layerwise.cluster import slurm
    source = inspect.getsource(slurm.SlurmLauncher.__call__)
    assert "torch.set_num_threads(rank_threads(" in source and source.count("set_num_threads") == 1


def test_torchrun_ranks_set_their_threads_from_rank_threads():
    """torchrun sets OMP_NUM_THREADS=1 when it starts several ranks a node; a rank it started
    (fit_in_this_process) asks rank_threads with torchrun's LOCAL_WORLD_SIZE, so a GPU rank gets its
    share of the node's cores (tests/test_torchrun.py runs the CPU path, where that share is 1)."""
    import inspect

    from layerwise.run import fit
    source = inspect.getsource(fit.fit_in_this_process)
    assert "set_num_threads(rank_threads(cfg.hardware.accelerator" in source and "LOCAL_WORLD_SIZE" in source
