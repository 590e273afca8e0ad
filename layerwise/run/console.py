"""The console says each thing once: our `[layerwise]` lines and real warnings; the rest to train.log.

Lightning logs its setup (devices, the process group, a product tip) at INFO on its own loggers,
which Hydra's console handler can print a second time, and the dependencies raise deprecation and
environment warnings nobody running a job can act on. While a rank fits, those go to the run
directory's `train.log` (rank 0's; the other ranks' are the same lines and are dropped: only rank 0
writes the run directory), and the console keeps rank 0's progress lines (printed by the evidence
callback) and the warnings raised by this repository's own code.
"""

import contextlib
import logging
import time
import warnings
from pathlib import Path

REPOSITORY = str(Path(__file__).resolve().parents[2])
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def ours(filename: str) -> bool:
    """A warning raised by this repository's code (not a dependency's, not the interpreter's)."""
    return filename.startswith(REPOSITORY) and "site-packages" not in filename


@contextlib.contextmanager
def console_to_log(run_directory, rank: int):
    """Within: Lightning's loggers write only to train.log (rank 0), dependencies' warnings too; the
    loggers and the warning display are restored afterwards (tests fit many runs in one process)."""
    # Only global rank 0 writes the run directory (under torchrun or srun another node may not even
    # share it): the other ranks' Lightning lines, the same as rank 0's, are dropped.
    handler = logging.FileHandler(Path(run_directory) / "train.log") if rank == 0 else logging.NullHandler()
    handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] %(message)s"))
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
             for name in LIGHTNING_LOGGERS}
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).handlers[:] = [handler]
        logging.getLogger(name).propagate = False
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if ours(filename):  # a real warning, on every rank that meets it
            show(message, category, filename, lineno, file, line)
        elif rank == 0:
            handler.emit(logging.LogRecord("py.warnings", logging.WARNING, filename, lineno,
                                           f"{category.__name__}: {message}", None, None))
    warnings.showwarning = showwarning
    try:
        yield
    finally:
        warnings.showwarning = show
        for name, (handlers, propagate) in saved.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate
        handler.close()


class Eta:
    """The progress line's time left: the steps left × the mean wall time of the steps THIS process ran
    after its first.

    A resumed run restores the steps of an earlier process (global_step, the loss history) but not
    their time: dividing this process's elapsed time by the global step count made a resumed run at
    step 70 of 100 say "eta 2 s" (issue 55). So only steps run here divide time measured here. The
    first step after a start pays one-off costs (the data loader's start, lazy initialisation, the
    memory meter's warm-up steps): the mean starts at its end, and until a second step ends the first
    one's time is the estimate. `clock` is injectable so tests need no wall clock.
    """

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._started = self._first_ended = None
        self._steps = 0  # ended since the first

    def start(self) -> None:
        """This process's training starts (fresh or resumed): nothing measured yet."""
        self._started, self._first_ended, self._steps = self._clock(), None, 0

    def step(self) -> None:
        """One more step ended in this process."""
        if self._first_ended is None:
            self._first_ended = self._clock()
        else:
            self._steps += 1

    def seconds_per_step(self):
        """The mean time of this process's steps after its first; the first's alone until then; None before."""
        if self._started is None or self._first_ended is None:
            return None
        if self._steps == 0:
            return self._first_ended - self._started
        return (self._clock() - self._first_ended) / self._steps

    def seconds_left(self, steps_left: int):
        """Seconds for `steps_left` more steps at seconds_per_step; None before this process's first step."""
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(0, steps_left)

    def describe(self, steps_left: int) -> str:
        """'eta 68 s' (hours and minutes from an hour on), 'eta ?' before a step ran."""
        seconds = self.seconds_left(steps_left)
        if seconds is None:
            return "eta ?"
        if seconds < 3600:
            return f"eta {seconds:.0f} s"
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"eta {hours} h {minutes:02d} min"
