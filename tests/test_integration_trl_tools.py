"""grpo_fast.integrations.trl.GRPOTrainer with tools: TRL 1.16's own tool loop, our fused loss.

TRL's ``GRPOTrainer(tools=[...])`` parses each completion with the tokenizer's
``response_template`` (transformers >= 5.13), runs the tool calls, appends the chat template's
tool-result turn to the completion and generates on; its ``tool_mask`` marks the model's tokens
1 and the tool results' tokens 0, and ``_compute_loss`` takes ``completion_mask * tool_mask`` as
the loss mask. Everything here is built locally: tests/_hermes.py's tokenizer (a token a byte)
with its Hermes-style chat template (the tools' schemas in a system turn, ``<tool_call>`` JSON,
results as ``<tool_response>`` blocks of a user turn) and response template, the tiny Llama of
the arithmetic task, one typed tool. A random tiny model never writes a tool call, so
generation is scripted (``_generate_single_turn`` replaced, the same in both trainers): per
group, one correct call, one call with other arguments, one direct answer, one call of a tool
that does not exist (a failure). The rest of the path is TRL's: the parsing, the tool
execution, the tool-result tokens, ``tool_mask``, the rewards, the metrics.
"""

import warnings

import pytest
import torch
from _hermes import RESPONSE_TEMPLATE, make_tokenizer
from conftest import max_err, rel_err

trl = pytest.importorskip("trl", reason="TRL is in the [test] extra: pip install -e '.[test]'")
datasets = pytest.importorskip("datasets")
chat_template_utils = pytest.importorskip("trl.chat_template_utils")
from _trl import make_trainer as make_trl_trainer  # noqa: E402

if not chat_template_utils._SUPPORTS_RESPONSE_TEMPLATE:
    pytest.skip("TRL's tool loop with a response_template needs transformers >= 5.13", allow_module_level=True)

from grpo_fast.integrations.trl import GRPOTrainer  # noqa: E402
from grpo_fast.tasks.arithmetic import build_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

G = 4  # completions per prompt, and the batch (one prompt per step)
MAX_COMPLETION = 160
# The scripted first turns of a group: a correct call, a call with other arguments, a direct
# answer, a call of a tool that does not exist (TRL answers it with an error, a failure).
FIRST_TURNS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 4}}\n</tool_call><|im_end|>',
    "5<|im_end|>",
    '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
)


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def final_answer_reward(prompts, completions, answer, **columns):
    """1 when the last assistant message is the answer."""
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = make_tokenizer()
    tokenizer.response_template = RESPONSE_TEMPLATE  # what TRL's loop parses the completions by
    folder = str(tmp_path_factory.mktemp("trl_tools") / "model")
    build_model(tokenizer, seed=0, max_position_embeddings=640).save_pretrained(folder)
    rows = [{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}] * 16
    return tokenizer, folder, datasets.Dataset.from_list(rows)


def scripted_generation(trainer):
    """Replaces the model's sampling in TRL's ``_generate_single_turn`` (first turns by the
    row's place in its group; after a tool result, the result itself, or 9 after an error)."""
    tokenizer = trainer.processing_class

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        texts = []
        for i, ids in enumerate(prompt_ids):
            prompt = tokenizer.decode(ids)
            if "<tool_response>" not in prompt:
                texts.append(FIRST_TURNS[i % G])
            else:
                result = prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
                texts.append((result if result.isdigit() else "9") + "<|im_end|>")
        return [tokenizer.encode(text, add_special_tokens=False) for text in texts], None

    trainer._generate_single_turn = generate


class Adder:
    """A TRL ``environment_factory`` class, as TRL's docs write them: ``reset(**row)``, a tool
    method bound to its episode, state that a reward function reads (``environments=``)."""

    def reset(self, **row) -> str | None:
        self.calls = 0
        return None

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b


def called_once_reward(prompts, completions, environments, answer, **columns):
    """1 for a completion whose episode called add once and answered right."""
    return [float(e.calls == 1 and c[-1]["content"].strip() == a) for c, e, a in zip(completions, environments, answer)]


def make_trainer(cls, setup, environment: bool = False, **options):
    """test_integration_trl's trainer with the tool ``add`` (or the environment ``Adder``, whose
    method it is), its tokenizer's template and scripted turns."""
    options = {
        "per_device_train_batch_size": G,
        "num_generations": G,
        "max_completion_length": MAX_COMPLETION,
        **options,
    }
    tools = dict(environment_factory=Adder, reward_funcs=called_once_reward) if environment else dict(tools=[add])
    trainer = make_trl_trainer(
        cls, setup, **{"reward_funcs": final_answer_reward, **tools}, max_tool_calling_iterations=2, **options
    )
    scripted_generation(trainer)
    return trainer


