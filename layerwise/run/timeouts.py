"""The chain of timeouts: every timeout of a run from one number, in the order they fire.

The watchdog (layerwise/run/hangs.py) waits `step_s` per wait and `long_s` in the first step,
validation and checkpoints; every process group's own timeout (`process_group_s`: NCCL's watchdog
aborts the rank after it) comes later, so our diagnosis is always written first (docs/faults.md,
"The chain of timeouts").
"""

from typing import NamedTuple


def collective_timeout_s(cfg) -> float:
    """trainer.collective_timeout_s, or the hardware profile's default when null; 0 = off."""
    seconds = cfg.trainer.collective_timeout_s
    return float(cfg.hardware.collective_timeout_s if seconds is None else seconds)


class TimeoutChain(NamedTuple):
    """Every timeout of a run, from one number, in the order they fire (docs/faults.md, "The chain").

    step_s: the watchdog's allowance for one wait in a training step (trainer.collective_timeout_s);
    long_s: its allowance in the first step, validation and checkpoints (× trainer.long_timeout_factor);
    poll_s: how often the watchdog looks (and how soon another rank's watchdog answers a request);
    answers_s: how long a fired watchdog waits for the other ranks' records before it diagnoses
        (`Watchdog._answered_or_stuck`: a rank answers within a poll; a silent one is waited for
        about one step's allowance);
    diagnosed_s: from the start of the longest wait to the diagnosis written: the long allowance,
        a poll to notice it, the answers, a poll to write;
    process_group_s: the backend's own timeout of every process group (NCCL's watchdog aborts the
        rank with SIGABRT after it, and no diagnosis is written): diagnosed_s + PROCESS_GROUP_MARGIN_S,
        so ours always comes first.
    """

    step_s: float
    long_s: float
    poll_s: float
    answers_s: float
    diagnosed_s: float
    process_group_s: float


PROCESS_GROUP_MARGIN_S = 60.0  # between our diagnosis written and the backend's abort: slow file systems


def timeout_chain(step_s: float, long_factor: float) -> TimeoutChain:
    """The chain for a watchdog allowance of `step_s` (> 0) seconds per wait, × `long_factor` outside
    steady steps: a collective that outlasts even a checkpoint's allowance is diagnosed, and the
    diagnosis written, PROCESS_GROUP_MARGIN_S before the backend would abort the rank."""
    long_s = step_s * long_factor
    poll_s = min(1.0, step_s / 5)
    answers_s = step_s + 2 * poll_s + 2
    diagnosed_s = long_s + poll_s + answers_s + poll_s
    return TimeoutChain(step_s, long_s, poll_s, answers_s, diagnosed_s, diagnosed_s + PROCESS_GROUP_MARGIN_S)


def run_timeout_chain(cfg) -> TimeoutChain:
    """The run's chain. With the watchdog off (trainer.collective_timeout_s=0) the process groups
    keep the bound the profile's own allowance would give (hardware.collective_timeout_s): a long
    checkpoint is never aborted by the backend either way."""
    seconds = collective_timeout_s(cfg) or float(cfg.hardware.collective_timeout_s)
    return timeout_chain(seconds, float(cfg.trainer.long_timeout_factor))
