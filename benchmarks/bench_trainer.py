"""Trainer throughput on CPU: grpo_fast's GRPOTrainer against TRL's GRPOTrainer, side by side.

Two workloads, each run by both trainers fresh from the same weights, with the same
tokenizer, prompts, reward, G, batch, completion limit, sampling (temperature 1, no top-k /
top-p), loss type, beta and learning rate, and the same thread count:

    demo        the demo's tiny Llama (hidden 64, 2 layers, vocabulary 15): 128 completions
                of "a+b=" prompts (G = 16), 4 new tokens
    realistic   a tiny Llama (hidden 256, 4 layers, vocabulary 32000 from a byte-level BPE
                trained here on generated text), prompts of 20-200 tokens, G = 8, 32
                completions of up to 128 new tokens; the model says EOS right after one of
                V / 48 "stop" tokens: completion lengths spread geometrically up to the limit

A step's time is the interval between the ends of consecutive steps: data, sampling,
rewards, reference log-probs, the update and the per-step logging. Rounds alternate (ours,
TRL, ours, TRL, ...) so that load from other processes hits both alike; each round builds a
fresh trainer, drops its first ``--warmup`` steps, and the per-step times of all rounds are
pooled: median, 20% and 80% quantiles. tokens/s counts prompt + completion tokens of the
batch (completion tokens up to EOS). "cpu ms" is the process's CPU time per step: with one
thread it is what the step costs, whatever else loads the machine.

TRL as it runs on a GPU: TRL 1.16's LM head (``trl/trainer/utils.py``) scores only the
completion positions when ``_use_triton(device)`` says the device runs Triton (CUDA, XPU),
and every position, prompt and padding included, elsewhere. Users train on GPUs, so the
benchmark makes that check answer True (TRL's chunked log-prob function still runs its torch
tiles on CPU: it asks its own module's copy of the check); ``--trl-as-shipped`` leaves it.

    python benchmarks/bench_trainer.py                      # both workloads -> results/trainer_cpu*.json
    python benchmarks/bench_trainer.py --workload demo --steps 10 --rounds 1 --no-trl   # quick look
"""

import argparse
import contextlib
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.bench.measure import machine_info, quantiles
from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer, run_log

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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
    steps: int  # defaults of --steps / --warmup for this workload
    warmup: int

    def trainer(self, **options) -> GRPOTrainer:
        """A fresh grpo_fast trainer on this workload (its model, rows, reward and shape; no
        warmup, no progress bar, a temporary output folder), with `options` as config fields."""
        from transformers import AutoModelForCausalLM

        config = GRPOConfig(
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
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True, dtype=torch.float32)
        return GRPOTrainer(config, model=model, tokenizer=self.tokenizer, rows=self.rows, reward_funcs=[self.reward])


# ----------------------------------------------------------------------------- the workloads


def demo_workload(args) -> Workload:
    tokenizer = build_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    build_model(tokenizer, seed=args.seed).save_pretrained(model_dir)
    return Workload(
        "demo",
        "demo Llama, hidden 64, 2 layers, vocab 15 (grpo_fast.tasks.arithmetic)",
        tokenizer,
        model_dir,
        build_dataset(seed=args.seed),
        arithmetic_reward,
        batch_size=128,
        group_size=16,
        max_new_tokens=4,
        beta=0.005,
        learning_rate=1e-3,
        steps=25,
        warmup=5,
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


def llama_with_spread_eos(tokenizer, seed: int, eos_rate: float = 1 / 48):
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
        max_position_embeddings=512,
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


def realistic_workload(args) -> Workload:
    babble = Babble(args.seed)
    tokenizer = bpe_tokenizer(babble)
    model_dir = tempfile.mkdtemp(prefix="bench-model-")
    llama_with_spread_eos(tokenizer, args.seed).save_pretrained(model_dir)
    description = (
        "Llama hidden 256, 4 layers, 4 heads, vocab 32000 (byte-level BPE trained on generated text), "
        "untied head, EOS after 1 in 48 tokens; prompts 20-200 tokens"
    )
    return Workload(
        "realistic",
        description,
        tokenizer,
        model_dir,
        babble_prompts(babble, tokenizer, 256),
        babble_reward,
        batch_size=32,
        group_size=8,
        max_new_tokens=128,
        beta=0.04,
        learning_rate=1e-6,
        steps=9,
        warmup=1,
    )


def babble_reward(prompts, completions, **columns):
    """Distinct words per word of the completion: cheap, and it varies within a group."""
    return [len(set(c.split())) / (1 + len(c.split())) for c in completions]


WORKLOADS = {"demo": demo_workload, "realistic": realistic_workload}


# ----------------------------------------------------------------------------- the trainers


def run_ours(work: Workload, args, steps: int) -> dict:
    """Per-step seconds, tokens and batch layout of one fresh grpo_fast run."""
    trainer = work.trainer(steps=steps, loss_type="grpo", generator=args.generator, seed=args.seed)
    os.makedirs(trainer.output_dir, exist_ok=True)
    layouts = []
    sample = trainer.source.next

    def recorded(position, version):  # the batch layout: what a padded forward computes, what prefills cost
        batch = sample(position, version)
        N, width = batch.input_ids.shape
        prompt_width = width - batch.completion_mask.shape[1]
        layouts.append(
            dict(
                real=batch.attention_mask.sum().item(),
                padded=N * width,
                prefill_ours=N // work.group_size * prompt_width if args.generator == "sampler" else N * prompt_width,
                prefill_per_sample=N * prompt_width,
            )
        )
        return batch

    trainer.source.next = recorded
    times, cpu_times, tokens, lengths = [], [], [], []
    last, last_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):  # the body of GRPOTrainer.train, less its progress bar
        metrics = trainer.train_step()
        trainer.history.append(metrics)
        run_log.append_metrics(trainer.output_dir, metrics)
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(now - last)
        cpu_times.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
        tokens.append(metrics["tokens_per_s"] * metrics["step_time_s"])
        lengths.append(metrics["completion_len_mean"])
    return dict(times=times, cpu_times=cpu_times, tokens=tokens, lengths=lengths, layouts=layouts)


