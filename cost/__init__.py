"""The cost model: pure formulas over a model shape, a layout and a hardware profile (no config, no
process, no model built). inputs (what is asked about), step_time (the simulated step), memory (each
rank role's bytes), kfac (PipeFisher's K-FAC work and bytes), traffic (logical bytes per step)."""
