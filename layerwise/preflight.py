"""Pre-flight: every room's rules over a composed config, before any process starts.

Each room owns its rules — the config's (layerwise/config/validate.py: names, ranges, keys, the
model, the hardware, the strategy's own checks), the run's (layerwise/run/rules.py: data files, GPUs,
the checkpoint to resume from), plan mode's (layerwise/planning/fits.py: a layout whose plan does not
fit) and the claims' (layerwise/reproduce/) — and this module, above them all, runs them in stages and
raises one ConfigError listing every problem. train.py, the Hydra launchers, the Slurm submission
and the GPU check call it.
"""

from omegaconf import OmegaConf

from layerwise.config.errors import ConfigError
from layerwise.config.validate import (CHOICES, check_choices, check_encoding, check_hardware, check_model,
                                       check_ranges, check_schema_keys, check_strategy, check_vocabulary,
                                       memory_errors, world_size)
from layerwise.planning.fits import planned_memory_errors
from layerwise.planning.inputs import plan_mode_errors
from layerwise.reproduce import CHOICES as CLAIM_CHOICES
from layerwise.run.rules import check_data, check_resume_from, fill_hf_model, gpu_errors


def validate(cfg, submitting: bool = False) -> int:
    """Raise ConfigError listing every problem; return the world size when the config is sound,
    and leave it read-only: what every rank runs is exactly what was validated.

    `submitting`: the run goes to a cluster (layerwise/cluster/slurm.py checks every point before submission),
    so this machine's own devices do not matter."""
    errors = fill_hf_model(cfg)  # model=hf: the shape is config.json's, before any rule reads it
    if errors:
        raise ConfigError(errors)
    errors = check_choices(cfg, {**CHOICES, **CLAIM_CHOICES}) + check_schema_keys(cfg) + check_ranges(cfg)
    if errors:  # later checks assume known names, declared keys and values in range
        raise ConfigError(errors)
    world = world_size(cfg)
    searching = cfg.mode == "plan" and cfg.plan.search  # layerwise/planning/search.py validates each layout it keeps
    errors = (check_model(cfg) + check_vocabulary(cfg) + check_encoding(cfg) + check_hardware(cfg)
              + gpu_errors(cfg, submitting) + memory_errors(cfg, world)
              + check_data(cfg)
              + ([] if searching else check_strategy(cfg, world)) + check_resume_from(cfg))
    if errors:
        raise ConfigError(errors)
    if cfg.mode != "plan":  # plan mode reports memory itself, fitting or not
        errors = planned_memory_errors(cfg, world)  # the layout is sound: its plan can be built
    elif not searching:
        errors = plan_mode_errors(cfg)
    if errors:
        raise ConfigError(errors)
    OmegaConf.set_readonly(cfg, True)
    return world