@contextlib.contextmanager
def trl_scoring(as_shipped: bool):
    """TRL's LM head as on a GPU (completion positions only), unless ``as_shipped``."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._use_triton
    if not as_shipped:
        trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = saved


def run_trl(work: Workload, args, steps: int) -> dict:
    """Per-step seconds and tokens of one fresh TRL run (timed by a callback around each step)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    class StepTimer(TrainerCallback):
        """Time between the ends of consecutive steps: the data loader, the step and the logging."""

        def __init__(self):
            self.times, self.cpu_times, self.last = [], [], None

        def on_train_begin(self, *unused, **kwargs):
            self.last = time.perf_counter(), time.process_time()

        def on_step_end(self, *unused, **kwargs):
            now = time.perf_counter(), time.process_time()
            self.times.append(now[0] - self.last[0])
            self.cpu_times.append(now[1] - self.last[1])
            self.last = now

    timer = StepTimer()
    config = TRLConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        max_steps=steps,
        per_device_train_batch_size=work.batch_size,
        gradient_accumulation_steps=1,
        num_generations=work.group_size,
        max_completion_length=work.max_new_tokens,
        beta=work.beta,
        learning_rate=work.learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        loss_type="grpo",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = TRLTrainer(
        model=work.model_dir,
        reward_funcs=work.reward,
        args=config,
        train_dataset=Dataset.from_list(work.rows),
        processing_class=work.tokenizer,
        callbacks=[timer],
    )
    with trl_scoring(args.trl_as_shipped):
        trainer.train()
    logs = [log for log in trainer.state.log_history if "num_tokens" in log]
    cumulative = [log["num_tokens"] for log in logs]
    tokens = [b - a for a, b in zip([0.0] + cumulative[:-1], cumulative)]
    return dict(
        times=timer.times,
        cpu_times=timer.cpu_times,
        tokens=tokens,
        lengths=[log.get("completions/mean_length") for log in logs],
    )


def summarize(runs: list, warmup: int) -> dict:
    times = [t for run in runs for t in run["times"][warmup:]]
    tokens = [t for run in runs for t in run["tokens"][warmup:]]
    stats = quantiles(times)
    stats["steps_per_s"] = 1.0 / stats["median_s"]
    # CPU seconds of the process per step: with one thread, what the step costs whatever the load
    stats["median_cpu_s"] = statistics.median(t for run in runs for t in run["cpu_times"][warmup:])
    stats["tokens_per_s"] = statistics.median(tokens) / stats["median_s"]
    lengths = [n for run in runs for n in run["lengths"][warmup:] if n is not None]
    stats["completion_len_mean"] = statistics.mean(lengths) if lengths else None
    layouts = [layout for run in runs for layout in run.get("layouts", [])[warmup:]]
    if layouts:
        total = {key: sum(layout[key] for layout in layouts) for key in layouts[0]}
        stats["padding_fraction_of_padded_batch"] = 1 - total["real"] / total["padded"]
        stats["prefill_tokens_saved"] = 1 - total["prefill_ours"] / total["prefill_per_sample"]
    return stats


