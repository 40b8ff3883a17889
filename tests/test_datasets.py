"""load_prompt_dataset: a round trip through each loader, answer extraction, chat templates,
bad input, and the bundled samples scored by the rewards they are meant for."""

import csv
import json
import os

import pytest
from conftest import make_chat_tokenizer, write_jsonl

from grpo_fast.rewards import SandboxLimits, code_reward, math_reward
from grpo_fast.tasks.datasets import SAMPLE_MATH, load_prompt_dataset

ROWS = [
    {"prompt": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42", "level": "1"},
    {"prompt": "Simplify 2/4.", "answer": "It is $\\boxed{\\frac{1}{2}}$.", "level": "2"},
    {"prompt": "Name the answer.", "answer": "17", "level": "3"},
]
EXPECTED_ANSWERS = ["42", "\\frac{1}{2}", "17"]


def write_json(path, rows):
    with open(path, "w") as f:
        json.dump(rows, f)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_saved_dataset(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))


def write_saved_dataset_dict(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))


def write_parquet(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def write_hub_layout(path, rows):
    """A Hub dataset's files on disk: Parquet shards of each split under data/, as
    ``huggingface-cli download`` leaves them; the test split holds other rows."""
    datasets = pytest.importorskip("datasets")
    os.makedirs(path / "data")
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(path / "data" / "train-00000-of-00002.parquet"))
    datasets.Dataset.from_list(rows[2:]).to_parquet(str(path / "data" / "train-00001-of-00002.parquet"))
    datasets.Dataset.from_list(rows[:1]).to_parquet(str(path / "data" / "test-00000-of-00001.parquet"))


@pytest.mark.parametrize(
    "writer, name",
    [
        (write_jsonl, "data.jsonl"),
        (write_json, "data.json"),
        (write_csv, "data.csv"),
        (write_saved_dataset, "saved"),
        (write_saved_dataset_dict, "saved_dict"),
        (write_parquet, "data.parquet"),
        (write_hub_layout, "hub_layout"),
    ],
    ids=["jsonl", "json", "csv", "save_to_disk", "save_to_disk-dict", "parquet", "hub-layout"],
)
def test_round_trip_through_each_loader(tmp_path, writer, name):
    path = tmp_path / name
    writer(path, ROWS)
    rows = load_prompt_dataset(str(path))
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    assert [r["answer"] for r in rows] == EXPECTED_ANSWERS
    assert [r["level"] for r in rows] == ["1", "2", "3"]  # other columns are kept


def test_a_split_of_a_folder_and_a_hub_name_through_load_dataset(tmp_path, monkeypatch):
    """A folder's other split by name; a name that is no local path goes to
    ``datasets.load_dataset(name, config, split=...)`` as given (a stand-in here: no network)."""
    datasets = pytest.importorskip("datasets")
    write_hub_layout(tmp_path / "gsm", ROWS)
    assert [r["answer"] for r in load_prompt_dataset(str(tmp_path / "gsm"), split="test")] == EXPECTED_ANSWERS[:1]
    with pytest.raises(ValueError, match=r"holds splits \['test', 'train'\], not 'validation'"):
        load_prompt_dataset(str(tmp_path / "gsm"), split="validation")
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = load_prompt_dataset("openai/gsm8k", config="main", split="train")
    assert calls == [("openai/gsm8k", "main", "train")] and [r["answer"] for r in rows] == EXPECTED_ANSWERS


def test_an_unreachable_hub_dataset_is_one_clear_error(tmp_path):
    """Offline, a Hub dataset name not in the cache is a ValueError naming it (a fresh process:
    the offline switch is read when the libraries load)."""
    import subprocess
    import sys

    code = (
        "from grpo_fast.tasks.datasets import load_prompt_dataset\n"
        "try:\n    load_prompt_dataset('nobody/no-such-dataset', config='main')\n"
        "except ValueError as exc:\n    print(exc)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "dataset 'nobody/no-such-dataset' (config main, split train): offline or not found on the Hub" in out
    assert "--dataset ./data.jsonl" in out


def test_custom_columns_and_math_solution_column(tmp_path):
    path = tmp_path / "math.jsonl"
    write_jsonl(path, [{"problem": "1+1?", "solution": "We get $\\boxed{2}$."}])
    rows = load_prompt_dataset(path, prompt_column="problem")
    assert rows == [{"prompt": "1+1?", "solution": "We get $\\boxed{2}$.", "answer": "2"}]
    rows = load_prompt_dataset(path, prompt_column="problem", answer_column="solution", system_prompt="Be brief.")
    assert rows[0]["prompt"] == "Be brief.\n\n1+1?"


def test_chat_template_is_applied(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(
        path,
        [{"prompt": "What is 6 * 7?", "answer": "42"}, {"prompt": [{"role": "user", "content": "Hi"}], "answer": "0"}],
    )
    rows = load_prompt_dataset(path, tokenizer=make_chat_tokenizer(), system_prompt="Think first.")
    assert rows[0]["prompt"] == "<|system|>Think first.\n<|user|>What is 6 * 7?\n<|assistant|>"
    assert rows[1]["prompt"] == "<|system|>Think first.\n<|user|>Hi\n<|assistant|>"


def test_bad_input(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, ROWS)
    with pytest.raises(ValueError, match=r"prompt_column 'question'.*\['prompt', 'answer', 'level'\]"):
        load_prompt_dataset(path, prompt_column="question")
    with pytest.raises(ValueError, match="answer_column 'label'"):
        load_prompt_dataset(path, answer_column="label")
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="path must end in"):
        load_prompt_dataset(tmp_path / "data.txt")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        load_prompt_dataset(tmp_path / "broken.jsonl")
    write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(ValueError, match="chat template"):
        load_prompt_dataset(tmp_path / "chat.jsonl")
    with pytest.raises(TypeError, match="path"):
        load_prompt_dataset(3)


def test_bundled_math_sample_scores_its_own_solutions():
    rows = load_prompt_dataset(SAMPLE_MATH)
    assert len(rows) >= 10 and all(r["answer"] for r in rows)
    with open(SAMPLE_MATH) as f:
        solutions = [json.loads(line)["answer"] for line in f]
    prompts = [r["prompt"] for r in rows]
    assert math_reward(prompts, solutions, answer=[r["answer"] for r in rows]) == [1.0] * len(rows)
    wrong = ["The answer is \\boxed{99999}"] * len(rows)
    assert math_reward(prompts, wrong, answer=[r["answer"] for r in rows]) == [0.0] * len(rows)


SAMPLE_CODE_SOLUTIONS = [
    "def add(a, b):\n    return a + b\n",
    "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n",
    "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)\n",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
    "a, b = map(int, input().split())\nprint(a * b)\n",
    "print(' '.join(reversed(input().split())))\n",
]


def test_bundled_code_sample_passes_reference_solutions():
    rows = load_prompt_dataset(os.path.join(os.path.dirname(SAMPLE_MATH), "sample_code.jsonl"))
    completions = [f"```python\n{code}```" for code in SAMPLE_CODE_SOLUTIONS]
    rewards = code_reward(
        [r["prompt"] for r in rows],
        completions,
        tests=[r["tests"] for r in rows],
        limits=SandboxLimits(wall_time_s=3.0),
    )
    assert rewards == [1.0] * len(rows)
