"""The loss spec: one validated options object and one table of what varies by loss type.

Every layer reads this module and nothing else for the loss's options and per-type rules:
the reference (``grpo_fast/reference.py``), the CPU path and the fused LM head
(``grpo_fast/ops/``), the Triton launcher (``grpo_fast/kernels/grpo_loss.py``) and the
trainer's micro-batch weighting. Adding a loss type is a row of :data:`LOSS_TYPES` (and,
for the one-launch Triton path, a branch of the kernel's ``_policy_terms``); adding a KL
estimator is a row of :data:`KL_ESTIMATORS` and a branch of the kernel. A name that is not
in a table raises, in every layer, before anything runs.

The per-token math, with w the importance ratio and A the advantage (docs/design.md):

    clipped (grpo, bnpo, dr_grpo, dapo, luspo):
        pg = -min(min(w, delta) * A, clamp(w, 1 - eps_low, 1 + eps_high) * A)
        dual clip c, where A < 0:  pg = min(pg, -A * c)
    cispo:  pg = -min(w, eps_high).detach() * A * logp
    sapo:   pg = -sigmoid(tau * (w - 1)) * 4 / tau * A,   tau = tau_pos if A > 0 else tau_neg
    kl (d = ref_logp - logp):  k3 exp(d) - d - 1,  k1 -d,  k2 d^2 / 2;   times w when
        kl_bias_correction (TRL's use_bias_correction_kl)
    per_token = pg * importance_weights + beta * kl

and the loss is ``sum_bt per_token * weight`` with the aggregation's token weights.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from grpo_fast._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:  # the options below validate without torch: the command line checks a run before torch loads
    torch = LazyModule("torch", globals())

SCALES = ("group", "batch", "none")


def accumulate_dtype(x: "torch.Tensor") -> "torch.dtype":
    """The dtype every op computes in: float64 for float64 inputs, float32 for the rest."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def option(default, help: str, topic: str | None = None):
    """A config field with its one-line help and the help topic it is listed under (shown by
    ``grpo-fast train --help`` and the docs' flag table)."""
    metadata = {"help": help, "topic": topic}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def fields_of(cls, source, **overrides):
    """A ``cls`` (a dataclass) from ``source``'s attributes of its fields' names, ``overrides``
    applied: a view of the run's config (a section, the loss, the engine's settings)."""
    return cls(**{**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)}, **overrides})


