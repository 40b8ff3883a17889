"""One round of a grpo_fast engine (sampler, hf, vllm) in a worker process: a fresh trainer on
the workload runs its steps with ``trainer.run_step()``, nothing of it patched.

Its phases are the trainer's own per-stage timings, read from each step's log line
(``grpo_fast/trainer/grpo.py`` ``run_step``; on CUDA they are CUDA events, so a stage's
kernels count for it):

    weight_sync   ``sync_time_s``: the vLLM engine's weight sync (inside the rollout; the
                  sampler and HF engines sample with the policy and report none: 0)
    sampling      ``time/rollout_s`` less ``sync_time_s``: the rollout source's ``next``,
                  sampling and the rewards (milliseconds on these workloads)
    reference     ``time/prepare_s``: the step's batch, the reference model's pass with its
                  packing and the group advantages
    old_logprobs  0: the sampling correction reads the log-probs of the first training pass
    training      ``time/update_s``: the backward passes, the optimizer steps, the weights
                  published to the engine
    rest          the step less the above: the log line's read of the device, the loop

The batch layout (what a padded forward computes, what per-sample prefills cost) is read
from the batch each step returns.
"""

import time

from trainer_bench import vllm_settings, with_rest
from trainer_bench.workloads import Workload


def step_phases(metrics: dict, seconds: float) -> dict:
    """A step's ``{phase: seconds}`` (module docstring) from its log line ``metrics``, the step
    having taken ``seconds``."""
    sync = metrics.get("sync_time_s", 0.0)
    stages = dict(
        sampling=metrics["time/rollout_s"] - sync,
        weight_sync=sync,
        reference=metrics["time/prepare_s"],
        training=metrics["time/update_s"],
    )
    return with_rest(stages, seconds)


def batch_layout(samples, group_size: int, one_prefill_per_group: bool) -> dict:
    """The tokens of a step's ``samples`` that are real against the padded batch's; with
    ``one_prefill_per_group`` (our sampler, by construction), the prompt tokens it prefills
    against one prefill per sample (vLLM's prefix cache is its own)."""
    N, width = samples.input_ids.shape
    layout = dict(real=samples.attention_mask.sum().item(), padded=N * width)
    if one_prefill_per_group:
        prompt_width = width - samples.completion_mask.shape[1]
        layout.update(prefill_ours=N // group_size * prompt_width, prefill_per_sample=N * prompt_width)
    return layout


def run_grpo_fast(work: Workload, options: dict, generator: str, shared_prefix: bool = True) -> dict:
    """Per-step seconds (between the ends of consecutive steps), CPU seconds, phases, tokens,
    completion lengths, batch layout and the body's tokens per pass (``forward_tokens``,
    ``prefix_saved``) of one fresh grpo_fast run; ``shared_prefix`` False packs every row whole."""
    steps, device = options["steps"], options["device"]
    trainer = work.trainer(
        steps=steps,
        loss_type="grpo",
        generator=generator,
        seed=options["seed"],
        device=device,
        shared_prefix=shared_prefix,
    )
    out = dict(times=[], cpu_times=[], tokens=[], lengths=[], phases=[], layouts=[], forward_tokens=[], prefix_saved=[])
    last, last_cpu = time.perf_counter(), time.process_time()
    try:
        for _ in range(steps):
            metrics, batch = trainer.run_step()
            now, now_cpu = time.perf_counter(), time.process_time()
            out["times"].append(now - last)
            out["cpu_times"].append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu
            out["phases"].append(step_phases(metrics, out["times"][-1]))
            out["tokens"].append(metrics["tokens_per_s"] * metrics["step_time_s"])
            out["lengths"].append(metrics["completion_len_mean"])
            out["forward_tokens"].append(metrics["forward_tokens"])
            out["prefix_saved"].append(metrics["prefix_saved"])
            out["layouts"].append(batch_layout(batch.samples, work.group_size, generator == "sampler"))
        if generator == "vllm":
            out["vllm"] = vllm_settings(trainer.source.engine.llm)
    finally:
        trainer.close()
    return out
