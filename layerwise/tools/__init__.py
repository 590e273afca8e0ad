"""The tools room: commands beside training — calibrate, dry_run + cross_check (the second estimator),
report (sweeps), export, gpu_check. Below: config, planning, run."""