def option_default(f: dataclasses.Field):
    """The default of a config field (a fresh list for a list's), as ``option`` made it."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ----------------------------------------------------------------------------- aggregations


class Aggregation(NamedTuple):
    """How per-token terms become the loss: ``loss = sum_bt per_token * m / (row_len_b? * denominator)``.

    per_row_mean: divide each row's sum by its active-token count first (grpo, sapo).
    denominator(rows, tokens, config, num_items): what the (row-normalised) sum is divided
        by, from the batch's row and active-token counts; ``num_items`` is the caller's
        global token count (dapo/cispo) or None.
    """

    per_row_mean: bool
    denominator: Callable

    def token_weights(
        self, mask: "torch.Tensor", row_len: "torch.Tensor", rows: int, config: "LossConfig", num_items=None
    ):
        """dL/dper_token, the shape of ``mask`` ([B, T] or flat [Nc]): 0 on padding. ``row_len``
        is the active-token count of each token's row, broadcastable to ``mask`` ([B, 1] on a
        grid); ``rows`` the number of rows, empty ones included."""
        m = mask / row_len.clamp(min=1.0) if self.per_row_mean else mask
        denominator = self.denominator(rows, mask.sum(), config, num_items)
        return m / torch.as_tensor(denominator, dtype=m.dtype, device=m.device).clamp(min=1.0)

    def micro_batch_weight(self, rows: int, tokens, total_rows: int, total_tokens, config, num_items=None):
        """The weight of a micro-batch's loss (``rows`` rows and ``tokens`` active tokens of
        the whole batch's ``total_rows`` and ``total_tokens``) such that the weighted sum of
        micro-batch losses is the whole batch's loss: its denominator over the batch's. A
        float from numbers; a 0-dim tensor when a count is a tensor (no host read)."""
        part = _at_least_one(self.denominator(rows, tokens, config, num_items))
        return part / _at_least_one(self.denominator(total_rows, total_tokens, config, num_items))


def _at_least_one(x):
    return x.clamp(min=1.0) if torch.is_tensor(x) else max(float(x), 1.0)


AGGREGATIONS = {
    # mean over sequences of each sequence's token mean (GRPO, DeepSeekMath)
    "sequence_mean": Aggregation(True, lambda rows, tokens, c, n: rows),
    # token sum over the batch's active tokens (BNPO)
    "batch_tokens": Aggregation(False, lambda rows, tokens, c, n: tokens),
    # token sum over B * max_completion_length, a constant (Dr. GRPO)
    "fixed_length": Aggregation(False, lambda rows, tokens, c, n: rows * c.max_completion_length),
    # token sum over the global active-token count, summed over micro-batches and ranks (DAPO)
    "global_tokens": Aggregation(False, lambda rows, tokens, c, n: tokens if n is None else n),
    # mean over sequences of each sequence's token sum (LUSPO)
    "sequence_sum": Aggregation(False, lambda rows, tokens, c, n: rows),
}


# ----------------------------------------------------------------------------- policy terms


def clipped_term(w, logp, adv, c: "LossConfig"):
    w2 = torch.clamp(w, 1 - c.eps_low, 1 + c.clip_high)
    w1 = w if c.delta is None else torch.clamp(w, max=c.delta)
    pg = -torch.min(w1 * adv, w2 * adv)
    if c.dual_clip is not None:
        pg = torch.where(adv < 0, torch.min(pg, -adv * c.dual_clip), pg)
    return pg


def cispo_term(w, logp, adv, c: "LossConfig"):
    return -torch.clamp(w, max=c.clip_high).detach() * adv * logp


def sapo_term(w, logp, adv, c: "LossConfig"):
    tau = torch.where(adv > 0, adv.new_tensor(c.sapo_tau_pos), adv.new_tensor(c.sapo_tau_neg))
    return -torch.sigmoid(tau * (w - 1)) * 4 / tau * adv


def clipped_flags(w, adv, c: "LossConfig"):
    """(low, high): the ratio left the trust region where it matters, TRL's clip metrics."""
    return (w < 1 - c.eps_low) & (adv < 0), (w > 1 + c.clip_high) & (adv > 0)


def cispo_flags(w, adv, c: "LossConfig"):
    """CISPO truncates the ratio from above only."""
    return torch.zeros_like(w, dtype=torch.bool), (w > c.clip_high) & (adv > 0)


class LossType(NamedTuple):
    """Everything that varies by loss type.

    policy_term(w, logp, adv, config): the per-token policy term pg, differentiable in w and logp.
    clip_flags(w, adv, config): boolean (low, high) for the clip metrics.
    aggregation: a key of :data:`AGGREGATIONS`.
    kernel_kind: the branch of the Triton kernel's ``_policy_terms``, or None when the
        one-launch kernel does not implement the type (the two-pass path then runs it).
    clipped: the type clips the ratio to [1 - eps_low, 1 + eps_high] (needs eps_low < 1).
    requires: LossConfig fields that must not be None for this type.
    """

    policy_term: Callable
    clip_flags: Callable
    aggregation: str
    kernel_kind: int | None
    clipped: bool = True
    requires: tuple = ()


LOSS_TYPES = {
    "grpo": LossType(clipped_term, clipped_flags, "sequence_mean", kernel_kind=0),
    "bnpo": LossType(clipped_term, clipped_flags, "batch_tokens", kernel_kind=0),
    "dr_grpo": LossType(
        clipped_term, clipped_flags, "fixed_length", kernel_kind=0, requires=("max_completion_length",)
    ),
    "dapo": LossType(clipped_term, clipped_flags, "global_tokens", kernel_kind=0),
    "luspo": LossType(clipped_term, clipped_flags, "sequence_sum", kernel_kind=0),
    "cispo": LossType(cispo_term, cispo_flags, "global_tokens", kernel_kind=1, clipped=False),
    "sapo": LossType(sapo_term, clipped_flags, "sequence_mean", kernel_kind=2, clipped=False),
}


