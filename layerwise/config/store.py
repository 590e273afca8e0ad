"""The config store: every schema registered in Hydra's ConfigStore, our resolvers, and compose().

train.py registers before Hydra composes; scripts and tests compose conf/ with `compose(overrides)`.
"""

import hashlib
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from layerwise.config.machine import core_peak_flops, machine_cores
from layerwise.config.schema import SCHEMAS, Config

CONF = Path(__file__).resolve().parents[2] / "conf"


MAX_DIRECTORY_NAME = 150  # file systems stop at 255 bytes; a sweep over many fields reaches that


def point_directory(number, overrides: str) -> str:
    """A sweep point's directory name: its number and overrides, shortened with a hash if long."""
    name = f"{number}_{overrides}"
    if len(name) <= MAX_DIRECTORY_NAME:
        return name
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:10]
    return f"{name[:MAX_DIRECTORY_NAME - 11]}-{digest}"


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore and our resolvers in OmegaConf (idempotent;
    train.py calls it before composing)."""
    OmegaConf.register_new_resolver("point_directory", point_directory, replace=True)
    # conf/hardware/cpu.yaml: this machine's peak per core and its cores (layerwise/config/machine.py)
    OmegaConf.register_new_resolver("machine_peak_flops", core_peak_flops, replace=True)
    OmegaConf.register_new_resolver("machine_cores", machine_cores, replace=True)
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            # Root-level names, not a `schema/` group: --help then lists only the real groups.
            store.store(name=f"schema_{group}_{name}", node=node)


def compose(overrides: list):
    """conf/ composed with these overrides, as train.py sees it, from a script or from inside train.py's
    own Hydra app (there Hydra is initialised with conf/ already and a second initialise would fail)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))
