"""The built-in guess_number environment and task (issue 39): the game's rules with scripted
guesses, the tokenizer and its chat template, the dataset, the warm start (the format, not the
strategy), and the learning test: reading the environment's answers lifts held-out success well
above what one guess can reach."""

import json
import subprocess
import sys
import time

import pytest

from grpo_fast.environments import EnvironmentFactory
from grpo_fast.environments.guess_number import INVALID_REWARD, GuessNumber, GuessNumberBlind

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from grpo_fast.tasks import TASK_SETTINGS, TASKS, get_reward_function  # noqa: E402
from grpo_fast.tasks import guess_number as task  # noqa: E402


def say(content: str) -> dict:
    return {"role": "assistant", "content": content}


def play(env, row: dict, guesses: list) -> list:
    """The EnvSteps answering ``guesses`` (after ``reset(row)``)."""
    env.reset(row)
    return [env.step(say(g)) for g in guesses]


# ------------------------------------------------------------------ the environment's rules
def test_rules_higher_lower_and_the_hit():
    env = GuessNumber()
    assert env.reset({"target": 6}) == [{"role": "user", "content": task.prompt_of(1, 8)}]
    steps = play(env, {"target": 6}, ["4", " 7 ", "6"])
    assert steps[0] == ([{"role": "user", "content": "higher"}], False, 0.0)
    assert steps[1] == ([{"role": "user", "content": "lower"}], False, 0.0)
    assert steps[2] == ([], True, 1.0)
    assert env.guesses == [4, 7, 6]


@pytest.mark.parametrize(
    "answer",
    ["", "six", "6.0", "6 7", "0", "9", "-1", "1000"],
    ids=["empty", "word", "decimal", "two numbers", "below", "above", "negative", "far above"],
)
def test_an_answer_that_is_not_a_guess_in_range_ends_the_game_below_a_loss(answer):
    (step,) = play(GuessNumber(), {"target": 6}, [answer])
    assert step == ([], True, INVALID_REWARD) and INVALID_REWARD < 0


def test_the_range_comes_from_the_row_and_the_target_must_lie_in_it():
    env = GuessNumber()
    assert env.reset({"target": 12, "low": 10, "high": 20})[0]["content"] == task.prompt_of(10, 20)
    assert env.step(say("9")).reward == INVALID_REWARD
    env.reset({"target": 12, "low": 10, "high": 20})
    assert env.step(say("15")).observations[0]["content"] == "lower"
    with pytest.raises(ValueError, match="outside the range"):
        GuessNumber().reset({"target": 9})


def test_the_blind_control_answers_wrong_and_scores_alike():
    for target in (1, 5, 8):
        told = play(GuessNumber(), {"target": target}, ["1", "8", "5"])
        blind = play(GuessNumberBlind(), {"target": target}, ["1", "8", "5"])
        assert [s.done for s in blind] == [s.done for s in told]
        assert [s.reward for s in blind] == [s.reward for s in told]
        assert all(s.observations == [{"role": "user", "content": "wrong"}] for s in blind if not s.done)


def test_a_fresh_game_per_episode_and_every_episode_of_a_row_starts_alike():
    factory = EnvironmentFactory("guess_number")
    first, second = factory(), factory()
    assert first is not second and factory.scores and factory.tools == []
    assert first.reset({"target": 2}) == second.reset({"target": 7})  # the prompt tells nothing
    first.step(say("5"))
    assert second.reset({"target": 7}) and second.guesses == []


# ------------------------------------------------------------------ the task
@pytest.fixture(scope="module")
def tokenizer():
    return task.build_tokenizer()


def test_registered_with_its_settings_and_reward():
    assert TASKS["guess_number"] == "grpo_fast.tasks.guess_number:environment_reward"
    settings = TASK_SETTINGS["guess_number"]
    assert settings["environment"] == "guess_number" and settings["max_turns"] == task.MAX_TURNS
    reward = get_reward_function("guess_number")
    assert reward(["p", "p"], ["a", "b"], environment_reward=[1.0, -1.0]) == [1.0, -1.0]