class KLEstimator(NamedTuple):
    """value(d) with d = ref_logp - logp; kernel_kind: the Triton kernel's branch."""

    value: Callable
    kernel_kind: int


KL_ESTIMATORS = {
    "k3": KLEstimator(lambda d: torch.exp(d) - d - 1, 0),  # DeepSeekMath, TRL
    "k1": KLEstimator(lambda d: -d, 1),
    "k2": KLEstimator(lambda d: d * d / 2, 2),
}


def grid_row_sum(x: "torch.Tensor") -> "torch.Tensor":
    """Each row's sum on a [B, T] grid, [B, 1]."""
    return x.sum(-1, keepdim=True)


def _sequence_log_ratio(log_ratio, m, row_sum=grid_row_sum):
    """GSPO: the length-normalised sum of each sequence's log-ratios, one per sequence ([B, 1]
    on a grid; ``row_sum`` says how tokens group into sequences)."""
    return row_sum(log_ratio * m) / row_sum(m).clamp(min=1.0)


def per_token_loss(w, logp, adv, ref, iw, c: "LossConfig"):
    """``(pg * iw + beta * kl, kl)`` per token, the policy term read from the loss type's row.

    w: importance ratio ([B, T], or [B, 1] at sequence level); logp: [B, T] differentiable;
    adv: [B, 1] or [B, T]; ref, iw: reference log-probs and importance weights, or None.
    kl is None without ``ref``; the KL term is left out when beta is 0.
    """
    pg = c.kind.policy_term(w, logp, adv, c)
    if iw is not None:
        pg = pg * iw
    if ref is None:
        return pg, None
    kl = c.kl.value(ref - logp)
    if c.kl_bias_correction:
        kl = kl * w
    return (pg if c.beta == 0 else pg + c.beta * kl), kl


def loss_metrics(w, adv, kl, entropy, m, c: "LossConfig") -> dict:
    """The logged metrics, TRL's definitions: 0-dim float32 means of the KL, clip flags, ratio
    and entropy over active tokens (m [B, T]); sequence-level ratios ([B, 1]) over sequences.
    kl and entropy may be None. Outside autograd: the inputs are detached."""
    w, adv, kl, entropy, m = (None if x is None else x.detach() for x in (w, adv, kl, entropy, m))
    n_active = m.sum().clamp(min=1.0)

    def batch_mean(x):  # [B, 1] at T = 1 is still token-level: masked tokens do not count
        if x.shape[-1] == 1 and c.importance_sampling == "sequence":
            return x.to(m.dtype).mean().float()
        return ((x * m).sum() / n_active).float()

    low, high = c.kind.clip_flags(w, adv, c)
    return dict(
        kl=None if kl is None else batch_mean(kl),
        clip_ratio_low=batch_mean(low.to(m.dtype)),
        clip_ratio_high=batch_mean(high.to(m.dtype)),
        clip_ratio_region=batch_mean((low | high).to(m.dtype)),
        ratio_mean=batch_mean(w),
        entropy=None if entropy is None else batch_mean(entropy.to(m.dtype)),
    )


def without_padding(m: "torch.Tensor", *tensors):
    """The tensors shaped like the mask m with 0 where m is 0 (others, and None, unchanged), so
    that whatever a padded position holds (an overflowing reference log-prob, an infinite
    log-prob, NaN) reaches neither the loss nor its gradient: its weight is 0, and 0 * inf
    would be NaN."""
    return tuple(x.masked_fill(m == 0, 0.0) if x is not None and x.shape == m.shape else x for x in tensors)


# How the per-token log-ratio becomes the log of the importance ratio w: (log_ratio, mask,
# row_sum=grid_row_sum) -> the log-ratio per token, or per sequence.
IMPORTANCE_LEVELS = {
    "token": lambda log_ratio, m, row_sum=grid_row_sum: log_ratio,
    "sequence": _sequence_log_ratio,
}


