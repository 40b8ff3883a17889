"""One configuration of ``grpo-fast bench memory`` (``memory.py``), in its own fresh process:
a policy built from the spec, the trainer's steps on a fixed synthetic batch, their peak
memory and time, and the exact sizes of the states the peak holds."""

import json
import os
import sys

_TOKENIZER_NOT_USED = object()  # the trainers need a tokenizer only to sample and to save
# grpo_fused with its CPU vocabulary sweep forced to one route (GRPO_FAST_CPU_COMPILE): the
# kernels inductor builds, or eager chunks. grpo_fused picks one by the logits' size
# (ops/_backend.py); naming these configurations shows the route it did not pick beside it.
SWEEP_ROUTES = {"grpo_fused_compiled": "1", "grpo_fused_chunked": "0"}


def synthetic_batch(N: int, P: int, C: int, V: int, device, exact: bool = False):
    """A fixed rollout: prompts of P tokens, completions of C // 2 + 1 to C tokens, rewards in
    {0, 1}; with ``exact`` every completion has C tokens and the rewards alternate 0, 1, so
    that every group of an even size carries a gradient. Tensors [N, P + C], [N, C], [N, 1]."""
    import torch

    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, V, (N, P + C), generator=g)
    if exact:
        lengths = torch.full((N, 1), C)
        rewards = (torch.arange(N) % 2).float().unsqueeze(1)
    else:
        lengths = torch.randint(C // 2 + 1, C + 1, (N, 1), generator=g)
        rewards = torch.randint(0, 2, (N, 1), generator=g).float()  # [N, K=1]
    completion_mask = (torch.arange(C).unsqueeze(0) < lengths).float()  # [N, C]
    attention_mask = torch.cat([torch.ones(N, P, dtype=torch.long), completion_mask.long()], dim=1)
    return dict(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        completion_mask=completion_mask.to(device),
        rewards=rewards.to(device),
    )


def _fixed_source(batch: dict, ranks):
    """A rollout source whose samples are this rank's rows of ``batch`` (tensors [N, ...]),
    every step, instead of sampled ones: the rest of the step (reference log-probs) runs as usual."""
    from grpo_fast.trainer.rollout.samples import Samples
    from grpo_fast.trainer.rollout.sources import RolloutSource

    class FixedSamples(RolloutSource):
        def next(self, position: int, version: int) -> Samples:
            rows = ranks.share(batch["input_ids"].shape[0])
            n = rows.stop - rows.start
            mine = {name: tensor[rows] for name, tensor in batch.items()}
            return Samples(prompts=[""] * n, completions=[""] * n, columns={}, **mine, data_end=position)

    return FixedSamples()


def build_policy(spec: dict):
    """The preset's model built from its config, or ``model_path`` (a local folder, or a Hub
    name as the trainer takes it, downloaded by ``from_pretrained`` when not cached)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_fast.model_files import model_folder
    from grpo_fast.tasks.datasets import is_local_path

    if spec.get("model_path"):
        name = model_folder(spec["model_path"])
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=is_local_path(name))
    shape = dict(spec["model"])
    length = spec["prompt_length"] + spec["completion_length"]
    config = AutoConfig.for_model(
        shape.pop("model_type", "llama"), **shape, max_position_embeddings=length, tie_word_embeddings=True
    )
    return AutoModelForCausalLM.from_config(config)


def _state_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor (FSDP2) counts its local shard."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def start_optimizer_state(optimizer) -> None:
    """Creates ``optimizer``'s per-parameter state (AdamW's two moments) by a step at learning
    rate 0 on zero gradients, which moves no weight: the next training step then holds the
    state from its start, as every step of a run after the first does, so that one step shows
    the steady state's peak (a benchmark whose steps take minutes cannot afford a second)."""
    import torch

    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


