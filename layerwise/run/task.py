"""The Lightning task (model, loss, optimizer, schedule) and the data module every strategy shares.

The task is strategy-agnostic: it computes a loss from a batch with the plain model. Strategies
that own the step (pipelines, ZeRO, offload) call into `task.model` themselves and leave
`training_step` unused; `single` and `ddp` use it as it is.
"""

from dataclasses import fields

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from layerwise.run import data as data_lib
from layerwise.run.optim import add_parameters, build_optimizer, build_scheduler
from models import build_model, layer_drop_mask
from models.moe import MoeSettings, start_step, update_expert_biases
from models.documents import batch_documents


def objective_of(model_config) -> str:
    return "masked" if model_config.architecture == "bert" else "causal"


LLAMA_FIELDS = ("kv_heads", "ffn_hidden", "norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "head_dim", "qk_norm")


# mixture of experts (models/moe.py MoeSettings: the model config's names), llama only
MOE_FIELDS = tuple(field.name for field in fields(MoeSettings))


def model_arguments(model_config, vocab_size: int, seed: int) -> dict:
    """Keyword arguments of `models.build_model` from the model config group."""
    arguments = dict(vocab_size=vocab_size, sequence_length=model_config.max_sequence_length,
                     layers=model_config.layers, hidden=model_config.hidden,
                     heads=model_config.heads, mlp_ratio=model_config.mlp_ratio,
                     dropout=model_config.dropout, tie_embeddings=model_config.tie_embeddings,
                     seed=seed)
    if model_config.architecture == "llama":
        arguments.update({name: model_config.get(name) for name in LLAMA_FIELDS + MOE_FIELDS})
    return arguments


def initial_weights(model_config):
    """The `weights` hook of the model (models/transformer.py build_part): model.path's Hugging Face
    tensors, read by each rank for the parts it materialises; None = seeded values."""
    if not model_config.get("path"):
        return None
    from models.hf import PartWeights
    return PartWeights(model_config.path, model_config.architecture, model_config.tie_embeddings)


def depth_at(cfg, step: int) -> int:
    """Blocks at training step `step`: model.layers, plus strategy.grow_by at each strategy.grow_at
    step already reached (growth happens at the start of that step); grow_by = 0 doubles the depth."""
    return depths(cfg)[sum(1 for at in cfg.strategy.get("grow_at", ()) if at <= step)]


def depths(cfg) -> list:
    """The depths a run passes through: model.layers, then after each strategy.grow_at step."""
    found = [cfg.model.layers]
    for _ in cfg.strategy.get("grow_at", ()):
        found.append(found[-1] + (cfg.strategy.get("grow_by", 1) or found[-1]))
    return found


class LanguageModelTask(pl.LightningModule):
    """A GPT (causal) or BERT (masked) language model with its optimizer and LR schedule.

    1. the model is built on the meta device (shapes only); in `configure_model` the strategy
       materialises the parts this rank owns with their values seeded from `cfg.seed`, so every
       rank holds exactly the weights the whole model would, and only those;
    2. a step's loss is the mean cross-entropy over the rank's slice of the global batch;
    3. dropout masks are re-seeded from (seed, step, data rank) so a resumed run replays them.
    """

    def __init__(self, cfg, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size = cfg.model.get("vocab_size") or vocab_size
        self.model = build_model(cfg.model.architecture, device="meta", weights=initial_weights(cfg.model),
                                 **model_arguments(cfg.model, vocab_size, cfg.seed))

    def training_step(self, batch, batch_index):
        self.model.set_loss_scale(1.0)  # one forward: this rank's whole share of the step (MoE aux loss)
        batch = self._rows(batch)
        return self.model.loss(self.model(batch["tokens"]), batch["targets"])

    def validation_step(self, batch, batch_index):
        batch = self._rows(batch)
        return self.model.loss(self.model(batch["tokens"]), batch["targets"])

    def _rows(self, batch) -> dict:
        """The rows this rank computes (the strategy's `context_batch`: under context parallelism its
        head and tail chunks, positions set on the model); packed rows (data.packing): the model reads
        the batch's documents (models/documents.py)."""
        batch = self.trainer.strategy.context_batch(self.model, batch)
        documents = batch_documents(batch)
        if documents is not None:
            self.model.set_documents(documents)
        return batch

    def on_train_batch_start(self, batch, batch_index):
        rank, _ = self.trainer.strategy.data_parallel()
        # Integers only: tuple hashes of ints are stable across processes (strings are salted).
        torch.manual_seed(hash((int(self.cfg.seed), int(self.global_step), rank)) % 2**63)
        self.vary_depth(int(self.global_step))
        start_step(self.model)  # MoE loads, drops and aux loss: recorded afresh each step (models/moe.py)

    def vary_depth(self, step: int) -> None:
        """This step's depth (progressive stacking: grown at each `grow_at` step reached), then
        LayerDrop's mask from (seed, step) alone: every rank and strategy draws the same."""
        if self.cfg.strategy.get("grow_at"):
            self.grow_to(depth_at(self.cfg, step))
        p = self.cfg.strategy.get("layer_drop", 0.0)
        if p:
            self.model.drop_blocks(layer_drop_mask(int(self.cfg.seed), step, len(self.model.blocks), p))

    def grow_to(self, depth: int) -> None:
        """Stack blocks until the model has `depth`; the optimizer (if built) gets them, stateless."""
        missing = depth - self.model.layers  # the whole model's depth (a pipeline rank holds fewer blocks)
        if missing <= 0:
            return
        added = self.model.grow(missing)
        for optimizer in (self.trainer.optimizers if self._trainer is not None else []):
            add_parameters(optimizer, added)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["model_depth"] = self.model.layers  # the whole model's: a grown one resumes at its depth

    def on_load_checkpoint(self, checkpoint):
        self.grow_to(checkpoint.get("model_depth", 0))  # before the weights and optimizer state load

    def optimizer_zero_grad(self, epoch, batch_index, optimizer):
        # Lightning's closure zeroes gradients *after* training_step; a strategy whose
        # training_step runs the whole schedule (backward included) zeroes them itself, before.
        if not self.trainer.strategy.owns_step:
            optimizer.zero_grad()

    def optimizer_step(self, epoch, batch_index, optimizer, optimizer_closure=None):
        super().optimizer_step(epoch, batch_index, optimizer, optimizer_closure)
        # DeepSeek-V3's sigmoid_bias update after each optimizer step, from the step's loads summed
        # over the data ranks (models/moe.py); before the callbacks' step end, so checkpoints hold it
        update_expert_biases(self.model, self.trainer.strategy.sum_over_data)

    def configure_model(self):
        # After the layout exists, before the strategy's setup and the optimizers: the strategy
        # materialises (and places, cuts or shards) the parts of the meta model this rank owns.
        self.trainer.strategy.shard_lightning_module(self)

    def configure_optimizers(self):
        # Strategies that keep only some layers or shards have left only those in `self.model`.
        optimizer = build_optimizer(self.cfg.optimizer, self.model.named_parameters())
        scheduler = build_scheduler(optimizer, self.cfg.optimizer, self.cfg.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LanguageModelData(pl.LightningDataModule):
    """Global batches sliced per data-parallel rank; resumes at the trainer's global step."""

    def __init__(self, cfg, corpus):
        super().__init__()
        self.cfg = cfg
        self.corpus = corpus
        self.objective = objective_of(cfg.model)

    def _arguments(self):
        rank, degree = self.trainer.strategy.data_parallel()
        return dict(global_batch_size=self.cfg.data.global_batch_size,
                    sequence_length=self.cfg.data.sequence_length, seed=self.cfg.seed,
                    objective=self.objective, data_rank=rank, data_degree=degree,
                    packing=bool(self.cfg.data.get("packing", False)))

    def train_dataloader(self):
        # Built after checkpoint restore, so a resumed run continues with the next global batch.
        dataset = data_lib.TrainBatches(self.corpus, start_step=self.trainer.global_step,
                                        **self._arguments())
        return DataLoader(dataset, batch_size=None, num_workers=0)

    def val_dataloader(self):
        dataset = data_lib.ValidationBatches(self.corpus, batches=self.cfg.trainer.limit_val_batches,
                                             **self._arguments())
        return DataLoader(dataset, batch_size=None, num_workers=0)
