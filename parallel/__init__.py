"""The ground floor strategies stand on: the layout of process groups, the counted communicator,
and the compute-side memory meter. Imports nothing from `layerwise/` (the run sits above it)."""
