"""Samples: G sampled completions per prompt with their rewards, what a rollout source returns.

Shared by the trainer and the evaluation: each samples with a generation engine
(``rollout/engines/``) and scores with :func:`score`; dynamic sampling keeps only the groups
that carry a signal (:func:`groups_with_signal`, :func:`select_groups`,
:func:`concat_samples`). What the trainer makes of samples (advantages,
reference log-probs, packed micro-batches) is the step's batch (``update/batch.py``).

Sequence layout, N = num_prompts * G rows (see :class:`~grpo_fast.trainer.rollout.engines.Generation`):

    input_ids      [N, P + C]   left-padded prompt, then the completion (right-padded after EOS)
    attention_mask [N, P + C]   1 on real prompt tokens and on completion tokens up to EOS
    completion_mask [N, C]      1 on completion tokens up to and including the first EOS

With tools (a multi-turn rollout, ``tool_turns.py``) a completion is the whole trajectory: the
model's turns and the tools' results between them, all under the attention mask, the results
out of the completion mask; ``completions`` are then message lists (TRL's shape).
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast import group_advantages


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not one score per completion."""


class EngineError(RuntimeError):
    """The generation engine failed while sampling (vLLM's engine core raised, for one); the
    message names the engine and its error, the original is the cause."""


@dataclass
class Samples:
    """One batch of samples: N = len(prompts) rows, the samples of a prompt adjacent."""

    prompts: list  # [N] str, each prompt repeated G times
    completions: list  # [N] str, decoded without special tokens; with tools [N] message lists
    columns: dict  # dataset columns other than the prompt, each a list of N values
    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    completion_mask: torch.Tensor  # [N, C] float32
    rewards: torch.Tensor  # [N, K] float32, NaN where a function returned None
    # [N, C] the log-probs the samples were drawn with, where they may differ from the trainer's:
    # the vllm engine's, or a rollout worker's (older weights: asynchronous rollouts)
    sampling_logprobs: torch.Tensor | None = None
    policy_version: int | None = None  # optimizer steps of the weights that sampled them (a rollout worker's)
    # [N, C] long the version each completion token was sampled at, -1 off the completion mask: an
    # engine on servers that take the weights apart from the trainer (vllm_mode server), or None
    token_versions: torch.Tensor | None = None
    # [k, C] the reference log-probs of the first k rows, computed ahead by a rollout worker
    # (the trainer computes the others), or None
    ref_logprobs: torch.Tensor | None = None
    data_end: int = 0  # the data position after the rows sampled: where the next batch starts
    sampling_rounds: int = 1  # generation rounds it took (dynamic sampling)
    dropped_groups: int = 0  # groups sampled but dropped, over every rank: their rewards were all equal
    # [N, 3] float32 per row: tool calls, failed calls, turns (a rollout with tools), or None
    tool_counts: torch.Tensor | None = None
    # [N, 4] float32 per row: turns, errors, successes, scored (a rollout in an environment), or None
    env_counts: torch.Tensor | None = None

    def to(self, device) -> "Samples":
        """These samples with their tensors on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Samples(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def score(reward_funcs: list, prompts: list, completions: list, columns: dict) -> torch.Tensor:
    """Calls each ``f(prompts, completions, **columns) -> list[float | None]``; returns [N, K] float32.

    None becomes NaN ("not scored", left out of the weighted sum). A function that raises,
    returns the wrong number of scores, or a score that is not a finite number (NaN, an
    infinity, a string) is a :class:`RewardError` naming it, the sample and the value.
    """
    N = len(prompts)
    scores = torch.empty(N, len(reward_funcs), dtype=torch.float32)
    for k, func in enumerate(reward_funcs):
        name = getattr(func, "__name__", repr(func))
        try:
            values = list(func(prompts, completions, **columns))
        except Exception as exc:
            i = _first_failing_sample(func, prompts, completions, columns)
            where = "" if i is None else f" on sample {i} (prompt={prompts[i]!r}, completion={completions[i]!r})"
            raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc}{where}") from exc
        if len(values) != N:
            raise RewardError(f"reward function {name!r} returned {len(values)} scores for {N} completions")
        for i, value in enumerate(values):
            # NaN or an infinity would reach every advantage of its group, and the weights
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise RewardError(
                    f"reward function {name!r} returned {value!r} (need a finite float, or None for unscored) on "
                    f"sample {i} (prompt={prompts[i]!r}, completion={completions[i]!r})"
                )
            scores[i, k] = math.nan if value is None else float(value)
    return scores


def _first_failing_sample(func: Callable, prompts: list, completions: list, columns: dict) -> int | None:
    """Index of the first sample on which ``func`` raises when called on it alone."""
    for i in range(len(prompts)):
        try:
            func(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
        except Exception:
            return i
    return None


def groups_with_signal(rewards: torch.Tensor, group_size: int, reward_weights=None) -> torch.Tensor:
    """[num_groups] bool: the groups whose advantages are not all 0, i.e. whose scored
    rewards [N, K] are not all equal (DAPO's dynamic sampling keeps these)."""
    advantages = group_advantages(rewards, group_size, scale="none", reward_weights=reward_weights).advantages
    return (advantages.view(-1, group_size) != 0).any(1)


# The per-row tensors a batch may lack (None), besides the ones every batch has.
PER_ROW_OPTIONAL = ("sampling_logprobs", "token_versions", "tool_counts", "env_counts")


def select_groups(batch: Samples, groups: torch.Tensor, group_size: int) -> Samples:
    """The rows of the groups ``groups`` [k] (indices, in order) of freshly sampled ``batch``."""
    rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1).tolist()
    pick = torch.tensor(rows, dtype=torch.long)
    per_row = ("input_ids", "attention_mask", "completion_mask", "rewards")
    per_row += tuple(name for name in PER_ROW_OPTIONAL if getattr(batch, name) is not None)
    return dataclasses.replace(
        batch,
        prompts=[batch.prompts[i] for i in rows],
        completions=[batch.completions[i] for i in rows],
        columns={key: [values[i] for i in rows] for key, values in batch.columns.items()},
        **{name: getattr(batch, name)[pick.to(getattr(batch, name).device)] for name in per_row},
    )


