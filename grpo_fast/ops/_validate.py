"""Argument checks at the public boundary: every error names the argument and what was expected."""

import dataclasses
import functools
import inspect
import math

import torch

from grpo_fast.spec import LossConfig

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


def check_token_tensor(name: str, x, shapes: list) -> None:
    """A per-token (or per-sequence) tensor of one of ``shapes``, or None."""
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {list(x.shape)}")
    if x.dtype.is_complex:
        raise TypeError(f"{name} must be real, got {x.dtype}")


def check_cu_seqlens(cu_seqlens, num_tokens: int, device) -> None:
    """cu_seqlens: integer [n + 1], 0 first, ``num_tokens`` last, non-decreasing."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 1:
        raise ValueError(f"cu_seqlens must have shape [n + 1] (sequence boundaries), got {list(cu_seqlens.shape)}")
    if cu_seqlens.device != torch.device(device):
        raise ValueError(f"cu_seqlens must be on the tokens' device {device}, got {cu_seqlens.device}")
    if cu_seqlens.is_cuda:  # a host-side check would synchronise the stream
        return
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, end at the token count {num_tokens} and never decrease, got "
            f"{cu_seqlens.tolist()}"
        )


def check_loss_batch(shape, config: LossConfig, inputs) -> None:
    """Checks a call's per-token inputs (``ops.policy.LossInputs``) against the token shape:
    a [B, T] grid, or flat [Nc] rows of n = len(cu_seqlens) - 1 sequences."""
    advantages, mask, old_logprobs, ref_logprobs, importance_weights, n, cu_seqlens = inputs
    if cu_seqlens is None:
        B, T = shape
        token, per_sequence = [(B, T)], [(B, T), (B,)]
        token_shape = "[B, T]"
    else:
        (N,) = shape
        token, per_sequence = [(N,)], [(N,), (len(cu_seqlens) - 1, 1)]
        token_shape = "[Nc]"
    if advantages is None:
        raise ValueError(f"advantages is required: per sequence or per token {token_shape}")
    check_token_tensor("advantages", advantages, per_sequence)
    check_token_tensor("mask", mask, token)
    check_token_tensor("old_logprobs", old_logprobs, token)
    check_token_tensor("ref_logprobs", ref_logprobs, token)
    check_token_tensor("importance_weights", importance_weights, per_sequence)
    if config.beta != 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs {token_shape} is required when beta != 0 (beta={config.beta})")
    if n is None:
        return
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dtype.is_complex or n.dtype == torch.bool:
            raise ValueError(f"num_items_in_batch must be a real scalar, got {n.dtype} of shape {list(n.shape)}")
        if not n.is_cuda and not float(n) >= 0:  # on CUDA the check would synchronise the stream
            raise ValueError(f"num_items_in_batch must be >= 0 (0 counts as 1, as in TRL), got {float(n)!r}")
    elif isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0:
        raise ValueError(
            f"num_items_in_batch must be a number >= 0 (0 counts as 1, as in TRL) or a scalar tensor, got {n!r}"
        )


def loss_options(fn):
    """Gives ``fn`` every :class:`LossConfig` field as a keyword-only parameter.

    ``fn`` takes ``loss_config`` as its last keyword; the wrapper builds (and so validates)
    a LossConfig from the option keywords, or takes one passed as ``loss_config=``, never
    both. The field list lives in LossConfig alone: the signature and the docstring's
    ``{loss_options}`` section are generated from its fields and their help.
    """
    names = [f.name for f in dataclasses.fields(LossConfig)]
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("loss_config")
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(LossConfig)
    ]

    @functools.wraps(fn)
    def wrapper(*args, loss_config=None, **kwargs):
        given = {name: kwargs.pop(name) for name in names if name in kwargs}
        if loss_config is None:
            loss_config = LossConfig(**given)
        elif given:
            raise TypeError(f"pass the loss options as keywords or as loss_config, not both: got {sorted(given)}")
        elif not isinstance(loss_config, LossConfig):
            raise TypeError(f"loss_config must be a grpo_fast.LossConfig, got {type(loss_config).__name__}")
        return fn(*args, loss_config=LossConfig.of(loss_config), **kwargs)

    wrapper.__signature__ = signature.replace(parameters=params[:at] + options + params[at:])
    help_lines = [
        f"        {f.name}: {f.metadata['help']} (default {f.default!r})." for f in dataclasses.fields(LossConfig)
    ]
    wrapper.__doc__ = (fn.__doc__ or "").replace("        {loss_options}", "\n".join(help_lines))
    return wrapper
