"""The sampler engine (grpo_fast/trainer/rollout/engines/sampler.py) and its token sampling.

The model is the demo's tiny Llama (vocabulary 15), freshly initialised: its distributions
are spread enough that samples differ and EOS comes at varied positions.
"""

import copy
import math

import pytest
import torch

from grpo_fast import reference
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig
from grpo_fast.trainer.rollout.engines import EngineSettings, encode_prompts
from grpo_fast.trainer.rollout.engines.sampler import Sampler
from grpo_fast.trainer.rollout.engines.sampling import sample_streams, sample_tokens, stream_uniforms

PROMPTS = ["1+2=", "9+0=11+", "3+", "4+4=", "7", "2+2=4+5=", "0+", "8+1="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tokenizer, seed=1, num_key_value_heads=2)  # grouped-query attention


def sampler(model, tokenizer, static_cache=False, **config):
    return Sampler(
        model, tokenizer, EngineSettings.of(GRPOConfig(**{"max_new_tokens": 8, **config})), static_cache=static_cache
    )


def completion_tokens(generation) -> list:
    """Each row's completion tokens up to and including EOS."""
    C = generation.completion_mask.shape[1]
    lengths = generation.completion_mask.sum(1).long().tolist()
    return [row[:n] for row, n in zip(generation.input_ids[:, -C:].tolist(), lengths)]


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the standard normal quantile z (3.09: 99.9%), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_greedy_equals_hugging_face_generate(model, tokenizer):
    """top_k=1 is greedy decoding: token for token what HF generate(do_sample=False) gives.
    A random model's argmax is never EOS, so the head is untied and EOS's row set to 1.05x the
    row of prompt 0's greedy token: rows that would say that token stop instead."""
    ids, mask = (x.repeat_interleave(2, dim=0) for x in encode_prompts(tokenizer, PROMPTS, None))
    stopping = copy.deepcopy(model)
    with torch.no_grad():
        first = stopping(input_ids=ids[:1], attention_mask=mask[:1]).logits[0, -1].argmax()
        stopping.lm_head.weight = torch.nn.Parameter(stopping.lm_head.weight.clone())
        stopping.lm_head.weight[tokenizer.eos_token_id] = 1.05 * stopping.lm_head.weight[first]
    out = sampler(stopping, tokenizer, top_k=1).generate(PROMPTS, 2, list(range(len(PROMPTS))))
    truth = stopping.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    C = out.completion_mask.shape[1]
    assert torch.equal(out.input_ids, truth[:, : ids.shape[1] + C])
    assert (truth[:, ids.shape[1] + C :] == tokenizer.pad_token_id).all()
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < 8 and lengths.max() == 8  # some stopped at EOS, some ran to the limit


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic_cache", "static_cache"])
def test_logprobs_equal_independent_forwards_of_each_sequence(model, tokenizer, static_cache):
    """One prefill per prompt, its cache shared by the group, finished rows dropped from the
    batch (or kept, static cache): each returned log-prob equals that of a forward of the
    sequence alone, without cache or padding; after EOS the mask and log-probs are 0."""
    out = sampler(model, tokenizer, static_cache, temperature=0.8).generate(PROMPTS, 3, list(range(len(PROMPTS))))
    C = out.completion_mask.shape[1]
    P = out.input_ids.shape[1] - C
    eos = tokenizer.eos_token_id
    for b, tokens in enumerate(completion_tokens(out)):
        n = len(tokens)
        assert eos not in tokens[:-1] and (n == C or tokens[-1] == eos)
        assert (out.input_ids[b, P + n :] == tokenizer.pad_token_id).all() and (out.logprobs[b, n:] == 0).all()
        prompt = out.input_ids[b, :P][out.attention_mask[b, :P].bool()]
        alone = torch.cat([prompt, torch.tensor(tokens)]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=alone).logits[:, len(prompt) - 1 : -1]
        truth = reference.token_logprobs(logits.double(), alone[:, len(prompt) :], temperature=0.8)[0]
        torch.testing.assert_close(out.logprobs[b, :n].double(), truth, rtol=0, atol=1e-5)


def test_static_cache_samples_what_the_dynamic_cache_samples(model, tokenizer):
    dynamic = sampler(model, tokenizer, top_p=0.9).generate(PROMPTS, 3, list(range(8)))
    static = sampler(model, tokenizer, True, top_p=0.9).generate(PROMPTS, 3, list(range(8)))
    assert completion_tokens(static) == completion_tokens(dynamic)
    assert len(set(dynamic.completions)) > 8  # the samples of a group differ


def test_finished_rows_cost_no_more_forwards(model, tokenizer):
    """A row that sampled EOS leaves the decode batch: the decode forwards see each row for
    exactly its completion length minus one steps (the first token comes from the prefill)."""
    rows_per_step = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_per_step.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        out = sampler(model, tokenizer).generate(PROMPTS, 4, list(range(8)))
    finally:
        hook.remove()
    prefill, *decode = rows_per_step
    assert prefill[0] == len(PROMPTS)  # one prefill row per prompt, not per sample
    assert all(shape[1] == 1 for shape in decode)
    lengths = out.completion_mask.sum(1)
    assert sum(shape[0] for shape in decode) == int((lengths - 1).sum())
    assert decode[-1][0] < decode[0][0]  # the batch shrank


