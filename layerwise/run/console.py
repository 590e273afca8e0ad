"""The console says each thing once: our `[layerwise]` lines and real warnings; the rest to train.log.

Lightning logs its setup (devices, the process group, a product tip) at INFO on its own loggers,
which Hydra's console handler can print a second time, and the dependencies raise deprecation and
environment warnings nobody running a job can act on. While a rank fits, those go to the run
directory's `train.log` (each line marked with its rank), and the console keeps rank 0's progress
lines (printed by the evidence callback) and the warnings raised by this repository's own code.
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
    """Within: Lightning's loggers write only to train.log, dependencies' warnings too; the
    loggers and the warning display are restored afterwards (tests fit many runs in one process)."""
    handler = logging.FileHandler(Path(run_directory) / "train.log")
    handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] %(message)s"))
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
             for name in LIGHTNING_LOGGERS}
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).handlers[:] = [handler]
        logging.getLogger(name).propagate = False
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if rank == 0 and ours(filename):
            show(message, category, filename, lineno, file, line)
        else:
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
