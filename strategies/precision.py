"""What `hardware.precision` (Lightning's names) means for the tensors a strategy creates itself.

Lightning's precision plugin runs autocast around the step and keeps fp32 master weights under
"-mixed"; these two tables say what the strategies' own buffers hold under each name.
"""

import torch

# Matrix products (and L2L's device copies of the weights) run in this dtype.
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                  "16-mixed": torch.float16, "16-true": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    return COMPUTE_DTYPES.get(precision, torch.float32)


def activation_dtype(precision: str) -> torch.dtype:
    """The residual stream between blocks, what pipeline stages exchange: under "-mixed" autocast
    runs norms and additions in fp32, so it stays fp32; under "-true" the whole model is narrow."""
    return compute_dtype(precision) if precision.endswith("-true") else torch.float32
