"""Tolerances: every one an "equals single" test uses, derived from error analysis, and the
assertions that apply them (losses, first-step gradients, parameters after SGD or AdamW/LAMB steps).
Reference runs and how they are made: tests/references.py."""

from pathlib import Path

from strategies.checkpoint.safe_load import load_torch_file


# ----- Tolerances: every one a test uses, and why it is that size ------------------------------------
#
# Two runs of one computation in fp32 whose sums run in another order (micro-batches accumulated
# in another order, all-reduces, sharded matrix products) differ by round-off, a few ulp (2^-23 ≈
# 1.2e-7 relative) per operation. Each fp32 tolerance sits above the largest such difference
# measured and far below the effect of every bug in test_mutations.py (≥ 1e4× on the comparison that
# sees it best, ≥ 20× on the first that fails). The parameter tolerances are derived from the update
# rule (sgd_parameter_atol, adam_tolerance), not fitted to one CPU. Measured margins, worst
# |actual − expected| / tolerance over every "equals single" comparison of the numerics tests, the
# same under OMP_NUM_THREADS=1, the default threads and LAYERWISE_DETERMINISTIC=1 (issue 28):
#   plain SGD (SgdComparison.check): losses 0.018, first-step gradients 0.46 (one ulp of a recovered
#   weight is half the recovery term), parameters 0.026 (0.033 in test_resume_matrix);
#   AdamW/LAMB: losses 0.026, masked parameters 0.042, free parameters 0.017 (adam_parameter_excess).
#
# K-FAC's damped inverses run in float64 (strategies/kfac.py `damped_inverse`): in fp32, Cholesky of
# A + λ_A·I (condition number up to ~1/λ ≈ 1e3) would magnify the ~1e-7 differences between equal
# factors summed in another order (pipeline vs one process) beyond these tolerances; in float64 the
# inverses agree to ~1e-13, so PipeFisher is held to the same fp32 tolerances as every strategy.

