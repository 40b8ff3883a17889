"""Prompt datasets: a local file (JSONL, JSON, CSV, Parquet), a folder (``save_to_disk``, or
Parquet/JSON shards as a Hub dataset lies on disk), or a Hub dataset by name.

    rows = load_prompt_dataset("grpo_fast/tasks/data/sample_math.jsonl", tokenizer=tok)
    rows = load_prompt_dataset("openai/gsm8k", config="main", split="train", tokenizer=tok)
    rows[0] -> {"prompt": "<chat-formatted question>", "answer": "18", "question": ..., ...}

A name that is not a local path goes to ``datasets.load_dataset`` (``HF_HUB_OFFLINE=1`` and the
local cache honoured, as every Hugging Face tool does).
"""

import csv
import json
import os
import string

from grpo_fast.rewards.math_answer import reference_answer

SAMPLE_MATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample_math.jsonl")


def is_local_path(name: str) -> bool:
    """Whether a ``model`` (or similar) names a local folder rather than a Hub repository: it
    exists here, or reads as a path (absolute, ``./``, ``~``, or more than one ``/``, which a
    Hub name ``org/name`` never has)."""
    return os.path.exists(name) or name.startswith((os.sep, ".", "~")) or name.count("/") > 1


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object per line ({exc.msg})") from exc
    return rows


