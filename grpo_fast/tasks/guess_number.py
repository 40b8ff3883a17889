"""The built-in environment task: find a hidden number from 1 to 8 in 3 guesses, told higher or lower.

Issue 39's small stateful task. Every episode opens with the same user message, ``"Guess
1-8."``; the ``guess_number`` environment (``grpo_fast.environments.guess_number``) answers each
wrong guess with ``higher`` or ``lower``, and the episode scores 1 when the model names the
number within ``max_turns`` guesses, 0 when they run out, -1 for an answer that is not a number
in range (``environment_reward``, the task's reward). A trajectory, as the chat template renders
it (``|`` between tokens)::

    <|im_start|>|user|\\n|G|u|e|s|s| |1|-|8|.|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    4|<|im_end|>|\\n|<|im_start|>|user|\\n|higher|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    6|<|im_end|>|\\n|<|im_start|>|user|\\n|lower|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    5|<|im_end|>

18 prompt tokens, then 2 sampled tokens a guess and a 10-token answer between guesses (26
completion tokens at most). The prompt is short on purpose: fine-tuned on halving games after
the warm start, the model put 0.52 of its second guess's probability on numbers consistent with
the answer after 20 steps with ``"Guess my number from 1 to 8."`` (36 tokens), 0.78 with this
prompt.

Why 8 numbers and 3 guesses. The prompt is the same for every target, so without the answers a
policy finds the number with its first guess 1/8 of the time (``max_turns 1``: exactly 1/8 on
the balanced held-out games, whatever the policy) and with three guesses at most 3/8 (three
distinct numbers; the ``GuessNumberBlind`` control, whose every answer is ``wrong``). Guessing
any number consistent with the answers so far finds it 0.62 of the time, halving the range (4,
then 2 or 6, then what is left) 7/8. So the issue's target, 0.3 above the one-guess run (0.425),
is out of reach of every policy that does not read the answers. A policy is a lookup on the
game's states (the first guess, then the answers so far), small enough for the demo's model.

The model and tokenizer are the tool task's (``grpo_fast.tasks.tool_arithmetic``: a 2-layer
Llama of hidden 64, every number up to 999 one token, ChatML), with the environment's answers
``higher``, ``lower`` and ``wrong`` added as single tokens (1217 tokens).

What is held out: nothing can be. The game has 8 states at its start, one per hidden number,
and training sees them all; ``held_out_rows`` is each target 4 times (32 rows, balanced), so
``eval/pass@1`` is the policy's success rate on uniform targets, sampled as the evaluation
samples (8 per game, temperature 1).

The warm start (``warm_start``) teaches the format only, as the tool task's does: 60 AdamW steps
of 32 synthetic games (lr 3e-3, about 4 s) whose guesses are drawn uniformly from 1..8 whatever
the target and the answers, each answer the environment's own (half of the games told
higher/lower, half ``wrong``: every arm of the benchmark starts from the same weights), up to 3
guesses, ending at a hit. The loss is on the first guess and on every turn's end, not on the
later guesses: trained on them, the model learned to ignore the answers (a uniform guess
whatever they say is what those labels ask), and RL took longer to make it read them. After
it every guess is a number in range that ends its turn, and the next guess does not depend on
the answer (tests/test_guess_number.py); its success is that of blind guessing, about
``1 - (7/8)^3 = 0.33`` with 3 turns, 1/8 with one. The strategy comes from the RL.

The RL settings (``TASK_SETTINGS["guess_number"]``): 300 steps of 64 episodes (16 games, 4
samples each), lr 3e-3, 4 passes over each batch (``num_iterations``), beta 0.02. Held-out
pass@1 after them: 0.73, 0.86 and 0.54 for seeds 0-2, against 0.11-0.13 with one guess and 0.31
for the blind control (benchmarks/bench_guess_number.py, about 3 minutes a run, two side by side
on 2 cores). Measured while choosing them: with the trainer's defaults (lr 1e-3, one pass; and
the first version of the prompt and warm start) the model's second guess still ignored the
answer after 200 steps; beta 0 let the policy turn deterministic early and stall (0.25-0.63 at
300 steps, 8 samples a game); 8 samples of 8 games a step learned less evenly across seeds
(0.35-0.72 at 150 steps) than 4 samples of 16 games (0.46-0.63).
"""

import functools
import random
import time

from tokenizers import AddedToken

from grpo_fast.environments.guess_number import GuessNumber, GuessNumberBlind, prompt_of
from grpo_fast.rewards import environment_reward
from grpo_fast.tasks import tool_arithmetic

__all__ = ["build_dataset", "build_model", "build_tokenizer", "environment_reward", "held_out_rows", "warm_start"]

