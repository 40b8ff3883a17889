"""Generation engines: how a rollout samples its completions.

An engine is a subclass of :class:`Generator` built as ``Engine(model, tokenizer, settings,
runtime)`` (the policy, its tokenizer, the :class:`EngineSettings` it samples with, the
:class:`~grpo_fast.trainer.runtime.Runtime` it samples in) whose ``generate(prompts,
group_size, keys)`` returns a :class:`Generation`. Adding an engine is one module in this
folder and one row of :data:`grpo_fast.trainer.choices.ENGINES`; ``--generator NAME`` picks it.
:class:`Generator` declares what else an engine may say or do, with defaults: whether its
log-probs drift from the trainer's, whether it samples with the policy itself, how it learns
of new weights (``publish``), its share of the log line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import NamedTuple

import torch

from grpo_fast.spec import fields_of
from grpo_fast.trainer.choices import ENGINES, VLLM_MODES
from grpo_fast.trainer.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an engine samples with: the run config's fields of the same names
    (:meth:`of`), and nothing else of the run.

    seed: a sample is a function of (seed, prompt key, sample index) and the weights.
    temperature, top_p, top_k: the sampling distribution (top_k 0 = all tokens).
    max_new_tokens: the completion's limit, tool tokens included.
    max_prompt_length: longer prompts keep their last tokens; None = no limit.
    batch_size: the rows of one rollout (vLLM's CPU KV cache is sized for it).
    compile_generation: our sampler's static cache and CUDA graph.
    model, model_revision: the folder or Hub name vLLM starts from (None: the policy, saved).
    vllm_*: the vLLM engine's options, where it runs (``vllm_mode``: in this process or on
        the servers of ``vllm_server_urls``) among them (see :class:`~grpo_fast.trainer.GRPOConfig`).
    """

    seed: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_prompt_length: int | None
    batch_size: int
    compile_generation: bool
    model: str | None
    model_revision: str | None
    vllm_gpu_memory_utilization: float
    vllm_sleep_level: int
    vllm_enforce_eager: bool
    vllm_prefix_cache: bool
    vllm_max_model_len: int | None
    vllm_mode: str
    vllm_server_urls: list | None
    vllm_server_timeout_s: float

    @classmethod
    def of(cls, config, **changes) -> EngineSettings:
        """The settings in ``config`` (a :class:`~grpo_fast.trainer.GRPOConfig`), with ``changes``
        (the evaluation's temperature)."""
        return fields_of(cls, config, **changes)


class Generation(NamedTuple):
    """G completions per prompt, N = num_prompts * G rows, a prompt's samples adjacent.

    input_ids        [N, P + C]  left-padded prompt, then the completion (padded after EOS)
    attention_mask   [N, P + C]  1 on real prompt tokens and on completion tokens up to EOS
    completion_mask  [N, C]      float, 1 on the model's sampled tokens: up to and including the
                                 first EOS; in a multi-turn rollout (tools) every turn's, and
                                 0 on the tools' tokens, which the attention mask keeps as context
    completions      [N] str     decoded without special tokens
    logprobs         [N, C]      the sampler's log-probs of the sampled tokens, or None
    versions         [N, C] long the policy version (optimizer steps) each completion token was
                                 sampled at, -1 off the completion mask; None: the engine's
                                 weights are the policy's own or follow it before each rollout
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    completions: list
    logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None


class Turns:
    """What a multi-turn rollout (tool calls) asks of an engine: a turn ends at EOS or at one of
    ``stop_token_ids``; when every row's turn has ended, :meth:`suffixes` gives each the tokens
    to append (the tool results, then the next turn's opening) or None (its trajectory ends).
    The appended tokens are the completion's, out of the loss (``completion_mask`` 0)."""

    stop_token_ids: list = []

    def suffixes(self, rows: list, turns: list, room: list) -> list:
        """For each row that ended a turn: ``rows`` [n] its output row, ``turns`` [n] the token
        ids it sampled in that turn, ``room`` [n] the completion tokens left of
        ``max_new_tokens``. Returns [n] token-id lists (each shorter than its room), or None."""
        raise NotImplementedError


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

    def __init__(self, model, tokenizer, settings: EngineSettings, runtime: Runtime | None = None):
        if not isinstance(settings, EngineSettings):
            raise TypeError(
                f"settings must be an EngineSettings (EngineSettings.of(config)), got {type(settings).__name__}"
            )
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.runtime = runtime or Runtime.of(model)

    def generate(self, prompts: list, group_size: int, keys: list, turns: Turns | None = None) -> Generation:
        """Samples ``group_size`` completions of each prompt. ``keys`` [num_prompts] int
        identify the prompts within the run (their data positions), so that an engine can
        make a sample a function of (seed, key, sample index) alone. ``turns``: a multi-turn
        rollout's tool loop, which every engine runs."""
        raise NotImplementedError

    def publish(self, version: int) -> None:
        """The policy's weights are now at ``version`` (optimizer steps). An engine that
        samples with the policy itself has nothing to do; one with a copy refreshes it before
        its next rollout."""

    def metrics(self) -> dict:
        """The engine's share of the step's log line (timings), reset on read."""
        return {}

    def close(self) -> None:
        """Stops what the engine runs apart from the policy (vllm: its engine core, its memory);
        the next rollout starts it again."""


def make_generator(name: str, model, tokenizer, settings: EngineSettings, runtime: Runtime | None = None):
    """The engine ``name`` (a key of ``choices.ENGINES``) for ``model``, sampling with
    ``settings`` in ``runtime`` (default: a single process at float32 on the model's device)."""
    if name not in ENGINES:
        raise ValueError(f"generator must be one of {tuple(ENGINES)}, got {name!r}")
    module, cls = (VLLM_MODES[settings.vllm_mode] if name == "vllm" else ENGINES[name]).split(":")
    return getattr(importlib.import_module(module), cls)(model, tokenizer, settings, runtime)


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


def assemble_turns(tokenizer, prompt_ids, prompt_mask, tokens, logprobs, sampled, written) -> Generation:
    """The :class:`Generation` of a multi-turn rollout: completions [N, T] ``tokens`` where
    ``written`` [N, T] bool marks every completion token (sampled or a tool's) and ``sampled``
    [N, T] bool the model's; trimmed to the longest. The attention mask covers every written
    token, the completion mask and the ``logprobs`` [N, T] (or None) the sampled ones only."""
    width = max(1, int(written.any(0).nonzero().max()) + 1) if bool(written.any()) else 1
    tokens, sampled, written = tokens[:, :width], sampled[:, :width], written[:, :width]
    tokens = tokens.masked_fill(~written, tokenizer.pad_token_id)
    return Generation(
        input_ids=torch.cat([prompt_ids, tokens], dim=1),
        attention_mask=torch.cat([prompt_mask, written.to(prompt_mask.dtype)], dim=1),
        completion_mask=sampled.float(),
        completions=tokenizer.batch_decode(tokens, skip_special_tokens=True),
        logprobs=None if logprobs is None else logprobs[:, :width] * sampled,
    )


def continue_turns(sample, tokenizer, prompt_ids, prompt_mask, turns: Turns, max_new_tokens: int) -> Generation:
    """A multi-turn rollout for an engine that continues rows from their token ids (hf, vllm):
    turn after turn until no row goes on, ``sample`` each going row's turn from its whole
    sequence, then append what ``turns`` gives it. The :class:`Generation` of
    :func:`assemble_turns`.

    Args:
        sample: ``(rows [n], sequences [n] id lists, rooms [n], stop_ids) -> [n] (turn ids, their
            log-probs or None)``: the next turn of each output row in ``rows``, from its whole
            sequence, at most its room of tokens, ending at a stop id or not.
        prompt_ids, prompt_mask: [N, P] the left-padded prompts (each row its own).
    """
    T, stop_ids, N = max_new_tokens, [tokenizer.eos_token_id, *turns.stop_token_ids], prompt_ids.shape[0]
    prompts = [row[real.bool()].tolist() for row, real in zip(prompt_ids, prompt_mask)]
    tokens, sampled, logprobs = ([[] for _ in range(N)] for _ in range(3))  # per row, sampled and tools'
    going, engine_logprobs = list(range(N)), False
    while going:
        rooms = [T - len(tokens[r]) for r in going]
        ended = []
        for r, (turn, logp) in zip(going, sample(going, [prompts[r] + tokens[r] for r in going], rooms, stop_ids)):
            engine_logprobs |= logp is not None
            tokens[r] += turn
            sampled[r] += [True] * len(turn)
            logprobs[r] += logp if logp is not None else [0.0] * len(turn)
            if turn and turn[-1] in stop_ids and len(tokens[r]) < T:
                ended.append((r, turn))
        rows = [r for r, _ in ended]
        suffixes = turns.suffixes(rows, [turn for _, turn in ended], [T - len(tokens[r]) for r in rows]) if rows else []
        going = [r for r, suffix in zip(rows, suffixes) if suffix]
        for r, suffix in zip(rows, suffixes):
            if suffix:
                tokens[r] += suffix
                sampled[r] += [False] * len(suffix)
                logprobs[r] += [0.0] * len(suffix)
    width = max(1, max(len(row) for row in tokens))

    def grid(values: list, fill, dtype):
        return torch.tensor([row + [fill] * (width - len(row)) for row in values], dtype=dtype)

    written = grid([[True] * len(row) for row in tokens], False, torch.bool)
    device = prompt_ids.device
    return assemble_turns(
        tokenizer,
        prompt_ids,
        prompt_mask,
        grid(tokens, tokenizer.pad_token_id, torch.long).to(device),
        grid(logprobs, 0.0, torch.float32).to(device) if engine_logprobs else None,
        grid(sampled, False, torch.bool).to(device),
        written.to(device),
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
