"""A TRL GRPOTrainer on a model folder, as the TRL drop-in's tests build it (stock or ours)."""

import os
import tempfile
import warnings

import trl

from grpo_fast.tasks.arithmetic import arithmetic_reward

B, T = 4, 6  # rows a step and completion tokens, unless a test's options say otherwise
# TRL's GRPOConfig turns gradient checkpointing on by default under the name transformers 5.2x
# deprecated: the current name where the installed transformers has it, the same setting.
CHECKPOINTING = {"activation_checkpointing": True} if hasattr(trl.GRPOConfig, "activation_checkpointing") else {}


def make_trainer(
    cls,
    setup,
    reward_funcs=arithmetic_reward,
    peft_config=None,
    tools=None,
    ours=None,
    environment_factory=None,
    **options,
):
    """A TRL GRPOTrainer of class ``cls`` (stock or ours) on ``setup``'s model folder and rows,
    CPU, no saving; ``options`` are GRPOConfig's; ``tools`` and ``environment_factory`` TRL's tool
    loop's (test_integration_trl_tools); ``ours`` our constructor's own keywords (``shared_prefix``)."""
    tokenizer, folder, dataset = setup
    options = {"per_device_train_batch_size": B, "num_generations": 4, "max_completion_length": T, **options}
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(dir=os.path.dirname(folder)),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        **CHECKPOINTING,
        **options,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=folder,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            **({"tools": tools} if tools else {}),
            **({"environment_factory": environment_factory} if environment_factory else {}),
            **(ours or {}),
        )
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by train() otherwise
    trainer.model.train()  # as in train(): from_pretrained leaves it in eval mode, whose loss and metrics differ
    return trainer