def concat_samples(parts: list, pad_token_id: int) -> Samples:
    """Freshly sampled batches one after the other, re-padded to the widest prompt (on the
    left) and the longest completion (on the right)."""
    parts = [part for part in parts if part.input_ids.shape[0]] or parts[-1:]
    if len(parts) == 1:
        return parts[0]
    C = max(part.completion_mask.shape[1] for part in parts)
    P = max(part.input_ids.shape[1] - part.completion_mask.shape[1] for part in parts)

    def widen(x, c, value):  # [n, p + c] -> [n, P + C]: pad the prompt on the left, the completion on the right
        return torch.nn.functional.pad(x, (P - (x.shape[1] - c), C - c), value=value)

    widths = [part.completion_mask.shape[1] for part in parts]

    def completion_grid(name, fill=0):  # [n, c] -> [N, C], padded on the right with fill
        if getattr(parts[0], name) is None:
            return None
        pad = torch.nn.functional.pad
        return torch.cat([pad(getattr(part, name), (0, C - c), value=fill) for part, c in zip(parts, widths)])

    return dataclasses.replace(
        parts[0],
        prompts=[p for part in parts for p in part.prompts],
        completions=[c for part in parts for c in part.completions],
        columns={key: [v for part in parts for v in part.columns[key]] for key in parts[0].columns},
        input_ids=torch.cat([widen(part.input_ids, c, pad_token_id) for part, c in zip(parts, widths)]),
        attention_mask=torch.cat([widen(part.attention_mask, c, 0) for part, c in zip(parts, widths)]),
        completion_mask=completion_grid("completion_mask"),
        sampling_logprobs=completion_grid("sampling_logprobs"),
        token_versions=completion_grid("token_versions", fill=-1),
        rewards=torch.cat([part.rewards for part in parts]),
        **{
            name: None if getattr(parts[0], name) is None else torch.cat([getattr(part, name) for part in parts])
            for name in ("tool_counts", "env_counts")
        },
    )


def rollout(
    generator,
    rows: list,
    keys: list,
    reward_funcs: list,
    *,
    group_size: int,
    keep_logprobs: bool = False,
    turns: Callable | None = None,
) -> Samples:
    """Generation and rewards of one batch of prompts, with the engine's log-probs as
    ``sampling_logprobs`` where the trainer corrects for them: an engine that drifts (vllm), or
    ``keep_logprobs`` (a rollout worker's batch). The trainer computes its own log-probs once it
    knows which groups it keeps.

    Args:
        generator: a generation engine (``grpo_fast.trainer.rollout.engines``).
        rows: dataset rows, each with a "prompt" str and optional answer/test columns (with an
            environment, what its reset reads: the prompt is then the environment's).
        keys: [len(rows)] int, the rows' positions in the run's data order.
        reward_funcs: ``f(prompts, completions, **columns) -> list[float | None]``.
        keep_logprobs: keep the engine's log-probs (None for an engine that returns none).
        turns: with tools or an environment, the run's ``turns.TurnLoop``: ``turns(rows, G)``
            makes the batch's episodes; the rewards then get each trajectory's messages and what
            ``Episodes.columns`` adds (tool counts, the environments and their rewards), and the
            rows their tool and environment counts.
    """
    loop = None if turns is None else turns(rows, group_size)
    texts = loop.prompts if loop is not None and loop.prompts is not None else [row["prompt"] for row in rows]
    prompts = [text for text in texts for _ in range(group_size)]
    columns = {key: [row[key] for row in rows for _ in range(group_size)] for key in rows[0] if key != "prompt"}
    try:
        out = generator.generate(texts, group_size, keys, **({"turns": loop} if loop else {}))
    except (ValueError, TypeError):
        raise  # a request the engine refuses, named by its check
    except Exception as exc:
        raise EngineError(
            f"the {type(generator).__name__} engine failed while sampling: {type(exc).__name__}: {exc}"
        ) from exc
    completions, tool_counts, env_counts, scored = out.completions, None, None, columns
    if loop is not None:
        C = out.completion_mask.shape[1]
        ids = [row[real.bool()].tolist() for row, real in zip(out.input_ids[:, -C:], out.attention_mask[:, -C:])]
        completions = loop.trajectories(ids)
        tool_counts, env_counts = loop.counts()
        scored = {**columns, **loop.columns()}
    return Samples(
        prompts=prompts,
        completions=completions,
        columns=columns,
        input_ids=out.input_ids,
        attention_mask=out.attention_mask,
        completion_mask=out.completion_mask,
        rewards=score(reward_funcs, prompts, completions, scored),
        sampling_logprobs=out.logprobs if keep_logprobs or generator.drifts else None,
        token_versions=out.versions,
        tool_counts=tool_counts,
        env_counts=env_counts,
    )
