"""grpo_fast.integrations.trl.GRPOTrainer against TRL 1.16's own GRPOTrainer, side by side.

Both trainers load the same tiny Llama from one folder, get the same batch, and must agree on
the loss (1e-5 relative), every parameter's gradient and every logged metric; then on the
parameters and metrics after three ``train()`` steps from the same seed, in one process and in
two (torchrun); with LoRA; and on the advantages of completions no reward function scored.
The batch is built by hand so that every regime shows up: ratios off 1 (old log-probs
perturbed, both clip sides), advantages of both signs, a left-padded prompt, right-padded and
one empty completion.
"""

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import max_err, rel_err

trl = pytest.importorskip("trl", reason="TRL is in the [test] extra: pip install -e '.[test]'")
datasets = pytest.importorskip("datasets")

from _trl import B, T, make_trainer  # noqa: E402

from grpo_fast import group_advantages  # noqa: E402
from grpo_fast.integrations.trl import GRPOTrainer  # noqa: E402
from grpo_fast.tasks.arithmetic import build_dataset, build_model, build_tokenizer  # noqa: E402

# TRL 1.16 reads transformers' deprecated is_gradient_checkpointing around its generation;
# that call is TRL's, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
P = 3
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"]
# Every GRPOConfig field that touches the loss, away from its default (delta above
# 1 + epsilon_high: TRL's high clip ratio is then the one grpo_fast logs, docs/design.md).
CUSTOM = dict(
    epsilon=0.15,
    epsilon_high=0.28,
    delta=1.5,
    use_bias_correction_kl=False,
    temperature=0.7,
    top_entropy_quantile=0.5,
    sapo_temperature_pos=0.9,
    sapo_temperature_neg=1.2,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, model folder, dataset): TRL builds its reference model from the policy's path."""
    tokenizer = build_tokenizer(vocab_size=40)
    folder = str(tmp_path_factory.mktemp("trl") / "model")
    build_model(tokenizer, seed=0).save_pretrained(folder)
    return tokenizer, folder, datasets.Dataset.from_list(build_dataset(num_rows=64, seed=0))


