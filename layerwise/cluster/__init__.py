"""The cluster room: Slurm submission and the Hydra launchers' implementation (slurm). Below: config,
planning, run, tools."""