# ----------------------------------------------------------------------------- sampling correction

# The engine that sampled (vLLM) computes other log-probs than the trainer at the same weights
# (kernels, dtype, top-p renormalisation). TRL's vllm_importance_sampling_mode: the ratio of the
# trainer's probability to the engine's, per token or per sequence, and what happens to a ratio
# outside [clip_min, clip_max]: clamped into it ("truncate") or set to 0 ("mask").
SAMPLING_CORRECTIONS = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


class SamplingCorrection(NamedTuple):
    """weights [B, T]: the loss's ``importance_weights`` (a sequence mode's ratio on each of the
    row's tokens), 0 on padding; ratio: [B, T] (token modes) or [B, 1] (sequence modes), the
    bounded ratio as TRL logs it."""

    weights: "torch.Tensor"
    ratio: "torch.Tensor"


def check_sampling_correction(mode, clip_min, clip_max) -> None:
    """Raises ValueError naming the first bad sampling-correction option (TRL's rules)."""
    if mode not in SAMPLING_CORRECTIONS:
        raise ValueError(f"sampling_correction must be one of {tuple(SAMPLING_CORRECTIONS)} or None, got {mode!r}")
    _number("sampling_correction_min", clip_min, low=0, optional=True)
    _number("sampling_correction_max", clip_max, low=0, strict=True, optional=True)
    if clip_min is None and clip_max is None:
        raise ValueError("sampling_correction needs sampling_correction_min or sampling_correction_max (or both)")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"sampling_correction_min must be < sampling_correction_max, got {clip_min!r} >= {clip_max!r}")


