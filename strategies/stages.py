"""Stages of a layered model, and the handlers that run a schedule's actions on them.

A stage is `layers_per_stage` consecutive blocks; stage 0 also owns the embedding, the last stage
the head and the loss. `StageWork` holds one rank's stages and implements one handler per action
kind of strategies/schedule: the executor calls them in plan order. Every stage input is a leaf
(`detach().requires_grad_()`), whether it came from another rank or from the previous stage on
this rank, so a backward never reaches across stages: the input's gradient is handed on explicitly.
"""

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from models.documents import batch_documents
from strategies.buckets import GradientBuckets, sum_over_groups
from strategies.expert_parallel import expert_parameter_ids
from strategies.recompute import apply_activation_recompute
from strategies.split_backward import input_gradient
from strategies.tensor_parallel.grids import local_activation_shape
from strategies.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FINISH, FORWARD, POST_RECV_ACTIVATION, POST_RECV_GRADIENT,
                                 RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT,
                                 Action, posted_receive)


def stage_blocks(stage: int, layers_per_stage: int) -> list:
    """Block names ("0".."L-1") of one stage."""
    return [str(index) for index in range(stage * layers_per_stage, (stage + 1) * layers_per_stage)]


def keep_local_stages(model: nn.Module, local_stages: list, stages: int, layers_per_stage: int):
    """Drop every module this rank does not run; its parameters then belong to other ranks."""
    kept = {name for stage in local_stages for name in stage_blocks(stage, layers_per_stage)}
    for name in [name for name in model.blocks if name not in kept]:
        del model.blocks[name]
    if 0 not in local_stages:
        model.embed = None
    if stages - 1 not in local_stages:
        model.head = None


def stage_part_names(stage: int, stages: int, layers_per_stage: int) -> list:
    """The model's parts (see models.LanguageModel.part_names) one stage holds: its blocks, +
    the embedding on the first stage and the head on the last."""
    parts = [f"blocks.{block}" for block in stage_blocks(stage, layers_per_stage)]
    parts += ["embed"] if stage == 0 else []
    return parts + (["head"] if stage == stages - 1 else [])


def stage_parameter_names(model: nn.Module, stage: int, stages: int, layers_per_stage: int) -> list:
    """Names (in the model) of one stage's parameters: its blocks, + embedding / head at the ends."""
    return [f"{part}.{name}" for part in stage_part_names(stage, stages, layers_per_stage)
            for name, _ in model.get_submodule(part).named_parameters()]


def stage_parameters(model: nn.Module, stage: int, stages: int, layers_per_stage: int) -> list:
    names = stage_parameter_names(model, stage, stages, layers_per_stage)
    return [model.get_parameter(name) for name in names]


@dataclass
class Peers:
    """Where messages go: a global rank per stage, the groups, the communicator."""

    rank_of_stage: list  # global rank running each stage, within this pipeline
    pipeline_group: object
    data_group: object
    communicator: object
    expert_data_group: object = None  # where split experts' gradients are summed (strategies/expert_parallel.py)


@dataclass(frozen=True)
class BoundaryScatter:
    """Where boundary messages are scattered over a tensor group (Narayanan et al. 2021 §4.1): the
    group whose ranks hold copies of the piece, and this rank's index in it (its slice)."""

    group: object  # parallel.comm.Group
    index: int


@dataclass
class StepState:
    """Everything one step keeps between actions, keyed by (stage, micro-batch)."""

    inputs: dict = field(default_factory=dict)  # leaf input of each stage's forward
    outputs: dict = field(default_factory=dict)  # output (or scaled loss on the last stage)
    output_gradients: dict = field(default_factory=dict)  # gradient arriving for an output
    # split backward: (stage, micro-batch) -> its I's PendingWeightGradient (graph + recorded gradients) until W
    weight_work: dict = field(default_factory=dict)
    # peer rank -> (SEND, work, tensor) in issue order: a sent tensor stays alive until its work completes
    pending_sends: dict = field(default_factory=dict)
    proven: set = field(default_factory=set)  # SENDs whose receive the peer has issued (send_releases)
    releases: dict = field(default_factory=dict)  # RECV -> the SENDs it proves received (the plan's)
    most_held: int = 0  # most sends held at once this step (tests hold it to the plan's count)
    posted_receives: dict = field(default_factory=dict)  # RECV action -> (work, buffer), from its post
    loss: torch.Tensor = None