def _read_json(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.lstrip().startswith("["):
        return _read_jsonl(path)
    return json.loads(text)


def _read_csv(path: str) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise ImportError('reading this dataset needs the datasets library: pip install "grpo-fast[data]"') from exc
    return datasets


def _one_split(data, where: str, split: str | None):
    """The rows of ``split`` (default: "train", or the only split) of a DatasetDict, or of a Dataset."""
    if not isinstance(data, _datasets().DatasetDict):
        return data.to_list()
    if split is not None or "train" in data or len(data) != 1:
        split = split or "train"
        if split not in data:
            raise ValueError(f"{where} holds splits {sorted(data)}, not {split!r}: pass one of them as the split")
        return data[split].to_list()
    return next(iter(data.values())).to_list()


def _read_folder(path: str, split: str | None) -> list[dict]:
    """A ``save_to_disk`` folder, or a folder of Parquet / JSON(L) / CSV shards (a Hub dataset's
    files on disk; ``datasets`` takes its splits from the file names)."""
    datasets = _datasets()
    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
        return _one_split(datasets.load_from_disk(path), path, split)
    return _one_split(datasets.load_dataset(path), path, split)


def _read_parquet(path: str) -> list[dict]:
    return _datasets().load_dataset("parquet", data_files=path, split="train").to_list()


def _read_hub(name: str, config: str | None, split: str | None) -> list[dict]:
    """A Hub dataset's split; ValueError naming it when it cannot be reached."""
    datasets = _datasets()
    try:
        return _one_split(datasets.load_dataset(name, config, split=split), name, split)
    except (ConnectionError, FileNotFoundError, OSError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise ValueError(
            f"dataset {name!r} (config {config or 'default'}, split {split or 'train'}): offline or not found on the "
            f"Hub ({str(exc).splitlines()[0]}); pass a local file or folder (--dataset ./data.jsonl), or connect "
            "and unset HF_HUB_OFFLINE"
        ) from exc


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def is_dataset_path(name: str) -> bool:
    """Whether a dataset name is a local path: :func:`is_local_path`, or a data file's name
    (``data/train.jsonl``), which a Hub name never is."""
    return is_local_path(name) or os.path.splitext(name)[1].lower() in _READERS


def format_prompts(rows: list, tokenizer, system_prompt: str | None = None, tools: list | None = None) -> list:
    """``rows`` with each "prompt" chat-formatted by the tokenizer's template when it has one
    (with the tools' schemas ``tools``), else as they are (a built-in task without a template)."""
    if getattr(tokenizer, "chat_template", None) is None and tools is None and system_prompt is None:
        return rows
    return [
        {**row, "prompt": _format_prompt(row["prompt"], tokenizer, system_prompt, i, tools)}
        for i, row in enumerate(rows)
    ]


def _format_prompt(prompt, tokenizer, system_prompt: str | None, row_index: int, tools: list | None = None) -> str:
    """Chat-format a prompt (a str, or a list of {"role", "content"} messages), showing ``tools``
    (JSON schemas) when given."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        messages = list(prompt)
    else:
        raise TypeError(
            f"row {row_index}: the prompt must be a str or a list of {{'role', 'content'}} messages, "
            f"got {type(prompt).__name__}"
        )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if tools is not None:
        raise ValueError("tools need a tokenizer with a chat template that renders them (apply_chat_template(tools=))")
    if isinstance(prompt, list):
        raise ValueError(f"row {row_index}: a prompt given as chat messages needs a tokenizer with a chat template")
    return prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"


def _template_fields(template: str) -> list[str]:
    """The columns a prompt template names (``"{text}\n{test_list}"``); ValueError for a
    malformed template or a field that is not a plain column name."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(
            f"prompt_template {template!r} is malformed: {exc} (a literal brace is {{{{ or }}}})"
        ) from None
    if not fields or any(not name or "." in name or "[" in name for name in fields):
        raise ValueError(f"prompt_template {template!r} must name whole columns as {{column}}, got {fields}")
    return fields


def _render(template: str, row: dict) -> str:
    """A prompt template filled from a row: a list column as one item per line."""
    values = {
        name: "\n".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        for name, value in row.items()
    }
    return template.format_map(values)


def load_prompt_dataset(
    path: str,
    *,
    prompt_column: str = "prompt",
    prompt_template: str | None = None,
    answer_column: str | None = None,
    tokenizer=None,
    system_prompt: str | None = None,
    config: str | None = None,
    split: str | None = None,
    tools: list | None = None,
) -> list[dict]:
    """Rows of prompts (and reference answers) for training.

    path: a .jsonl / .json / .csv / .parquet file, a folder (written by ``save_to_disk``, or
        of Parquet/JSON shards), or a Hub dataset name (``openai/gsm8k``).
    config, split: the Hub dataset's configuration (``main``) and split (default "train", or
        a folder's only split).
    prompt_column: the column holding the prompt (a str, or a list of chat messages).
    prompt_template: instead of prompt_column, the prompt built from each row's columns, a
        list column one item per line (MBPP: ``"{text}\nYour code should pass these
        tests:\n{test_list}"``); every column stays in the row (the rewards may need them).
    answer_column: the column with the reference answer or solution; default "answer" when
        present, else "solution" (MATH). Its final answer (GSM8K "#### 42", MATH "\\boxed{}")
        is extracted into the row's "answer"; the full text stays under the column's own name
        when that is not "answer".
    tokenizer: when it has a chat template, every prompt is rendered with it
        (add_generation_prompt=True); otherwise prompts stay plain text.
    system_prompt: a system message (or, without a chat template, a preamble).
    tools: the JSON schemas of the tools the model may call, shown by the chat template.
    Returns a list of dicts, each with "prompt" (str) and every other column of the row.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file or folder path, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isdir(path):
        rows = _read_folder(path, split)
    elif os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in _READERS:
            raise ValueError(f"path must end in {sorted(_READERS)} or be a dataset folder, got {path!r}")
        rows = _READERS[ext](path)
    elif is_dataset_path(path):
        raise FileNotFoundError(f"no dataset file or folder at {path!r}")
    else:
        rows = _read_hub(path, config, split)
    columns = list(rows[0]) if rows else []
    needed = [prompt_column] if prompt_template is None else _template_fields(prompt_template)

    def source(name: str) -> str:
        return f"prompt_column {name!r}" if prompt_template is None else f"prompt_template's column {name!r}"

    missing = [name for name in needed if name not in columns]
    if rows and missing:
        raise ValueError(f"{source(missing[0])} is not in {path}; its columns are {columns}")
    if answer_column is None:
        answer_column = next((c for c in ("answer", "solution") if c in columns), None)
    elif rows and answer_column not in rows[0]:
        raise ValueError(f"answer_column {answer_column!r} is not in {path}; its columns are {columns}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} must be an object with named columns, got {type(row).__name__}")
        absent = [name for name in needed if name not in row]
        if absent:
            raise ValueError(f"{source(absent[0])} is missing from row {i} of {path}; its columns are {list(row)}")
        new = {k: v for k, v in row.items() if prompt_template is not None or k != prompt_column}
        prompt = row[prompt_column] if prompt_template is None else _render(prompt_template, row)
        new["prompt"] = _format_prompt(prompt, tokenizer, system_prompt, i, tools)
        if answer_column is not None:
            new["answer"] = reference_answer(row.get(answer_column))
        out.append(new)
    return out
