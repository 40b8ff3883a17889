"""math_reward, format_reward, overlong_penalty and none_on_error on real answer formats; which
names a config may give."""

import functools
import re
import sys
import threading

import pytest

from grpo_fast import rewards
from grpo_fast.rewards import (
    REWARD_FUNCTIONS,
    extract_answer,
    format_reward,
    math_reward,
    none_on_error,
    overlong_penalty,
)
from grpo_fast.tasks import TASKS, get_reward_function

# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("first \\boxed{1}, corrected: \\boxed{x^{2}+1}", "x^{2}+1"),  # last box, nested braces
        ("\\fbox{12}", "12"),
        ("She has 42 apples.\n#### 42", "42"),
        ("He pays 1,250 dollars in total.\n#### 1,250\n", "1,250"),
        ("<think>2 + 2</think><answer> 4 </answer>", "4"),
        ("It costs 3 dollars, then 5 more, so 8.", "8"),
        ("The temperature dropped to -7.5 degrees.", "-7.5"),
        ("no number here", None),
    ],
    ids=[
        "boxed-frac",
        "last-boxed-nested",
        "fbox",
        "gsm8k",
        "gsm8k-comma",
        "answer-tag",
        "last-number",
        "negative-decimal",
        "none",
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- math_reward


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is \\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
        ("\\boxed{(x+1)^2}", "x^2 + 2x + 1"),
        ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2"),
        ("\\boxed{\\{2, 1\\}}", "\\{1, 2\\}"),
        ("So she pays $1,000.", "1000"),
        ("#### 42", "Natalia sold 48/2 = 24 clips in May, 48 + 24 = 72 in all... #### 42"),
        ("\\boxed{6}", "Adding 7 gives $3x = 18$, so $x = \\boxed{6}$."),
        ("\\boxed{42.0}", "42"),
    ],
    ids=[
        "decimal-vs-frac",
        "dfrac",
        "sqrt",
        "expanded-poly",
        "pi",
        "set-order",
        "comma-number",
        "gsm8k-reference",
        "math-solution-reference",
        "float-int",
    ],
)
def test_math_reward_accepts_equivalent_answers(completion, reference):
    assert math_reward(["q"], [completion], answer=[reference]) == [1.0]


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("\\boxed{x^2 + 2x}", "(x+1)^2"),
        ("#### 41", "#### 42"),
        ("I am not sure.", "7"),
        ("\\boxed{-3}", "3"),
    ],
    ids=["wrong-frac", "wrong-poly", "wrong-number", "no-answer", "sign"],
)
def test_math_reward_rejects_wrong_answers(completion, reference):
    assert math_reward(["q"], [completion], answer=[reference]) == [0.0]


def test_math_reward_columns():
    # solution= (MATH's column) is used without answer=; None scores None; unknown columns are ignored.
    assert math_reward(["a", "b"], ["\\boxed{5}", "7"], solution=["\\boxed{5}", None], tests=[[], []]) == [1.0, None]
    with pytest.raises(ValueError, match="answer"):
        math_reward(["q"], ["1"])
    with pytest.raises(ValueError, match="answer.*length N=2"):
        math_reward(["q", "r"], ["1", "2"], answer=["1"])
    with pytest.raises(TypeError, match=r"completions\[0\]"):
        math_reward(["q"], [None], answer=["1"])


