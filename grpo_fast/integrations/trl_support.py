"""The TRL releases and internals that ``grpo_fast.integrations.trl`` is written against.

The drop-in overrides two private methods of ``trl.GRPOTrainer``, calls them through
``super()``, reads attributes that TRL's constructor sets and imports helpers from
``trl.trainer.utils``. None of it is TRL's public API, so any release may change it; the change
would then surface inside a training step (a TypeError, an AttributeError), or not at all where
TRL stops calling an override and its own loss runs in its place. :func:`check_trl` runs when the
drop-in is imported: it compares the installed TRL with what is listed here and raises one
:class:`UnsupportedTRLError` that names the installed version, the supported range and every
difference.

``TRL_REQUIREMENT`` is the pin of pyproject.toml's ``trl`` and ``test`` extras
(tests/test_integration_trl_support.py checks that they agree).
"""

import dataclasses
import inspect
import types

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

TRL_REQUIREMENT = "trl>=1.16,<1.17"

# What TRL passes to _get_per_token_logps_and_entropies besides the token ids (multimodal
# models): the override takes them as **model_inputs and defers to TRL's path when one is set.
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

# trl.GRPOTrainer's methods that the drop-in overrides or calls, as inspect.signature writes
# them without annotations (names, kinds and defaults are the contract; type hints are not).
SIGNATURES = {
    "_get_per_token_logps_and_entropies": (
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        f"compute_aux_loss=False, {', '.join(f'{key}=None' for key in MODEL_INPUT_KEYS)})"
    ),
    "_compute_loss": "(self, model, inputs)",
    "get_high_entropy_mask": "(self, entropies, mask, threshold)",
}
# {overridden method: TRL's methods that must still call it}: one that no longer does would
# leave TRL's own log-probs or loss running without a word.
CALLERS = {
    "_compute_loss": ("compute_loss",),
    "_get_per_token_logps_and_entropies": ("_compute_loss", "_generate_and_score_completions"),
}
# Attributes the drop-in reads that exist on instances only: trl.GRPOTrainer.__init__ must set
# them (the check reads the names in its bytecode, so it needs no instance, no model).
INIT_ATTRIBUTES = (
    "_metrics",
    "_entropy_bonus_enabled",
    "aux_loss_enabled",
    "off_policy_mask_threshold",
    "loss_type",
    "beta",
    "epsilon_low",
    "epsilon_high",
    "temperature",
    "importance_sampling_level",
    "max_completion_length",
    "top_entropy_quantile",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "ref_model",
)
# trl.GRPOConfig fields the drop-in reads from ``self.args``.
CONFIG_FIELDS = (
    "cast_lm_head_to_fp32",
    "delta",
    "use_bias_correction_kl",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "steps_per_generation",
)
# Helpers the drop-in calls from trl.trainer.utils.
UTILS = ("maybe_gather_lm_head_ctx", "nanmax", "nanmin")


class UnsupportedTRLError(ImportError):
    """The installed TRL is not one the drop-in supports.

    An ImportError, as for a missing optional dependency or one too old (pandas' and
    transformers' optional imports raise the same): the drop-in cannot be imported with this
    TRL, the cure is an install (the message says which), and code that guards an optional
    integration with ``except ImportError`` treats both cases alike.
    """


def plain_signature(function) -> str:
    """``inspect.signature`` of ``function`` (through decorators' ``__wrapped__``) without annotations."""
    signature = inspect.signature(function)
    parameters = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=signature.empty))


def code_names(function) -> set:
    """The attribute and global names that ``function``'s code (nested functions included) uses."""
    names, stack = set(), [inspect.unwrap(function).__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return names


def version_mismatch(version: str):
    """Why TRL ``version`` is outside ``TRL_REQUIREMENT`` (a phrase), or None."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"the version {version!r} is not a release number"
    # A development build of a supported series is judged by its internals, listed below.
    if not Requirement(TRL_REQUIREMENT).specifier.contains(parsed, prereleases=True):
        return "the version is outside the supported range"
    return None


def trl_mismatches(version: str, trainer: type, config: type, utils) -> list:
    """Every difference between a TRL (its ``__version__``, ``GRPOTrainer``, ``GRPOConfig`` and
    ``trl.trainer.utils``) and what the drop-in is written against, as phrases; [] when none."""
    reason = version_mismatch(version)
    found = [] if reason is None else [reason]
    for name, expected in SIGNATURES.items():
        method = getattr(trainer, name, None)
        if not callable(method):
            found.append(f"GRPOTrainer.{name} is missing")
        elif plain_signature(method) != expected:
            found.append(f"GRPOTrainer.{name}{plain_signature(method)}, expected {expected}")
    for name, callers in CALLERS.items():
        for caller in callers:
            if not callable(getattr(trainer, caller, None)):
                found.append(f"GRPOTrainer.{caller} is missing (it calls {name}, which the drop-in overrides)")
            elif name not in code_names(getattr(trainer, caller)):
                found.append(f"GRPOTrainer.{caller} no longer calls {name}, which the drop-in overrides")
    init_names = code_names(trainer.__init__)
    for name in INIT_ATTRIBUTES:
        if name not in init_names and not hasattr(trainer, name):
            found.append(f"GRPOTrainer.__init__ no longer sets {name}")
    fields = {field.name for field in dataclasses.fields(config)}
    found += [f"GRPOConfig has no field {name}" for name in CONFIG_FIELDS if name not in fields]
    found += [f"trl.trainer.utils has no {name}" for name in UTILS if not hasattr(utils, name)]
    return found


def check_trl() -> None:
    """Raises :class:`UnsupportedTRLError` unless the installed TRL is one the drop-in supports."""
    import trl
    import trl.trainer.utils

    found = trl_mismatches(trl.__version__, trl.GRPOTrainer, trl.GRPOConfig, trl.trainer.utils)
    if found:
        raise UnsupportedTRLError(
            f"grpo_fast.integrations.trl supports {TRL_REQUIREMENT}; the installed TRL is {trl.__version__}. "
            f'Install a supported one (pip install "{TRL_REQUIREMENT}", or "grpo-fast[trl]"). '
            "What differs from the TRL the drop-in is written against:\n- " + "\n- ".join(found)
        )
