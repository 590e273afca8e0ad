"""Plan mode's answers for context parallelism (issue 57 item 5): plan.json `context`, and the
(pipeline, context, exchange) options the search ranges over. The prices themselves are cost/context.py's."""

from cost.context import exchange_buffers, exchange_bytes, exchange_seconds
from cost.inputs import Workload
from cost.step_time import collective_seconds, core_attention_seconds
from strategies.checks import divisors


def pipeline_context(cfg, ranks: int) -> list:
    """(pipeline degree, context degree c, exchange) over `ranks` = world / tensor: c = 1, and each
    power of two up to plan.search_max_context that divides what the pipeline leaves and splits
    data.sequence_length into 2c chunks (a head and a tail per rank), with either exchange."""
    options = []
    for pipeline in divisors(ranks):
        options.append((pipeline, 1, "ring"))
        context = 2
        while context <= cfg.plan.get("search_max_context", 1) and (ranks // pipeline) % context == 0 \
                and cfg.data.sequence_length % (2 * context) == 0:
            options += [(pipeline, context, "ring"), (pipeline, context, "all_gather")]
            context *= 2
    return options


def context_plan(workload: Workload, device) -> dict:
    """plan.json `context` (context parallelism, cost/context.py): the degree and the exchange, the
    tokens of a sequence each rank holds, the exchange's bytes per layer and micro-batch by kind
    (cost.traffic.context_traffic), its exposed seconds per micro-batch through a stage (forward,
    backward: what the attention does not hide) and the K/V buffers it holds beside the activations."""
    forward, backward = exchange_seconds(workload, device, collective_seconds, core_attention_seconds(workload, device))
    return {"context_parallel": workload.layout.context, "context_parallel_comm": workload.context_comm,
            "sequence_tokens_per_rank": workload.shape.length,
            "exchange_bytes_per_layer": dict(exchange_bytes(workload)),
            "exposed_exchange_s_per_micro_batch": {"forward": forward, "backward": backward},
            "exchange_buffers_bytes": exchange_buffers(workload)}