def sampling_correction(
    proximal: "torch.Tensor",
    behaviour: "torch.Tensor",
    mask: "torch.Tensor",
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> SamplingCorrection:
    """Importance weights that correct for samples drawn by another distribution than the
    one the loss's ratios start from (TRL 1.16's ``vllm_importance_sampling_correction``;
    its defaults): ``ratio = exp(proximal - behaviour)`` per token, or ``exp`` of the row's
    sum for a sequence mode, then clamped into [clip_min, clip_max] or set to 0 outside it.

    Args:
        proximal: [B, T] the trainer's log-probs of the samples at the weights that sampled.
        behaviour: [B, T] the log-probs the sampler reported (NaN where it had none: ratio 1).
        mask: [B, T] 1 on completion tokens.
        mode: a key of :data:`SAMPLING_CORRECTIONS`.
        clip_min, clip_max: the bounds (None = unbounded on that side; not both None).
    """
    check_sampling_correction(mode, clip_min, clip_max)
    level, bound = SAMPLING_CORRECTIONS[mode]
    mask = mask.to(proximal.dtype)
    log_ratio = torch.nan_to_num((proximal - behaviour) * mask, nan=0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if bound == "truncate":
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return SamplingCorrection(ratio.expand_as(mask) * mask, ratio)


# ----------------------------------------------------------------------------- the options


class _Frozen:
    """Assignment raises once ``__post_init__`` has validated the instance."""

    def __setattr__(self, name, value):
        if getattr(self, "_validated", False):
            raise dataclasses.FrozenInstanceError(
                f"LossConfig is frozen: cannot assign {name!r}; use dataclasses.replace(config, {name}=...)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"LossConfig is frozen: cannot delete {name!r}")


@dataclass(eq=True)
class LossConfig(_Frozen):
    """The options of the GRPO loss, validated once at construction and frozen.

    ``grpo_loss(..., beta=0.04)`` builds one from its keywords; ``grpo_loss(...,
    loss_config=LossConfig(beta=0.04))`` passes one that was built once (the trainer does).
    """

    beta: float = option(0.0, "weight of the KL penalty to the reference model (0 = no reference)")
    eps_low: float = option(0.2, "lower clip: the ratio is clipped at 1 - eps_low")
    eps_high: float | None = option(None, "upper clip 1 + eps_high (None = eps_low); for cispo, the ratio's cap")
    delta: float | None = option(None, "upper bound > 1 of the unclipped ratio (two-sided clipping), or None")
    dual_clip: float | None = option(None, "c > 1: where A < 0 the policy term is capped at -A * c (verl), or None")
    temperature: float = option(1.0, "> 0: the logits are divided by it (the sampling temperature)")
    loss_type: str = option("grpo", f"one of {', '.join(LOSS_TYPES)}")
    importance_sampling: str = option("token", "'token' ratios, or 'sequence' (GSPO: one ratio per sequence)")
    kl_estimator: str = option("k3", f"KL estimator of d = ref - logp: {', '.join(KL_ESTIMATORS)}")
    kl_bias_correction: bool = option(
        False, "multiply the KL term by the importance ratio (TRL's use_bias_correction_kl)"
    )
    max_completion_length: int | None = option(None, "dr_grpo's normaliser: the loss is divided by B * it")
    sapo_tau_pos: float = option(1.0, "SAPO's gate temperature where A > 0")
    sapo_tau_neg: float = option(1.05, "SAPO's gate temperature where A <= 0")

    def __post_init__(self):
        self.validate()
        object.__setattr__(self, "_validated", True)

    def __hash__(self):
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(LossConfig)))

    @classmethod
    def of(cls, options, **overrides) -> "LossConfig":
        """A frozen LossConfig from any object with its fields (e.g. the trainer's config),
        with ``overrides`` applied."""
        if type(options) is cls and not overrides:
            return options
        return fields_of(cls, options, **overrides)

    @property
    def clip_high(self) -> float:
        """eps_high, or eps_low when eps_high is None."""
        return self.eps_low if self.eps_high is None else self.eps_high

    @property
    def kind(self) -> LossType:
        return LOSS_TYPES[self.loss_type]

    @property
    def aggregation(self) -> Aggregation:
        return AGGREGATIONS[self.kind.aggregation]

    @property
    def kl(self) -> KLEstimator:
        return KL_ESTIMATORS[self.kl_estimator]

    def validate(self) -> None:
        """Raises ValueError naming the first option that is out of range."""
        for name, table in (
            ("loss_type", LOSS_TYPES),
            ("importance_sampling", IMPORTANCE_LEVELS),
            ("kl_estimator", KL_ESTIMATORS),
        ):
            if getattr(self, name) not in table:
                raise ValueError(f"{name} must be one of {tuple(table)}, got {getattr(self, name)!r}")
        if self.kind.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss type {self.loss_type!r} names an unknown aggregation {self.kind.aggregation!r}")
        _number("beta", self.beta, low=0)
        _number("eps_low", self.eps_low, low=0)
        _number("eps_high", self.eps_high, low=0, optional=True)
        _number("temperature", self.temperature, low=0, strict=True)
        _number("delta", self.delta, low=1, strict=True, optional=True)
        _number("dual_clip", self.dual_clip, low=1, strict=True, optional=True)
        _number("sapo_tau_pos", self.sapo_tau_pos, low=0, strict=True)
        _number("sapo_tau_neg", self.sapo_tau_neg, low=0, strict=True)
        if not isinstance(self.kl_bias_correction, bool):
            raise ValueError(f"kl_bias_correction must be a bool, got {self.kl_bias_correction!r}")
        if self.kind.clipped and self.eps_low >= 1:
            raise ValueError(f"eps_low must be < 1 (the lower clip bound is 1 - eps_low), got {self.eps_low!r}")
        for name in self.kind.requires:
            if getattr(self, name) is None:
                raise ValueError(f"{name} is required for loss_type={self.loss_type!r}")
        mcl = self.max_completion_length
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, int) or mcl <= 0):
            raise ValueError(f"max_completion_length must be a positive int or None, got {mcl!r}")


def _number(name: str, value, *, low: float, strict: bool = False, optional: bool = False) -> None:
    """value is a finite real number >= low (> low when strict), or None when optional."""
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"{'>' if strict else '>='} {low}"
        raise ValueError(f"{name} must be a finite number {bound}{' or None' if optional else ''}, got {value!r}")
