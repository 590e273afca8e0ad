"""Hydra only instantiates launchers from the `hydra_plugins` namespace: these are layerwise's.

The implementation is in layerwise/cluster/slurm.py; `conf/hydra/launcher/{slurm,local}.yaml` name
these. Each validates every sweep point with the pre-flight (layerwise/preflight.py) first.
"""

from layerwise.cluster.slurm import LocalLauncher as _LocalLauncher
from layerwise.cluster.slurm import SlurmLauncher as _SlurmLauncher
from layerwise.preflight import validate


class SlurmLauncher(_SlurmLauncher):
    """hydra/launcher=slurm (see layerwise.cluster.slurm.SlurmLauncher)."""

    preflight = staticmethod(validate)


class LocalLauncher(_LocalLauncher):
    """hydra/launcher=local (see layerwise.cluster.slurm.LocalLauncher)."""

    preflight = staticmethod(validate)
