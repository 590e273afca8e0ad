"""Two runs' checkpoints hold the same training state, bit for bit, on every rank."""

from strategies.checkpoint.safe_load import load_torch_file


# What a checkpoint holds that is evidence, not training state: the evidence callback's wall-clock
# step times (they differ between any two runs) and the version string.
NOT_TRAINING_STATE = ("callbacks", "pytorch-lightning_version")


def checkpoint_files(run_directory) -> dict:
    """`last.ckpt` of a run, as {file name: path}: the single file, or every `rank{r}.pt`."""
    from pathlib import Path

    path = Path(run_directory) / "checkpoints" / "last.ckpt"
    if path.is_file():
        return {path.name: path}
    assert path.is_dir(), f"{path}: no checkpoint"
    return {p.name: p for p in sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))}


# Lightning marks the epoch finished when max_steps ends the fit, so a last checkpoint written at the
# end of training (on_train_end) and one written after the last batch (checkpoint_every_n_steps
# divides max_steps) differ in these counters while their training state is the same: skip them
# (`skip=SAVED_AT_ANOTHER_HOOK`) only when the two runs saved at different hooks.
SAVED_AT_ANOTHER_HOOK = ("epoch", "loops")


def assert_same_checkpoints(directory_a, directory_b, skip=()) -> int:
    """The two runs' final checkpoints hold the same training state, bit for bit, on every rank.

    Compared tensor by tensor (dtype, shape and bytes, so -0.0 ≠ 0.0 and NaN = NaN): the model's
    state dict, every optimizer's state (AdamW's and LAMB's step, exp_avg, exp_avg_sq) and param
    groups, the schedulers, the loops' counters, and whatever a strategy adds (PipeFisher's `kfac`:
    factors, inverses, pending captures). Only NOT_TRAINING_STATE and `skip` are skipped. Returns the
    number of tensors compared.
    """
    files_a, files_b = checkpoint_files(directory_a), checkpoint_files(directory_b)
    assert files_a.keys() == files_b.keys(), (list(files_a), list(files_b))
    compared = 0
    for name in files_a:
        a, b = (load_torch_file(files[name]) for files in (files_a, files_b))
        skipped = set(NOT_TRAINING_STATE) | set(skip)
        keys = set(a) - skipped
        assert keys == set(b) - skipped, f"{name}: {sorted(set(a) ^ set(b))}"
        assert {"state_dict", "optimizer_states"} <= keys, f"{name}: {sorted(keys)}"
        for key in sorted(keys):
            compared += _assert_same_state(a[key], b[key], f"{name}:{key}")
    assert compared > 0
    return compared


def _assert_same_state(a, b, where: str) -> int:
    """Recursive exact equality of checkpoint contents; the number of tensors compared."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        same = torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        if not same:
            difference = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
            raise AssertionError(f"{where}: tensors differ (largest difference {difference})")
        return 1
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"
        return sum(_assert_same_state(a[key], b[key], f"{where}.{key}") for key in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        return sum(_assert_same_state(x, y, f"{where}[{index}]") for index, (x, y) in enumerate(zip(a, b)))
    assert a == b, f"{where}: {a!r} vs {b!r}"
    return 0