@pytest.fixture(scope="module")
def trainers(setup):
    """(stock, ours), beta 0.04 (a reference model), gradient accumulation (TRL's normalisers);
    loss options are set per test."""
    options = dict(beta=0.04, gradient_accumulation_steps=2, steps_per_generation=4)
    return tuple(make_trainer(cls, setup, **options) for cls in (trl.GRPOTrainer, GRPOTrainer))


@pytest.fixture(scope="module")
def tool_batch(trainers, setup):
    """One batch from TRL's own tool loop (stock trainer), then made harder: old and reference
    log-probs off the policy's, advantages of both signs, a vLLM importance-sampling ratio."""
    stock = trainers[0]
    with torch.no_grad():
        batch = stock._generate_and_score_completions([setup[2][i] for i in range(G)])
    assert stock._metrics["train"]["tools/call_frequency"] == [0.75]  # three calls in four completions
    assert stock._metrics["train"]["tools/failure_frequency"] == [pytest.approx(1 / 3)]  # "mul" does not exist
    tool_mask, completion_mask = batch["tool_mask"], batch["completion_mask"]
    tool_tokens = ((tool_mask == 0) & (completion_mask == 1)).sum(1).tolist()
    # the tool-result turns, a token a byte but for the markers: 54 for "\n<|im_start|>user\n<tool_response>
    # \n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 85 for mul's error
    assert tool_tokens == [54, 54, 0, 85]
    assert int(batch["num_items_in_batch"]) == int((tool_mask * completion_mask).sum())  # TRL's count skips them
    g = torch.Generator().manual_seed(0)
    B, T = batch["completion_ids"].shape
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], completion_mask], 1)
    with torch.no_grad():
        logp = trl.GRPOTrainer._get_per_token_logps_and_entropies(stock, stock.model, ids, mask, T)[0]
    batch["old_per_token_logps"] = logp + 0.3 * torch.randn(B, T, generator=g)
    batch["ref_per_token_logps"] = logp + 0.2 * torch.randn(B, T, generator=g)
    batch["advantages"] = torch.tensor([1.2, -0.7, 0.4, -1.1])
    batch["importance_sampling_ratio"] = torch.exp(0.2 * torch.randn(B, T, generator=g))
    return batch


def use_loss_options(trainer, **options):
    for name, value in options.items():
        setattr(trainer.args, name, value)
        setattr(trainer, name, value)
    trainer._metrics["train"].clear()


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def assert_close(loss, grads, our_loss, our_grads, tol=1e-5):
    assert torch.isfinite(our_loss)
    # 1e-7: float32 rounding of per-token terms of size ~1, where the loss nearly cancels (gspo: 1.1e-3)
    assert abs(float(our_loss - loss)) <= tol * abs(float(loss)) + 1e-7, (float(our_loss), float(loss))
    for name, grad in grads.items():
        assert rel_err(our_grads[name], grad) < tol and max_err(our_grads[name], grad) < tol, name


