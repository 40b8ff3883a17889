"""Prompt datasets from local files: JSONL, JSON, CSV, or a Hugging Face `datasets` folder.

    rows = load_prompt_dataset("grpo_fast/tasks/data/sample_math.jsonl", tokenizer=tok)
    rows[0] -> {"prompt": "<chat-formatted question>", "answer": "18", "question": ..., ...}

Nothing is downloaded: `path` is a file or a folder written by `Dataset.save_to_disk`.
"""

import csv
import json
import os

from grpo_fast.rewards.math_answer import reference_answer

SAMPLE_MATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample_math.jsonl")


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


def _read_saved_dataset(path: str) -> list[dict]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as exc:
        raise ImportError(
            f'{path} is a folder: reading a save_to_disk dataset needs `pip install "grpo-fast[data]"`'
        ) from exc
    data = load_from_disk(path)
    if isinstance(data, DatasetDict):
        if "train" in data:
            data = data["train"]
        elif len(data) == 1:
            data = next(iter(data.values()))
        else:
            raise ValueError(
                f"{path} holds splits {sorted(data)}; pass the folder of one split or save a 'train' split"
            )
    return data.to_list()


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}


def _format_prompt(prompt, tokenizer, system_prompt: str | None, row_index: int) -> str:
    """Chat-format a prompt (a str, or a list of {"role", "content"} messages)."""
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
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, list):
        raise ValueError(f"row {row_index}: a prompt given as chat messages needs a tokenizer with a chat template")
    return prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"


def load_prompt_dataset(
    path: str,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = None,
    tokenizer=None,
    system_prompt: str | None = None,
) -> list[dict]:
    """Rows of prompts (and reference answers) for training.

    path: a .jsonl / .json / .csv file, or a folder written by `datasets.Dataset.save_to_disk`
        (a DatasetDict folder gives its "train" split).
    prompt_column: the column holding the prompt (a str, or a list of chat messages).
    answer_column: the column with the reference answer or solution; default "answer" when
        present, else "solution" (MATH). Its final answer (GSM8K "#### 42", MATH "\\boxed{}")
        is extracted into the row's "answer"; the full text stays under the column's own name
        when that is not "answer".
    tokenizer: when it has a chat template, every prompt is rendered with it
        (add_generation_prompt=True); otherwise prompts stay plain text.
    system_prompt: a system message (or, without a chat template, a preamble).
    Returns a list of dicts, each with "prompt" (str) and every other column of the row.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file or folder path, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isdir(path):
        rows = _read_saved_dataset(path)
    elif os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in _READERS:
            raise ValueError(f"path must end in {sorted(_READERS)} or be a save_to_disk folder, got {path!r}")
        rows = _READERS[ext](path)
    else:
        raise FileNotFoundError(f"no dataset file or folder at {path!r}")
    columns = list(rows[0]) if rows else []
    if rows and prompt_column not in rows[0]:
        raise ValueError(f"prompt_column {prompt_column!r} is not in {path}; its columns are {columns}")
    if answer_column is None:
        answer_column = next((c for c in ("answer", "solution") if c in columns), None)
    elif rows and answer_column not in rows[0]:
        raise ValueError(f"answer_column {answer_column!r} is not in {path}; its columns are {columns}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} must be an object with named columns, got {type(row).__name__}")
        if prompt_column not in row:
            raise ValueError(
                f"prompt_column {prompt_column!r} is missing from row {i} of {path}; its columns are {list(row)}"
            )
        new = {k: v for k, v in row.items() if k != prompt_column}
        new["prompt"] = _format_prompt(row[prompt_column], tokenizer, system_prompt, i)
        if answer_column is not None:
            new["answer"] = reference_answer(row.get(answer_column))
        out.append(new)
    return out
