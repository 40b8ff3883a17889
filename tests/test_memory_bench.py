"""The memory benchmark: the tiny preset end to end (JSON with every key, PNG), and clear errors."""

import contextlib
import io
import json

import pytest

from grpo_fast.bench import memory

RESULT_KEYS = (
    "peak_bytes",
    "first_step_peak_bytes",
    "step_s",
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "logits_bytes",
    "rest_bytes",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset through the CLI, every configuration, run once for the tests below:
    (exit code, stdout, stderr, JSON path, plot path)."""
    folder = tmp_path_factory.mktemp("memory")
    json_path, plot_path = folder / "memory.json", folder / "memory.png"
    argv = ["--preset", "tiny", "--repeats", "1", "--jobs", "4", "--json", str(json_path), "--plot", str(plot_path)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memory.main(argv)
    return code, out.getvalue(), err.getvalue(), json_path, plot_path


@pytest.mark.slow
def test_tiny_preset_writes_every_key(tiny):
    code, table, err, json_path, plot_path = tiny
    assert code == 0, err
    results = json.loads(json_path.read_text())
    for name in memory.CONFIGS:
        assert "error" not in results[name], results[name]
        for key in RESULT_KEYS:
            assert key in results[name], (name, key)
        assert results[name]["peak_bytes"] >= results[name]["first_step_peak_bytes"] > 0
        assert results[name]["step_s"] > 0
    ppo, fused = results["ppo"], results["grpo_fused"]
    # The states are exact: the critic is the policy's decoder plus a [1, H] head; AdamW holds
    # two fp32 moments per trainable parameter; fused-linear never makes the logits tensor.
    H, V = memory.PRESETS["tiny"]["model"]["hidden_size"], memory.PRESETS["tiny"]["model"]["vocab_size"]
    assert fused["params_bytes"] == 4 * fused["num_params"] > 4 * V * H  # fp32, tied embedding counted once
    assert ppo["params_bytes"] == 2 * fused["params_bytes"] + 4 * (H + 1)
    for res in results.values():
        if "optimizer_bytes" in res:
            assert res["optimizer_bytes"] >= 2 * res["grads_bytes"]  # exp_avg, exp_avg_sq (+ step counters)
    assert results["grpo_fused_linear"]["logits_bytes"] == 0
    assert results["meta"]["settings"]["preset"] == "tiny"
    assert set(results["meta"]["ratios"]) >= {"grpo_fused/ppo", "grpo_fused/grpo_eager"}
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| config | peak MB |" in table and "grpo_fused_linear" in table


def test_unknown_preset_is_a_clear_error(capsys):
    with pytest.raises(
        ValueError, match=r"unknown preset 'huge'; choose one of \['100m', '1b', 'qwen2.5-0.5b', 'tiny'\]"
    ):
        memory.run_memory_benchmark(preset="huge")
    assert memory.main(["--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    from grpo_fast import cli

    assert cli.main(["bench", "memory", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err


def test_model_path_that_is_not_a_causal_lm(tmp_path):
    from transformers import BertConfig, ViTConfig

    with pytest.raises(ValueError, match="is not a model folder with a config.json"):
        memory.run_memory_benchmark(preset="tiny", model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a model folder with a config.json"):
        memory.run_memory_benchmark(preset="tiny", model=str(tmp_path))
    masked_lm = tmp_path / "bert"
    BertConfig(architectures=["BertForMaskedLM"]).save_pretrained(masked_lm)
    with pytest.raises(
        ValueError, match=r"is not a causal LM \(model_type 'bert', architectures \['BertForMaskedLM'\]"
    ):
        memory.run_memory_benchmark(preset="tiny", model=str(masked_lm))
    vision = tmp_path / "vit"
    ViTConfig().save_pretrained(vision)
    with pytest.raises(ValueError, match=r"is not a causal LM \(model_type 'vit'"):
        memory.run_memory_benchmark(preset="tiny", model=str(vision))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_report_each_rank(tmp_path, parallel, tiny):
    """--nproc 2 runs the worker under torchrun: one result per rank, the peak is the larger;
    DDP ranks hold whole replicas, FSDP2 ranks shards that add up to one replica (the one-process
    run of the same configuration is the tiny preset's)."""
    one = json.loads(tiny[3].read_text())["grpo_fused"]
    two = memory.run_memory_benchmark(
        preset="tiny", configs=["grpo_fused"], repeats=1, nproc=2, parallel=parallel, json_path=str(tmp_path / "m.json")
    )
    assert json.loads((tmp_path / "m.json").read_text())["meta"]["settings"]["nproc"] == 2
    res = two["grpo_fused"]
    assert "error" not in res, res
    ranks = res["ranks"]
    assert len(ranks) == 2 and res["peak_bytes"] == max(r["peak_bytes"] for r in ranks) > 0
    counters = one["optimizer_bytes"] - 2 * one["grads_bytes"]  # AdamW's step counters, beside the moments
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        held = [r[key] for r in ranks]
        if parallel == "ddp":
            assert held == [one[key], one[key]], key
        else:  # every rank keeps its own step counters
            assert sum(held) == one[key] + (counters if key == "optimizer_bytes" else 0), key
            assert max(held) < one[key], key
    # each rank's forward holds half the rows' logits
    assert [r["logits_bytes"] for r in ranks] == [one["logits_bytes"] // 2] * 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch=6), r"batch=6 must be divisible by group_size=4"),
        (dict(batch=0), r"batch must be an int >= 1"),
        (dict(micro_batch=9), r"micro_batch must be in \[1, batch=8\]"),
        (dict(configs=["ppo", "dpo"]), r"unknown configs \['dpo'\]"),
        (dict(repeats=0), r"repeats must be >= 1"),
        (dict(jobs=0), r"jobs must be >= 1"),
        (dict(nproc=0), r"nproc must be an int >= 1, got 0"),
        (dict(nproc=2, configs=["ppo", "grpo_fused"]), r"the PPO baseline runs in one process"),
        (dict(nproc=4), r"batch=8 holds 2 groups of 4, which must be divisible by nproc=4"),
        (dict(nproc=2, parallel="zero3"), r"parallel must be one of \('ddp', 'fsdp'\), got 'zero3'"),
    ],
    ids=[
        "batch-not-divisible",
        "batch-zero",
        "micro-batch-too-big",
        "unknown-config",
        "no-repeats",
        "no-jobs",
        "no-processes",
        "ppo-on-many-processes",
        "groups-not-divisible",
        "unknown-parallel",
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory.run_memory_benchmark(preset="tiny", **kwargs)


def worker_spec(model_path: str, config: str, beta: float = 0.0) -> dict:
    """What the driver hands the worker: the tiny preset's batch with ``model_path`` as the model."""
    settings = dict(memory.preset_settings("tiny"), model_path=model_path, preset="tiny", group_size=4, beta=beta)
    return dict(settings, repeats=1, jobs=1, device="cpu", config=config)


def test_worker_trains_a_saved_model(tmp_path):
    # --model PATH: a causal LM saved with save_pretrained runs through the PPO worker (in this process).
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    memory.check_causal_lm(str(tmp_path / "llama"))
    result = memory.worker(worker_spec(str(tmp_path / "llama"), "ppo", beta=0.1))
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    decoder = params - 50 * 16  # the critic copies the decoder, not the untied LM head
    # held: policy, its frozen reference (beta > 0) and the critic (decoder + [1, 16] head + bias)
    assert result["params_bytes"] == 4 * (2 * params + decoder + 17)
    assert result["grads_bytes"] == 4 * (params + decoder + 17)
    assert result["num_params"] == params and result["step_s"] > 0


def test_fused_sweep_compiles_only_where_it_repays_its_resident_cost(monkeypatch):
    """The CPU sweep's route at each preset's micro-batch logits (completion tokens x V): the
    100m preset's 6M logits run as eager chunks (compiled, the kernels' resident ~75 MiB put
    grpo_fused above grpo_eager), the Qwen-shaped preset's 156M compile; GRPO_FAST_CPU_COMPILE forces one."""
    import torch

    from grpo_fast.ops._backend import cpu_compile

    monkeypatch.delenv("GRPO_FAST_CPU_COMPILE", raising=False)

    def logits(preset):  # the largest [tokens, V] one forward scores, without allocating it
        settings = memory.PRESETS[preset]
        rows = settings["micro_batch"] or settings["batch"]
        return torch.empty(()).expand(rows * settings["completion_length"], settings["model"]["vocab_size"])

    assert [cpu_compile(logits(p)) for p in ("tiny", "100m", "qwen2.5-0.5b")] == [False, False, True]
    monkeypatch.setenv("GRPO_FAST_CPU_COMPILE", "1")
    assert cpu_compile(logits("tiny"))
    monkeypatch.setenv("GRPO_FAST_CPU_COMPILE", "0")
    assert not cpu_compile(logits("qwen2.5-0.5b"))


def test_fused_head_runs_where_it_saves_memory():
    """The trainer's fused_linear route at each preset's completion tokens: the 100m preset's
    micro-batch logits (192 x 32,000) fit one chunk, where the fused head would also hold the
    [V, H] weight gradient from its forward (it peaked 15 MiB above eager): the plain head runs;
    the Qwen-shaped preset's (1,024 x 151,936) take two chunks: the fused head runs; a tiny
    model's gradient is under 1 MiB: the fused head is kept."""
    import torch

    from grpo_fast.ops.fused_linear_grpo_loss import fused_head_saves_memory

    def saves(preset):
        settings = memory.PRESETS[preset]
        rows = settings["micro_batch"] or settings["batch"]
        shape = settings["model"]["vocab_size"], settings["model"]["hidden_size"]
        weight = torch.empty(()).expand(shape)  # [V, H] without allocating it
        return fused_head_saves_memory(rows * settings["completion_length"], weight, torch.float32)

    assert [saves(p) for p in ("tiny", "100m", "qwen2.5-0.5b")] == [True, False, True]
    # the chunk budget is in bytes: bf16 logits fit twice the rows
    weight = torch.empty(()).expand(151936, 896)
    assert not fused_head_saves_memory(800, weight, torch.bfloat16) and fused_head_saves_memory(
        800, weight, torch.float32
    )


def test_a_hub_model_name_is_loaded_as_the_trainer_loads_it(monkeypatch):
    """``--model org/name`` goes to from_pretrained as given, without local_files_only (no
    network here: the loaders are stand-ins that record their arguments, as in the trainer's
    Hub-name test); a name that cannot be reached is a ValueError naming it."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config.architectures = ["LlamaForCausalLM"]
    calls = []

    def loader(made):
        return classmethod(lambda cls, name, **kwargs: calls.append((cls.__name__, name, kwargs)) or made)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", loader(config))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loader(LlamaForCausalLM(config)))
    memory.check_causal_lm("org/tiny-llama")
    result = memory.worker(worker_spec("org/tiny-llama", "grpo_fused"))
    assert [(cls, name, kwargs["local_files_only"]) for cls, name, kwargs in calls] == [
        ("AutoConfig", "org/tiny-llama", False),
        ("AutoModelForCausalLM", "org/tiny-llama", False),
    ]
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert result["num_params"] == params and result["params_bytes"] == 4 * params

    def offline(cls, name, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files for {name}.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(offline))
    with pytest.raises(ValueError, match=r"model 'org/missing': offline or not found on the Hub \(We couldn't"):
        memory.run_memory_benchmark(preset="tiny", model="org/missing")
