"""reasoning-gym tasks as a dataset (``reasoning_gym:<task>``) and their scorers as a reward:
rows a function of the seed, eval rows apart from training rows, right answers 1 and wrong 0
on real entries of several tasks, the task's options reaching its scorer, bad names, and two
steps of the demo model with eval, all offline."""

import json
import pickle
import sys

import pytest

from grpo_fast.rewards import reasoning_gym_reward
from grpo_fast.rewards.reasoning_gym import require_reasoning_gym
from grpo_fast.tasks import get_reward_function, load_rows, resolve_rewards
from grpo_fast.tasks.reasoning_gym import EVAL_SEED, EVAL_SIZE, parse_task_spec

reasoning_gym = pytest.importorskip("reasoning_gym")

SMALL_SUMS = "reasoning_gym:basic_arithmetic?max_terms=2&max_digits=1"


def score(rows, completions, **columns):
    """reasoning_gym_reward over ``rows`` with their columns, as the trainer passes them."""
    columns = {"entry": [r["entry"] for r in rows], "task_options": [r["task_options"] for r in rows], **columns}
    return reasoning_gym_reward([r["prompt"] for r in rows], completions, **columns)


def questions(rows) -> list:
    return [row["entry"]["question"] for row in rows]


def test_rows_are_a_function_of_the_seed():
    rows = load_rows("reasoning_gym:basic_arithmetic?size=50", seed=3)
    assert len(rows) == 50 and rows == load_rows("reasoning_gym:basic_arithmetic?size=50", seed=3)
    assert questions(rows) != questions(load_rows("reasoning_gym:basic_arithmetic?size=50", seed=4))
    row = rows[0]
    assert set(row) == {"prompt", "answer", "entry", "task_options"} and row["answer"] == row["entry"]["answer"]
    assert row["entry"]["metadata"]["source_dataset"] == "basic_arithmetic"
    # no tokenizer: the default system prompt, then the question, as a plain-text prompt
    assert row["prompt"] == f"{reasoning_gym.utils.SYSTEM_PROMPTS['default']}\n\n{row['entry']['question']}"


def test_eval_rows_never_meet_the_training_rows():
    """Entry i of seed s is reasoning-gym's Random(s + i): eval rows draw from seeds of their own,
    the same for every run, so no run's training rows hold one (checked on a task of many
    distinct questions, where a collision would be a shared generator seed)."""
    train = load_rows("reasoning_gym:basic_arithmetic?size=2000", seed=0)
    held_out = load_rows("reasoning_gym:basic_arithmetic", seed=0, held_out=True)
    assert len(held_out) == EVAL_SIZE and held_out == load_rows("reasoning_gym:basic_arithmetic", seed=9, held_out=True)
    assert not set(questions(train)) & set(questions(held_out))
    assert questions(load_rows("reasoning_gym:basic_arithmetic?size=3&seed=5", held_out=True)) == questions(
        load_rows("reasoning_gym:basic_arithmetic?size=3", seed=5)
    )  # a seed in the name replaces either default
    with pytest.raises(ValueError, match="reaches the eval rows' generator seeds"):
        load_rows("reasoning_gym:basic_arithmetic?size=10", seed=EVAL_SEED - 5)


@pytest.mark.parametrize(
    "name",
    [
        "reasoning_gym:basic_arithmetic",
        "reasoning_gym:leg_counting",
        "reasoning_gym:chain_sum",
        "reasoning_gym:word_sorting",
        "reasoning_gym:letter_counting",
        "reasoning_gym:gcd,lcm?lcm.weight=3",
    ],
    ids=["basic_arithmetic", "leg_counting", "chain_sum", "word_sorting", "letter_counting", "composite"],
)
def test_right_answers_score_1_and_wrong_ones_0(name):
    rows = load_rows(f"{name}{'&' if '?' in name else '?'}size=6", seed=1)
    right = [f"<think>so</think> <answer>{r['answer']}</answer>" for r in rows]
    assert score(rows, right) == [1.0] * 6
    assert score(rows, ["<answer>not it</answer>"] * 6) == [0.0] * 6
    assert score(rows, [r["answer"] for r in rows]) == [0.0] * 6  # without the tags: no answer