def worker(spec: dict) -> dict:
    """One configuration's peak over ``steps`` steps (default two) and the time of ``repeats``
    more (none: the last measured step's seconds); runs in a fresh process. Optional keys of
    ``spec``: ``exact_lengths`` (every completion ``completion_length`` tokens),
    ``gradient_checkpointing``, ``optimizer_state_first`` (:func:`start_optimizer_state`
    before the first step)."""
    name = spec["config"]
    if name == "grpo_eager":
        os.environ["GRPO_FAST_BACKEND"] = "reference"
    if name in SWEEP_ROUTES:
        os.environ["GRPO_FAST_CPU_COMPILE"] = SWEEP_ROUTES[name]
    import torch

    # transformers' modeling code (about 200 MB resident on CPU) loads before the baseline, as
    # TRL's workers load it with trl: the peak is the step's, not the libraries'
    import transformers.modeling_utils  # noqa: F401

    from grpo_fast.bench.measure import current_rss_bytes, peak_rss_bytes, reset_peak_rss, time_fn
    from grpo_fast.bench.ppo import PPO
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer, distributed

    processes = spec["jobs"] * spec.get("nproc", 1)
    if processes > 1:  # processes side by side share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    torch.manual_seed(0)
    device = distributed.resolve_device(spec["device"])  # under torchrun: cuda:LOCAL_RANK
    cuda = device.type == "cuda"
    baseline = torch.cuda.memory_allocated(device) if cuda else current_rss_bytes()

    policy = build_policy(spec)
    N, P, C = spec["batch"], spec["prompt_length"], spec["completion_length"]
    V = policy.get_output_embeddings().weight.shape[0]
    options = dict(
        batch_size=N,
        group_size=spec["group_size"],
        max_new_tokens=C,
        beta=spec["beta"],
        micro_batch_size=spec["micro_batch"],
        fused_linear=name == "grpo_fused_linear",
        warmup_steps=0,
        device=str(device),
        parallel=spec.get("parallel", "ddp"),
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        checkpoint_every=spec.get("checkpoint_every", 1),
        mlp_tile_tokens=spec.get("mlp_tile_tokens", 0),
        activation_offloading=spec.get("activation_offloading", False),
        progress=False,
    )
    strategy = PPO() if name == "ppo" else None  # GRPO's own by default
    trainer = GRPOTrainer(
        GRPOConfig(**options), model=policy, tokenizer=_TOKENIZER_NOT_USED, rows=[{"prompt": ""}], strategy=strategy
    )
    ranks = trainer.runtime.ranks
    trainer.source = _fixed_source(synthetic_batch(N, P, C, V, device, spec.get("exact_lengths", False)), ranks)

    if spec.get("optimizer_state_first"):
        start_optimizer_state(trainer.optimizer)
    optimizer_s = _time_calls(trainer, "optimizer_step")
    # Without optimizer_state_first the first step creates the optimizer's moments and the second
    # holds them in its backward. Each peak is its own step's: on CUDA each step resets the peak
    # counter, on CPU the high-water mark is reset before it (the libraries' loading, or a transient
    # in building the model, can peak above a small model's step and hide how it grows).
    peaks = []
    for _ in range(spec.get("steps", 2)):
        if not cuda:
            reset_peak_rss()
        metrics = trainer.train_step()
        peaks.append((torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()) - baseline)
    peak = max(peaks)
    phases = dict(  # the last measured step's, from the trainer's clock (the optimizer's by the host's)
        prepare_s=metrics["time/prepare_s"],
        forward_backward_s=metrics["time/update_s"] - optimizer_s[-1],
        optimizer_s=optimizer_s[-1],
    )
    if spec["repeats"]:
        timing = time_fn(trainer.train_step, warmup=0, repeats=spec["repeats"])
    else:
        step_s = metrics["time/rollout_s"] + metrics["time/prepare_s"] + metrics["time/update_s"]
        timing = dict(median_s=step_s, p20_s=step_s, p80_s=step_s)

    trainable = [p for p in trainer.policy.parameters() if p.requires_grad]
    held = list(trainer.policy.parameters())
    optimizers = [trainer.optimizer]
    for part in trainer.strategy.parts().values():  # PPO's critic
        trainable += list(part.module.parameters())
        held += list(part.module.parameters())
        optimizers.append(part.optimizer)
    if trainer.reference is not None and trainer.reference is not trainer.policy:
        held += list(trainer.reference.parameters())
    optimizer_states = [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    micro = min(spec["micro_batch"] or N, N // ranks.world_size)  # rows per forward on this rank
    logits_dtype = trainer.runtime.dtype
    logits = 0 if name == "grpo_fused_linear" else micro * (C + 1) * V * logits_dtype.itemsize
    states = dict(
        params_bytes=_state_bytes({id(p): p for p in held}.values()),  # tied weights once
        grads_bytes=_state_bytes({id(p): p for p in trainable}.values()),
        optimizer_bytes=_state_bytes(optimizer_states),
    )
    result = dict(
        peak_bytes=int(peak),
        first_step_peak_bytes=int(peaks[0]),
        step_s=timing["median_s"],
        step_p20_s=timing["p20_s"],
        step_p80_s=timing["p80_s"],
        phases=phases,
        **states,
        logits_bytes=logits,
        rest_bytes=int(peak) - sum(states.values()),
        num_params=sum(p.numel() for p in {id(p): p for p in trainer.policy.parameters()}.values()),
        device=device.type,
    )
    if not ranks.active:
        return result
    import torch.distributed as dist

    results = [None] * ranks.world_size
    dist.all_gather_object(results, result)
    if ranks.is_main:
        print(json.dumps(dict(results[0], peak_bytes=max(r["peak_bytes"] for r in results), ranks=results)), flush=True)
    # Freeing the DDP reducer's gloo group after the last collective can deadlock in torch
    # (its destructor joins a gloo thread that waits for the GIL to free the all-gather's
    # tensors; seen in 1 of 2 runs here): the numbers are out, so leave without the teardown.
    sys.stderr.flush()
    os._exit(0)


def _time_calls(owner, name: str) -> list:
    """Wraps ``owner.name`` (on the instance) to append each call's seconds to the list returned."""
    import time

    seconds, inner = [], getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(owner, name, timed)
    return seconds


# ---------------------------------------------------------------- the driver
