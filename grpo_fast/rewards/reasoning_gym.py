"""reasoning-gym's scorers as a reward: the answer in ``<answer>…</answer>``, scored by the
entry's own task (``reasoning_gym`` imported on first use: the import takes about 2 s).

The rows of ``--dataset reasoning_gym:<task>`` (``grpo_fast.tasks.reasoning_gym``) carry what
the scorer needs: ``entry``, the generated entry as reasoning-gym made it, and
``task_options``, the options of the entry's task (a few scorers read them: puzzle24's value
range, decimal_arithmetic's decimal places, ...).
"""

import functools
import json

from grpo_fast.rewards.base import check_batch, completion_texts


def require_reasoning_gym():
    """The ``reasoning_gym`` package; ImportError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(
            'reasoning-gym tasks need the reasoning-gym package: pip install "grpo-fast[reasoning-gym]"'
        ) from exc
    return reasoning_gym


@functools.cache
def _scorer(task: str, options_json: str):
    """``score_answer(answer, entry)`` of ``task`` built with its options (as JSON, to be hashable)."""
    return require_reasoning_gym().create_dataset(task, **json.loads(options_json)).score_answer


def reasoning_gym_reward(
    prompts: list, completions: list, entry: list, task_options: list | None = None, **columns
) -> list[float]:
    """The task's own score, in [0, 1], of the answer each completion gives in its last
    ``<answer>…</answer>`` (a completion without one answers None, which scores 0).

    prompts, completions: N strings (or, with tools, N message lists: the last assistant
        message answers).
    entry: N reasoning-gym entries ``{"question", "answer", "metadata": {"source_dataset", ...}}``;
        ``metadata["source_dataset"]`` names the task whose scorer scores it.
    task_options: N dicts, the options the task was generated with (None: its defaults).
    Example:
        >>> entry = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=1)[0]
        >>> reasoning_gym_reward(["q"], [f"<answer>{entry['answer']}</answer>"], entry=[entry])
        [1.0]
    """
    options = task_options if task_options is not None else [None] * len(completions)
    check_batch(prompts, completions, {"entry": entry, "task_options": options})
    extract_answer = require_reasoning_gym().utils.extract_answer
    scores = []
    for text, item, opts in zip(completion_texts(completions), entry, options):
        score_answer = _scorer(item["metadata"]["source_dataset"], json.dumps(opts or {}, sort_keys=True))
        try:
            scores.append(float(score_answer(extract_answer(text), item)))
        except Exception:  # noqa: BLE001 - a scorer that cannot parse the answer (prime_factorization's int()) raises
            scores.append(0.0)
    return scores
