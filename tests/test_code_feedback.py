"""code_feedback (grpo_fast/environments/code_feedback.py) with scripted policies: hand-written
assistant turns drive the environment's reset and step, as the turn loop does, over each form of
tests code_reward reads; hostile programs from the sandbox tests' battery (tests/_hostile.py); programs that never
end; and one short training run on the tool task's tiny model, whose episodes show the feedback.

The programs run in this machine's default sandbox mode with small limits (tests/_sandboxed.py);
a run takes ~0.05 s, a timed-out one its wall limit.
"""

import functools
import os
import re
import secrets
import textwrap
import time
from string import Template

import pytest
import torch
from _hostile import HOSTILE, NEEDS_LANDLOCK
from _sandboxed import LIMITS

from grpo_fast.environments import EnvironmentFactory, EnvStep
from grpo_fast.environments.code_feedback import CodeFeedback
from grpo_fast.sandbox import SandboxLimits, run_python
from grpo_fast.tasks import tool_arithmetic
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run.run_log import read_completions

ROW = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
RIGHT = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG_FIRST = "```python\ndef add(a, b):\n    return a - b\n```"  # fails both tests: the feedback names the first
WRONG_SECOND = "```python\ndef add(a, b):\n    return 3\n```"  # passes the first test, fails the second
FAST = SandboxLimits(wall_time_s=1.0, memory_bytes=256 << 20, max_processes=8, output_bytes=64 << 10)


def play(turns: list, row: dict = ROW, **options) -> tuple:
    """An episode in which the model says ``turns`` until one ends it: ``(its EnvSteps, the env)``."""
    env = CodeFeedback(**{"limits": LIMITS, **options})
    assert env.reset(row) == [{"role": "user", "content": row["prompt"]}]
    steps = []
    for content in turns:
        steps.append(env.step({"role": "assistant", "content": content}))
        if steps[-1].done:
            break
    return steps, env


def feedback(step: EnvStep) -> str:
    """The one user message of a step that goes on."""
    assert not step.done and [m["role"] for m in step.observations] == ["user"], step
    return step.observations[0]["content"]


# ---------------------------------------------------------------- scripted policies


def test_right_first_try_scores_one_in_one_step():
    steps, env = play([RIGHT, RIGHT])
    assert steps == [EnvStep([], True, 1.0)]
    assert (env.attempts, env.score) == (1, 1.0)


def test_a_fix_after_feedback_scores_one_and_the_feedback_names_the_failing_test():
    steps, env = play([WRONG_SECOND, RIGHT])
    assert len(steps) == 2 and steps[0].reward == 0.0 and steps[1] == EnvStep([], True, 1.0)
    message = feedback(steps[0])
    assert "assert add(-1, 1) == 0" in message and "assert add(1, 2) == 3" not in message  # the first that failed
    assert sum(step.reward for step in steps) == 1.0 and (env.attempts, env.score) == (2, 1.0)


def test_a_wrong_fix_scores_zero_and_each_attempt_hears_its_own_failure():
    steps, env = play([WRONG_FIRST, WRONG_SECOND, WRONG_FIRST])
    assert [step.reward for step in steps] == [0.0, 0.0, 0.0] and not any(step.done for step in steps)
    first, second, third = map(feedback, steps)
    assert "assert add(1, 2) == 3" in first and "assert add(-1, 1) == 0" in second and third == first
    assert (env.attempts, env.score) == (3, 0.0)


