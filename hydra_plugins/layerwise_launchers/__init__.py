"""Hydra only instantiates launchers from the `hydra_plugins` namespace: these are layerwise's.

The implementation is in layerwise/cluster/slurm.py; `conf/hydra/launcher/{slurm,local}.yaml` name
these. Each takes every sweep point checked by layerwise/sweep.py (the pre-flight of each point) first.
"""

from layerwise.cluster.slurm import LocalLauncher as _LocalLauncher
from layerwise.cluster.slurm import SlurmLauncher as _SlurmLauncher
from layerwise.sweep import check_points


class SlurmLauncher(_SlurmLauncher):
    """hydra/launcher=slurm (see layerwise.cluster.slurm.SlurmLauncher)."""

    check_points = staticmethod(check_points)


class LocalLauncher(_LocalLauncher):
    """hydra/launcher=local (see layerwise.cluster.slurm.LocalLauncher)."""

    check_points = staticmethod(check_points)