# fp32 loss of every step ("equals single"), under SGD and AdamW/LAMB alike: one forward's sums
# (~10 matrix products, a log-sum-exp, a mean over 512 tokens) in another order differ by a few ulp
# per operation, ~1e-7 relative. Under AdamW the elements that may drift by a whole step between two
# correct runs (adam_tolerance, case 1) are exactly those whose gradient is within rounding of 0, so
# they move the loss by |g|·|Δp| — a rounding-sized gradient times one lr — and beyond that only at
# second order. Largest measured: see the measured-margins note below this table.
LOSS_RTOL = 1e-5
# fp32 parameters after k steps, the part relative to |p|: fp32 storage rounds p once per step
# (≤ 2^-24·|p| each, 6e-8·|p| after 1 step, 3.6e-7·|p| after 6); 1e-5 leaves a margin above that and
# above SGD's lr·GRADIENT_RTOL·|g| when |g| ≲ |p|/lr. The absolute part is not a fixed number: it
# is derived per comparison, for plain SGD (sgd_parameter_atol: lr × each step's gradient tolerance)
# and for AdamW/LAMB (adam_tolerance: from the update rule). A fixed 1e-5 under AdamW passed on one
# CPU and failed on another (issue 28: 1.52e-5 on one element of blocks.1.attention.proj.weight).
PARAMETER_RTOL = 1e-5
# First-step gradient g = (p0 − p1)/lr under plain SGD (references.SgdComparison), per element:
GRADIENT_RTOL = 1e-5
# ... plus this fraction of the tensor's largest |g| as atol: entries that are sums of cancelling
# terms (the qkv key bias: analytically 0) carry round-off of the tensor's scale, not their own.
# Sized by K-FAC: B⁻¹ ∇W A⁻¹ multiplies ∇W's round-off by the damped factors' condition number:
# 1.0e-5 of max |g| measured (PipeFisher vs kfac, block 0 fc_out, at an entry near the maximum);
# first-order gradients differ by ≤ 1.3e-6 of max |g| beyond the recovery rounding below.
# The same bound on a gradient's round-off sizes the parameter tolerances (sgd_parameter_atol and
# ADAM_ROUNDING in adam_tolerance), so one measured fact has one home.
GRADIENT_SCALE_ATOL = 3e-5
# ... plus the rounding of recovering g from fp32 weights: p1 = p0 − lr·g is stored to the nearest
# fp32, so two runs' p1 may differ by one ulp ≤ 2^-23·|p| although their g agree; p0 − p1 is exact
# (Sterbenz), so g carries GRADIENT_RECOVERY_EPS·max|p0|/lr (2 ulp: |p1| may exceed |p0|).
GRADIENT_RECOVERY_EPS = 2 * 2.0 ** -23
# bf16 keeps 8 bits of mantissa (relative step 2^-8 ≈ 4e-3): two equal computations whose fp32
# reductions run in another order round differently in a few matrix products per step.
BF16_LOSS_RTOL = 1e-2
# bf16 stage-boundary messages (strategy.message_dtype=compute under bf16-mixed: test_stage_messages)
# against `single` under bf16-mixed, first-step gradients g = (p0 − p1)/lr per element. bf16 keeps
# 8 significant bits: rounding to it moves an element by at most u = 2^-8 of itself. A bf16-mixed
# run rounds the inputs and the output of every product to bf16, so each gradient element carries
# ~u of its tensor's scale already: two runs whose fp32 sums run in another order (pipeline vs one
# process) round differently, measured 1.03·u·max|g| (blocks.3 fc_out weight) with today's fp32
# messages. The boundary cast rounds each message element once more by ≤ u: an activation element
# before the next stage's products (whose inputs autocast rounds anyway) and a gradient element
# before the previous stage's backward products — the same kind of perturbation entering the same
# products, one more per message. Per run ≤ 2u (autocast's rounding + the message's) of the tensor's
# scale, between two runs ≤ 4u: atol = 4u·max|g| per tensor, rtol = 4u. Measured with bf16
# messages: 1.03·u·max|g|, the same worst element (the reordering dominates the cast). A bug in the
# messages (a slice lost, gathered out of order) is a relative error of order 1, ≥ 60× this; a
# factor 2 on a gradient is 64×; messages rounded to 4 significant bits (fp8 e4m3 on the wire, 16×
# coarser than bf16) measured 25× on the gradients and 6.5× on the parameters. Under AdamW the same
# Δ = 4u·max|g| enters adam_tolerance (`rounding`): no element with a gradient keeps the headroom of
# ADAM_HEADROOM at that Δ, so each gets case 1's 2·C_t·lr_t per step (Adam normalises each step, so
# bf16 rounding of a small gradient may move its element by up to a step); the SGD comparison and
# the losses are the sharp ones there (measured: free elements 0.65 of that bound).
BF16_MESSAGE_UNIT = 2.0 ** -8
BF16_MESSAGE_GRADIENT_RTOL = 4 * BF16_MESSAGE_UNIT
BF16_MESSAGE_GRADIENT_SCALE_ATOL = 4 * BF16_MESSAGE_UNIT
# bf16 tensor collectives and gradient reductions (strategy.tensor_collective_dtype=compute,
# strategy.reduction_dtype=compute under bf16-mixed: test_tensor_collective_dtype) against `single`
# under bf16-mixed, first-step gradients per element. A reduction in bf16 rounds its result to bf16
# (≤ u = 2^-8 of it; each addend first, where it was fp32) where fp32 reduces exactly enough to round
# once later. The 1-D grid's forward sums are products' outputs, which single rounds to bf16 anyway
# (autocast): at t = 2 one bf16 addition of two bf16 partials rounds as single's fp32 product does.
# Its backward sums (the column linears' input gradients, fp32 sums of bf16 products) and the data
# reduction's gradients (fp32 sums over micro-batches) are rounded once more. Each value crosses one
# such reduction before products or the update consume it (later reductions sum new values, each
# rounded once: the count per value is 1), so per run ≤ 2u of the tensor's scale (autocast's + the
# reduction's), ≤ 4u between two runs: the BF16_MESSAGE_* bound, one rounding per reduction in place
# of one per message. A ring of t members rounds t − 1 partial sums: at t = 2 (every test here) one.
BF16_COLLECTIVE_GRADIENT_RTOL = 4 * BF16_MESSAGE_UNIT
BF16_COLLECTIVE_GRADIENT_SCALE_ATOL = 4 * BF16_MESSAGE_UNIT
# A bf16 forward against an fp32 one (L2L's cross mixed precision vs a plain step): not two
# roundings of one computation but ~10 matrix products whose inputs lose 16 bits each (2^-9 relative).
BF16_VERSUS_FP32_LOSS_RTOL = 2e-2
# CUDA against CPU (the GPU-only L2L test): other kernels, other blocking of every reduction.
DEVICE_LOSS_RTOL = 1e-4
# One tensor-parallel operator's shards against the chunks of the unsharded result (test_three_d):
# a single product or norm, whose only difference is the order of its own sums; atol is relative to
# the largest entry (OPERATOR_SCALE_ATOL × max|expected|) so entries near zero do not fail spuriously.
OPERATOR_RTOL = 1e-6
OPERATOR_SCALE_ATOL = 1e-6
# float64 sums of the same terms grouped differently (K-FAC factor split in token halves): 2^-52 ≈
# 2.2e-16 per addition, over ~15 terms.
FLOAT64_RTOL = 1e-12
FLOAT64_ATOL = 1e-15
# Byte counts and simulated times: integers and (g−1)/g factors computed in float64, exact up to
# float64 rounding; anything but rounding is a different count.
EXACT_RTOL = 1e-12
# Estimates, not equalities, keep their literal next to the quantity they bound (not numerics):
# test_models (initial std within 10% of a finite sample, 6N FLOPs within 5%), test_setup_memory
# and test_l2l's memory tests (allocator slack, 5%), test_schedule (pytest.approx defaults on
# simulated makespans, which are exact sums of unit costs).


