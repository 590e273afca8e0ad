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
