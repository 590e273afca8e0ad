"""First-order optimizers and the learning-rate schedule, built from `cfg.optimizer`."""

import math

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020), the outer optimizer of the PipeFisher paper's BERT runs.

    1. Adam moments m, v with bias correction give the direction u = m̂ / (√v̂ + ε);
    2. decoupled weight decay adds λ·w to u;
    3. the step is scaled per tensor by the trust ratio ‖w‖ / ‖u‖ (1 where either is zero).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    self._update(parameter, group)
        return loss

    def _update(self, parameter, group):
        beta1, beta2 = group["betas"]
        state = self.state[parameter]
        if not state:
            # on the host, as torch's own optimizers keep it: reading it is then no device sync
            state["step"] = torch.zeros((), dtype=torch.float32)  # host
            state["exp_avg"] = torch.zeros_like(parameter)
            state["exp_avg_sq"] = torch.zeros_like(parameter)
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].mul_(beta1).add_(parameter.grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(parameter.grad, parameter.grad, value=1 - beta2)
        first = state["exp_avg"] / (1 - beta1**step)
        second = state["exp_avg_sq"] / (1 - beta2**step)
        update = first / (second.sqrt() + group["eps"]) + group["weight_decay"] * parameter
        weight_norm, update_norm = parameter.norm(), update.norm()
        trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
        parameter.add_(update * trust, alpha=-group["lr"])


def parameter_groups(named_parameters, weight_decay: float):
    """Decay matrices only: biases and LayerNorm gains are not decayed (GPT-2/BERT practice)."""
    decay, no_decay = [], []
    for _, parameter in named_parameters:
        (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def add_parameters(optimizer: torch.optim.Optimizer, parameters) -> None:
    """Append new parameters (a grown model's blocks) to the groups `parameter_groups` would give
    them; their state starts empty, so their first step is a fresh optimizer's (progressive stacking)."""
    decay, no_decay = optimizer.param_groups[0]["params"], optimizer.param_groups[-1]["params"]
    for parameter in parameters:
        (decay if parameter.dim() >= 2 else no_decay).append(parameter)


def build_optimizer(config, named_parameters) -> torch.optim.Optimizer:
    """AdamW (default), LAMB or momentum SGD over `named_parameters`."""
    groups = parameter_groups(named_parameters, config.weight_decay)
    betas = (config.beta1, config.beta2)
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.eps, foreach=False)
    if config.name == "lamb":
        return Lamb(groups, lr=config.lr, betas=betas, eps=config.eps)
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    raise ValueError(f"optimizer.name: unknown optimizer {config.name!r}; use adamw, lamb or sgd")


def learning_rate_factor(step: int, config, max_steps: int) -> float:
    """Linear warm-up to 1, then constant or cosine decay to `min_lr_ratio`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, max_steps - config.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer, config, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, config, max_steps))