# ----- AdamW and LAMB: the parameter tolerance from the update rule ------------------------------
#
# Adam's step is lr·(u + λ·p), u = m̂/(√v̂ + ε), with m̂ = Σ_i w_i·g_i and v̂ = Σ_i a_i·g_i² the
# bias-corrected moving averages of the gradients g_1..g_t (weights w_i = (1−β1)β1^(t−i)/(1−β1^t),
# a_i = (1−β2)β2^(t−i)/(1−β2^t), each set summing to 1); LAMB multiplies it by a per-tensor trust
# ratio s = ‖p‖/‖u + λ·p‖. Two correct runs feed it gradients that differ by δ_i, |δ_i| ≤ Δ.
#
# 1. Any element: |u| ≤ C_t = √(Σ_i w_i²/a_i) (Cauchy–Schwarz on m̂ = Σ (w_i/√a_i)·(√a_i·g_i));
#    C_t = 1.000–1.003 for t ≤ 5 at β = (0.9, 0.95), 1.04 at t = 20. Whatever the gradient, the two
#    runs' u differ by at most 2·C_t: an element whose gradient is within rounding of zero (the qkv
#    key bias, analytically 0; any weight whose gradient happens to cross 0) may move by
#    2·C_t·lr_t·s_t more in one run than in the other. This is the issue-28 failure: 1.52e-5 on one
#    element of a projection weight, against a fixed 1e-5, on another CPU of this kind.
# 2. An element whose gradient is well above rounding: |Δm̂| ≤ Σ w_i·|δ_i| ≤ Δ, and √v̂ is a weighted
#    2-norm of the gradient history, so |√v̂' − √v̂| ≤ ‖δ‖ ≤ Δ (triangle inequality). Hence
#        |u' − u| ≤ |Δm̂|/(√v̂' + ε) + |u|·|√v̂ − √v̂'|/(√v̂' + ε) ≤ (1 + C_t)·Δ/(√v̂ − Δ),
#    i.e. (1 + C_t)/(h − 1) with the element's headroom h = √v̂/Δ. An element with h ≥ ADAM_HEADROOM at
#    every step ("masked") gets (1 + C_t)/(ADAM_HEADROOM − 1) per unit step instead of 2·C_t.
#    An element no term of the loss reaches (the embedding rows of tokens and positions the batches
#    never hold: v = 0, every gradient so far exactly 0) has an empty sum for a gradient, exactly 0 in
#    every correct computation whatever the order, so u = 0 in both runs: b_t = 0 (counted as masked).
# 3. Δ: two correct computations of a gradient differ by round-off of the tensor's scale (see
#    GRADIENT_SCALE_ATOL: ≤ 1.3e-6 of max|g| measured for first-order strategies, 1.0e-5 for K-FAC's
#    preconditioned gradient), so Δ_t = ADAM_ROUNDING·max_{i≤t} max|g_i| of the tensor, with g_i read
#    from the reference's own optimizer state (g_t = (m_t − β1·m_{t−1})/(1 − β1), what Adam consumed).
#    The free elements' drift of (1) also perturbs the other elements' later gradients (through the
#    Hessian); Δ assumes that stays within the rounding allowance, which the measured margins check
#    (`adam_parameter_excess` prints the worst masked and free ratios of every comparison).
# 4. Weight decay: the difference of λ·p terms multiplies an existing Δp by (1 − lr·s·λ) ≤ 1, it
#    contracts. LAMB's trust ratio changes by |Δs|/s ≤ ‖Δu + λΔp‖/‖u + λp‖ + ‖Δp‖/‖p‖ (first order), which
#    moves every element by lr·s·(C_t + λ|p|)·|Δs|/s more; ‖Δu‖ ≤ the 2-norm of the bounds above.
# 5. fp32 storage rounds p once per step (2^-24·|p|), well inside PARAMETER_RTOL·|p|.
# So after T steps: |Δp| ≤ PARAMETER_RTOL·|p| + Σ_t lr_t·s_t·b_t (+ LAMB's trust term), with b_t =
# (1 + C_t)/(ADAM_HEADROOM − 1) where h_t ≥ ADAM_HEADROOM, else 2·C_t.
#
# ADAM_HEADROOM: k = 100 leaves a masked element (1 + C)/(k − 1) ≈ 2% of its summed steps Σ lr·s.
# A wrong learning rate (a factor on every step) or a dropped or reset optimizer state (a step of
# m̂/√v̂ = ±1 in place of the running ratio) changes typical elements by 10–100% of a step:
# test_mutations.py measures 58× (warm-up one step ahead) and 62× (moments dropped before step 3)
# this bound on the masked parameters, 843× and 423× LOSS_RTOL on the losses. On the 4-block model
# of the composed tests, k = 100 masks 78% of the elements (74% of those with a gradient, plus the
# 17% no term reaches); the free rest are mostly query/key weights (gradients ~1e-5 of the tensor's
# largest at initialisation) and head rows of rare tokens. k = 10 would mask 92% but allow 22% of a
# step (bugs of that size hide); k = 1000 masks 60%.
ADAM_ROUNDING = GRADIENT_SCALE_ATOL
ADAM_HEADROOM = 100


