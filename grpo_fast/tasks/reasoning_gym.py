"""reasoning-gym's procedural tasks as prompt rows: ``--dataset reasoning_gym:<task>``.

    reasoning_gym:basic_arithmetic                          10,000 rows seeded by the run's seed
    reasoning_gym:basic_arithmetic?max_terms=2&size=500     the task's options; the number of rows
    reasoning_gym:chain_sum,leg_counting?leg_counting.weight=2&chain_sum.max_terms=3
                                                            a mix (reasoning-gym's composite)

A name is ``reasoning_gym:`` then one task or several joined by ``,``, then optionally a query
``?key=value&...``. A key is an option of the task's config (``min_digits``; with several tasks
``<task>.<option>``, and ``<task>.weight``, its share of the mix, default 1), or ``size`` (the
number of rows: 10,000 for ``--dataset``, 100 for ``--eval-dataset``) or ``seed`` (the
generator's). A value is read as JSON where it parses (``2``, ``0.5``, ``true``,
``["+","-"]``), else as a string; ``%26`` and ``%3D`` stand for ``&`` and ``=``.

Training rows come from the run's seed; eval rows (``--eval-dataset``) from the fixed seed
:data:`EVAL_SEED`, the same for every run. reasoning-gym draws entry ``i`` of seed ``s`` from
``Random(s + i)`` (a composite's k-th task from ``s + k + i``), so seeds ``s`` and ``s + 1``
share all but one entry: the two sets draw from disjoint ranges of generator seeds, and never
share an entry (a task with few distinct questions may still ask the same question twice,
within a set as between them).

Each row holds the entry's question as its prompt (chat-formatted, under a system prompt that
asks for ``<answer>…</answer>``, reasoning-gym's default, unless ``--system-prompt`` gives
another), its ``answer``, the ``entry`` itself and its task's ``task_options``: what
``grpo_fast.rewards.reasoning_gym_reward``, the default reward of such a dataset, scores with.
"""

import dataclasses
import json
import urllib.parse

from grpo_fast.rewards.reasoning_gym import require_reasoning_gym
from grpo_fast.tasks.datasets import format_prompts

PREFIX = "reasoning_gym:"
TRAIN_SIZE = 10_000
EVAL_SIZE = 100
# Eval rows draw from generator seeds EVAL_SEED, EVAL_SEED + 1, ...; training rows from the run's
# seed up, which must stay below it.
EVAL_SEED = 1_000_000_000
USAGE = (
    "name reasoning-gym tasks as reasoning_gym:<task>[,<task>...][?option=value&...], e.g. "
    "reasoning_gym:basic_arithmetic?max_terms=2&size=500 (with several tasks, <task>.<option>=value "
    "and <task>.weight=w; size and seed for all)"
)