def test_tokenizer_answers_are_single_tokens_and_a_turn_is_two(tokenizer):
    from grpo_fast.tools import ChatTemplate

    for word in task.ANSWERS:
        assert tokenizer.tokenize(word) == [word]
    template = ChatTemplate(tokenizer)
    messages = GuessNumber().reset({"target": 3})
    turn = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]
    suffix = template.suffix_ids([{"role": "user", "content": "lower"}], completion_ids=turn)
    assert len(turn) == 2 and len(suffix) == 10
    full = tokenizer.apply_chat_template(
        messages + [say("5"), {"role": "user", "content": "lower"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert template.prompt_ids(messages) + turn + suffix == list(full)


def test_dataset_and_held_out_rows():
    rows = task.build_dataset(2000, seed=3)
    assert rows == task.build_dataset(2000, seed=3, hold_out=True) != task.build_dataset(2000, seed=4)
    assert {row["target"] for row in rows} == set(range(task.LOW, task.HIGH + 1))
    held = task.held_out_rows()
    counts = {t: sum(row["target"] == t for row in held) for t in range(task.LOW, task.HIGH + 1)}
    assert set(counts.values()) == {task.HELD_OUT_REPEATS}
    assert all(row["prompt"] == task.prompt_of(task.LOW, task.HIGH) for row in rows[:50] + held)


@pytest.mark.parametrize("feedback", [True, False], ids=["told", "blind"])
def test_a_demonstration_is_a_rollout_trained_on_the_first_guess_and_the_turn_ends(tokenizer, feedback):
    import random

    from grpo_fast.tools import ChatTemplate

    template, eos = ChatTemplate(tokenizer), tokenizer.eos_token_id
    row = {"target": 8, "low": 1, "high": 8}
    prompt = template.prompt_ids(GuessNumber().reset(row))
    lengths = set()
    for seed in range(30):
        ids, mask = task.demonstration(template, row, random.Random(seed), feedback=feedback)
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        ends = [i for i, token in enumerate(ids) if token == eos and i >= len(prompt) and mask[i]]
        guesses = [int(tokenizer.decode([ids[i - 1]])) for i in ends]  # 1..8 are single tokens
        assert [mask[i - 1] for i in ends] == [1] + [0] * (len(ends) - 1)  # the first guess alone
        assert sum(mask) == len(ends) + 1 and ends[-1] == len(ids) - 1
        assert all(1 <= g <= 8 for g in guesses) and (guesses[-1] == 8 or len(guesses) == task.MAX_TURNS)
        answers = [tokenizer.decode(ids[a + 1 : b - 1], skip_special_tokens=True) for a, b in zip(ends, ends[1:])]
        assert answers == ["\nuser\n" + ("higher" if feedback else "wrong") + "\nassistant\n"] * len(answers)
        lengths.add(len(guesses))
    assert lengths == {1, 2, 3}


def greedy_games(model, tokenizer, rows: list, max_turns: int) -> list:
    """One greedy (top-k 1) game of ``model`` per row through the trainer's own rollout: our
    sampler and the turn loop in the guess_number environment. Returns the rows' trajectories."""
    from grpo_fast.tools import ChatTemplate
    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
    from grpo_fast.trainer.rollout.samples import rollout
    from grpo_fast.trainer.rollout.turns import TurnLoop

    config = GRPOConfig(task="guess_number", max_turns=max_turns, top_k=1)
    engine = make_generator("sampler", model, tokenizer, EngineSettings.of(config))
    loop = TurnLoop(ChatTemplate(tokenizer), config.tooling, EnvironmentFactory("guess_number"))
    return rollout(engine, rows, list(range(len(rows))), [], group_size=1, turns=loop).completions


def next_guess_distribution(model, tokenizer, guess: int, answer: str) -> torch.Tensor:
    """The model's probabilities of 1..8 for its second guess after ``guess`` was answered ``answer``."""
    from grpo_fast.tools import ChatTemplate

    template = ChatTemplate(tokenizer)
    turn = tokenizer.encode(str(guess), add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = template.prompt_ids(GuessNumber().reset({"target": 1}))
    ids += turn + template.suffix_ids([{"role": "user", "content": answer}], completion_ids=turn)
    numbers = tokenizer.convert_tokens_to_ids([str(n) for n in range(task.LOW, task.HIGH + 1)])
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].softmax(-1)[numbers]


def test_warm_start_teaches_the_format_not_the_strategy(tokenizer):
    """After the warm start every greedy guess is a number in range that ends its turn, and the
    next guess does not depend on the answer: the strategy is left to the RL."""
    model = task.build_model(tokenizer, seed=0)
    report = task.warm_start(model, tokenizer, seed=0)
    assert report["seconds"] > 0 and report["loss"] < 1.2  # ln(8) / 2 = 1.04: a uniform guess, then EOS
    for trajectory in greedy_games(model, tokenizer, task.held_out_rows(), task.MAX_TURNS):
        guesses = [m["content"] for m in trajectory if m["role"] == "assistant"]
        assert all(g.isdigit() and task.LOW <= int(g) <= task.HIGH for g in guesses), trajectory
    model.eval()
    for guess in (3, 4, 5, 6):
        higher = next_guess_distribution(model, tokenizer, guess, "higher")
        lower = next_guess_distribution(model, tokenizer, guess, "lower")
        assert higher.sum() > 0.95 and lower.sum() > 0.95
        assert (higher - lower).abs().max() < 0.05  # blind to the answer
        assert higher.max() < 0.25  # and close to uniform (1/8)


# ------------------------------------------------------------------ the learning test
LEARNING_STEPS = 150
CONTROL_STEPS = 20  # the one-guess control: any policy scores 1/8 in expectation


def train_command(output, *flags, steps: int = LEARNING_STEPS) -> list:
    """``grpo-fast train --task guess_number`` for ``steps`` steps, evaluated at the end."""
    steps = str(steps)
    return [
        sys.executable,
        "-m",
        "grpo_fast",
        "train",
        "--task",
        "guess_number",
        "--steps",
        steps,
        "--eval-every",
        steps,
        "--seed",
        "0",
        "--output",
        str(output),
        "--no-progress",
        *flags,
    ]


@pytest.mark.slow
def test_reading_the_answers_is_learned(tmp_path):
    """The issue's target in bounded time: held-out pass@1 after LEARNING_STEPS steps with the
    task's settings is at least 0.3 above the same task with one guess, and above 3/8, which no
    policy reaches without reading the answers. One guess scores 1/8 in expectation whatever the
    policy, so its run stops at CONTROL_STEPS (0.113 there, 0.121 at 150 steps). The two runs
    go side by side, one per core. Seed 0 gives 0.461, the same in three runs (the runs are
    deterministic on one machine); elsewhere the numerics, and so the trajectory, may differ:
    the 7 trajectories measured at 150 steps (seeds 0-3, two eval schedules) gave 0.46-0.63,
    a margin of 0.34 or more (benchmarks/bench_guess_number.py: 300 steps, every arm)."""
    from grpo_fast.trainer.run.run_log import read_metrics

    arms = {"feedback": ([], LEARNING_STEPS), "one_guess": (["--max-turns", "1"], CONTROL_STEPS)}
    start = time.perf_counter()
    runs = {
        arm: subprocess.Popen(
            train_command(tmp_path / arm, *flags, steps=steps),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arm, (flags, steps) in arms.items()
    }
    for arm, run in runs.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-2000:]
    seconds = time.perf_counter() - start
    final = {arm: read_metrics(str(tmp_path / arm))[-1] for arm in arms}
    passed = {arm: metrics["eval/pass@1"] for arm, metrics in final.items()}
    summary = json.dumps(dict(pass_at_1=passed, seconds=round(seconds)))
    assert final["feedback"]["env/turns_mean"] > 1.5 and final["one_guess"]["env/turns_mean"] == 1.0, summary
    assert abs(passed["one_guess"] - 1 / 8) < 0.05, summary  # exactly 1/8 in expectation, any policy
    assert passed["feedback"] - passed["one_guess"] >= 0.3, summary
    assert passed["feedback"] > 3 / 8, summary