def adam_direction_bound(step: int, beta1: float, beta2: float) -> float:
    """C_t = √(Σ_i w_i²/a_i): the largest |m̂/√v̂| Adam's bias-corrected moments allow at step t."""
    import math
    first = [(1 - beta1) * beta1 ** (step - i) / (1 - beta1 ** step) for i in range(1, step + 1)]
    second = [(1 - beta2) * beta2 ** (step - i) / (1 - beta2 ** step) for i in range(1, step + 1)]
    return math.sqrt(sum(w * w / a for w, a in zip(first, second)))


class OptimizerTrace:
    """What the AdamW/LAMB tolerance needs from a one-process reference run, step by step and
    parameter by parameter: the step size lr·s, C_t, the headroom h = √v̂/Δ of every element, and
    (LAMB) the norms of the direction and of the weights. Recorded by `optimizer_trace_callback`
    into `<run>/optimizer_trace.pt`; read back with `OptimizerTrace.load(run_directory)`."""

    FILE = "optimizer_trace.pt"

    def __init__(self, steps=None):
        self.steps = list(steps or [])  # one {name: record or None (not updated)} per optimizer step
        self._before, self._scale = {}, {}

    @classmethod
    def load(cls, run_directory):
        return cls(load_torch_file(Path(run_directory) / cls.FILE))

    def save(self, run_directory):
        import torch
        torch.save(self.steps, Path(run_directory) / self.FILE)

    def names(self) -> set:
        return set().union(*(step.keys() for step in self.steps)) if self.steps else set()

    @staticmethod
    def _group(optimizer, parameter):
        return next(group for group in optimizer.param_groups if any(p is parameter for p in group["params"]))

    def before_step(self, named_parameters, optimizer, only_new: bool = False):
        """Before an optimizer step; `named_parameters` with every name a state dict has (tied
        weights under each of their names: `named_parameters(remove_duplicate=False)`). `only_new`:
        add the parameters not yet recorded (blocks a growing model gained after the step began)."""
        import torch
        if not only_new:
            self._before = {}
        for name, parameter in named_parameters:
            if name in self._before:
                continue
            state = optimizer.state.get(parameter, {})
            average = state["exp_avg"].detach().clone() if "exp_avg" in state else torch.zeros_like(parameter)
            self._before[name] = (parameter.detach().clone(), average, self._group(optimizer, parameter)["lr"])

    def after_step(self, named_parameters, optimizer):
        import torch

        from layerwise.run.optim import Lamb
        lamb = isinstance(optimizer, Lamb)
        assert lamb or isinstance(optimizer, torch.optim.AdamW), f"{type(optimizer).__name__}: not AdamW or LAMB"
        record = {}
        for name, parameter in named_parameters:
            weights, previous_average, lr = self._before[name]
            state = optimizer.state.get(parameter, {})
            if "exp_avg_sq" not in state:
                record[name] = None  # no gradient: the optimizer left it alone
                continue
            group = self._group(optimizer, parameter)
            (beta1, beta2), eps, decay = group["betas"], group["eps"], group["weight_decay"]
            step = int(state["step"])
            average, square = state["exp_avg"].double(), state["exp_avg_sq"].double()
            gradient = (average - beta1 * previous_average.double()) / (1 - beta1)
            scale = max(self._scale.get(name, 0.0), float(gradient.abs().max()))
            self._scale[name] = scale
            root = (square / (1 - beta2 ** step)).sqrt()
            headroom = root / (ADAM_ROUNDING * scale) if scale > 0 else torch.full_like(root, float("inf"))
            direction = average / (1 - beta1 ** step) / (root + eps) + decay * weights.double()
            weight_norm, direction_norm = float(weights.double().norm()), float(direction.norm())
            trust = weight_norm / direction_norm if lamb and weight_norm > 0 and direction_norm > 0 else 1.0
            record[name] = {"step_size": lr * trust, "scale": scale, "bound": adam_direction_bound(step, beta1, beta2),
                            "headroom": headroom.float(), "lamb": lamb, "weight_decay": decay,
                            "direction_norm": direction_norm, "weight_norm": weight_norm}
        self.steps.append(record)


