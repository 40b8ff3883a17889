"""Generation engines: how a rollout samples its completions.

An engine is a subclass of :class:`Generator` built as ``Engine(model, tokenizer, config,
runtime)`` (the policy, its tokenizer, the run's :class:`~grpo_fast.trainer.GRPOConfig` with
the sampling knobs, the :class:`~grpo_fast.trainer.runtime.Runtime` it samples in) whose
``generate(prompts, group_size, keys)`` returns a :class:`Generation`. Adding an engine is one
module in this folder and one row of :data:`ENGINES`; ``--generator NAME`` picks it.
:class:`Generator` declares what else an engine may say or do, with defaults: whether its
log-probs drift from the trainer's, whether it samples with the policy itself, how it learns
of new weights (``publish``), its share of the log line.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, NamedTuple

from grpo_fast._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:  # the config names the engines before torch loads
    torch = LazyModule("torch", globals())

# name -> "module:Class", imported only when picked (an engine may need an optional package).
ENGINES = {
    "hf": "grpo_fast.trainer.generators.hf:HFGenerator",
    "sampler": "grpo_fast.trainer.generators.sampler:Sampler",
    "vllm": "grpo_fast.trainer.generators.vllm:VLLMGenerator",
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


class Generator:
    """A generation engine. Subclasses implement :meth:`generate` and override what differs.

    Attributes:
        drifts: its log-probs may differ from the trainer's at the same weights (other
            kernels: vllm); the trainer then corrects the loss for it (the loss spec's
            ``sampling_correction``).
        runs_policy: it samples with the policy module itself, so an FSDP2 policy is gathered
            for a rollout; False: it holds its own copy of the weights (vllm).
    """

    drifts = False
    runs_policy = True

    def __init__(self, model, tokenizer, config, runtime=None):
        from grpo_fast.trainer.runtime import Runtime

        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.runtime = runtime or Runtime.of(model)

    def generate(self, prompts: list, group_size: int, keys: list) -> Generation:
        """Samples ``group_size`` completions of each prompt. ``keys`` [num_prompts] int
        identify the prompts within the run (their data positions), so that an engine can
        make a sample a function of (seed, key, sample index) alone."""
        raise NotImplementedError

    def publish(self, version: int) -> None:
        """The policy's weights are now at ``version`` (optimizer steps). An engine that
        samples with the policy itself has nothing to do; one with a copy refreshes it before
        its next rollout."""

    def metrics(self) -> dict:
        """The engine's share of the step's log line (timings), reset on read."""
        return {}


def make_generator(name: str, model, tokenizer, config, runtime=None) -> Generator:
    """The engine ``name`` (a key of :data:`ENGINES`) for ``model``, sampling in ``runtime``
    (default: a single process at float32 on the model's device)."""
    if name not in ENGINES:
        raise ValueError(f"generator must be one of {tuple(ENGINES)}, got {name!r}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(model, tokenizer, config, runtime)


@contextlib.contextmanager
def left_padded(tokenizer):
    """The tokenizer pads and truncates on the left inside the block, and is as it was after."""
    saved = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = saved


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int | None, pad_to_multiple_of: int | None = None):
    """``(input_ids, attention_mask)`` [num_prompts, P] long: each prompt tokenized once, without
    special tokens, left-padded (and, beyond ``max_prompt_length``, left-truncated)."""
    with left_padded(tokenizer):
        enc = tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            truncation=max_prompt_length is not None,
            max_length=max_prompt_length,
            pad_to_multiple_of=pad_to_multiple_of,
            add_special_tokens=False,
        )
    return enc["input_ids"], enc["attention_mask"]


@contextlib.contextmanager
def evaluating(model):
    """``model`` in eval mode inside the block (no dropout while sampling), as it was after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions [N, L] of a left-padded batch that follow its attention mask [N, L], so that
    left padding does not shift the prompt (a padded slot gets 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def assemble(tokenizer, prompt_ids, prompt_mask, completion_ids, logprobs=None) -> Generation:
    """The :class:`Generation` of left-padded prompts [N, P] and sampled completions [N, C]:
    padding after each first EOS, masks, decoded text; ``logprobs`` [N, C] zeroed after EOS."""
    completion_ids, completion_mask = completion_masks(completion_ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return Generation(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask.float(),
        completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        logprobs=None if logprobs is None else logprobs * completion_mask,
    )


def completion_masks(completion_ids: torch.Tensor, eos_token_id: int, pad_token_id: int):
    """``(completion_ids with padding after the first EOS, completion_mask [N, C] long)``: the
    mask covers tokens up to and including each row's first EOS, or all C without one."""
    N, C = completion_ids.shape
    is_eos = completion_ids == eos_token_id
    no_eos = torch.full((N,), C, dtype=torch.long, device=completion_ids.device)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)
    mask = (torch.arange(C, device=completion_ids.device).unsqueeze(0) <= first_eos.unsqueeze(1)).long()
    return completion_ids.masked_fill(mask == 0, pad_token_id), mask
