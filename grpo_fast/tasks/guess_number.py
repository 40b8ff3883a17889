"""The built-in environment task: find a hidden number from 1 to 8 in 3 guesses, told higher or lower.

Issue 39's small stateful task. Every episode opens with the same user message, ``"Guess my
number from 1 to 8."``; the ``guess_number`` environment (``grpo_fast.environments.guess_number``)
answers each wrong guess with ``higher`` or ``lower``, and the episode scores 1 when the model
names the number within ``max_turns`` guesses (``environment_reward``, the task's reward). A
trajectory, as the chat template renders it (``|`` between tokens, the prompt's characters
elided)::

    <|im_start|>|user|\\n|G|u|...|8|.|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    4|<|im_end|>|\\n|<|im_start|>|user|\\n|higher|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    6|<|im_end|>|\\n|<|im_start|>|user|\\n|lower|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    5|<|im_end|>

36 prompt tokens, then 2 sampled tokens a guess and a 10-token answer between guesses.

Why 8 numbers and 3 guesses: the prompt is the same for every target, so a policy that cannot
read the answers finds the number with its first guess 1/8 of the time (``max_turns 1``), and
with three distinct guesses 3/8; halving the range on each answer finds it 7/8 of the time (4,
then 2 or 6, then the middle of what is left). The gap between 3/8 and 7/8 is what the answers
are worth. The policy is a lookup on 7 game states (the first guess, then each answer so far),
which the demo's 2-layer model holds.

The model and tokenizer are the tool task's (``grpo_fast.tasks.tool_arithmetic``: a 2-layer
Llama of hidden 64, every number up to 999 one token, ChatML), with the environment's answers
``higher``, ``lower`` and ``wrong`` added as single tokens (1217 tokens).

What is held out: nothing can be. The game has 8 states at its start, one per hidden number,
and training sees them all; ``held_out_rows`` is each target 4 times (32 rows, balanced), so
``eval/pass@1`` is the policy's success rate on uniform targets, sampled as the evaluation
samples (temperature 1 by default).

The warm start (``warm_start``) teaches the format only, as the tool task's does: a short
supervised fine-tuning on synthetic games whose guesses are drawn uniformly from 1..8, whatever
the target and the answers, each answer the environment's own (half of the games told
higher/lower, half told ``wrong``, so that every arm of the benchmark starts from the same
weights and knows both answers' layout), up to 3 guesses, stopping at a hit. After it the model
answers a number in range and ends its turn, and guesses blindly: its success is about
``1 - (7/8)^3 = 0.33`` with 3 turns, 1/8 with one. The strategy (where to guess after an answer)
comes from the RL.
"""

import random
import time

import torch
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
    """One synthetic game of ``row``, token ids and loss mask (1 on the model's tokens), laid out
    as a rollout is (prompt | guess | answer's suffix | guess ...): up to MAX_TURNS guesses drawn
    uniformly from the row's range regardless of the answers, each answered by the environment
    (``feedback``: GuessNumber, else GuessNumberBlind), ending at a hit. ``template``: the
    tokenizer's ChatTemplate."""
    tokenizer = template.tokenizer
    env = GuessNumber() if feedback else GuessNumberBlind()
    ids = template.prompt_ids(env.reset(row))
    mask = [0] * len(ids)
    for _ in range(MAX_TURNS):
        guess = str(rng.randint(row["low"], row["high"]))
        turn = tokenizer.encode(guess, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        step = env.step({"role": "assistant", "content": guess})
        if step.done:
            break
        suffix = template.suffix_ids(step.observations, completion_ids=turn)
        ids, mask = ids + suffix, mask + [0] * len(suffix)
    return ids, mask


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
    loss = fine_tune(model, tokenizer, examples, batch_size=batch_size, learning_rate=learning_rate, seed=seed)
    return {"seconds": time.perf_counter() - start, "loss": loss}


def fine_tune(model, tokenizer, examples: list, *, batch_size: int, learning_rate: float, seed: int) -> float:
    """Supervised steps of ``model`` in place on ``examples`` (``(ids, mask)`` pairs, loss on
    mask 1), ``batch_size`` a step in order, AdamW, gradients clipped to norm 1. Returns the last
    step's mean loss over the unmasked tokens."""
    was_training = model.training
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    loss_value = float("nan")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (B, T), right padding
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100)
            for i, (row_ids, mask) in enumerate(batch):
                ids[i, : len(row_ids)] = torch.tensor(row_ids)
                attention[i, : len(row_ids)] = 1
                labels[i, : len(row_ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(row_ids), -100)
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = loss.item()
    model.zero_grad(set_to_none=True)  # the RL's first step must not add the last demonstrations' gradient
    model.train(was_training)
    return loss_value
