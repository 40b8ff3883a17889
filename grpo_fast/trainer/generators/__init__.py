"""Generation engines: how a rollout samples its completions.

An engine is a class built as ``Engine(model, tokenizer, config, bf16=...)`` (the policy,
its tokenizer, the run's :class:`~grpo_fast.trainer.GRPOConfig` with the sampling knobs)
whose ``generate(prompts, group_size, keys)`` returns a :class:`Generation`. Adding an
engine is one module in this folder and one row of :data:`ENGINES`; ``--generator NAME``
picks it.
"""

import importlib
from typing import NamedTuple, Protocol

import torch

# name -> "module:Class", imported only when picked (an engine may need an optional package).
ENGINES = {
    "hf": "grpo_fast.trainer.generators.hf:HFGenerator",
}


class Generation(NamedTuple):
    """G completions per prompt, N = num_prompts * G rows, a prompt's samples adjacent.

    input_ids        [N, P + C]  left-padded prompt, then the completion (padded after EOS)
    attention_mask   [N, P + C]  1 on real prompt tokens and on completion tokens up to EOS
    completion_mask  [N, C]      float, 1 on completion tokens up to and including the first EOS
    completions      [N] str     decoded without special tokens
    logprobs         [N, C]      the sampler's log-probs of the sampled tokens, or None
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    completions: list
    logprobs: torch.Tensor | None = None


class Generator(Protocol):
    def generate(self, prompts: list, group_size: int, keys: list) -> Generation:
        """Samples ``group_size`` completions of each prompt. ``keys`` [num_prompts] int
        identify the prompts within the run (their data positions), so that an engine can
        make a sample a function of (seed, key, sample index) alone."""


def make_generator(name: str, model, tokenizer, config, *, bf16: bool = False) -> Generator:
    """The engine ``name`` (a key of :data:`ENGINES`) for ``model``."""
    if name not in ENGINES:
        raise ValueError(f"generator must be one of {tuple(ENGINES)}, got {name!r}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(model, tokenizer, config, bf16=bf16)


def completion_masks(completion_ids: torch.Tensor, eos_token_id: int, pad_token_id: int):
    """``(completion_ids with padding after the first EOS, completion_mask [N, C] long)``: the
    mask covers tokens up to and including each row's first EOS, or all C without one."""
    N, C = completion_ids.shape
    is_eos = completion_ids == eos_token_id
    no_eos = torch.full((N,), C, dtype=torch.long, device=completion_ids.device)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)
    mask = (torch.arange(C, device=completion_ids.device).unsqueeze(0) <= first_eos.unsqueeze(1)).long()
    return completion_ids.masked_fill(mask == 0, pad_token_id), mask
