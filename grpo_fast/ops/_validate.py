"""Argument checks at the public boundary: every error names the argument and what was expected."""

import math
from typing import Optional

import torch

from grpo_fast.reference import CLIPPED_LOSS_TYPES, IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_TYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x, dims: int, *, floating: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if floating and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")


def check_ids(ids, shape, vocab_size: int, name: str = "ids") -> None:
    """ids: integer [B, T] with values in [0, V)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    if tuple(ids.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)} (the logits' [B, T]), got {list(ids.shape)}")
    if ids.numel() == 0:
        return
    if ids.is_cuda:
        # A host-side check would synchronise the stream; a device assert does not.
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(), f"{name} must lie in [0, {vocab_size})")
    elif int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, V) = [0, {vocab_size}), got values in [{int(ids.min())}, {int(ids.max())}]"
        )


def check_temperature(temperature) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def check_token_tensor(name: str, x, B: int, T: int, *, allow_sequence: bool) -> None:
    """A per-token tensor [B, T], or per-sequence [B] when ``allow_sequence``."""
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    shapes = [(B, T), (B,)] if allow_sequence else [(B, T)]
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {list(x.shape)}")
    if x.dtype.is_complex:
        raise TypeError(f"{name} must be real, got {x.dtype}")


def check_loss_options(
    B: int,
    T: int,
    advantages,
    mask,
    old_logprobs,
    ref_logprobs,
    *,
    beta: float,
    eps_low: float,
    eps_high: Optional[float],
    delta: Optional[float],
    loss_type: str,
    importance_sampling: str,
    max_completion_length: Optional[int],
    num_items_in_batch,
    importance_weights,
    dual_clip: Optional[float],
    kl_estimator: str,
    sapo_tau_pos: float,
    sapo_tau_neg: float,
) -> None:
    """Checks the arguments of the policy loss against the token grid [B, T]."""
    if advantages is None:
        raise ValueError("advantages is required: [B] per sequence or [B, T] per token")
    check_token_tensor("advantages", advantages, B, T, allow_sequence=True)
    check_token_tensor("mask", mask, B, T, allow_sequence=False)
    check_token_tensor("old_logprobs", old_logprobs, B, T, allow_sequence=False)
    check_token_tensor("ref_logprobs", ref_logprobs, B, T, allow_sequence=False)
    check_token_tensor("importance_weights", importance_weights, B, T, allow_sequence=True)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_sampling must be one of {IMPORTANCE_LEVELS}, got {importance_sampling!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    for name, value in (("beta", beta), ("eps_low", eps_low)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if eps_high is not None and (not isinstance(eps_high, (int, float)) or not eps_high >= 0):
        raise ValueError(f"eps_high must be a number >= 0 or None (= eps_low), got {eps_high!r}")
    if loss_type in CLIPPED_LOSS_TYPES and eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the lower clip bound is 1 - eps_low), got {eps_low!r}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs [B, T] is required when beta != 0 (beta={beta})")
    if delta is not None and not (isinstance(delta, (int, float)) and delta > 1):
        raise ValueError(f"delta must be a number > 1 or None, got {delta!r}")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1):
        raise ValueError(f"dual_clip must be a number > 1 or None, got {dual_clip!r}")
    for name, value in (("sapo_tau_pos", sapo_tau_pos), ("sapo_tau_neg", sapo_tau_neg)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("max_completion_length is required for loss_type='dr_grpo'")
        if not isinstance(max_completion_length, int) or max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(f"num_items_in_batch must be a scalar, got shape {list(num_items_in_batch.shape)}")
        elif not isinstance(num_items_in_batch, (int, float)) or not num_items_in_batch > 0:
            raise ValueError(f"num_items_in_batch must be a number > 0 or a scalar tensor, got {num_items_in_batch!r}")
