"""Tensor parallelism: 1-D (Megatron), 2-D (SUMMA) and 3-D (Bian et al. 2021) forms of a plain model.

    form = parallelize_3d(model, layout)      # shards the plain model's weights in place
    loss = form.loss(model(tokens), targets)  # this rank's share of the global-batch loss
    form.gradient_groups                      # parameter name -> groups its gradient is summed over

collectives.py: counted collectives along a dimension and the autograd functions built on them;
grids.py: how each grid cuts a parameter and which groups hold copies; layers.py: the parallel
modules; parallelize.py: the plan (module name -> style) and the functions that apply it.
"""

from strategies.tensor_parallel.parallelize import (  # noqa: F401
    TensorParallelForm,
    consolidate,
    parallelize,
    parallelize_1d,
    parallelize_2d,
    parallelize_3d,
)