def optimizer_trace_callback(run_directory):
    """A trainer callback recording an OptimizerTrace of a one-process run (the reference)."""
    import lightning.pytorch as pl

    class Trace(pl.Callback):
        def __init__(self):
            self.trace = OptimizerTrace()

        def on_train_batch_start(self, trainer, module, batch, batch_index):
            assert trainer.world_size == 1, "trace the one-process reference"
            self.trace.before_step(module.named_parameters(remove_duplicate=False), trainer.optimizers[0])

        def on_before_backward(self, trainer, module, loss):
            # A growing model (strategy.grow_at) gains its blocks in the task's on_train_batch_start,
            # after this callback's: record them here, still before the step.
            self.trace.before_step(module.named_parameters(remove_duplicate=False), trainer.optimizers[0],
                                   only_new=True)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            self.trace.after_step(module.named_parameters(remove_duplicate=False), trainer.optimizers[0])

        def on_train_end(self, trainer, module):
            self.trace.save(run_directory)
    return Trace()


def adam_tolerance(expected, records, rounding: float = ADAM_ROUNDING) -> tuple:
    """(allowed |actual − expected| per element, masked elements) after the traced steps `records`
    of one tensor (see the derivation above); `rounding`: Δ's fraction of the gradient's scale
    (ADAM_ROUNDING in fp32; the trace's headroom is relative to it)."""
    import torch
    expected = expected.double()
    moved = torch.zeros_like(expected)
    masked = torch.ones_like(expected, dtype=torch.bool)
    for record in records:
        if record is None:
            continue
        bound = record["bound"]
        headroom = record["headroom"].double().reshape(expected.shape) * (ADAM_ROUNDING / rounding)
        silent = headroom == 0  # v = 0: every gradient so far exactly 0 (no term reaches it)
        per_unit = torch.where(silent, 0.0, torch.where(headroom >= ADAM_HEADROOM,
                                                        (1 + bound) / (ADAM_HEADROOM - 1), 2 * bound))
        masked &= silent | (headroom >= ADAM_HEADROOM)
        step = record["step_size"] * per_unit
        if record["lamb"]:
            decay = record["weight_decay"]
            relative = ((float(per_unit.norm()) + decay * float(moved.norm())) / record["direction_norm"]
                        + float(moved.norm()) / max(record["weight_norm"], 1e-30))
            step = step + record["step_size"] * (bound + decay * expected.abs()) * relative
        moved += step
    return PARAMETER_RTOL * expected.abs() + moved, masked


