"""The config store: every schema registered in Hydra's ConfigStore, our resolvers, and compose().

train.py registers before Hydra composes; scripts and tests compose conf/ with `compose(overrides)`.
"""

import copy
import functools
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


def default_run_name(strategy: str, model: str, hardware: str, mode: str, searching) -> str:
    """conf/config.yaml's run_name: `<strategy>-<model>-<hardware>`, or `search-<model>-<hardware>` for
    mode=plan plan.search=true, which chooses no strategy (it was named after the default one, issue 55)."""
    searched = mode == "plan" and str(searching).lower() == "true"  # a command-line `true` may arrive as text
    return f"{'search' if searched else strategy}-{model}-{hardware}"


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore and our resolvers in OmegaConf (idempotent;
    train.py calls it before composing)."""
    OmegaConf.register_new_resolver("point_directory", point_directory, replace=True)
    OmegaConf.register_new_resolver("default_run_name", default_run_name, replace=True)
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
    own Hydra app (there Hydra is initialised with conf/ already and a second initialise would fail).

    Why a cache: Hydra rebuilds the defaults tree and re-reads every YAML file on each compose
    (0.15 s here), while applying `key=value` overrides to a composed config takes 0.01 s. Hydra
    itself composes in two phases, the defaults (group choices: `strategy=ddp`) and then the value
    overrides in order (hydra/_internal/config_loader_impl.py, _load_configuration_impl): this does
    the same, keeping the first phase's result per group choices and conf/'s state. A test holds it
    equal to Hydra's own compose (tests/test_config.py)."""
    from hydra.core.global_hydra import GlobalHydra
    register_schemas()
    choices, values = _split(overrides)
    # inside train.py's app Hydra searches the app's path, outside it conf/ alone: cached apart
    composed = _defaults(tuple(choices), _conf_state(), GlobalHydra.instance().is_initialized())
    return _with_values(copy.deepcopy(composed), values) if values else copy.deepcopy(composed)


def hydra_compose_uncached(overrides: list):
    """Hydra's own compose of conf/ (both phases at once): the reference compose() is tested against."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def _split(overrides: list) -> tuple:
    """(what Hydra's first phase reads, the plain value overrides): a group choice, a hydra.* or sweep
    override goes to the first phase; so does anything else Hydra treats specially (Overrides in
    hydra/_internal/defaults_list.py: a key that names a group and a value that is not a dict)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices, values = [], []
    for text, override in zip(overrides, parsed):
        key = override.key_or_group
        group = "/" in key or (CONF / key).is_dir() or key.split(".")[0] == "hydra"
        special = override.is_sweep_override() or override.package is not None
        plain = not special and (not group or isinstance(override.value(), dict))
        (values if plain else choices).append(override if plain else text)
    return choices, values


@functools.lru_cache(maxsize=256)
def _defaults(choices: tuple, conf_state: tuple, in_app: bool):
    """The first phase's config, once per choices and conf/ state (a file written or changed between
    two composes, e.g. a calibrated hardware profile, changes the state: composed again)."""
    return hydra_compose_uncached(list(choices))


def _conf_state() -> tuple:
    """Every conf/ YAML file with its modification time (1.6 ms for conf/'s files)."""
    files = sorted(CONF.rglob("*.yaml"))
    return tuple((str(path), path.stat().st_mtime_ns) for path in files)


def _with_values(cfg, values: list):
    """Hydra's second phase on a composed config: the value overrides, in order, under struct mode,
    with Hydra's own function and its own errors."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl  # pinned hydra-core==1.3.*
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg
