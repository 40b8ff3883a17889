"""Model building: the policy and tokenizer, LoRA, the frozen reference, and the modules every
packed pass runs, wrapped for the job (DDP or FSDP2 under torchrun; see ``distributed.py``)."""

import contextlib
import copy
import dataclasses
import warnings

import torch

from grpo_fast.packing import Packed
from grpo_fast.spec import LossConfig
from grpo_fast.trainer import distributed
from grpo_fast.trainer.model.checkpoint_runs import checkpoint_runs
from grpo_fast.trainer.model.mlp_tiles import mlp_tiles
from grpo_fast.trainer.model.packed_policy import PackedPolicy, filler


def load_model_and_tokenizer(config, flash_attention: bool = False, before_model=None, tools: bool = False):
    """The policy and tokenizer: ``config.model`` (a Hub name at ``config.model_revision``, a
    local folder, or a GGUF file or ``package:<module>``, read from its converted folder: see
    ``grpo_fast/model_files.py``) through ``from_pretrained``, or the built-in task's (``config.task``).
    ``flash_attention`` loads the model with ``flash_attention_2``, whose varlen kernels run the
    packed forwards (see ``grpo_fast/packing/``). ``before_model(tokenizer)`` runs between the two (a
    run with tools checks its chat template there, before the model takes its time to load).
    A built-in task with a warm start (tool_arithmetic) runs it, ``tools`` saying whether the
    run has tools (its demonstrations call them or answer directly)."""
    if config.model is None:
        from grpo_fast.tasks import task_module

        task = task_module(config.task)
        tokenizer = task.build_tokenizer()
        if before_model is not None:
            before_model(tokenizer)
        # vLLM's CPU attention needs heads of 32 or more: its demo model has 2 heads of 32 (the
        # same weight shapes as the default's 4 heads of 16)
        heads = dict(num_attention_heads=2, num_key_value_heads=2) if config.generator == "vllm" else {}
        model = task.build_model(tokenizer, seed=config.seed, **heads)
        if hasattr(task, "warm_start"):
            task.warm_start(model, tokenizer, tools=tools, seed=config.seed)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.model_files import is_model_file, model_folder

    source, revision = model_folder(config.model), None if is_model_file(config.model) else config.model_revision
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if before_model is not None:
        before_model(tokenizer)
    attention = dict(attn_implementation="flash_attention_2") if flash_attention else {}
    model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=torch.float32, **attention)
    return model, tokenizer


def prepare_policy(model, config, device: torch.device):
    """``model`` as the run trains it, in place: a peft LoRA of it (lora_r > 0), gradient
    checkpointing (one decoder layer's input in ``checkpoint_every`` kept, in host memory with
    ``activation_offloading``; ``use_cache = False``),
    its MLPs in tiles of ``mlp_tile_tokens`` positions, on ``device``, in train mode."""
    if config.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, lora)
    if config.gradient_checkpointing:
        # activation_checkpointing_enable is gradient_checkpointing_enable's name from transformers 5.2x
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        checkpoint_runs(model, config.checkpoint_every, config.activation_offloading)
        model.config.use_cache = False
    mlp_tiles(model, config.mlp_tile_tokens)
    return model.to(device).train()


def make_reference(policy, beta: float):
    """None when beta == 0; the policy itself for a peft policy (adapters off); else a frozen copy."""
    if beta == 0:
        return None
    if hasattr(policy, "disable_adapter"):  # peft: lora_r > 0 or a PeftModel passed in
        return policy
    reference = copy.deepcopy(policy).eval()
    reference.requires_grad_(False)
    return reference


def reference_context(policy, reference):
    """The context in which ``reference`` computes reference log-probs: a peft policy used as
    its own reference runs with its adapters disabled (no second copy of the weights)."""
    if reference is policy:
        return policy.disable_adapter()
    return contextlib.nullcontext()


@dataclasses.dataclass
class Modules:
    """The modules every packed pass runs.

    packed: the policy's :class:`PackedPolicy` (sharded in place under FSDP2); train: what the
    backward passes run (DDP's wrapper of ``packed``, or it); reference: the frozen copy's,
    sharded alike, or ``packed`` for a peft policy (its reference is itself with adapters off),
    or None (beta = 0); filler: a one-token micro-batch for a rank with fewer micro-batches.
    """

    packed: PackedPolicy
    train: torch.nn.Module
    reference: torch.nn.Module | None
    filler: Packed


def wrap_modules(policy, reference, loss_config: LossConfig, config, runtime) -> Modules:
    """The :class:`Modules` of ``policy`` and ``reference`` for this job (``distributed.wrap``)."""
    packed = PackedPolicy(policy, loss_config, runtime, entropy=config.log_entropy)
    train = distributed.wrap(packed, config.parallel, runtime)
    reference_module = None
    if reference is policy:
        reference_module = packed
    elif reference is not None:
        frozen = PackedPolicy(reference, loss_config, runtime)
        reference_module = distributed.wrap(frozen, config.parallel, runtime, trainable=False)
    modules = Modules(packed, train, reference_module, filler(runtime.device))
    for module in dict.fromkeys(m for m in (packed, reference_module) if m is not None):
        if distributed.is_sharded(module):
            # FSDP2 finds its root on the first forward: the root's, before any layer runs alone
            # (generation calls the layers). The root keeps its whole weights after a forward;
            # the optimizer needs the shards.
            with torch.no_grad():
                module(modules.filler)
            module.reshard()
    return modules