def bench(work: Workload, args) -> dict:
    steps = args.steps or work.steps
    warmup = work.warmup if args.warmup is None else args.warmup
    runners = {"grpo_fast": run_ours}
    if not args.no_trl:
        runners["trl"] = run_trl
    runs = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            runs[name].append(run(work, args, steps))
            print(
                f"  {work.name} {name}: step medians {statistics.median(runs[name][-1]['times'][warmup:]):.3f} s",
                flush=True,
            )
    results = {name: summarize(runs[name], warmup) for name in runners}
    if "trl" in results:
        results["speedup_steps_per_s"] = results["grpo_fast"]["steps_per_s"] / results["trl"]["steps_per_s"]
        results["speedup_cpu_time"] = results["trl"]["median_cpu_s"] / results["grpo_fast"]["median_cpu_s"]
        # Round by round, so the spread that load from other processes causes is visible.
        results["speedup_per_round"] = [
            statistics.median(t["times"][warmup:]) / statistics.median(o["times"][warmup:])
            for o, t in zip(runs["grpo_fast"], runs["trl"])
        ]
    return dict(steps=steps, warmup=warmup, results=results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round, warm-up included (default: per workload)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per round (default: per workload)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--generator", default=GRPOConfig.generator, help="grpo_fast's generation engine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both (the demo uses 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trl", action="store_true", help="only time grpo_fast")
    parser.add_argument(
        "--trl-as-shipped", action="store_true", help="TRL's CPU path: log-probs over every position, prompt included"
    )
    parser.add_argument("--output-dir", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    try:
        import trl

        trl_version = None if args.no_trl else trl.__version__
    except ImportError:
        trl_version, args.no_trl = None, True
        print("TRL is not installed (pip install trl): timing grpo_fast only")

    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for name in names:
        work = WORKLOADS[name](args)
        measured = bench(work, args)
        results = measured.pop("results")
        report = {
            "benchmark": "trainer step on CPU (rollout + rewards + advantages + ref log-probs + update)",
            "workload": name,
            "model": work.description,
            "setup": dict(
                batch_size=work.batch_size,
                group_size=work.group_size,
                max_new_tokens=work.max_new_tokens,
                beta=work.beta,
                learning_rate=work.learning_rate,
                rounds=args.rounds,
                threads=args.threads,
                seed=args.seed,
                generator=args.generator,
                trl_scoring="every position (as shipped on CPU)"
                if args.trl_as_shipped
                else "completion positions only (as on a GPU)",
                **measured,
            ),
            "versions": {"transformers": transformers.__version__, "trl": trl_version},
            "machine": machine_info(),
            "results": results,
        }
        os.makedirs(args.output_dir, exist_ok=True)
        suffix = "" if name == "demo" else f"_{name}"
        if args.trl_as_shipped:
            suffix += "_trl_as_shipped"
        path = os.path.join(args.output_dir, f"trainer_cpu{suffix}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)

        print(f"\n{name}: {work.description}")
        columns = ("steps/s", 8), ("tokens/s", 9), ("median ms", 10), ("p20-p80 ms", 14), ("cpu ms", 9), ("len", 6)
        print(f"{'trainer':<10} " + " ".join(f"{name:>{width}}" for name, width in columns))
        for trainer in [k for k in results if isinstance(results[k], dict)]:
            r = results[trainer]
            spread = f"{r['p20_s'] * 1e3:.0f}-{r['p80_s'] * 1e3:.0f}"
            length = "-" if r["completion_len_mean"] is None else f"{r['completion_len_mean']:.1f}"
            print(
                f"{trainer:<10} {r['steps_per_s']:8.3f} {r['tokens_per_s']:9.0f} {r['median_s'] * 1e3:10.1f} "
                f"{spread:>14} {r['median_cpu_s'] * 1e3:9.1f} {length:>6}"
            )
        ours = results["grpo_fast"]
        print(
            f"padding a padded batch would compute: {ours['padding_fraction_of_padded_batch']:.1%}; "
            f"prefill tokens saved: {ours['prefill_tokens_saved']:.1%}"
        )
        if "speedup_steps_per_s" in results:
            rounds = ", ".join(f"{r:.2f}x" for r in results["speedup_per_round"])
            print(
                f"grpo_fast / TRL steps/s: {results['speedup_steps_per_s']:.2f}x (rounds: {rounds}); "
                f"CPU time per step: {results['speedup_cpu_time']:.2f}x"
            )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
