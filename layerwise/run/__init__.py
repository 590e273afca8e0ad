"""The run room: fit (a training run), launch (ranks), task, data, optim, evidence, charts, faults,
preemption (Slurm, inside the ranks) and rules (the run's pre-flight checks). Below: config, planning."""
