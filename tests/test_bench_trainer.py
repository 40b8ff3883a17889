"""benchmarks/bench_trainer.py (its modules in benchmarks/trainer_bench/): TRL's phase clock
counts nested time once; grpo_fast's phases are its trainer's own stage timings, within the
step; and a comparison runs every round of every engine in a fresh process, TRL's colocated
vLLM engine included (the benchmark's patches for vLLM 0.32 on CPU: its weights follow the
policy, its engine settings are ours)."""

import argparse
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # after tests/: its conftest is not ours
from trainer_bench import PHASES, compare, trl_runner  # noqa: E402
from trainer_bench.grpo_fast_runner import run_grpo_fast, step_phases  # noqa: E402
from trainer_bench.report import make_report  # noqa: E402
from trainer_bench.workloads import tiny_workload  # noqa: E402


def test_trl_phases_count_nested_time_for_the_inner_phase_only(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(trl_runner.time, "perf_counter", lambda: clock[0])

    class Engine:
        def sync(self):
            clock[0] += 2.0

        def generate(self):
            clock[0] += 1.0
            self.sync()
            clock[0] += 4.0

        def logprobs(self, model):
            clock[0] += 0.5 if model == "ref" else 0.25

    engine, phases = Engine(), trl_runner.Phases("cpu")
    phases.wrap(engine, "sync", "weight_sync")
    phases.wrap(engine, "generate", "sampling")
    phases.wrap(engine, "logprobs", lambda model: "reference" if model == "ref" else "old_logprobs")
    engine.generate()
    engine.logprobs("ref")
    engine.logprobs("policy")
    phases.end_step(10.0)
    engine.sync()
    phases.end_step(3.0)
    assert phases.steps == [
        dict(sampling=5.0, weight_sync=2.0, reference=0.5, old_logprobs=0.25, training=0.0, rest=2.25),
        dict(sampling=0.0, weight_sync=2.0, reference=0.0, old_logprobs=0.0, training=0.0, rest=1.0),
    ]


def test_our_phases_are_the_trainers_stage_times_the_sync_out_of_the_rollout():
    metrics = {"time/rollout_s": 3.0, "time/prepare_s": 0.5, "time/update_s": 1.25, "sync_time_s": 1.0}
    assert step_phases(metrics, 5.0) == dict(
        sampling=2.0, weight_sync=1.0, reference=0.5, old_logprobs=0.0, training=1.25, rest=0.25
    )
    del metrics["sync_time_s"]  # an engine that samples with the policy syncs nothing
    assert step_phases(metrics, 5.0)["sampling"] == 3.0 and step_phases(metrics, 5.0)["weight_sync"] == 0.0


def test_a_grpo_fast_round_reads_its_phases_and_layout_from_the_steps_it_runs():
    work = tiny_workload(argparse.Namespace(seed=0))
    out = run_grpo_fast(work, dict(steps=3, seed=0, device="cpu"), generator="sampler")
    assert len(out["times"]) == len(out["phases"]) == len(out["layouts"]) == len(out["tokens"]) == 3
    for seconds, phases in zip(out["times"], out["phases"]):
        assert tuple(phases) == PHASES and sum(phases.values()) == pytest.approx(seconds)
        # the trainer's stages lie within the step the benchmark times around run_step()
        assert phases["rest"] > 0 and phases["sampling"] > 0 and phases["reference"] > 0 and phases["training"] > 0
        assert phases["weight_sync"] == 0  # the sampler runs the policy: no weights to sync
    for tokens, layout in zip(out["tokens"], out["layouts"]):
        # the batch's real tokens are the ones its step's log line counted, fewer than padded
        assert layout["real"] == pytest.approx(tokens) and 0 < layout["real"] < layout["padded"]
        assert 0 < layout["prefill_ours"] < layout["prefill_per_sample"]  # one prefill per group
    # the body ran each group's prompt once; the whole-row engine ran every real token
    assert all(0 < n < tokens for n, tokens in zip(out["forward_tokens"], out["tokens"]))
    assert all(saved > 0.2 for saved in out["prefix_saved"])
    whole = run_grpo_fast(work, dict(steps=2, seed=0, device="cpu"), generator="sampler", shared_prefix=False)
    assert whole["prefix_saved"] == [0.0, 0.0]
    assert [round(n) for n in whole["forward_tokens"]] == [round(n) for n in whole["tokens"]]


@pytest.mark.slow
def test_ours_against_trl_colocated_vllm_each_round_in_its_own_process(monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoConfig

    from grpo_fast.trainer.rollout.engines.vllm import cpu_kv_cache_bytes

    pids, run_round = [], compare.run_round

    def recorded(*args, **kwargs):
        run = run_round(*args, **kwargs)
        pids.append(run.get("pid"))
        return run

    monkeypatch.setattr(compare, "run_round", recorded)
    work = tiny_workload(argparse.Namespace(seed=0))
    args = argparse.Namespace(
        engines=["vllm", "trl_vllm"],  # the sampler's round: test_a_grpo_fast_round_reads_...
        no_trl=False,
        steps=None,
        warmup=None,
        rounds=1,
        threads=1,
        seed=0,
        device="cpu",
        trl_as_shipped=False,
    )
    report = make_report(work, args)
    results = report["results"]
    ours_vllm, trl = results["vllm"], results["trl_vllm"]
    assert not [result["errors"] for result in results.values() if "errors" in result]
    assert set(report["versions"]) >= {"torch", "transformers", "trl", "vllm"}
    assert len(set(pids)) == 2 and os.getpid() not in pids and None not in pids  # a process per round
    for result in results.values():
        (round_,) = result["rounds"]
        assert round_["torch_threads"] == 1 and round_["peak_rss_bytes"] > round_["rss_start_bytes"] > 0
        phases = result["phases_median_s"]
        # two timed steps: a median is their mean, so the phases' medians sum to the step's
        assert sum(phases.values()) == pytest.approx(result["median_s"])
        assert phases["rest"] >= 0 and phases["sampling"] > 0 and phases["reference"] > 0 and phases["training"] > 0
    # both vLLM engines sync after every update, and TRL runs its extra no-grad pass where ours
    # reads its first training pass
    assert ours_vllm["phases_median_s"]["weight_sync"] > 0 and trl["phases_median_s"]["weight_sync"] > 0
    assert trl["phases_median_s"]["old_logprobs"] > 0
    base = trl["rounds"][0]["median_s"]
    # each round against TRL's of the same round
    assert ours_vllm["steps_per_s_vs_trl_vllm_per_round"] == [pytest.approx(base / ours_vllm["rounds"][0]["median_s"])]
    # TRL's engine holds the policy's weights after each optimizer step (lr 1e-3 moves them):
    # its log-probs of its own samples are the trainer's, as a float32 engine's should be
    settings = trl["rounds"][0]["vllm"]
    assert max(trl["rounds"][0]["sampling_logp_difference_mean"]) < 1e-5
    kv = cpu_kv_cache_bytes(AutoConfig.from_pretrained(work.model_dir), work.config(), torch.float32)
    assert settings["dtype"] == "float32" and settings["enforce_eager"] and settings["kv_cache_memory_bytes"] == kv
    assert ours_vllm["rounds"][0]["vllm"] == settings  # ours: the same engine settings