class StageWork:
    """One rank's stages and the handlers the executor dispatches to (one per action kind).

    1. FORWARD(c, i): input (tokens, a received activation, or the local previous stage's output
       as a leaf) → blocks of c (+ head and loss/m on the last stage);
    2. BACKWARD(c, i): backpropagate the loss or the received output gradient into ∂W_c and the
       input's gradient, which is what the previous stage receives; split (Qi et al. 2023 §2):
       BACKWARD_INPUT(c, i) computes only the input's gradient, keeping the graph, and
       BACKWARD_WEIGHT(c, i) later accumulates ∂W_c and frees the graph;
    3. SEND_* post asynchronous sends, each tensor kept until its transfer is known complete
       (`release_sends`); POST_RECV_* post asynchronous receives where the plan says
       (NCCL matches a pair's operations in issue order, so the plan fixes that order); RECV_*
       wait for their posted receive, or post and wait at once when the plan has no post for it;
       the data-parallel all-reduce runs per flat bucket of at most `bucket_bytes` (0: one per
       tensor) into which the backward accumulates in place (strategies/buckets.py GradientBuckets):
       with `overlap_reduction` each bucket is posted as soon as stage c's last backward (its
       m-th B or W of the step) has finished all of its gradients, under the rest of that backward;
       REDUCE_GRADIENT(c) posts the rest (all of them without overlap) — with layered
       accumulation both overlap the earlier stages' backward.
    With `activation_recompute="full"` each block keeps only its input and reruns in the backward.
    With a `tensor_form` (strategies/tensor_parallel) the stages' modules are this rank's shards:
    boundaries carry this grid position's piece of the activation to the same position of the next
    stage, the loss is the vocabulary-parallel one, and REDUCE_GRADIENT first sums the gradients of
    pieces the grid replicates over their tensor groups (docs/strategies/three_d.md), then over data.
    Messages travel in `message_dtype` (bf16/fp16 under mixed precision), cast back to the stream's
    `activation_dtype` on arrival; with a `scatter` group whose ranks hold copies of the piece (1-D),
    each rank sends only its 1/t slice and the receivers all-gather the slices
    (docs/strategies/modular_pipeline.md, "Stage-boundary messages").
    """

    def __init__(self, model: nn.Module, stages: int, layers_per_stage: int, micro_batches: int,
                 peers: Peers, activation_dtype: torch.dtype = torch.float32, scale_loss=None,
                 activation_recompute: str = "none", bucket_bytes: int = 0, tensor_form=None,
                 message_dtype: torch.dtype = None, scatter: BoundaryScatter = None,
                 overlap_reduction: bool = False, gradient_buckets: bool = True,
                 reduction_dtype: torch.dtype = torch.float32, context=None):
        self.model = model
        # Context parallelism (strategies/context_layout.py ContextCut): each micro-batch's rows cut to
        # this rank's head and tail chunks, the model's positions set for them; None: whole rows.
        self.context = context
        self.tensor_form = tensor_form
        self.loss_function = tensor_form.loss if tensor_form is not None else model.loss
        self.stages = stages
        self.layers_per_stage = layers_per_stage
        self.micro_batches = micro_batches
        self.peers = peers
        # What crosses a stage boundary (the residual stream: fp32 under autocast, whose norms and
        # additions run in fp32). Receive buffers are allocated in it; NCCL needs equal sizes.
        self.activation_dtype = activation_dtype
        # What travels: the compute dtype under mixed precision (Megatron-LM sends its pipeline
        # tensors in the params dtype), cast back to activation_dtype on arrival (None: no cast).
        self.message_dtype = message_dtype or activation_dtype
        self.scatter = scatter  # a tensor group holding copies of the piece: send 1/t, gather on arrival
        self.scale_loss = scale_loss or (lambda loss: loss)  # fp16: the loss scaler's scale
        apply_activation_recompute(model, activation_recompute)
        self.bucket_bytes = bucket_bytes
        # None where another owner keeps the gradients in its own flat buffers and reduces them
        # (the distributed optimizer, strategies/distributed_optimizer.py)
        self.gradients = GradientBuckets(bucket_bytes, peers.communicator, peers.data_group,
                                         overlap_reduction, reduction_dtype,
                                         expert_group=peers.expert_data_group) if gradient_buckets else None
        self.state = StepState()
        self.batch = None
        self.scattered = False  # this step's messages scattered (`_scatters`), set by `start`
        self.training = True

    def handlers(self) -> dict:
        """Action kind -> the method that runs it (the executor's dispatch table)."""
        return {FORWARD: self.forward, BACKWARD: self.backward,
                BACKWARD_INPUT: self.backward_input, BACKWARD_WEIGHT: self.backward_weight,
                SEND_ACTIVATION: self.send_activation, RECV_ACTIVATION: self.receive_activation,
                SEND_GRADIENT: self.send_gradient, RECV_GRADIENT: self.receive_gradient,
                POST_RECV_ACTIVATION: self.post_receive, POST_RECV_GRADIENT: self.post_receive,
                REDUCE_GRADIENT: self.reduce_gradient, FINISH: self.finish}

    def start(self, batch: dict, training: bool, releases: dict = None) -> None:
        """Reset per-step state and split the batch. Receives are posted by the plan's own
        POST_RECV_* actions, in the order NCCL needs, never all at once here. `releases` is this
        rank's `send_releases` of the plan: after which RECV each send may be released."""
        self.state = StepState(releases=releases or {})
        if self.gradients is not None:
            self.gradients.start()
        self.training = training
        self.batch = {key: value.chunk(self.micro_batches) for key, value in batch.items()}
        self.scattered = self._scatters()

    # ----- compute
    def forward(self, action: Action) -> None:
        stage, micro_batch = action.stage, action.micro_batch
        rows = self._rows(micro_batch)
        hidden = self._stage_input(stage, micro_batch, rows["tokens"])
        self.model.set_loss_scale(1.0 / self.micro_batches)  # its share of the step's loss (MoE aux loss)
        for name in stage_blocks(stage, self.layers_per_stage):
            hidden = self.model.blocks[name](hidden)
        if stage == self.stages - 1:
            loss = self.loss_function(self.model.head(hidden), rows["targets"])
            hidden = loss / self.micro_batches  # mean over micro-batches = mean over the batch
            self.state.loss = hidden.detach() + (0 if self.state.loss is None else self.state.loss)
        self.state.outputs[(stage, micro_batch)] = hidden

    def _rows(self, micro_batch: int) -> dict:
        """Micro-batch `micro_batch` as this rank computes it, the model told what it reads (before
        every forward of any stage: schedules interleave micro-batches): under context parallelism its
        head and tail chunks, their positions set; packed rows (data.packing): their documents."""
        rows = {key: value[micro_batch] for key, value in self.batch.items()}
        if self.context is not None:
            rows = self.context(self.model, rows)
        documents = batch_documents(rows)
        if documents is not None:
            self.model.set_documents(documents)
        return rows

    def rows_shape(self) -> tuple:
        """(rows, positions) of one micro-batch as this rank holds it: s/c positions under context parallelism."""
        rows, length = self.batch["tokens"][0].shape
        return rows, length if self.context is None else self.context.length(length)

    def _stage_input(self, stage: int, micro_batch: int, tokens: torch.Tensor) -> torch.Tensor:
        if stage == 0:
            embedded = self.model.embed(tokens)
            if self.training:  # a split backward's I stops at it (popped by B or I)
                self.state.inputs[(stage, micro_batch)] = embedded
            return embedded
        if (stage, micro_batch) not in self.state.inputs:  # previous stage ran on this rank
            previous = self.state.outputs[(stage - 1, micro_batch)]
            self.state.inputs[(stage, micro_batch)] = previous.detach().requires_grad_(self.training)
        return self.state.inputs[(stage, micro_batch)]

    def backward(self, action: Action) -> None:
        key = (action.stage, action.micro_batch)
        output = self.state.outputs.pop(key)
        with self._accumulating(action.stage):
            if action.stage == self.stages - 1:
                self.scale_loss(output).backward()
            else:
                output.backward(self.state.output_gradients.pop(key))
        stage_input = self.state.inputs.pop(key)
        if action.stage > 0:
            self._hand_back_input_gradient(action, stage_input.grad)

    def backward_input(self, action: Action) -> None:
        """I: the stage input's gradient only (graph kept for W; strategies/split_backward.py).

        Stage 0's input gradient has no consumer (its input is the embedding's output): its I does
        nothing and its W runs the fused backward, one autograd pass, where the plan put the W
        (splitting costs ~16% more autograd work: docs/strategies/modular_pipeline.md)."""
        if action.stage == 0:
            return
        key = (action.stage, action.micro_batch)
        output = self.state.outputs.pop(key)
        if action.stage == self.stages - 1:
            output, output_gradient = self.scale_loss(output), None
        else:
            output_gradient = self.state.output_gradients.pop(key)
        gradient, self.state.weight_work[key] = input_gradient(output, output_gradient, self.state.inputs.pop(key),
                                                               self.weights(action.stage))
        self._hand_back_input_gradient(action, gradient)

    def backward_weight(self, action: Action) -> None:
        """W: accumulate ∂W_c of this micro-batch into .grad from what its I recorded, freeing the graph
        (stage 0: the whole backward, its I having done nothing)."""
        if action.stage == 0:
            return self.backward(Action(BACKWARD, 0, action.micro_batch))
        with self._accumulating(action.stage):
            accumulated = None if self.gradients is None else self.gradients.accumulated
            self.state.weight_work.pop((action.stage, action.micro_batch)).run(accumulated)

    def weights(self, stage: int) -> list:
        """The tensors a W accumulates into: the stage's trainable parameters."""
        return [parameter for parameter in stage_parameters(self.model, stage, self.stages, self.layers_per_stage)
                if parameter.requires_grad]

    def _hand_back_input_gradient(self, action: Action, gradient: torch.Tensor) -> None:
        key, previous = (action.stage, action.micro_batch), (action.stage - 1, action.micro_batch)
        if previous in self.state.outputs:  # the previous stage is on this rank
            self.state.output_gradients[previous] = gradient
        else:
            self.state.inputs[key] = gradient  # held until SEND_GRADIENT

    # ----- point to point
    def _tag(self, action: Action, gradient: bool) -> int:
        return (action.stage * self.micro_batches + action.micro_batch) * 2 + int(gradient)

    def send_activation(self, action: Action) -> None:
        tensor = self.state.outputs[(action.stage, action.micro_batch)].detach()
        self._send(action, tensor, self._tag(action, False))

    def send_gradient(self, action: Action) -> None:
        tensor = self.state.inputs.pop((action.stage, action.micro_batch))
        self._send(action, tensor, self._tag(action, True))

    def _send(self, action: Action, tensor, tag):
        if tensor.dtype != self.activation_dtype:  # the receiver allocated message_dtype bytes for it
            raise TypeError(f"stage boundary carries {tensor.dtype}, receivers expect {self.activation_dtype}")
        self.release_sends()
        tensor = self.message(tensor)
        peer = self.peers.rank_of_stage[action.peer_stage]
        work = self.peers.communicator.send(tensor, peer, self.peers.pipeline_group, tag=tag)
        self.state.pending_sends.setdefault(peer, deque()).append((action, work, tensor))
        held = sum(len(queue) for queue in self.state.pending_sends.values())
        self.state.most_held = max(self.state.most_held, held)

    def message(self, tensor: torch.Tensor) -> torch.Tensor:
        """What crosses the wire for a boundary tensor (an activation, or the gradient going back):
        cast to `message_dtype`; scattered, only this rank's slice of the flattened tensor — every
        rank of the tensor group holds the same tensor, so their slices together are the whole. A
        slice is copied out, so a held send keeps 1/t of the bytes alive, not the whole tensor."""
        if not self.scattered:
            return tensor.to(self.message_dtype).contiguous()  # no cast: the very tensor, as before
        size = self._slice_elements(tensor.numel())
        start = self.scatter.index * size
        return tensor.reshape(-1)[start:start + size].to(self.message_dtype, copy=True)

    def _slice_elements(self, elements: int) -> int:
        ranks = self.scatter.group.size
        if elements % ranks:  # the check refuses it first (checks.grid_errors: model.hidden)
            raise ValueError(f"a stage-boundary message of {elements} elements does not split into {ranks} "
                             f"slices. Fix: model.hidden a multiple of {ranks}, or strategy.scatter_gather=false.")
        return elements // ranks

    def release_sends(self) -> None:
        """Drop each sent tensor whose transfer is done, per peer in issue order (NCCL completes a
        pair's operations in that order, on one stream): when its work reports completion (NCCL), or
        when the plan proves the peer has issued its receive (`send_releases`), then `wait()` — gloo
        and the fake group complete a send only there, and with the receive outstanding the wait
        needs nothing more from this rank, so it cannot deadlock (docs/strategies/pipeline_memory.md)."""
        for queue in self.state.pending_sends.values():
            while queue and (queue[0][0] in self.state.proven or queue[0][1].is_completed()):
                action, work, _ = queue.popleft()
                work.wait()
                self.state.proven.discard(action)

    def receive_activation(self, action: Action) -> None:
        tensor = self._arrived(action)
        self.state.inputs[(action.stage, action.micro_batch)] = tensor.requires_grad_(self.training)

    def receive_gradient(self, action: Action) -> None:
        self.state.output_gradients[(action.stage, action.micro_batch)] = self._arrived(action)

    def post_receive(self, action: Action) -> None:
        """Issue the receive of the RECV this post names; the message lands while the rank works on."""
        receive = posted_receive(action)
        self.state.posted_receives[receive] = self._post_receive(receive)

    def _arrived(self, action: Action) -> torch.Tensor:
        if action not in self.state.posted_receives:  # no post in the plan: this RECV issues it
            self.state.posted_receives[action] = self._post_receive(action)
        work, tensor = self.state.posted_receives.pop(action)
        work.wait()
        self.state.proven.update(self.state.releases.get(action, ()))  # the peer issued their receives
        self.release_sends()
        return self.unpacked(tensor)

    def unpacked(self, message: torch.Tensor) -> torch.Tensor:
        """The boundary tensor from what arrived: scattered, the slices all-gathered over the tensor
        group (a collective: every rank of the group runs the same plan row, so they issue it at the
        same RECV, in the same order); then cast back to the residual stream's dtype, so the stage
        and autograd see what they did before (the gradient of the cast is the cast back: the
        sender's SEND_GRADIENT casts the fp32 input gradient to `message_dtype` in turn)."""
        if self.scattered:
            whole = torch.empty(message.numel() * self.scatter.group.size, dtype=message.dtype, device=message.device)
            self.peers.communicator.all_gather(whole, message, self.scatter.group)
            message = whole.view(self.boundary_shape(*self.rows_shape()))
        return message.to(self.activation_dtype)  # no cast: the very buffer, as before

    def _post_receive(self, action: Action):
        # The sender's tag is computed from its own action: (peer stage, same micro-batch).
        gradient = action.kind == RECV_GRADIENT
        sender = Action(SEND_GRADIENT if gradient else SEND_ACTIVATION, action.peer_stage,
                        action.micro_batch, action.stage)
        tokens = self.batch["tokens"][0]
        shape = self.boundary_shape(*self.rows_shape())
        if self.scattered:  # this rank's slice only
            shape = (self._slice_elements(math.prod(shape)),)
        tensor = torch.empty(shape, dtype=self.message_dtype, device=tokens.device)
        work = self.peers.communicator.receive(tensor, self.peers.rank_of_stage[action.peer_stage],
                                               self.peers.pipeline_group, tag=self._tag(sender, gradient))
        return work, tensor

    def boundary_shape(self, rows: int, length: int) -> tuple:
        """What crosses a stage boundary: the residual stream, or this grid position's piece of it."""
        if self.tensor_form is None:
            return rows, length, self.model.hidden
        return local_activation_shape(self.tensor_form.grid, rows, length, self.model.hidden)

    def _scatters(self) -> bool:
        """Whether boundary messages are scattered over `scatter.group` and gathered on arrival:
        where each grid position's piece is the whole activation (the 1-D grid: Megatron keeps the
        residual stream whole, so the group's ranks hold copies of it). A piece the grid already
        splits (2-D, 3-D, or split along the sequence) is sent as it is: nothing to scatter. The grid
        says which (`replicated_piece`, strategies/tensor_parallel/grids.py); no grid: a whole copy."""
        if self.scatter is None or self.scatter.group.size == 1:
            return False
        return self.tensor_form is None or self.tensor_form.grid.replicated_piece

    # ----- data parallel
    def _accumulating(self, stage: int):
        """Around one accumulation into stage `stage`'s gradients (a B, or a W): its buckets laid
        out and attached, and in its m-th of the step each finished bucket posted (GradientBuckets)."""
        if self.gradients is None:
            return contextlib.nullcontext()
        self._lay_out(stage)
        return self.gradients.accumulating(stage, self.micro_batches)

    def _lay_out(self, stage: int) -> None:
        """Stage `stage`'s buckets, once: its parameters reversed (the order the backward finishes
        them, DDP's); those a tensor grid replicates are late (summed over their tensor groups at
        REDUCE_GRADIENT first, then posted: not from the backward). A weight an earlier local stage
        also holds (model.tie_embeddings on one pipeline rank: the head's is the embedding's) is
        that stage's: its gradient is final only after stage 0's backward, which always comes last."""
        if self.gradients.laid_out(stage):
            return
        earlier = {id(parameter) for lower in range(stage) if stage_blocks(lower, self.layers_per_stage)[0] in self.model.blocks
                   for parameter in stage_parameters(self.model, lower, self.stages, self.layers_per_stage)}
        names = [name for name in stage_parameter_names(self.model, stage, self.stages, self.layers_per_stage)
                 if id(self.model.get_parameter(name)) not in earlier]
        groups = {} if self.tensor_form is None else self.tensor_form.gradient_groups
        late = {id(self.model.get_parameter(name)) for name in names if groups.get(name)}
        self.gradients.lay_out(stage, [self.model.get_parameter(name) for name in names][::-1], late,
                               expert_parameter_ids(self.model))

    def reduce_gradient(self, action: Action) -> None:
        """After stage c's last backward: the replicated pieces summed over the tensor grid, then
        every bucket of c not posted from the backward (all of them without overlap) posted."""
        self.sum_replicated_gradients(action.stage)
        self._lay_out(action.stage)
        self.gradients.post_rest(action.stage)

    def sum_replicated_gradients(self, stage: int) -> None:
        """Pieces a tensor grid holds on several ranks (norms, some biases, embeddings in 2-D/3-D)
        got a partial gradient on each: sum them over their groups, one collective per group set,
        before any data-parallel reduction (all ranks of a tensor block run the same plan row, so
        they issue these in the same order)."""
        if self.tensor_form is None:
            return
        names = stage_parameter_names(self.model, stage, self.stages, self.layers_per_stage)
        groups = self.tensor_form.gradient_groups
        sum_over_groups([(self.model.get_parameter(name).grad, groups.get(name, ())) for name in names],
                        self.peers.communicator)

    def finish(self) -> None:
        """Wait for the sends no later message proved received (the step's last ones)."""
        for queue in self.state.pending_sends.values():
            for _, work, _ in queue:
                work.wait()
        self.state.pending_sends.clear()

    def wait_for_reductions(self) -> None:
        """Called before the optimizer: the all-reduces summed; divide for the mean."""
        if self.gradients is not None:
            self.gradients.wait(self.peers.data_group.size)