def adam_parameter_excess(actual: dict, expected: dict, trace: OptimizerTrace, steps=None,
                          rounding: float = ADAM_ROUNDING) -> dict:
    """{"masked": (worst |a − e| / tolerance, where), "free": (...)} over the elements whose gradient
    stayed ≥ ADAM_HEADROOM × its rounding at every step (masked) and the rest (free), after the
    first `steps` traced steps (all by default); > 1 fails."""
    import torch
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    # state no optimizer moves (an MoE's expert bias, stepped by sign(load) from integer loads): equal,
    # to PARAMETER_RTOL, as the same integers give the same steps
    untraced = sorted(set(expected) - trace.names())
    assert all(name.endswith("expert_bias") for name in untraced), untraced
    for name in untraced:
        torch.testing.assert_close(actual[name], expected[name], rtol=PARAMETER_RTOL, atol=0, msg=name)
    expected = {name: value for name, value in expected.items() if name not in untraced}
    records = trace.steps[:steps] if steps is not None else trace.steps
    worst = {"masked": (0.0, "-"), "free": (0.0, "-")}
    counted = [0, 0]
    for name in expected:
        allowed, masked = adam_tolerance(expected[name], [record.get(name) for record in records], rounding)
        difference = (actual[name].double() - expected[name].double()).abs()
        ratio = torch.where(difference == 0, 0.0, difference / allowed)
        counted[0] += int(masked.sum())
        counted[1] += masked.numel()
        for kind, where in (("masked", masked), ("free", ~masked)):
            if where.any():
                value = float(ratio[where].max())
                if value > worst[kind][0]:
                    index = int(torch.where(where, ratio, -1.0).argmax())
                    worst[kind] = (value, f"{name}[{index}]")
    worst["masked"] = (worst["masked"][0], f"{worst['masked'][1]}; {counted[0] / max(counted[1], 1):.2%} masked")
    return worst


