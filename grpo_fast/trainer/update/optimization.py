"""AdamW with the run's learning-rate schedule, and one clipped optimizer step: the policy's and
those of the parts a strategy trains beside it alike. A step whose loss or gradient norm is not
finite is skipped."""

import functools
import math
import warnings

import torch

from grpo_fast.trainer.sections import OptimConfig, RolloutConfig

# transformers' (and so TRL's lr_scheduler_type) name of each lr_schedule: the same factors
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def schedule_factor(name: str, step: int, warmup: int, total: int) -> float:
    """The learning rate's factor at scheduler step ``step`` of ``total``: linear warmup from 0
    over ``warmup`` steps, then 1 (``constant``), or a linear or half-cosine decay to 0 at
    ``total`` (``linear``, ``cosine``). The same floats as transformers' ``get_scheduler`` with
    ``constant_with_warmup``, ``linear`` and ``cosine`` (tests/test_trainer.py), written here
    because importing it imports ``transformers.trainer_utils`` and with it peft: about 3 s of
    every trainer process's start."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def adamw(params, optim: OptimConfig, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over ``params`` with the run's betas and weight decay (its ``optim`` section), at
    ``lr`` (default: ``optim.learning_rate``). torch's default implementation: the fused kernel would let
    :func:`clipped_step` skip without a host read (``found_inf``), but it rounds differently
    enough that a 1-process resume drifts from the 2-rank run it continues (0.3% in the loss
    within 3 steps against 1e-5: tests/test_distributed.py)."""
    return torch.optim.AdamW(
        params,
        lr=optim.learning_rate if lr is None else lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
        weight_decay=optim.weight_decay,
    )


def lr_scheduler(optimizer, optim: OptimConfig, rollout: RolloutConfig):
    """The run's learning-rate schedule (its ``optim`` section), one step per optimizer step
    (``rollout.num_iterations`` per training step, ``rollout.steps`` of those): linear warmup
    over warmup_steps training steps, then constant, or linear or cosine decay towards 0 at the
    run's last step (:func:`schedule_factor`).

    transformers' warmup runs its first step at learning rate 0; ours runs optimizer step s at
    ``(s + 1) / (warmup + 1)`` of it, so the schedule is built one step longer and advanced
    once here: optimizer step s runs at transformers' step s + 1. A checkpoint stores the
    state at the optimizer-step count (:func:`schedule_state`).
    """
    mu = rollout.num_iterations
    factor = functools.partial(
        schedule_factor, optim.lr_schedule, warmup=optim.warmup_steps * mu + 1, total=rollout.steps * mu + 1
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    with warnings.catch_warnings():  # the advance above, not a step taken before the optimizer's
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()
    return scheduler


def schedule_state(scheduler) -> dict:
    """The scheduler's state with ``last_epoch`` the optimizer steps taken (see :func:`lr_scheduler`)."""
    state = scheduler.state_dict()
    return dict(state, last_epoch=state["last_epoch"] - 1)


def load_schedule_state(scheduler, state: dict) -> None:
    scheduler.load_state_dict(dict(state, last_epoch=state["last_epoch"] + 1))


def clipped_step(optimizer, scheduler, max_grad_norm: float | None, loss: torch.Tensor | None = None) -> dict:
    """Clips the gradient norm of the optimizer's parameters (None: no clipping), steps the
    optimizer and the schedule, clears the gradients. Returns ``grad_norm`` (whole: FSDP2's
    DTensor gathered) and ``nonfinite_steps`` (1 when the step was skipped), device tensors.

    A gradient norm or ``loss`` (every rank's, summed: every rank decides alike) that is NaN
    or infinite skips the update, leaving the weights, moments and step count as they were; it
    costs one host read of the flag per optimizer step. The schedule advances: the skipped step
    counts as one of the run's.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_grad_norm is None else max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2's is a DTensor
        grad_norm = grad_norm.full_tensor()
    bad = ~torch.isfinite(grad_norm)
    if loss is not None:
        bad = bad | ~torch.isfinite(loss.to(bad.device))
    if not bool(bad):
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(grad_norm=grad_norm, nonfinite_steps=bad)