def make_batch(trainer, beta: float, seed: int = 0, shared: bool = False) -> dict:
    """``shared``: rows 0 and 2 have one prompt, rows 1 and 3 another (a shuffled batch's groups)."""
    g = torch.Generator().manual_seed(seed)
    V = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, 0] = 0
    if shared:
        prompt_ids, prompt_mask = prompt_ids[[0, 1, 0, 1]], prompt_mask[[0, 1, 0, 1]]
    completion_ids = torch.randint(3, V, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[2, :] = 0
    with torch.no_grad():
        logp = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer,
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            T,
        )[0]
    batch = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=g) + 0.3,
        old_per_token_logps=logp + 0.3 * torch.randn(B, T, generator=g),
        num_items_in_batch=completion_mask.sum() * 2,
        importance_sampling_ratio=torch.exp(0.2 * torch.randn(B, T, generator=g)),
    )
    if beta:
        batch["ref_per_token_logps"] = logp + 0.2 * torch.randn(B, T, generator=g)
    return batch


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def assert_same_step(stock, ours, batch):
    loss, grads = loss_and_grads(stock, batch)
    our_loss, our_grads = loss_and_grads(ours, batch)
    assert torch.isfinite(our_loss)
    assert abs(float(our_loss - loss)) <= 1e-5 * abs(float(loss)), (float(our_loss), float(loss))
    for name, grad in grads.items():
        assert rel_err(our_grads[name], grad) < 1e-5 and max_err(our_grads[name], grad) < 1e-5, name
    assert dict(ours._metrics["train"]).keys() == dict(stock._metrics["train"]).keys() != set()
    for key, values in stock._metrics["train"].items():
        assert ours._metrics["train"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module", params=[False, True], ids=["trl-defaults", "custom"])
def trainers(request, setup):
    """(stock, ours) for one GRPOConfig, built once for every loss type, level and beta: TRL
    reads those three at loss time (set by :func:`use_loss_options`), grpo_fast's constructor
    reads none of them, and beta 0.04 builds the reference model that beta 0 does without."""
    options = dict(CUSTOM, gradient_accumulation_steps=2, steps_per_generation=4) if request.param else {}
    pair = tuple(make_trainer(cls, setup, beta=0.04, **options) for cls in (trl.GRPOTrainer, GRPOTrainer))
    if request.param:  # the vLLM importance-sampling correction (TRL reads these two at loss time)
        for trainer in pair:
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    return pair


def use_loss_options(trainer, **options):
    """Sets GRPOConfig fields on the config and on the copies TRL's constructor keeps
    (``trainer.loss_type``, ...), and forgets the metrics of earlier steps."""
    for name, value in options.items():
        setattr(trainer.args, name, value)
        setattr(trainer, name, value)
    trainer._metrics["train"].clear()


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_compute_loss_matches_trl(trainers, loss_type, level, beta):
    stock, ours = trainers
    for trainer in trainers:
        use_loss_options(trainer, loss_type=loss_type, importance_sampling_level=level, beta=beta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing defers to TRL's path
        assert_same_step(stock, ours, make_batch(stock, beta))


def test_sequence_level_importance_ratio_and_tool_mask(setup):
    """A per-sequence vLLM ratio [B, 1] and a tool mask, on the default loss type."""
    stock, ours = make_trainer(trl.GRPOTrainer, setup, beta=0.04), make_trainer(GRPOTrainer, setup, beta=0.04)
    for trainer in (stock, ours):
        trainer.use_vllm = True
    batch = make_batch(stock, 0.04, seed=1)
    batch["importance_sampling_ratio"] = batch["importance_sampling_ratio"][:, :1]
    batch["tool_mask"] = torch.ones(B, T, dtype=torch.long)
    batch["tool_mask"][0, 1:3] = 0
    assert_same_step(stock, ours, batch)


def test_shared_prompts_match_trl(setup):
    """Rows that repeat a prompt (a shuffled batch's groups) go through the backbone with each
    prompt once; the loss, every gradient, the metrics and the log-prob passes stay stock
    TRL's, with a tool mask and the vLLM ratio, and the unshared drop-in's."""
    stock = make_trainer(trl.GRPOTrainer, setup, beta=0.04, **CUSTOM)
    ours = make_trainer(GRPOTrainer, setup, beta=0.04, **CUSTOM)
    for trainer in (stock, ours):
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    batch = make_batch(stock, 0.04, seed=6, shared=True)
    batch["tool_mask"] = torch.ones(B, T, dtype=torch.long)
    batch["tool_mask"][2, 1:3] = 0
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    packed = ours._backbone_inputs(ids, mask, T)["grpo_fast_pack"]  # shared: two prompts of four rows
    assert packed.input_ids.shape[1] == mask.sum() - mask[[2, 3], :P].sum()
    assert_same_step(stock, ours, batch)
    active = batch["completion_mask"].bool()
    with torch.no_grad():
        for which, entropy in (("model", True), ("ref_model", False)):  # TRL's reference head has no entropy
            want = stock._get_per_token_logps_and_entropies(getattr(stock, which), ids, mask, T, 4, entropy)
            got = ours._get_per_token_logps_and_entropies(getattr(ours, which), ids, mask, T, 4, entropy)
            for a, b in zip(got[: 1 + entropy], want[: 1 + entropy]):
                assert rel_err(a[active], b[active]) < 1e-6, which
    unshared = make_trainer(GRPOTrainer, setup, beta=0.04, ours={"shared_prefix": False}, **CUSTOM)
    assert not unshared.shared_prefix and "input_ids" in unshared._backbone_inputs(ids, mask, T)
    with pytest.raises(TypeError, match="shared_prefix must be a bool"):
        make_trainer(GRPOTrainer, setup, ours={"shared_prefix": "yes"})


def test_lora_matches_trl(setup):
    """A LoRA policy: the head is found under the adapter, the frozen LM head gets no gradient,
    and the reference is the policy with its adapter disabled."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    stock = make_trainer(trl.GRPOTrainer, setup, peft_config=lora, beta=0.04)
    ours = make_trainer(GRPOTrainer, setup, peft_config=lora, beta=0.04)
    ours.model.load_state_dict(stock.model.state_dict())  # the adapters start random
    assert_same_step(stock, ours, make_batch(stock, 0.04, seed=5))


def test_eval_loss_matches_trl(setup):
    stock, ours = make_trainer(trl.GRPOTrainer, setup, beta=0.04), make_trainer(GRPOTrainer, setup, beta=0.04)
    batch = make_batch(stock, 0.04, seed=2)
    for trainer in (stock, ours):
        trainer.model.eval()
    with torch.no_grad():
        assert float(ours.compute_loss(ours.model, batch)) == pytest.approx(
            float(stock.compute_loss(stock.model, batch)), rel=1e-5
        )


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(loss_type="vespo"), "loss_type='vespo'"),
        (dict(entropy_coef=0.01), "the entropy bonus"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(delta=0.9), "an option grpo_fast rejects"),
    ],
    ids=["vespo", "entropy-bonus", "off-policy-mask", "delta-below-1"],
)
def test_unsupported_options_defer_to_trl_and_warn_once(setup, options, reason):
    stock, ours = make_trainer(trl.GRPOTrainer, setup, **options), make_trainer(GRPOTrainer, setup, **options)
    batch = make_batch(stock, 0.0, seed=3)
    with pytest.warns(UserWarning, match=reason):
        loss_and_grads(ours, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        ours._metrics["train"].clear()
        assert_same_step(stock, ours, batch)


@pytest.mark.parametrize("which", ["model", "ref_model"])
def test_logprob_passes_match_trl(setup, which):
    """The no-grad log-prob passes (old policy with entropies, reference), in batches of 3."""
    stock, ours = make_trainer(trl.GRPOTrainer, setup, beta=0.04), make_trainer(GRPOTrainer, setup, beta=0.04)
    batch = make_batch(stock, 0.0, seed=4)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    entropy = which == "model"  # TRL's fused head of the reference model has no entropy output
    with torch.no_grad():
        logp, ent, _ = stock._get_per_token_logps_and_entropies(getattr(stock, which), ids, mask, T, 3, entropy)
        our_logp, our_ent, _ = ours._get_per_token_logps_and_entropies(getattr(ours, which), ids, mask, T, 3, entropy)
    active = batch["completion_mask"].bool()  # TRL stores 0 on padding, we keep the model's value
    assert rel_err(our_logp[active], logp[active]) < 1e-6
    assert (our_ent is None) == (ent is None)
    if entropy:
        assert rel_err(our_ent[active], ent[active]) < 1e-6


def trained(cls, setup, **options):
    trainer = make_trainer(cls, setup, max_steps=3, learning_rate=1e-2, seed=7, **options)
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["whole-rows", "shared-prompts"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(
            loss_type="grpo",
            importance_sampling_level="sequence",
            beta=0.04,
            gradient_accumulation_steps=2,
            steps_per_generation=1,
            num_iterations=2,
        ),
    ],
    ids=["trl-defaults", "gspo-kl-accumulation-iterations"],
)
def test_three_train_steps_match_trl(setup, options, shared, request):
    """Same seed, same generations, same updates: equal parameters and logs after three steps
    (the second case accumulates gradients and reuses each generation for two updates, so the
    old-policy log-probs come from our no-grad pass). Each micro-batch is one prompt's group, so
    with ``shared`` the backbone runs each prompt once; those runs are in float64, where they
    also equal our whole-row run to 1e-10: in float32 a prompt's gradient, summed once over its
    group instead of row by row, rounds differently, and Adam's normalised steps carry that to
    1.4e-5 in three steps on the second case (the whole-row runs: 3e-6)."""
    if shared:
        request.getfixturevalue("float64_norms")
        options = dict(options, model_init_kwargs={"dtype": torch.float64})
    stock = trained(trl.GRPOTrainer, setup, **options)
    ours = trained(GRPOTrainer, setup, ours={"shared_prefix": shared}, **options)
    assert not ours._grpo_fast_warned  # nothing deferred to TRL's path
    stock_params, start = dict(stock.model.named_parameters()), make_trainer(trl.GRPOTrainer, setup).model
    for name, p in ours.model.named_parameters():
        assert rel_err(p, stock_params[name]) < 1e-5, name
    assert max(rel_err(p, start.get_parameter(name).to(p.dtype)) for name, p in stock_params.items()) > 1e-3
    logs, our_logs = stock.state.log_history, ours.state.log_history
    assert len(our_logs) == len(logs) == 4  # three steps and the summary
    for log, our_log in zip(logs[:-1], our_logs[:-1]):
        for key in ("loss", "reward", "entropy", "clip_ratio/region_mean", "kl", "completions/mean_length"):
            if key in log:
                assert our_log[key] == pytest.approx(log[key], rel=1e-4, abs=1e-6), key
    if shared:
        assert next(ours.model.parameters()).dtype == torch.float64
        whole = dict(trained(GRPOTrainer, setup, ours={"shared_prefix": False}, **options).model.named_parameters())
        for name, p in ours.model.named_parameters():
            assert rel_err(p, whole[name]) < 1e-10, name


# Two processes (torchrun, gloo): stock TRL then ours, the same seed, two steps each.
TWO_PROCESSES = """
import json, sys, tempfile, warnings
import datasets, trl
from grpo_fast.integrations.trl import GRPOTrainer
from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_tokenizer
warnings.simplefilter("ignore")
runs = {}
for name, cls in (("stock", trl.GRPOTrainer), ("ours", GRPOTrainer)):
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", seed=7,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.04,
                          max_steps=2, learning_rate=1e-2, save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = cls(model=sys.argv[1], reward_funcs=arithmetic_reward, args=args, processing_class=build_tokenizer(40),
                  train_dataset=datasets.Dataset.from_list(build_dataset(num_rows=64, seed=0)))
    trainer.train()
    runs[name] = dict(processes=trainer.accelerator.num_processes, logs=trainer.state.log_history[:-1],
                      params={n: p.detach().flatten().tolist() for n, p in trainer.model.named_parameters()},
                      deferred=sorted(getattr(trainer, "_grpo_fast_warned", ())))
if trainer.accelerator.is_main_process:
    json.dump(runs, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_two_process_training_matches_trl(setup, tmp_path):
    """TRL's accelerate multi-process training (two CPU processes, gloo), unchanged: the loss runs
    through the DDP-wrapped model's forward, the metrics are gathered and reduced across ranks."""
    script, result = tmp_path / "train.py", tmp_path / "runs.json"
    script.write_text(TWO_PROCESSES)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        setup[1],
        str(result),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(result.read_text())
    stock, ours = runs["stock"], runs["ours"]
    assert ours["processes"] == stock["processes"] == 2 and not ours["deferred"]
    for name, values in stock["params"].items():
        assert rel_err(torch.tensor(ours["params"][name]), torch.tensor(values)) < 1e-5, name
    assert len(ours["logs"]) == len(stock["logs"]) == 2
    for log, our_log in zip(stock["logs"], ours["logs"]):
        for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_min", "reward"):
            assert our_log[key] == pytest.approx(log[key], rel=1e-4, abs=1e-6), key


def scored_every_other(prompts, completions, **columns):
    """Scores some completions (by length), leaves every third unscored."""
    return [None if i % 3 == 0 else float(len(c) % 4) for i, c in enumerate(completions)]


def scored_odd(prompts, completions, **columns):
    return [None if i % 2 == 0 else float("7" in c) for i, c in enumerate(completions)]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_with_unscored_completions_match_trl(setup, scale):
    """Completions no reward function scored (rows 0 and 6 of each 12) are left out of the group
    statistics and get advantage 0, in TRL and in grpo_fast.group_advantages alike."""
    trainer = make_trainer(
        GRPOTrainer,
        setup,
        reward_funcs=[scored_every_other, scored_odd],
        reward_weights=[1.0, 0.5],
        scale_rewards=scale,
        per_device_train_batch_size=12,
    )
    seen = {}
    calculate = trainer._calculate_rewards

    def recording(*args):
        seen["rewards"] = calculate(*args)
        return seen["rewards"]

    trainer._calculate_rewards = recording
    rows = [trainer.train_dataset[i // 4] for i in range(12)]
    with torch.no_grad():
        inputs = trainer._generate_and_score_completions(rows)
    rewards = seen["rewards"]
    unscored = torch.isnan(rewards).all(dim=1)
    assert unscored.any() and not unscored.all()
    ours = group_advantages(rewards, 4, scale=scale, reward_weights=[1.0, 0.5]).advantages
    assert torch.equal(inputs["advantages"][unscored], torch.zeros(int(unscored.sum())))
    assert torch.allclose(ours, inputs["advantages"], rtol=1e-5, atol=1e-6)
    assert not math.isnan(float(ours.sum()))