def test_a_mix_draws_from_each_task_with_its_options():
    rows = load_rows("reasoning_gym:gcd,lcm?lcm.weight=3&gcd.max_value=20", seed=0)[:400]
    tasks = [r["entry"]["metadata"]["source_dataset"] for r in rows]
    assert 0.65 < tasks.count("lcm") / len(tasks) < 0.85  # weights 1 : 3
    assert {json.dumps(r["task_options"]) for r in rows if r["entry"]["metadata"]["source_dataset"] == "gcd"} == {
        '{"max_value": 20}'
    }
    assert all(r["task_options"] == {} for r in rows if r["entry"]["metadata"]["source_dataset"] == "lcm")


def test_the_tasks_options_reach_its_scorer():
    """decimal_arithmetic allows an error of one unit in the last of max_num_decimal_places
    (default 3): 0.05 off passes with 1 place, as the row's task_options say, and fails with 3."""
    rows = load_rows("reasoning_gym:decimal_arithmetic?min_num_decimal_places=1&max_num_decimal_places=1&size=4")
    near = [f"<answer>{float(r['answer']) + 0.05:.4f}</answer>" for r in rows]
    assert score(rows, near) == [1.0] * 4
    assert score(rows, near, task_options=[None] * 4) == [0.0] * 4


def test_a_scorer_that_raises_on_an_answer_scores_0():
    rows = load_rows("reasoning_gym:prime_factorization?size=2")
    with pytest.raises(ValueError):  # its own scorer int()s the answer
        reasoning_gym.get_score_answer_fn("prime_factorization")("twelve", rows[0]["entry"])
    assert score(rows, ["<answer>twelve</answer>"] * 2) == [0.0, 0.0]


def test_message_list_completions_answer_with_the_last_assistant_message():
    rows = load_rows("reasoning_gym:basic_arithmetic?size=2")
    trajectories = [
        [
            {"role": "assistant", "content": "<answer>0</answer>", "tool_calls": []},
            {"role": "tool", "content": f"<answer>{r['answer']}</answer>"},
            {"role": "assistant", "content": f"<answer>{r['answer']}</answer>"},
        ]
        for r in rows
    ]
    assert score(rows, trajectories) == [1.0, 1.0]
    assert score(rows, [t[:2] for t in trajectories]) == [0.0, 0.0]  # the tool's text is not an answer


def test_rows_survive_pickling_and_the_reward_resolves_by_name():
    """The rollout worker receives rows and hands back their columns pickled."""
    rows = load_rows("reasoning_gym:rearc?size=2")  # its scorer compares tuples, which JSON would make lists
    again = pickle.loads(pickle.dumps(rows))
    assert again == rows and score(again, [f"<answer>{r['answer']}</answer>" for r in again]) == [1.0, 1.0]
    assert get_reward_function("reasoning_gym_reward") is reasoning_gym_reward
    assert resolve_rewards(None, "reasoning_gym:gcd")[1] == ["reasoning_gym_reward"]
    assert resolve_rewards(None, "data.jsonl")[1] == ["math_reward"]


def test_the_system_prompt_is_the_users_when_given():
    from conftest import make_chat_tokenizer

    rows = load_rows("reasoning_gym:gcd?size=1", tokenizer=make_chat_tokenizer(), system_prompt="Be brief.")
    assert rows[0]["prompt"] == f"<|system|>Be brief.\n<|user|>{rows[0]['entry']['question']}\n<|assistant|>"
    default = load_rows("reasoning_gym:gcd?size=1", tokenizer=make_chat_tokenizer())[0]["prompt"]
    assert default.startswith(f"<|system|>{reasoning_gym.utils.SYSTEM_PROMPTS['default']}")