# The forms of tests code_reward reads (rewards/code.py), each row with a wrong and a right program
# and what the wrong one's feedback must quote.
FORMS = {
    "asserts": (ROW, WRONG_FIRST, RIGHT, ["assert add(1, 2) == 3"]),
    "mbpp_test_list": (
        {"prompt": "Write first(xs).", "test_list": ["assert first([4, 5]) == 4"]},
        "def first(xs):\n    return xs[1]\n",
        "def first(xs):\n    return xs[0]\n",
        ["assert first([4, 5]) == 4"],
    ),
    "mbpp_with_setup": (  # setup: trusted source run before the program and in the judge
        {
            "prompt": "Write hyp(a, b).",
            "tests": {
                "asserts": ["assert close(hyp(3, 4), 5.0)"],
                "setup": "def close(a, b):\n    return abs(a - b) < 1e-9",
            },
        },
        "def hyp(a, b):\n    return a + b\n",
        "import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n",
        ["assert close(hyp(3, 4), 5.0)"],
    ),
    "io_pairs": (
        {
            "prompt": "Print twice the number read.",
            "tests": [{"input": "3\n", "output": "6"}, {"input": "5", "output": "10"}],
        },
        "print(int(input()) * 3)",
        "print(int(input()) * 2)",
        ["Its input:\n3\nExpected output:\n6\nYour program's output:\n9\n"],
    ),
    "humaneval_check": (
        {
            "prompt": "def inc(x):\n    '''x + 1'''\n",
            "tests": "def check(candidate):\n    assert candidate(1) == 2\n",
            "entry_point": "inc",
        },
        "def inc(x):\n    return x\n",
        "def inc(x):\n    return x + 1\n",
        ["check(inc)"],
    ),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_tests_gets_feedback_then_a_pass(form):
    row, wrong, right, quoted = FORMS[form]
    steps, _ = play([wrong, right], row)
    message = feedback(steps[0])
    assert all(text in message for text in quoted), message
    assert steps[1] == EnvStep([], True, 1.0)


def test_the_feedback_says_how_the_program_failed_and_is_cut_to_size():
    crash = "import sys\nprint('x' * 5000, file=sys.stderr)\nraise ZeroDivisionError('at load')\n"
    steps, _ = play([crash], max_detail_chars=200)
    message = feedback(steps[0])
    assert "ZeroDivisionError: at load" in message and "..." in message and len(message) < 500
    assert "grpo_fast/sandbox" not in message  # the sandbox's own frames are left out
    long_test = {"prompt": "p", "tests": ["assert add(1, 2) == 3 and " + " and ".join(["True"] * 100)]}
    message = feedback(play([WRONG_FIRST], long_test, max_detail_chars=100)[0][0])
    assert "assert add(1, 2) == 3 and True" in message and len(message) < 250


@pytest.mark.parametrize(
    "program",
    ["while True:\n    pass\n", "import os\nwhile True:\n    os.fork()\n"],
    ids=["endless_loop", "fork_bomb"],
)
def test_a_program_that_never_ends_is_stopped_and_the_episode_goes_on(program):
    start = time.monotonic()
    steps, env = play([program, RIGHT], limits=FAST)
    assert time.monotonic() - start < FAST.wall_time_s + 5
    assert steps[0].reward == 0.0 and "failed this test" in feedback(steps[0])
    assert steps[1] == EnvStep([], True, 1.0) and env.attempts == 2


# ---------------------------------------------------------------- hostile programs


@pytest.fixture(scope="module")
def isolation():
    return run_python("", limits=LIMITS).isolation


@pytest.mark.parametrize(
    "attack", ["harness_tampering", "early_exit", "always_equal", "assert_stripping", "outside_writes"]
)
def test_a_hostile_program_scores_zero_and_changes_nothing(attack, isolation, tmp_path):
    """Forged verdicts and a printed pass, an early exit, values equal to everything, stripped
    asserts, writes to the host's files: the attempt fails (the judge outside the sandbox decides),
    the episode goes on, and nothing outside changed."""
    if isolation == "none" and attack in NEEDS_LANDLOCK:
        pytest.skip("the fallback without Landlock does not confine files (SECURITY.md)")
    for name in ("keep.txt", "victim.txt"):
        (tmp_path / name).write_text(name)
    marker = f"grpo-fast-feedback-{secrets.token_hex(6)}"

    def filled(text: str) -> str:
        return Template(textwrap.dedent(text)).safe_substitute(target=tmp_path, marker=marker)

    program, asserts, setup = HOSTILE[attack]
    steps, env = play(
        [filled(program)], {"prompt": "p", "tests": {"asserts": list(map(filled, asserts)), "setup": setup}}
    )
    assert steps[0].reward == 0.0 and "failed this test" in feedback(steps[0])
    assert (env.attempts, env.score) == (1, 0.0)
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "victim.txt"]
    assert (tmp_path / "keep.txt").read_text() == "keep.txt" and (tmp_path / "keep.txt").stat().st_mode & 0o777 != 0o777
    assert not any(os.path.exists(os.path.join(d, marker)) for d in ("/tmp", "/var/tmp", "/dev/shm"))


