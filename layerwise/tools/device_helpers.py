"""What device_check measures inside a process of its own (a CUDA error or an out-of-memory stays
there): the device and its bf16 product rate, a Hugging Face export, the agreed loss scaler's skip,
and a plain PyTorch training loop beside ours. Each takes a dict of JSON arguments and returns a
dict; `python -m layerwise.tools.device_helpers NAME JSON` prints it after HELPER_PREFIX, which
layerwise/tools/device_check.py `run_helper` reads.
"""

import json
import os
import statistics
import sys
import time
from typing import Callable

HELPER_PREFIX = "device_check result: "  # a helper's last line: this prefix and its JSON


def environment_helper(arguments: dict) -> dict:
    import platform

    import torch
    import lightning
    import hydra
    use_gpu = arguments["gpu"] and torch.cuda.is_available()
    if arguments["gpu"] and not use_gpu:
        raise RuntimeError("the GPU mode found no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda" if use_gpu else "cpu")
    edge, repeats = (8192, 10) if use_gpu else (256, 5)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(edge, edge, device=device, generator=generator).to(torch.bfloat16)  # random, never zeros
    b = torch.randn(edge, edge, device=device, generator=generator).to(torch.bfloat16)
    seconds = timed(lambda: torch.mm(a, b), device, warmup=3, repeats=repeats)
    name = torch.cuda.get_device_name() if use_gpu else f"CPU ({platform.processor() or platform.machine()})"
    memory = torch.cuda.get_device_properties(0).total_memory if use_gpu else None
    return {"device": name, "device_memory_bytes": memory, "torch": torch.__version__,
            "cuda": torch.version.cuda, "lightning": lightning.__version__, "hydra": hydra.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "matmul_edge": edge, "matmul_repeats": repeats,
            "matmul_tflops": 2 * edge ** 3 / statistics.median(seconds) / 1e12}


def timed(work: Callable, device, warmup: int, repeats: int) -> list:
    """Seconds of each of `repeats` calls after `warmup`: CUDA events on a GPU (the work is
    asynchronous), the host clock on a CPU."""
    import torch
    for _ in range(warmup):
        work()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            work()
            seconds.append(time.perf_counter() - begin)
    return seconds


def export_hf_helper(arguments: dict) -> dict:
    import torch
    from layerwise.config.store import compose
    from layerwise.run.task import model_arguments
    from models import build_model
    from models.hf import save_pretrained
    cfg = compose(arguments["overrides"])
    model = build_model(cfg.model.architecture, device="cpu",
                        **model_arguments(cfg.model, cfg.model.vocab_size, cfg.seed))
    save_pretrained(model.to(getattr(torch, arguments["dtype"])), arguments["path"])
    return {"path": arguments["path"]}


def scaler_helper(arguments: dict) -> dict:
    """AgreedGradScaler (strategies/precision.py) on one rank of a real device: fp16 autocast, a
    scaled backward, inf written into one gradient, step: GradScaler must skip it and halve the scale."""
    import torch
    from parallel.comm import Communicator, Group
    from strategies.precision import AgreedGradScaler
    device = torch.device("cuda" if arguments["gpu"] else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = AgreedGradScaler(Communicator(), Group("world", (0,)), device.type)
    inputs = torch.randn(16, 64, device=device)

    def step(poison: bool) -> None:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    scale_before = float(scaler.get_scale())  # the initial scale until the first update
    step(poison=True)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    scale_after = float(scaler.get_scale())
    step(poison=False)
    moved = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return {"device": str(device), "skipped_unchanged": unchanged, "scale_before": scale_before,
            "scale_after": scale_after, "clean_moved": moved}


def plain_loop_helper(arguments: dict) -> dict:
    """The same model class and seeded weights as the run, torch.optim.AdamW with the run's settings,
    autocast in the run's precision, random tokens of the run's batch shape; the median step after
    warm-up, timed with CUDA events on a GPU."""
    import torch
    from layerwise.config.store import compose
    from models import block_of, build_model, model_flops_per_token
    from layerwise.run.task import model_arguments
    cfg = compose(arguments["overrides"])
    device = torch.device("cuda" if cfg.hardware.accelerator == "gpu" else "cpu")
    # torch's default threads, as a one-process run keeps them (layerwise/run/fit.py trains it in the
    # launching process: no rank_threads); on a loaded CPU two spinning threads cost either side alike
    vocab, batch, sequence = 256, cfg.data.global_batch_size, cfg.data.sequence_length
    model = build_model(cfg.model.architecture, device=device, **model_arguments(cfg.model, vocab, cfg.seed))
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    tokens = torch.randint(0, vocab, (batch, sequence + 1), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    precision = cfg.hardware.precision
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = statistics.median(timed(step, device, warmup=4, repeats=max(3, arguments["steps"] - 4)))
    flops = model_flops_per_token(cfg.model.layers, cfg.model.hidden, sequence, vocab, cfg.model.mlp_ratio,
                                  block=block_of(cfg.model))
    return {"tokens_per_s": batch * sequence / seconds, "step_s": seconds, "flops_per_token": flops,
            "parameters": sum(p.numel() for p in model.parameters()), "batch": batch, "sequence": sequence,
            "precision": precision,
            "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None}


HELPERS = {"environment": environment_helper, "export_hf": export_hf_helper, "scaler": scaler_helper,
           "plain_loop": plain_loop_helper}


if __name__ == "__main__":
    print(HELPER_PREFIX + json.dumps(HELPERS[sys.argv[1]](json.loads(sys.argv[2]))), flush=True)
