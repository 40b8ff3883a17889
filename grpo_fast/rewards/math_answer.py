"""Math answer reward: the completion's final answer against the reference, via math-verify.

The final answer is the last `\\boxed{...}` (or `\\fbox{...}`), else the text after the
last `####` (GSM8K), else the content of the last `<answer>...</answer>`, else the last
number. The same extraction is applied to the reference, so raw GSM8K solutions
("... #### 42") and MATH solutions ("... \\boxed{\\frac{1}{2}}") work as references.
Equivalence (fractions, decimals, LaTeX forms, algebraically equal expressions, sets,
intervals) is decided by math-verify (`pip install "grpo-fast[math]"`), imported lazily.
"""

import re
import threading

from grpo_fast.rewards.base import check_batch, completion_texts

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, with nested braces balanced."""
    match = None
    for match in _BOXED.finditer(text):
        pass
    if match is None:
        return None
    depth = 0
    for j in range(match.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[match.end() : j].strip()
    return None  # unbalanced: the answer was cut off


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (see the module docstring), or None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(".") if numbers else None


def reference_answer(text) -> str | None:
    """The final answer of a reference: after GSM8K's '####', inside MATH's \\boxed{},
    or the whole (stripped) text when it has neither; None stays None."""
    if text is None:
        return None
    text = str(text)
    if "####" in text or _BOXED.search(text):
        return extract_answer(text)
    return text.strip()


def _math_verify():
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(
            'math_reward needs math-verify: pip install "grpo-fast[math]" (or pip install math-verify)'
        ) from exc
    return math_verify


def _as_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    return float(cleaned) if _PLAIN_NUMBER.fullmatch(cleaned) else None


def answers_match(predicted: str, reference: str) -> bool:
    """True when two extracted answers are mathematically equal."""
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:  # plain numbers: no need for sympy
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    mv = _math_verify()
    # math-verify bounds its own time with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"${reference}$", parsing_timeout=timeout) or mv.parse(reference, parsing_timeout=timeout)
    pred = mv.parse(f"${predicted}$", parsing_timeout=timeout) or mv.parse(predicted, parsing_timeout=timeout)
    if gold and pred:
        return bool(mv.verify(gold, pred, timeout_seconds=timeout))
    return "".join(predicted.split()) == "".join(reference.split())


def math_reward(
    prompts: list[str], completions: list[str], answer: list | None = None, solution: list | None = None, **columns
) -> list[float | None]:
    """1.0 when a completion's final answer equals the reference answer, else 0.0.

    prompts, completions: N strings.
    answer: N reference answers ("42", "\\frac{1}{2}", or a full "... #### 42" solution);
        `solution` (MATH's column name) is used when `answer` is not given. A None
        reference scores None.
    Example:
        >>> math_reward(["1/2 as a decimal?"], ["... so the answer is \\\\boxed{0.5}"], answer=["\\\\frac{1}{2}"])
        [1.0]
    """
    references = answer if answer is not None else solution
    if references is None:
        raise ValueError("math_reward needs a reference column: answer=[N strings] (or solution=[...])")
    check_batch(prompts, completions, {"answer": references})
    completions = completion_texts(completions)
    scores = []
    for completion, ref in zip(completions, references):
        if ref is None:
            scores.append(None)
            continue
        ref_answer = reference_answer(ref)
        predicted = extract_answer(completion)
        scores.append(float(predicted is not None and ref_answer is not None and answers_match(predicted, ref_answer)))
    return scores
