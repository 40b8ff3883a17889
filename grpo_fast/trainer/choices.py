"""The names a run's settings choose from, where nothing heavy is imported: the config
validates against them before torch loads, and the modules that act on a name read it here.

A new engine is a module of ``rollout/engines/`` and a row of :data:`ENGINES`; a new tracker an
adapter of ``run/trackers.py`` and a row of :data:`TRACKERS`.
"""

# name -> "module:Class" of a generation engine, imported only when picked (it may need an
# optional package)
ENGINES = {
    "hf": "grpo_fast.trainer.rollout.engines.hf:HFGenerator",
    "sampler": "grpo_fast.trainer.rollout.engines.sampler:Sampler",
    "vllm": "grpo_fast.trainer.rollout.engines.vllm:VLLMGenerator",
}
TURN_ENGINES = ("sampler", "hf", "vllm")  # the engines that run multi-turn rollouts (tools)
PRECISIONS = ("auto", "bf16", "fp32")
PARALLEL = ("ddp", "fsdp")  # under torchrun: each rank a replica, or a shard (FSDP2)
LR_SCHEDULES = ("cosine", "linear", "constant")
# tracker name -> the library it needs installed (the pip extra of the tracker's name installs it)
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