CASES = {
    "grpo": dict(loss_type="grpo", importance_sampling_level="token"),
    "dapo": dict(loss_type="dapo", importance_sampling_level="token"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo-vllm-is-entropy-quantile": dict(
        loss_type="dapo",
        importance_sampling_level="token",
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        top_entropy_quantile=0.5,
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_tool_batch_loss_matches_trl(trainers, tool_batch, case):
    """On TRL's tool batch, beta 0.04: the same loss, gradients and metrics as stock TRL, and
    nothing defers to TRL's path."""
    stock, ours = trainers
    for trainer in trainers:
        use_loss_options(trainer, use_vllm=False, vllm_importance_sampling_correction=False, top_entropy_quantile=1.0)
        use_loss_options(trainer, **CASES[case])
    loss, grads = loss_and_grads(stock, tool_batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        our_loss, our_grads = loss_and_grads(ours, tool_batch)
    assert_close(loss, grads, our_loss, our_grads)
    assert dict(ours._metrics["train"]).keys() == dict(stock._metrics["train"]).keys() != set()
    for key, values in stock._metrics["train"].items():
        assert ours._metrics["train"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    # the mask matters: without tool_mask the same batch gives another loss
    without = {k: v for k, v in tool_batch.items() if k != "tool_mask"}
    with torch.no_grad():
        assert abs(float(ours.compute_loss(ours.model, without) - our_loss)) > 1e-4 * abs(float(our_loss))


@pytest.mark.parametrize("case", ["grpo", "dapo", "gspo"])
def test_tool_tokens_are_out_of_the_loss(trainers, tool_batch, case):
    """A tool token's target, old and reference log-probs and importance-sampling ratio change
    neither the loss nor the gradients. The batch ends at the last tool token of row 0 (so its
    id is an input to nothing after it) and that token's id is replaced."""
    ours = trainers[1]
    use_loss_options(ours, use_vllm=True, vllm_importance_sampling_correction=True, top_entropy_quantile=1.0)
    use_loss_options(ours, **CASES[case])
    tool = (tool_batch["tool_mask"][0] == 0) & (tool_batch["completion_mask"][0] == 1)
    end = int(tool.nonzero().max()) + 1
    cut = {
        k: v[:, :end] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == tool.shape[0] else v
        for k, v in tool_batch.items()
    }
    loss, grads = loss_and_grads(ours, cut)
    changed = {k: v.clone() if torch.is_tensor(v) else v for k, v in cut.items()}
    tool_tokens = (changed["tool_mask"] == 0) & (changed["completion_mask"] == 1)
    changed["completion_ids"][0, end - 1] = (changed["completion_ids"][0, end - 1] + 7) % ours.model.config.vocab_size
    for key, value in (
        ("old_per_token_logps", -9.0),
        ("ref_per_token_logps", 3.0),
        ("importance_sampling_ratio", 50.0),
    ):
        changed[key] = torch.where(tool_tokens, torch.full_like(changed[key], value), changed[key])
    our_loss, our_grads = loss_and_grads(ours, changed)
    assert_close(loss, grads, our_loss, our_grads, tol=1e-6)


@pytest.mark.slow
def test_train_steps_with_tools_match_trl(setup):
    """Two ``train()`` steps through TRL's tool loop, grpo and dapo-style normalisation by
    TRL's tool-free token count, beta 0.04: the same parameters and logs as stock TRL,
    ``tools/call_frequency`` and ``tools/failure_frequency`` logged."""
    options = dict(max_steps=2, learning_rate=1e-2, seed=7, beta=0.04, loss_type="dapo")
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = make_trainer(cls, setup, **options)
        trainer.train()
        runs.append(trainer)
    stock, ours = runs
    assert not ours._grpo_fast_warned
    # Adam at lr 1e-2 moves the tiny weights by ~60% in two steps and turns float noise in
    # near-zero gradients into whole steps, so the updates are compared (measured: <= 4e-5)
    start, stock_params = make_trainer(trl.GRPOTrainer, setup).model, dict(stock.model.named_parameters())
    for name, p in ours.model.named_parameters():
        p0 = start.get_parameter(name)
        assert rel_err(p - p0, stock_params[name] - p0) < 1e-4, name
    assert max(rel_err(p, start.get_parameter(name)) for name, p in stock_params.items()) > 0.1  # it trained
    logs, our_logs = stock.state.log_history[:-1], ours.state.log_history[:-1]
    assert len(logs) == len(our_logs) == 2
    for log, our_log in zip(logs, our_logs):
        assert our_log["tools/call_frequency"] == log["tools/call_frequency"] == 0.75
        assert our_log["tools/failure_frequency"] == pytest.approx(1 / 3)
        for key in ("loss", "reward", "entropy", "kl", "clip_ratio/region_mean", "completions/mean_length"):
            assert our_log[key] == pytest.approx(log[key], rel=1e-4, abs=1e-6), key


def test_an_environment_factory_trains_as_in_trl(setup):
    """TRL's ``environment_factory`` passed through our drop-in to TRL, unchanged: one
    ``train()`` step, the same loss, rewards (read from the episodes' instances) and tool
    metrics as stock TRL (our trainer runs the same class: test_environments.py)."""
    options = dict(max_steps=1, learning_rate=1e-2, seed=7, beta=0.04, loss_type="dapo")
    logs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = make_trainer(cls, setup, environment=True, **options)
        trainer.train()
        logs.append(trainer.state.log_history[0])
    stock, ours = logs
    assert stock["rewards/called_once_reward/mean"] == 0.25  # one completion of four calls add with 2 and 3
    for key in ("loss", "reward", "tools/call_frequency", "tools/failure_frequency", "entropy", "kl"):
        assert ours[key] == pytest.approx(stock[key], rel=1e-4, abs=1e-6), key
