"""The built-in tool task: multi-digit multiplication, which a tiny model can only do with the calculator.

ToRL in miniature (issue 27). Prompts are ``"a*b"`` with a 3-digit a (100-999) and a 2-digit b
(10-99): 81,000 problems; the answer is the exact product (4 or 5 digits). The model is the
demo's tiny Llama (2 layers, hidden 64, about 0.16M parameters with this vocabulary). It cannot
multiply in its head: every digit of a product depends on every digit of both factors through
carries, which a model this size does not learn in minutes (after the warm start below, the
model that answers directly gets 0 of the 64 held-out products right). With the calculator it
only has to copy: the factors into the call, then the tool's result into its answer.

A trajectory with the tool, as the chat template renders it (``|`` between tokens)::

    <|im_start|>|system|\\n|<tools>|calculator|(|expression|)|</tools>|<|im_end|>|\\n|
    <|im_start|>|user|\\n|347|*|28|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    <tool_call>{"name": "calculator", "arguments": {"expression": "|347|*|28|"}}</tool_call>|<|im_end|>|
    \\n|<|im_start|>|user|\\n|<tool_response>|971|6|</tool_response>|<|im_end|>|\\n|<|im_start|>|assistant|\\n|
    971|6|<|im_end|>

22 prompt tokens, a 6-token call (sampled), a 13-token tool suffix, a 3-token answer (sampled).

The tokenizer (``build_tokenizer``, 1214 tokens) is designed so that the copies are easy:

* Numbers are read left to right in chunks of up to 3 digits, one token per digit string of
  length 1-3 (1110 tokens, leading zeros included: ``10005`` is ``100|05``). So a is one
  3-digit token and b one 2-digit token: copying them into the call is content-based attention
  (fetch the 3-digit token, then after ``*`` the 2-digit one), which the tiny model learns in a
  few hundred steps; with one token per digit it had to learn positional copying and did not in
  200 steps. Tied embeddings make a copy's output the token it attends to.
* Whole-word tokens (``WORDS``) for the chat markers' roles, ``<tools>``, ``calculator``,
  ``expression``, ``<tool_response>`` and the call's fixed JSON: ``<tool_call>{"name":
  "calculator", "arguments": {"expression": "`` is ONE token and ``"}}</tool_call>`` another, so
  a calculator call is 6 sampled tokens (open, 347, ``*``, 28, close, ``<|im_end|>``).
* Every other printable ASCII character and the newline is a token of its own, so any text
  encodes (a tool's error message, another tool's name, a system prompt); ``<unk>`` only for
  non-ASCII. Added tokens match leftmost-longest before the split, so each text has one
  tokenization and the template's renderings re-tokenise to what a model samples.
* ``<|im_end|>`` is the EOS (it ends every turn), ``<pad>`` pads on the left; no BOS.

The chat template (``CHAT_TEMPLATE``) is ChatML with Hermes-style tool calls (Qwen2.5's layout),
prefix-preserving and short: with tools, one system line lists each tool as
``name(parameter, ...)`` (the name and the parameter names of its JSON schema, not the whole
schema: hundreds of characters, i.e. positions, that a 0.16M-parameter model cannot use); a call
renders as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` right after the
assistant's content; tool results as ``<tool_response>...</tool_response>`` in a user turn.
Without tools (and no system message) the prompt is only the user turn.

The reward (``tool_arithmetic_reward``): the final answer (the last assistant message's content,
or the completion string) scores 1 when it is the exact product; another bare number n scores a
little, ``0.1 * max(0, 1 - |n - answer| / answer)``, so that a model without the tool still has
a gradient (magnitude, leading digits) and a half-right copy of the tool's result scores more
than nothing; anything else scores 0. Only 1 passes (eval_pass_threshold = 1).

The warm start (``warm_start``), as issue 27 allows: a short supervised fine-tuning on synthetic
demonstrations rendered with the chat template, before RL (200 AdamW steps of 32 problems at lr
3e-3: about 11 s on one CPU thread with tools, 4 s without, whose sequences are shorter). With
tools: the user's problem, the assistant's calculator call of that expression, the tool's
response (the calculator's own output) and the assistant's answer copying it, laid out token for
token as a rollout is. Without tools: the user's problem and the assistant's direct, correct
answer. Both arms take the same steps over the same problems (the no-tool model sees the right
answers too); only the assistant's tokens are trained (the prompt and the tool's tokens are
masked), and never on a held-out problem. After it the tools model calls the calculator, copies
the expression and the result about half the time: held-out pass@1 sampled at temperature 1 (as
the RL samples) is 0.59, 0.47 and 0.56 for seeds 0-2 (the trainer's rollout: our sampler and the
tool loop), and 0 without tools; the RL does the rest (benchmarks/bench_tools.py,
docs/tools.md). Measured while choosing it, with an earlier two-turn loop of the model's
``generate`` (200 steps at lr 3e-3 gave 0.52, 0.50, 0.61 there): at lr 1e-2 the copy emerged
abruptly at a seed-dependent step (300 steps gave 0.22, 0.93 and 0.00), and a seed that starts
at 0 gives the RL no exact answer to reinforce; at lr 3e-3 it emerges evenly (150 steps: 0.16,
0.05, 0.11; 300: 0.78, 0.91, 0.94). ``build_model`` initialises
with ``initializer_range=0.1`` (not 0.02): with the default the copy had not emerged after
100-200 steps.
"""

