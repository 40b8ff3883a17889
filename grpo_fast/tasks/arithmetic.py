"""The built-in demo: single-digit addition learned from scratch by a tiny causal LM.

Prompts are ``"a+b="`` with a, b >= 0 and a + b <= 9; the answer is the decimal sum. The
tokenizer is character level (digits, ``+``, ``=`` and the special tokens), built with
``tokenizers`` and wrapped in ``PreTrainedTokenizerFast``; the model is a 2-layer
Llama-style transformer built from a ``transformers`` config (about 0.1M parameters).

The reward gives partial credit so that an untrained policy already scores a little and
every step of progress is visible: the exact sum scores 1, another number n scores
``max(0, 0.5 - |n - answer| / 20)``, anything else 0. A random policy rarely
writes a bare number, so the reward starts low; it first learns the format (a number,
then EOS) and then the sums.
"""

import random
import re

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARACTERS = tuple("0123456789+=")
_NUMBER = re.compile(r"\d{1,3}")


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character is one token; decoding joins them.

    ``vocab_size`` pads the vocabulary with unused tokens ``<w0>``, ``<w1>``, ... (benchmarks
    use it to give a model a realistic LM-head width).
    """
    tokens = SPECIAL_TOKENS + CHARACTERS
    tokens += tuple(f"<w{i}>" for i in range(max(0, (vocab_size or 0) - len(tokens))))
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **sizes) -> LlamaForCausalLM:
    """A freshly initialised 2-layer Llama (hidden 64), about 0.1M parameters.

    ``sizes`` override the ``LlamaConfig`` (e.g. ``hidden_size``, ``num_hidden_layers``).
    """
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**shape, **sizes},
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


# The held-out sums (a, b): one of each of 10 pairs (a, b), (b, a), so that training still
# shows b+a. A run that evaluates on them trains without them; the default demo trains on every sum.
HELD_OUT = ((0, 2), (3, 1), (4, 0), (1, 4), (5, 1), (2, 5), (6, 2), (1, 7), (8, 1), (3, 6))


def build_dataset(num_rows: int = 1000, seed: int = 0, hold_out: bool = False) -> list[dict]:
    """Rows ``{"prompt": "a+b=", "answer": "a+b as a decimal string"}``, drawn at random:
    every sum a + b <= 9, or with ``hold_out`` every sum but the :data:`HELD_OUT` ones."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < num_rows:
        a = rng.randrange(10)
        b = rng.randrange(10 - a)
        if not (hold_out and (a, b) in HELD_OUT):
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def held_out_rows() -> list[dict]:
    """The held-out sums, one row each, as :func:`build_dataset` writes rows."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in HELD_OUT]


def arithmetic_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1 for a completion that is the answer, ``max(0, 0.5 - |n - answer| / 20)`` for another number n, else 0."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion.strip()
        if _NUMBER.fullmatch(text) is None:
            rewards.append(0.0)
        else:
            error = abs(int(text) - int(target))
            rewards.append(1.0 if error == 0 else max(0.0, 0.5 - error / 20.0))
    return rewards