def test_query_values_are_json_where_they_parse():
    spec = parse_task_spec('reasoning_gym:basic_arithmetic?max_terms=2&operators=["+","-"]&format_style=simple')
    assert spec.tasks == {
        "basic_arithmetic": (1.0, {"max_terms": 2, "operators": ["+", "-"], "format_style": "simple"})
    }
    assert (spec.size, spec.seed) == (None, None)


# id: (name, what the ValueError says)
BAD_NAMES = {
    "empty": ("reasoning_gym:", r"names no task.*reasoning_gym:<task>\[,<task>\.\.\.\]"),
    "unknown-task": ("reasoning_gym:no_such", r"no task 'no_such'; name reasoning-gym tasks as .*'basic_arithmetic'"),
    "unknown-option": ("reasoning_gym:gcd?nope=1", r"task 'gcd' has no option 'nope'; its options: .*max_value"),
    "mix-needs-task": ("reasoning_gym:gcd,lcm?max_value=9", r"mixes tasks: name the task of option 'max_value' as"),
    "other-task": ("reasoning_gym:gcd?lcm.max_value=9", r"names task 'lcm', which is not among \['gcd'\]"),
    "size": ("reasoning_gym:gcd?size=0", r"size must be an integer >= 1, got '0'"),
    "weight": ("reasoning_gym:gcd?gcd.weight=-1", r"gcd.weight must be a number > 0"),
    "query": ("reasoning_gym:gcd?max_value", r"its query 'max_value' is not key=value"),
    "twice": ("reasoning_gym:gcd,gcd", r"names a task twice"),
    "rejected": ("reasoning_gym:basic_arithmetic?min_terms=5&max_terms=2", r"cannot generate it with these options"),
}


@pytest.mark.parametrize("name, message", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
def test_a_bad_name_is_a_value_error_that_says_how_to_name_a_task(name, message):
    with pytest.raises(ValueError, match=message):
        load_rows(name)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r'pip install "grpo-fast\[reasoning-gym\]"'):
        require_reasoning_gym()


def test_two_steps_of_the_demo_model_train_and_evaluate(tmp_path):
    """The default reward, training rows and eval rows end to end. The demo's tokenizer reads
    only digits, + and =, every other character one unknown token: a short system prompt keeps
    the prompts short (the Triton interpreter runs the loss here)."""
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        dataset=f"{SMALL_SUMS}&size=16",
        eval_dataset=f"{SMALL_SUMS}&size=4",
        eval_samples=2,
        steps=2,
        batch_size=8,
        group_size=4,
        max_new_tokens=4,
        progress=False,
        output_dir=str(tmp_path),
        system_prompt="<answer>",
    )
    trainer = GRPOTrainer(config)
    assert trainer.reward_names == ["reasoning_gym_reward"] and len(trainer.rows) == 16
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert all(0.0 <= m["rewards/reasoning_gym_reward"] <= 1.0 for m in history)
    assert "eval/pass@1" in history[-1] and len(trainer.evaluator.rows) == 4
    with open(tmp_path / "completions.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert logged and all(any(q in row["prompt"] for q in questions(trainer.rows)) for row in logged)


def test_without_an_eval_dataset_the_eval_rows_are_its_held_out_rows():
    """``--dataset reasoning_gym:<task> --eval-every N`` evaluates on the task's own held-out rows
    (the eval seed range: test_eval_rows_never_meet_the_training_rows), as a built-in task does."""
    from grpo_fast.trainer import GRPOConfig
    from grpo_fast.trainer.run.evaluation import load_eval_rows

    config = GRPOConfig(dataset=f"{SMALL_SUMS}&size=16", eval_every=1, steps=2)
    held = load_eval_rows(config)
    explicit = load_eval_rows(GRPOConfig(dataset=config.dataset, eval_dataset=config.dataset, eval_every=1, steps=2))
    assert held == explicit and held and held != load_rows(config.dataset)[: len(held)]
