"""Split backward (Qi et al. 2023 §2): I computes a stage input's gradient now, W the weights' later.

I runs autograd toward the stage input only, the graph kept. On the way it records the gradient
arriving at each node of that path that also feeds a weight (an "intermediate": a product's
backward, whose other branch leads to the weight, possibly through a cast or a view). W later starts
from those recorded gradients and runs only the weight branches, so it never recomputes an
activation gradient: I + W cost one fused backward, not one and a half. torch's
`torch/distributed/pipelining/_backward.py` (stage_backward_input/weight) keeps the same
intermediates; this is our own reading of the autograd graph, with the stage input being a non-leaf
(stage 0's embedding output) handled too.

The price is memory: each pending W holds, besides the graph, the gradient at every intermediate
(one activation-sized tensor per weighted operator) until it runs (cost/memory.py counts it).
Nodes only I needed (an activation function's) are not run again, so their saved tensors go when
the graph does, at W's end: a saved-tensor pack hook must not return its tensor whole (a saved
output would then hold its own node, a cycle Python's collector cannot see; `.detach()` it).
"""

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge


def autograd_node(tensor: torch.Tensor):
    """The node a gradient for `tensor` flows into: its grad_fn, or a leaf's accumulator (made
    lazily by autograd, so a throwaway view creates it)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


def _children(node):
    return [child for child, _ in node.next_functions if child is not None]


def _reaching(root, target) -> set:
    """Nodes under `root` from which `target` is reachable, target excluded: the path I runs.
    An iterative post-order walk (a stage of many blocks is deeper than Python's recursion)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if child not in seen)
    reaches = {target}
    for node in order:  # children before parents
        if node is not target and any(child in reaches for child in _children(node)):
            reaches.add(node)
    return reaches - {target}


def _branch(root, blocked: set) -> set:
    """Nodes of a weight branch: everything under `root` (which is off I's path)."""
    nodes, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node not in nodes and node not in blocked:
            nodes.add(node)
            stack.extend(_children(node))
    return nodes


@dataclass
class _Group:
    """Intermediates whose weight branches share nodes, so one autograd call must run them together."""

    intermediates: list = field(default_factory=list)
    branch: set = field(default_factory=set)


def _groups(path: set, start, weights: dict) -> list:
    """Intermediates grouped by shared branches; each group's branches reach at least one weight."""
    groups, blocked = [], path | {start}
    for node in [*path, start]:
        roots = [child for child in _children(node) if child not in blocked]
        branch = set().union(*(_branch(root, blocked) for root in roots))
        if not any(member in weights for member in branch):
            continue
        group = _Group([node], branch)
        for other in [g for g in groups if g.branch & branch]:  # tied weights, a cached autocast cast
            groups.remove(other)
            group.intermediates += other.intermediates
            group.branch |= other.branch
        groups.append(group)
    return groups


class PendingWeightGradient:
    """What a W needs from its I: per group, the intermediates' recorded gradients and the weights."""

    def __init__(self, groups: list, recorded: dict, weights: dict):
        self.groups, self.recorded, self.weights = groups, recorded, weights

    def run(self, accumulated=None) -> None:
        """Accumulate each weight's gradient into `.grad`, group by group. A group of several
        intermediates (one may lie on another's path) replays each one's recorded gradient at it,
        so a gradient is never counted twice; those go first, with the graph kept for the rest.
        `accumulated(weight)` is called after each weight's accumulation, as autograd's accumulator
        runs a post-accumulate-grad hook (strategies/buckets.py posts a finished bucket from it)."""
        ordered = sorted(self.groups, key=lambda group: len(group.intermediates) == 1)
        for group in ordered:
            self._run_group(group, shared=len(group.intermediates) > 1, accumulated=accumulated)
        self.groups, self.recorded = [], {}  # the graph and the gradients go with this W

    def _run_group(self, group: _Group, shared: bool, accumulated=None) -> None:
        edges, gradients = [], []
        for node in group.intermediates:
            for index, gradient in enumerate(self.recorded.get(node, ())):
                if gradient is not None:
                    edges.append(GradientEdge(node, index))
                    gradients.append(gradient)
        if not edges:
            return
        accumulators = [node for node in group.branch if node in self.weights]
        handles = [node.register_prehook(lambda arrived, kept=self.recorded.get(node, ()): _replay(arrived, kept))
                   for node in group.intermediates] if shared else []
        try:
            results = torch.autograd.grad(edges, [GradientEdge(node, 0) for node in accumulators], gradients,
                                          retain_graph=shared, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for node, gradient in zip(accumulators, results):
            if gradient is not None:
                _accumulate(self.weights[node], gradient)
                if accumulated is not None:
                    accumulated(self.weights[node])


def _replay(arrived: tuple, kept: tuple) -> tuple:
    """The gradients I recorded at a node, in place of what W's own traversal brings to it."""
    return tuple(kept[index] if index < len(kept) else None for index in range(len(arrived)))


def _accumulate(weight: torch.Tensor, gradient: torch.Tensor) -> None:
    """As autograd's accumulator: into the existing `.grad` in place (ZeRO's are views of a flat
    buffer that must stay views), else a copy becomes it (the result may share storage with a
    gradient still in use elsewhere, which autograd's accumulator checks and we do not)."""
    if weight.grad is None:
        weight.grad = gradient.clone(memory_format=torch.contiguous_format)
    else:
        weight.grad.add_(gradient)


def input_gradient(output: torch.Tensor, output_gradient, stage_input: torch.Tensor, weights: list):
    """I: the gradient of `stage_input`, and the PendingWeightGradient its W runs later."""
    start = autograd_node(stage_input)
    weight_nodes = {autograd_node(weight): weight for weight in weights}
    path = _reaching(autograd_node(output), start)
    groups = _groups(path, start, weight_nodes)
    recorded = {}
    handles = [node.register_prehook(lambda gradients, node=node: recorded.__setitem__(node, gradients))
               for group in groups for node in group.intermediates if node is not start]
    try:
        (gradient,) = torch.autograd.grad(output, stage_input, output_gradient, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    if any(start in group.intermediates for group in groups):  # a non-leaf input: its W starts at it
        recorded[start] = (None,) * stage_input.output_nr + (gradient,)
    return gradient, PendingWeightGradient(groups, recorded, weight_nodes)