def test_samples_do_not_depend_on_the_batch(model, tokenizer):
    """A prompt's samples are a function of (seed, key, sample index): the same alone (a batch
    of 2 rows) as among 16 rows, in another order; another key or seed changes them."""
    keys = list(range(100, 108))
    engine = sampler(model, tokenizer, top_k=10)
    together = completion_tokens(engine.generate(PROMPTS, 2, keys))
    order = [3, 0, 7, 5, 1, 6, 2, 4]
    shuffled = completion_tokens(engine.generate([PROMPTS[i] for i in order], 2, [keys[i] for i in order]))
    for i in range(8):
        alone = completion_tokens(engine.generate([PROMPTS[i]], 2, [keys[i]]))
        assert alone == together[2 * i : 2 * i + 2]
        j = order.index(i)
        assert shuffled[2 * j : 2 * j + 2] == alone
    assert completion_tokens(engine.generate(PROMPTS, 2, [k + 1000 for k in keys])) != together
    reseeded = sampler(model, tokenizer, top_k=10, seed=1)
    assert completion_tokens(reseeded.generate(PROMPTS, 2, keys)) != together


def test_sample_tokens_is_row_wise_exact():
    """The sampling math alone, on fixed logits: each row's token and log-prob are bit-for-bit
    the same in a batch of 16, alone, and after the batch is permuted."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)) * 3
    streams = sample_streams(5, torch.arange(16) * 7, torch.arange(16) % 4)
    options = dict(temperature=0.7, top_k=50, top_p=0.9)
    tokens, logp = sample_tokens(logits, stream_uniforms(streams, 3), **options)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    permuted = sample_tokens(logits[perm], stream_uniforms(streams[perm], 3), **options)
    assert torch.equal(permuted[0], tokens[perm]) and torch.equal(permuted[1], logp[perm])
    for i in range(16):
        alone = sample_tokens(logits[i : i + 1], stream_uniforms(streams[i : i + 1], 3), **options)
        assert torch.equal(alone[0], tokens[i : i + 1]) and torch.equal(alone[1], logp[i : i + 1])
    torch.testing.assert_close(logp, (logits / 0.7).log_softmax(-1).gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("options", [dict(), dict(top_k=4), dict(top_p=0.7)], ids=["full", "top_k", "top_p"])
def test_first_token_distribution_is_the_models(model, tokenizer, options):
    """4000 samples of one prompt's first token against softmax(logits / T), filtered and
    renormalised by top-k / top-p as Hugging Face does: Pearson's chi-square under its 99.9%
    quantile. The sample index alone varies the counter-based uniforms."""
    T, n = 0.5, 4000
    out = sampler(model, tokenizer, temperature=T, max_new_tokens=1, **options).generate(["3+4="], n, [0])
    counts = torch.bincount(out.input_ids[:, -1], minlength=len(tokenizer)).double()
    with torch.no_grad():
        logits = model(input_ids=encode_prompts(tokenizer, ["3+4="], None)[0]).logits[0, -1].double() / T
    probs = logits.softmax(-1)
    if "top_k" in options:
        probs = torch.where(logits >= logits.topk(options["top_k"]).values[-1], probs, 0.0)
    if "top_p" in options:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered
        probs = torch.zeros_like(probs).scatter(0, order, torch.where(before < options["top_p"], ordered, 0.0))
    expected = n * probs / probs.sum()
    assert (counts[expected == 0] == 0).all()  # filtered tokens never drawn
    kept = expected > 0
    assert kept.sum() >= 3
    statistic = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert statistic < chi_square_bound(int(kept.sum()) - 1)
    # The test has power: the unfiltered model at temperature 1 is rejected.
    wrong = n * (logits * T).softmax(-1)[kept] / (logits * T).softmax(-1)[kept].sum()
    assert ((counts[kept] - wrong) ** 2 / wrong).sum().item() > chi_square_bound(int(kept.sum()) - 1)


def test_bad_settings_are_value_errors(model, tokenizer):
    with pytest.raises(ValueError, match="compile_generation needs a CUDA device"):
        Sampler(model, tokenizer, EngineSettings.of(GRPOConfig(generator="sampler", compile_generation=True)))
    with pytest.raises(ValueError, match="compile_generation needs generator='sampler'"):
        GRPOConfig.from_dict(dict(compile_generation=True, generator="hf"))
    with pytest.raises(ValueError, match="keys must give one key per prompt"):
        sampler(model, tokenizer).generate(["1+1="], 2, [0, 1])
    unpadded = copy.deepcopy(tokenizer)
    unpadded.pad_token = None
    with pytest.raises(ValueError, match="needs a pad token"):
        sampler(model, unpadded).generate(["1+1="], 2, [0])