def assert_same_losses(actual, expected):
    import torch
    print(f"losses of every step, worst difference / tolerance: "
          f"{tolerance_excess(torch.tensor(actual), torch.tensor(expected), LOSS_RTOL, 0.0):.3g}")
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"losses of every step: {m}")


def sgd_parameter_atol(trajectory: list, learning_rate: float, scale_atol: float = GRADIENT_SCALE_ATOL,
                       rtol: float = GRADIENT_RTOL) -> dict:
    """The absolute part of each parameter's tolerance after plain-SGD steps, from the reference's
    weights after every step (`trajectory`, from step 0): SGD is linear in the gradient,
    p_T = p_0 − lr·Σ_t g_t, so two runs differ by lr·Σ_t Δg_t (plus fp32 storage rounding of p, one
    half-ulp per step: inside PARAMETER_RTOL·|p|). Each step's Δg_t is bounded as the gradient
    comparison bounds it, GRADIENT_RTOL·|g_t| + GRADIENT_SCALE_ATOL·S_t, except that S_t is the largest
    |g_t| of the whole model, not of the tensor: from step 2 on, a tensor's gradient also carries the
    Hessian's response to the other tensors' rounding-level weight differences (H·Δp), which is of
    the model's scale (it is what makes the qkv weights, with gradients of ~1e-5, drift together with
    the rest). The reference's g_t = (p_{t−1} − p_t)/lr. Elementwise:
        lr · Σ_t (GRADIENT_SCALE_ATOL · max_model |g_t| + GRADIENT_RTOL · |g_t|)."""
    steps = range(1, len(trajectory))
    gradients = [{name: (trajectory[t - 1][name].double() - trajectory[t][name].double()) / learning_rate
                  for name in trajectory[0]} for t in steps]
    scales = [max(float(g.abs().max()) for g in step.values()) for step in gradients]
    return {name: learning_rate * sum(scale_atol * scale + rtol * step[name].abs()
                                      for scale, step in zip(scales, gradients))
            for name in trajectory[0]}


def assert_same_parameters_after_sgd(actual: dict, expected: dict, atol: dict):
    """Parameters after plain-SGD steps (SgdComparison): PARAMETER_RTOL·|e| + sgd_parameter_atol."""
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for name in expected:
        excess = tolerance_excess(actual[name], expected[name], PARAMETER_RTOL, atol[name])
        assert excess <= 1, f"{name}: |actual − expected| is {excess:.3g}× its tolerance (tolerances.sgd_parameter_atol)"


def assert_same_parameters(actual: dict, expected: dict, trace: "OptimizerTrace", steps=None,
                           rounding: float = ADAM_ROUNDING):
    """Parameters after AdamW or LAMB steps, against a reference whose update was traced
    (OptimizerTrace): each element within the bound the update rule gives it (adam_tolerance)."""
    excess = adam_parameter_excess(actual, expected, trace, steps, rounding)
    print("parameters after Adam-family steps, worst difference / tolerance: "
          + ", ".join(f"{kind} {value:.3g} ({where})" for kind, (value, where) in excess.items()))
    for kind, (value, where) in excess.items():
        assert value <= 1, f"{where}: |actual − expected| is {value:.3g}× its {kind} tolerance (tolerances.adam_tolerance)"


def gradient_atol(expected, initial, learning_rate: float) -> float:
    """The absolute part of a gradient tensor's tolerance: GRADIENT_SCALE_ATOL of its largest
    entry, plus the rounding of recovering it from fp32 weights (GRADIENT_RECOVERY_EPS)."""
    return (GRADIENT_SCALE_ATOL * float(expected.abs().max())
            + GRADIENT_RECOVERY_EPS * float(initial.abs().max()) / learning_rate)