def is_reasoning_gym(name) -> bool:
    """Whether a dataset name names reasoning-gym tasks (``reasoning_gym:<task>...``)."""
    return isinstance(name, str) and name.startswith(PREFIX)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A parsed ``reasoning_gym:`` name: ``tasks`` maps each task to ``(weight, options)``;
    ``size`` and ``seed`` are None where the name leaves them to the defaults."""

    tasks: dict
    size: int | None = None
    seed: int | None = None


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_task_spec(name: str) -> TaskSpec:
    """The tasks, options, size and seed of a ``reasoning_gym:`` dataset name; ValueError for a
    malformed one (task names are checked against reasoning-gym when the rows are built)."""
    body, _, query = name[len(PREFIX) :].partition("?")
    names = [task.strip() for task in body.split(",")]
    if not all(names):
        raise ValueError(f"dataset {name!r} names no task, or an empty one: {USAGE}")
    if len(set(names)) != len(names):
        raise ValueError(f"dataset {name!r} names a task twice")
    tasks = {task: [1.0, {}] for task in names}
    size = seed = None
    # key=value&...; unlike a URL's query, + stays + (operators=["+","-"]); %XX escapes & and =
    pairs = [part.partition("=") for part in query.split("&")] if query else []
    if not all(key and eq for key, eq, _ in pairs):
        raise ValueError(f"dataset {name!r}: its query {query!r} is not key=value&...: {USAGE}")
    pairs = [(urllib.parse.unquote(key), urllib.parse.unquote(text)) for key, _, text in pairs]
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"dataset {name!r} gives an option twice: {keys}")
    for key, text in pairs:
        value = _value(text)
        if key in ("size", "seed"):
            if not isinstance(value, int) or isinstance(value, bool) or value < (key == "size"):
                raise ValueError(f"dataset {name!r}: {key} must be an integer >= {int(key == 'size')}, got {text!r}")
            size, seed = (value, seed) if key == "size" else (size, value)
            continue
        task, dot, option = key.rpartition(".")
        if not dot and len(names) > 1:
            raise ValueError(f"dataset {name!r} mixes tasks: name the task of option {key!r} as <task>.{key}")
        task = task or names[0]
        if task not in tasks:
            raise ValueError(f"dataset {name!r}: option {key!r} names task {task!r}, which is not among {names}")
        if option == "weight":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"dataset {name!r}: {key} must be a number > 0, got {text!r}")
            tasks[task][0] = float(value)
        else:
            tasks[task][1][option] = value
    return TaskSpec({task: (weight, options) for task, (weight, options) in tasks.items()}, size, seed)


def _check_tasks(name: str, spec: TaskSpec, reasoning_gym) -> None:
    """ValueError naming an unknown task (with the known ones) or an option its config lacks."""
    known = sorted(task for task in reasoning_gym.factory.DATASETS if task != "composite")
    for task, (_, options) in spec.tasks.items():
        if task not in known:
            raise ValueError(f"dataset {name!r}: reasoning-gym has no task {task!r}; {USAGE}; the tasks: {known}")
        fields = [f.name for f in dataclasses.fields(reasoning_gym.factory.DATASETS[task][1])]
        fields = [field for field in fields if field not in ("seed", "size")]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"dataset {name!r}: task {task!r} has no option {unknown[0]!r}; its options: {fields}")


def build_entries(name: str, *, seed: int = 0, held_out: bool = False) -> list[tuple]:
    """The reasoning-gym entries of the dataset ``name``: ``size`` entries from the generator
    seed ``seed`` (the training rows) or, ``held_out``, from :data:`EVAL_SEED` (the eval rows);
    a ``seed`` in the name replaces either. Each entry comes back with its task's options,
    ``(entry, options)``."""
    spec = parse_task_spec(name)
    reasoning_gym = require_reasoning_gym()
    _check_tasks(name, spec, reasoning_gym)
    size = spec.size or (EVAL_SIZE if held_out else TRAIN_SIZE)
    base = spec.seed if spec.seed is not None else EVAL_SEED if held_out else seed
    if not held_out and spec.seed is None and not 0 <= base <= EVAL_SEED - size - len(spec.tasks):
        raise ValueError(
            f"seed={seed} with {size} rows reaches the eval rows' generator seeds ({EVAL_SEED} up): training "
            f"rows draw from seeds 0 to {EVAL_SEED - 1}"
        )
    try:
        if len(spec.tasks) == 1:
            [(task, (_, options))] = spec.tasks.items()
            dataset = reasoning_gym.create_dataset(task, seed=base, size=size, **options)
        else:
            from reasoning_gym.composite import DatasetSpec

            mix = [DatasetSpec(task, weight, dict(options)) for task, (weight, options) in spec.tasks.items()]
            dataset = reasoning_gym.create_dataset("composite", seed=base, size=size, datasets=mix)
        entries = list(dataset)  # options that contradict each other may pass validate() and fail here
    except (AssertionError, TypeError, ValueError) as exc:  # reasoning-gym validates with assert
        raise ValueError(
            f"dataset {name!r}: reasoning-gym cannot generate it with these options: {exc or type(exc).__name__}"
        ) from exc
    return [(entry, spec.tasks[entry["metadata"]["source_dataset"]][1]) for entry in entries]


def reasoning_gym_rows(
    name: str,
    *,
    tokenizer=None,
    seed: int = 0,
    held_out: bool = False,
    system_prompt: str | None = None,
    tools: list | None = None,
) -> list[dict]:
    """Prompt rows of the dataset ``name`` (:func:`build_entries`): ``{"prompt", "answer",
    "entry", "task_options"}``, the prompt chat-formatted as every dataset's is, under
    ``system_prompt`` (None: reasoning-gym's default, which asks for ``<answer>`` tags)."""
    entries = build_entries(name, seed=seed, held_out=held_out)
    if system_prompt is None:
        system_prompt = require_reasoning_gym().utils.SYSTEM_PROMPTS["default"]
    rows = [
        {"prompt": entry["question"], "answer": entry["answer"], "entry": entry, "task_options": options}
        for entry, options in entries
    ]
    return format_prompts(rows, tokenizer, system_prompt, tools)
