"""same_checkpoints.assert_same_checkpoints, the resume tests' comparison, sees a one-ulp change anywhere."""

import copy

import pytest
import torch

from tests.same_checkpoints import SAVED_AT_ANOTHER_HOOK, assert_same_checkpoints


def rank_checkpoint(rank: int) -> dict:
    """A per-rank checkpoint shaped like Lightning's (+ PipeFisher's `kfac`), with known values."""
    generator = torch.Generator().manual_seed(rank)
    weight = torch.randn(4, 3, generator=generator)
    return {"epoch": 0, "global_step": 6, "pytorch-lightning_version": "2.x",
            "state_dict": {"model.blocks.0.weight": weight, "model.blocks.0.bias": torch.zeros(4)},
            "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 0}}}},
            "callbacks": {"RunEvidence": {"rows": [{"step_time_s": 0.1 * (rank + 1)}]}},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(6.0), "exp_avg": weight / 10,
                                                "exp_avg_sq": weight ** 2 / 100},
                                            1: {"step": torch.tensor(6.0), "exp_avg": torch.zeros(4),
                                                "exp_avg_sq": torch.zeros(4)}},
                                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}]}],
            "lr_schedulers": [{"last_epoch": 6, "_last_lr": [1e-3]}],
            "kfac": {"factors": {"fc": {"A": torch.eye(3), "B": torch.eye(4)}}, "fresh": True}}


def write_run(directory, checkpoints: list):
    path = directory / "checkpoints" / "last.ckpt"
    path.mkdir(parents=True)
    for rank, checkpoint in enumerate(checkpoints):
        torch.save(checkpoint, path / f"rank{rank}.pt")
    return directory


def next_float(value: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(value, torch.tensor(float("inf")))


CHANGES = {
    "exp_avg_sq one ulp": (lambda c: c["optimizer_states"][0]["state"][0].__setitem__(
        "exp_avg_sq", torch.cat([next_float(c["optimizer_states"][0]["state"][0]["exp_avg_sq"][:1]),
                                 c["optimizer_states"][0]["state"][0]["exp_avg_sq"][1:]])), "exp_avg_sq"),
    "step": (lambda c: c["optimizer_states"][0]["state"][1]["step"].add_(1), "state.1.step"),
    "negative zero": (lambda c: c["state_dict"]["model.blocks.0.bias"].neg_(), "model.blocks.0.bias"),
    "weight dtype": (lambda c: c["state_dict"].__setitem__(
        "model.blocks.0.weight", c["state_dict"]["model.blocks.0.weight"].double()), "float64"),
    "learning rate": (lambda c: c["optimizer_states"][0]["param_groups"][0].__setitem__("lr", 1.1e-3), "lr"),
    "k-fac factor": (lambda c: c["kfac"]["factors"]["fc"]["B"].mul_(1 + 2 ** -20), "kfac.factors.fc.B"),
    "scheduler": (lambda c: c["lr_schedulers"][0].__setitem__("last_epoch", 5), "last_epoch"),
    "missing state": (lambda c: c["optimizer_states"][0]["state"].pop(1), "keys"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_any_change_on_any_rank_is_named(change, tmp_path):
    reference = write_run(tmp_path / "a", [rank_checkpoint(0), rank_checkpoint(1)])
    same = write_run(tmp_path / "same", [rank_checkpoint(0), rank_checkpoint(1)])
    assert assert_same_checkpoints(reference, same) == 2 * (2 + 2 * 3 + 2)  # ranks × (weights, Adam, K-FAC)
    changed = copy.deepcopy(rank_checkpoint(1))
    mutate, where = CHANGES[change]
    mutate(changed)
    with pytest.raises(AssertionError, match=None) as caught:
        assert_same_checkpoints(reference, write_run(tmp_path / "b", [rank_checkpoint(0), changed]))
    assert "rank1.pt" in str(caught.value) and where in str(caught.value), str(caught.value)


def test_evidence_is_skipped_and_loop_counters_only_when_asked(tmp_path):
    reference = write_run(tmp_path / "a", [rank_checkpoint(0)])
    later = rank_checkpoint(0)
    later["callbacks"]["RunEvidence"]["rows"][0]["step_time_s"] = 9.0  # wall-clock: never compared
    assert_same_checkpoints(reference, write_run(tmp_path / "b", [later]))
    later["epoch"], later["loops"]["fit_loop"]["epoch_progress"]["total"]["completed"] = 1, 1
    with pytest.raises(AssertionError, match="epoch"):
        assert_same_checkpoints(reference, write_run(tmp_path / "c", [later]))
    assert_same_checkpoints(reference, tmp_path / "c", skip=SAVED_AT_ANOTHER_HOOK)


def test_a_missing_rank_file_fails(tmp_path):
    with pytest.raises(AssertionError, match="rank1.pt"):
        assert_same_checkpoints(write_run(tmp_path / "a", [rank_checkpoint(0), rank_checkpoint(1)]),
                                write_run(tmp_path / "b", [rank_checkpoint(0)]))
