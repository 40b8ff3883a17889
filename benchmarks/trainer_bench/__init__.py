"""The trainer benchmark (``benchmarks/bench_trainer.py``, the command line) by job:

    workloads.py          the workloads: the demo's task, and the realistic one (a synthetic
                          language, a BPE trained on it, a tiny Llama whose EOS is spread)
    grpo_fast_runner.py   one round of a grpo_fast engine: its steps, phases from the
                          trainer's own ``time/*`` metrics, its batches' layout
    trl_runner.py         one round of a TRL engine: TRL's config made equal to ours, its
                          phases by wrapping TRL's methods, the vLLM-CPU patches
    compare.py            the rounds, each in a fresh process (``bench_trainer.py --worker``),
                          alternating the engines
    report.py             the statistics of the rounds, the JSON report and the tables

What the modules share is here: the engines, the packages each needs, the phases, a step's
rest, a vLLM engine's settings.
"""

ENGINES = ("sampler", "hf", "vllm", "sampler_whole", "hf_whole", "vllm_whole", "trl", "trl_vllm")
TRL_ENGINES = ("trl", "trl_vllm")
REQUIRES = {"sampler": (), "hf": (), "vllm": ("vllm",), "trl": ("trl",), "trl_vllm": ("trl", "vllm")}
REQUIRES.update({f"{engine}_whole": REQUIRES[engine] for engine in ("sampler", "hf", "vllm")})
PHASES = ("sampling", "weight_sync", "reference", "old_logprobs", "training", "rest")


def with_rest(phases: dict, seconds: float) -> dict:
    """A step's ``{phase: seconds}`` of every phase: ``phases`` (all but rest, missing ones 0)
    and the rest of a step of ``seconds``."""
    step = {phase: phases.get(phase, 0.0) for phase in PHASES[:-1]}
    step["rest"] = seconds - sum(step.values())
    return step


def vllm_settings(llm) -> dict:
    """What a vLLM engine runs with: dtype, eager or compiled, KV-cache size, prefix cache,
    a step's token budget and whether it splits prefills."""
    config = llm.llm_engine.vllm_config
    cache, mode, scheduler = config.cache_config, config.compilation_config.mode, config.scheduler_config
    return dict(
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        enforce_eager=config.model_config.enforce_eager,
        compilation_mode=getattr(mode, "name", str(mode)),
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        kv_cache_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        prefix_caching=cache.enable_prefix_caching,
        chunked_prefill=scheduler.enable_chunked_prefill,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
    )