import random
import re

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_fast.rewards.base import completion_texts
from grpo_fast.tasks import arithmetic

# The reward names the task is scored with by default (grpo_fast.tasks.get_reward_function).
REWARDS = ("tool_arithmetic_reward",)
# The tools the task is meant for (--tools calculator).
TOOLS = ("calculator",)

PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, UNK, IM_START, IM_END)
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
# Whole-word tokens, matched (leftmost-longest) before the text is split into characters.
WORDS = (
    CALL_OPEN,
    CALL_CLOSE,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "system",
    "user",
    "assistant",
    "tool",
    "calculator",
    "expression",
)
# Numbers are read in chunks of up to 3 digits, left to right ("9716" is 971|6): one token per
# digit string of length 1-3 (leading zeros included: "10005" is 100|05).
NUMBERS = tuple(f"{i:0{width}d}" for width in (1, 2, 3) for i in range(10**width))
CHARACTERS = ("\n",) + tuple(chr(c) for c in range(32, 127) if not chr(c).isdigit())

# ChatML with Hermes-style tool calls, written for this tokenizer: short, prefix-preserving.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- if messages and messages[0].role == 'system' %}{%- set ns.system = messages[0].content or '' %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (ns.system + '\\n' if ns.system else '') + '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{%- set params = (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {}) %}"
    "{{- (', ' if not loop.first else '') + f.name + '(' + (params | list | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif ns.system %}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{{- (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user\\n' }}"
    "{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_response>' + (m.content or '') + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NUMBER = re.compile(r"-?\d+")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The task's tokenizer (1214 tokens): the chat specials, whole-word tokens for the chat and
    call markup (``WORDS``), one token per digit string of length 1-3 (numbers are read in such
    chunks, left to right), one per other character; its ``chat_template`` is ``CHAT_TEMPLATE``.
    ``<|im_end|>`` is the EOS (it ends every turn), ``<pad>`` the padding (left)."""
    tokens = SPECIAL_TOKENS + WORDS + NUMBERS + CHARACTERS
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d{1,3}|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORDS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **sizes) -> LlamaForCausalLM:
    """The demo's model (``arithmetic.build_model``: a 2-layer Llama, hidden 64) with room for
    a two-turn trajectory (256 positions: a tool's error is text, a token per character), its
    weights drawn with std 0.1 (see the module's docstring). ``sizes`` override the ``LlamaConfig``."""
    return arithmetic.build_model(
        tokenizer, seed, **{"max_position_embeddings": 256, "initializer_range": 0.1, **sizes}
    )


def _row(a: int, b: int) -> dict:
    return {"prompt": f"{a}*{b}", "answer": str(a * b)}


def _draw(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(100, 1000), rng.randrange(10, 100)


def _held_out_pairs(count: int = 64) -> tuple:
    rng = random.Random("tool_arithmetic held out")
    pairs: list = []
    while len(pairs) < count:
        pair = _draw(rng)
        if pair not in pairs:
            pairs.append(pair)
    return tuple(pairs)


# The held-out products (a, b): 64 fixed problems. A run that evaluates on them trains without them.
HELD_OUT = _held_out_pairs()


def build_dataset(num_rows: int = 1000, seed: int = 0, hold_out: bool = False) -> list[dict]:
    """Rows ``{"prompt": "a*b", "answer": "the product"}``, a in 100-999, b in 10-99, drawn at
    random (81,000 problems); with ``hold_out`` never one of :data:`HELD_OUT`."""
    rng = random.Random(seed)
    held = set(HELD_OUT) if hold_out else set()
    rows = []
    while len(rows) < num_rows:
        pair = _draw(rng)
        if pair not in held:
            rows.append(_row(*pair))
    return rows


def held_out_rows() -> list[dict]:
    """The held-out products, one row each, as :func:`build_dataset` writes rows."""
    return [_row(a, b) for a, b in HELD_OUT]


def final_answer(completion) -> str:
    """The text a completion answers with (``completion_texts``: a str as it is, a trajectory
    its last assistant message), without a trailing ``<|im_end|>``."""
    text = completion_texts([completion])[0].strip()
    while text.endswith(IM_END):
        text = text[: -len(IM_END)].rstrip()
    return text


def tool_arithmetic_reward(prompts: list, completions: list, answer: list, **columns) -> list[float]:
    """1 when the final answer is the exact product; another bare number n scores
    ``0.1 * max(0, 1 - |n - answer| / answer)``; anything else 0. A completion is a string or a
    trajectory (TRL's list of messages, when tools are on): its last assistant message is read."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = final_answer(completion)
        if _NUMBER.fullmatch(text) is None:
            rewards.append(0.0)
            continue
        value, target = int(text), int(target)
        if value == target:
            rewards.append(1.0)
        else:
            rewards.append(0.1 * max(0.0, 1.0 - abs(value - target) / max(abs(target), 1)))
    return rewards


# ---------------------------------------------------------------------------------------------
# The warm start and its measure
# ---------------------------------------------------------------------------------------------


def _tool_template(tokenizer):
    from grpo_fast.tools import ToolTemplate

    return ToolTemplate(tokenizer, list(TOOLS))


def _prompt_ids(tokenizer, prompt: str, template) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    if template is not None:
        return template.prompt_ids(messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def demonstration(tokenizer, row: dict, template=None) -> tuple[list[int], list[int]]:
    """One synthetic demonstration of ``row``, token ids and loss mask (1 on the assistant's tokens).

    With ``template`` (a ToolTemplate of the calculator): the prompt, the call of the row's
    expression, the tool's response (the exact product), the answer copying it; laid out as a
    rollout is (prompt | turn | template.tool_suffix_ids | turn). Without: the prompt and the
    direct answer. Each turn ends with ``<|im_end|>``.
    """
    from grpo_fast.tools.calculator import calculator

    eos = [tokenizer.eos_token_id]
    prompt = _prompt_ids(tokenizer, row["prompt"], template)
    answer = _encode(tokenizer, row["answer"]) + eos
    if template is None:
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    call = _encode(tokenizer, CALL_OPEN + row["prompt"] + CALL_CLOSE) + eos
    suffix = template.tool_suffix_ids([calculator(row["prompt"])], completion_ids=call)
    ids = prompt + call + suffix + answer
    mask = [0] * len(prompt) + [1] * len(call) + [0] * len(suffix) + [1] * len(answer)
    return ids, mask


def warm_start(
    model,
    tokenizer,
    *,
    tools: bool,
    seed: int = 0,
    steps: int = 200,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
) -> dict:
    """A short supervised fine-tuning of ``model`` in place on synthetic demonstrations (see the
    module's docstring): ``steps`` AdamW steps of ``batch_size`` problems drawn from the training
    problems (never the held-out ones), the same for ``tools`` True and False. Returns
    ``{"seconds", "loss"}`` (the last step's mean loss over the assistant's tokens)."""
    import time

    start = time.perf_counter()
    template = _tool_template(tokenizer) if tools else None
    rows = build_dataset(steps * batch_size, seed=10_000 + seed, hold_out=True)
    examples = [demonstration(tokenizer, row, template) for row in rows]
    loss_value = fine_tune(model, tokenizer, examples, batch_size=batch_size, learning_rate=learning_rate, seed=seed)
    return {"seconds": time.perf_counter() - start, "loss": loss_value}


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