# ---------------------------------------------------------------- options and errors


def test_options_and_rows_are_checked():
    with pytest.raises(TypeError, match="limits"):
        CodeFeedback(limits={"wall_time_s": 1})
    with pytest.raises(ValueError, match="max_detail_chars"):
        CodeFeedback(max_detail_chars=5)
    with pytest.raises(RuntimeError, match="before reset"):
        CodeFeedback().step({"role": "assistant", "content": RIGHT})
    with pytest.raises(ValueError, match="needs tests"):
        CodeFeedback().reset({"prompt": "p", "answer": "4"})
    with pytest.raises(ValueError, match="not valid Python"):
        CodeFeedback().reset({"prompt": "p", "tests": ["assert ("]})


def test_the_factory_makes_it_by_name_or_with_bound_options():
    for spec in ("code_feedback", functools.partial(CodeFeedback, limits=FAST)):
        factory = EnvironmentFactory(spec)
        assert factory.name == "CodeFeedback" and factory.scores and factory.tools == []
        first, second = factory(), factory()
        assert first is not second and isinstance(first, CodeFeedback)
    assert factory().limits == FAST


# ---------------------------------------------------------------- in the trainer


def test_a_training_step_plays_code_feedback_episodes(tmp_path):
    """One step of the tool task's tiny (untrained) model in code_feedback episodes: every attempt
    fails, so each episode hears its feedback until max_turns; the log line has the env/* metrics,
    and completions.jsonl each turn with its role. The model is made to end its turns early (its
    end-of-turn row of the tied LM head points along its mean final hidden state), so that an
    episode has room for a second turn."""
    tokenizer = tool_arithmetic.build_tokenizer()
    model = tool_arithmetic.build_model(tokenizer, seed=1, max_position_embeddings=1024)
    contexts = torch.randint(10, len(tokenizer), (16, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mean = model.model(input_ids=contexts).last_hidden_state.mean((0, 1))
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 4 * mean / mean.norm() ** 2
    rows = [{"prompt": "Write f() returning 1.", "tests": ["assert f() == 1"]}]
    config = GRPOConfig(
        steps=1,
        batch_size=2,
        group_size=2,
        max_new_tokens=256,
        max_turns=2,
        progress=False,
        save_every=0,
        log_completions_every=1,
        output_dir=str(tmp_path / "run"),
        report_to=None,
    )
    environment = functools.partial(CodeFeedback, limits=FAST, max_detail_chars=20)
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, rows=rows, environment=environment)
    try:
        (metrics,) = trainer.train()
    finally:
        trainer.close()
    assert metrics["env/errors"] == 0 and metrics["env/success"] == 0 and 1 < metrics["env/turns_mean"] <= 2
    assert metrics["rewards/environment_reward"] == 0.0 and metrics["env/seconds"] > 0
    completions = read_completions(str(tmp_path / "run"))
    heard = [m["content"] for row in completions for m in row["completion"] if m["role"] == "user"]
    assert heard and all(re.match(r"Your program failed this test:\nassert f\(\) == 1\n", text) for text in heard)
    assert all(row["completion"][-1]["role"] == "assistant" for row in completions)
