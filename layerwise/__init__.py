"""layerwise: training transformers with layer-wise parallelism strategies."""