def assert_same_gradients(actual: dict, expected: dict, initial: dict, learning_rate: float):
    """First-step gradients g = (p0 − p1)/lr equal, tensor by tensor (see the tolerance table)."""
    import torch
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, rtol=GRADIENT_RTOL,
                                   atol=gradient_atol(gradient, initial[name], learning_rate),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def tolerance_excess(actual, expected, rtol: float, atol: float) -> float:
    """max |a − e| / (atol + rtol·|e|): above 1 exactly where torch.testing.assert_close fails."""
    import torch
    difference = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    ratio = torch.where(difference == 0, 0.0, difference / allowed)  # 0/0 is a match, x/0 infinite
    return float(ratio.max()) if ratio.numel() else 0.0


# ----- bf16 stage-boundary messages against single under bf16-mixed (BF16_MESSAGE_*) ------------

def bf16_message_excess(comparison, rtol: float = None, scale_atol: float = None) -> dict:
    """A references.SgdComparison of two bf16-mixed runs under the BF16_MESSAGE_* tolerances:
    {kind: (worst |a − e| / tolerance, where, its max |a − e|, that over its max |e|)}; > 1 fails.
    Losses: BF16_LOSS_RTOL. Gradients: BF16_MESSAGE_GRADIENT_RTOL·|g| + BF16_MESSAGE_GRADIENT_SCALE_ATOL
    of the tensor's max|g|. Parameters after the SGD steps: PARAMETER_RTOL·|p| + lr·Σ_t of each
    step's gradient tolerance at the model's scale (sgd_parameter_atol, as in fp32)."""
    import torch
    actual, expected = comparison.actual, comparison.expected
    lr = expected.learning_rate
    rtol = BF16_MESSAGE_GRADIENT_RTOL if rtol is None else rtol  # another bf16 rounding's (BF16_COLLECTIVE_*)
    scale_atol = BF16_MESSAGE_GRADIENT_SCALE_ATOL if scale_atol is None else scale_atol
    atol = sgd_parameter_atol(expected.trajectory, lr, scale_atol, rtol)
    losses = (torch.tensor(actual.summary["losses"]), torch.tensor(expected.summary["losses"]))
    pairs = {"losses": {"losses": (*losses, BF16_LOSS_RTOL, 0.0)},
             "gradients": {name: (comparison.actual_gradients[name], gradient, rtol,
                                  scale_atol * float(gradient.abs().max()))
                           for name, gradient in comparison.expected_gradients.items()},
             "parameters": {name: (actual.last[name], value, PARAMETER_RTOL, atol[name])
                            for name, value in expected.last.items()}}
    worst = {}
    for kind, tensors in pairs.items():
        ratio, where = max((tolerance_excess(a, e, rtol, tol), name) for name, (a, e, rtol, tol) in tensors.items())
        a, e = tensors[where][:2]
        difference = (a.double() - e.double()).abs()
        worst[kind] = (ratio, where, float(difference.max()), float(difference.max() / e.double().abs().max()))
    return worst


def assert_same_with_bf16_messages(comparison, name: str = "", rtol: float = None, scale_atol: float = None) -> dict:
    """Losses, first-step gradients and parameters within the BF16_MESSAGE_* tolerances (or the
    `rtol`/`scale_atol` given: BF16_COLLECTIVE_*)."""
    worst = bf16_message_excess(comparison, rtol, scale_atol)
    print(f"{name} vs single (bf16-mixed, SGD): " + "; ".join(
        f"{kind} {ratio:.3g}× tolerance at {where} (max abs {absolute:.3g}, {relative:.3g} of its max)"
        for kind, (ratio, where, absolute, relative) in worst.items()))
    for kind, (ratio, where, _, _) in worst.items():
        assert ratio <= 1, f"{name} {kind}: {where} differs by {ratio:.3g}× its tolerance (tolerances.BF16_MESSAGE_*)"
    return worst