def test_math_reward_in_a_worker_thread():
    # math-verify's default timeout uses SIGALRM, which only the main thread may use.
    out = []
    worker = threading.Thread(target=lambda: out.append(math_reward(["q"], ["\\boxed{\\frac{2}{4}}"], answer=["0.5"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]


def test_math_reward_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    assert math_reward(["q"], ["#### 12"], answer=["12"]) == [1.0]  # plain numbers need no sympy
    with pytest.raises(ImportError, match=re.escape("grpo-fast[math]")):
        math_reward(["q"], ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])


# ---------------------------------------------------------------- format_reward


def test_format_reward_default_pattern():
    completions = [
        "<think>\n3 * 4 = 12\n</think>\n<answer>12</answer>",
        "  <think>x</think><answer>y</answer>\n",
        "<answer>12</answer>",
        "<think>x</think><answer>y</answer> and more",
        "<think>x</think>",
    ]
    assert format_reward(["q"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_reward_custom_pattern():
    boxed_only = functools.partial(format_reward, pattern=r".*\\boxed\{.+\}.*")
    assert boxed_only(["q", "q"], ["so \\boxed{3}", "so 3"], answer=["3", "3"]) == [1.0, 0.0]
    assert format_reward(["q"], ["ANSWER: 3"], pattern=re.compile(r"ANSWER: \d+")) == [1.0]
    with pytest.raises(TypeError, match="pattern"):
        format_reward(["q"], ["x"], pattern=3)


# ---------------------------------------------------------------- overlong_penalty


def dapo_overlong(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO eq. 13, written out case by case."""
    if length <= max_length - buffer_length:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer_length) - length) / buffer_length
    return -1.0


def test_overlong_penalty_matches_dapo():
    lengths = [0, 11, 12, 13, 14, 15, 16, 17, 40]
    ids = [[1] * n for n in lengths]
    got = overlong_penalty(
        ["q"] * len(lengths), ["c"] * len(lengths), max_length=16, buffer_length=4, completion_ids=ids
    )
    assert got == pytest.approx([dapo_overlong(n, 16, 4) for n in lengths])
    assert got[lengths.index(14)] == -0.5 and got[lengths.index(16)] == -1.0


def test_overlong_penalty_with_a_tokenizer():
    class CharTokenizer:  # one token per character: lengths are easy to check
        def encode(self, text, add_special_tokens=True):
            return list(text) + (["<eos>"] if add_special_tokens else [])

    got = overlong_penalty(
        ["q"] * 3, ["abc", "abcdef", "abcdefgh"], max_length=8, buffer_length=4, tokenizer=CharTokenizer()
    )
    assert got == pytest.approx([0.0, -0.5, -1.0])


def test_overlong_penalty_bad_arguments():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(["q"], ["c"], completion_ids=[[1]])
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(["q"], ["c"], max_length=4, buffer_length=8, completion_ids=[[1]])
    with pytest.raises(ValueError, match="completion_ids"):
        overlong_penalty(["q"], ["c"], max_length=8, buffer_length=4)
    with pytest.raises(ValueError, match="completion_ids.*length N=1"):
        overlong_penalty(["q"], ["c"], max_length=8, buffer_length=4, completion_ids=[[1], [2]])


# ---------------------------------------------------------------- none_on_error


def test_none_on_error_scores_only_failing_samples_none():
    def picky_reward(prompts, completions, **columns):
        return [1.0 / int(c) for c in completions]  # "0" and "x" raise

    wrapped = none_on_error(picky_reward)
    assert wrapped.__name__ == "picky_reward"
    assert wrapped(["q"] * 4, ["2", "0", "x", "4"], answer=["a"] * 4) == [0.5, None, None, 0.25]
    assert wrapped(["q"], ["5"]) == [0.2]
    with pytest.raises(ZeroDivisionError):
        picky_reward(["q"], ["0"])


@pytest.mark.parametrize("name", ["run_python", "check_batch", "none_on_error", "extract_answer", "SandboxLimits"])
def test_only_reward_functions_resolve_by_name(name):
    """A config names a reward function; the package's helpers are refused with the valid names."""
    known = [*TASKS, *REWARD_FUNCTIONS]
    with pytest.raises(ValueError, match=re.escape(f"unknown reward function {name!r}; known: {known}")):
        get_reward_function(name)
    assert [get_reward_function(n) for n in REWARD_FUNCTIONS] == [getattr(rewards, n) for n in REWARD_FUNCTIONS]