LOW, HIGH = 1, 8  # the hidden number's range, inclusive
MAX_TURNS = 3  # the guesses of an episode (TASK_SETTINGS' max_turns); the warm start's games are this long
ANSWERS = ("higher", "lower", "wrong")  # the environments' answers, one token each
HELD_OUT_REPEATS = 4  # each target's rows in held_out_rows()


def build_tokenizer():
    """The tool task's tokenizer with the environments' answers (``ANSWERS``) as single tokens."""
    tokenizer = tool_arithmetic.build_tokenizer()
    tokenizer.add_tokens([AddedToken(word, special=False, normalized=False) for word in ANSWERS])
    return tokenizer


def build_model(tokenizer, seed: int = 0, **sizes):
    """The tool task's model (``tool_arithmetic.build_model``) for this tokenizer."""
    return tool_arithmetic.build_model(tokenizer, seed, **sizes)


def _row(target: int) -> dict:
    return {"prompt": prompt_of(LOW, HIGH), "target": target, "low": LOW, "high": HIGH}


def build_dataset(num_rows: int = 1000, seed: int = 0, hold_out: bool = False) -> list[dict]:
    """Rows ``{"prompt", "target", "low", "high"}``, the target drawn uniformly from LOW..HIGH.
    ``hold_out`` changes nothing: every target is a training state (see the module's docstring)."""
    rng = random.Random(seed)
    return [_row(rng.randint(LOW, HIGH)) for _ in range(num_rows)]


def held_out_rows() -> list[dict]:
    """Each target ``HELD_OUT_REPEATS`` times, in order: the evaluation's balanced games."""
    return [_row(target) for target in range(LOW, HIGH + 1) for _ in range(HELD_OUT_REPEATS)]


# ---------------------------------------------------------------------------------------------
# The warm start: the format, not the strategy
# ---------------------------------------------------------------------------------------------


def demonstration(template, row: dict, rng: random.Random, feedback: bool) -> tuple[list[int], list[int]]:
    """One synthetic game of ``row``, token ids and loss mask, laid out as a rollout is (prompt |
    guess | answer's suffix | guess ...): up to MAX_TURNS guesses drawn uniformly from the row's
    range regardless of the answers, each answered by the environment (``feedback``:
    GuessNumber, else GuessNumberBlind), ending at a hit. The mask is 1 on the first guess and on
    every turn's end (EOS), 0 elsewhere: the later guesses are not trained, so that the warm start
    neither teaches the model what to do after an answer nor teaches it to ignore the answers
    (see the module's docstring). ``template``: the tokenizer's ChatTemplate."""
    tokenizer = template.tokenizer
    env = GuessNumber() if feedback else GuessNumberBlind()
    env.reset(row)
    ids = list(_prompt_ids(template, prompt_of(row["low"], row["high"])))
    mask = [0] * len(ids)
    for turn_index in range(MAX_TURNS):
        guess = str(rng.randint(row["low"], row["high"]))
        turn = tokenizer.encode(guess, add_special_tokens=False)
        ids += turn + [tokenizer.eos_token_id]
        mask += [int(turn_index == 0)] * len(turn) + [1]
        step = env.step({"role": "assistant", "content": guess})
        if step.done or turn_index == MAX_TURNS - 1:  # a rollout's last turn gets no answer
            break
        suffix = _answer_ids(template, step.observations[0]["content"])
        ids, mask = ids + list(suffix), mask + [0] * len(suffix)
    return ids, mask


# Each game's prompt and answers are a handful of texts: rendered once per template, not per game.
@functools.cache
def _prompt_ids(template, prompt: str) -> tuple:
    return tuple(template.prompt_ids([{"role": "user", "content": prompt}]))


@functools.cache
def _answer_ids(template, answer: str) -> tuple:
    """The suffix after a guess (a turn ending in EOS) that the environment answered ``answer``."""
    return tuple(template.suffix_ids([{"role": "user", "content": answer}]))


def warm_start(
    model,
    tokenizer,
    *,
    tools: bool = False,
    seed: int = 0,
    steps: int = 60,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
) -> dict:
    """A short supervised fine-tuning of ``model`` in place on :func:`demonstration` games
    (random targets, random guesses; see the module's docstring): ``steps`` AdamW steps of
    ``batch_size`` games. ``tools`` is unused (the task has none; the trainer passes it).
    Returns ``{"seconds", "loss"}`` (the last step's mean loss over the model's tokens)."""
    from grpo_fast.tools import ChatTemplate

    start = time.perf_counter()
    template = ChatTemplate(tokenizer)
    rng = random.Random(f"guess_number warm start {seed}")
    rows = build_dataset(steps * batch_size, seed=10_000 + seed)
    examples = [demonstration(template, row, rng, feedback=i % 2 == 0) for i, row in enumerate(rows)]
    loss = tool_arithmetic.fine_tune(
        model, tokenizer, examples, batch_size=batch_size, learning_rate=learning_rate, seed=seed
    )
    return {"seconds": time.perf_counter() - start, "loss": loss}
