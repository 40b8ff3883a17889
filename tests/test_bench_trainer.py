"""benchmarks/bench_trainer.py: its phase clock counts nested time once, and a comparison runs
every round of every engine in a fresh process, TRL's colocated vLLM engine included (the
benchmark's patches for vLLM 0.32 on CPU: its weights follow the policy, its engine settings
are ours)."""

import argparse
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_trainer  # noqa: E402


def test_phases_count_nested_time_for_the_inner_phase_only(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_trainer.time, "perf_counter", lambda: clock[0])

    class Engine:
        def sync(self):
            clock[0] += 2.0

        def generate(self):
            clock[0] += 1.0
            self.sync()
            clock[0] += 4.0

        def logprobs(self, model):
            clock[0] += 0.5 if model == "ref" else 0.25

    engine, phases = Engine(), bench_trainer.Phases("cpu")
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


@pytest.mark.slow
def test_sampler_against_trl_colocated_vllm_each_round_in_its_own_process():
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from grpo_fast.trainer.rollout.engines.vllm import cpu_kv_cache_bytes

    work = bench_trainer.tiny_workload(argparse.Namespace(seed=0))
    args = argparse.Namespace(
        engines=["sampler", "trl_vllm"],
        no_trl=False,
        steps=None,
        warmup=None,
        rounds=1,
        threads=1,
        seed=0,
        device="cpu",
        trl_as_shipped=False,
    )
    report = bench_trainer.bench(work, args)
    ours, trl = report["results"]["sampler"], report["results"]["trl_vllm"]
    assert "errors" not in ours and "errors" not in trl, (ours.get("errors"), trl.get("errors"))
    assert set(report["versions"]) >= {"torch", "transformers", "trl", "vllm"}
    for result in (ours, trl):
        (round_,) = result["rounds"]
        assert round_["torch_threads"] == 1 and round_["peak_rss_bytes"] > round_["rss_start_bytes"] > 0
        assert round_["loadavg_start"] >= 0 and round_["loadavg_end"] >= 0
        assert result["median_s"] > 0 and result["phases_median_s"]["sampling"] > 0
        assert result["phases_median_s"]["reference"] > 0 and result["phases_median_s"]["training"] > 0
    # ours samples with the policy and corrects nothing; TRL syncs its engine and runs its extra pass
    assert ours["phases_median_s"]["weight_sync"] == ours["phases_median_s"]["old_logprobs"] == 0
    assert trl["phases_median_s"]["weight_sync"] > 0 and trl["phases_median_s"]["old_logprobs"] > 0
    assert ours["steps_per_s_vs_trl_vllm"] > 0
    # TRL's engine holds the policy's weights after each optimizer step (lr 1e-3 moves them):
    # its log-probs of its own samples are the trainer's, as a float32 engine's should be
    settings = trl["rounds"][0]["vllm"]
    assert max(trl["rounds"][0]["sampling_logp_difference_mean"]) < 1e-5
    kv = cpu_kv_cache_bytes(AutoConfig.from_pretrained(work.model_dir), work.config(), bench_trainer.torch.float32)
    assert settings["dtype"] == "float32" and settings["enforce_eager"] and settings["kv_cache_memory_bytes"] == kv
