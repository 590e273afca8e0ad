"""Hydra only instantiates launchers from the `hydra_plugins` namespace: these are layerwise's.

The implementation is in layerwise/slurm.py; `conf/hydra/launcher/{slurm,local}.yaml` name these.
"""

from layerwise.slurm import LocalLauncher as _LocalLauncher
from layerwise.slurm import SlurmLauncher as _SlurmLauncher


class SlurmLauncher(_SlurmLauncher):
    """hydra/launcher=slurm (see layerwise.slurm.SlurmLauncher)."""


class LocalLauncher(_LocalLauncher):
    """hydra/launcher=local (see layerwise.slurm.LocalLauncher)."""
