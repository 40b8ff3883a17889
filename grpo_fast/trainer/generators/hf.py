"""The Hugging Face ``generate`` engine: KV-cached sampling, stop at EOS, on any causal LM."""

import contextlib

import torch

from grpo_fast.trainer.generators import Generation, completion_masks
from grpo_fast.trainer.rollout import autocast


@contextlib.contextmanager
def left_padded(tokenizer):
    """The tokenizer pads and truncates on the left inside the block, and is as it was after."""
    saved = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = saved


class HFGenerator:
    """Samples with ``model.generate`` (temperature, top-p; no top-k), each prompt tokenized
    once and repeated G times. Randomness comes from torch's global generator."""

    def __init__(self, model, tokenizer, config, *, bf16: bool = False):
        self.model, self.tokenizer, self.config, self.bf16 = model, tokenizer, config, bf16

    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list | None = None) -> Generation:
        from transformers import GenerationConfig

        model, tokenizer, config = self.model, self.tokenizer, self.config
        device = next(model.parameters()).device
        with left_padded(tokenizer):
            enc = tokenizer(
                prompts,
                return_tensors="pt",
                padding=True,
                truncation=config.max_prompt_length is not None,
                max_length=config.max_prompt_length,
                add_special_tokens=False,
            )
        enc = {key: enc[key].repeat_interleave(group_size, dim=0).to(device) for key in ("input_ids", "attention_mask")}
        gen_config = GenerationConfig(
            do_sample=True,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=0,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        was_training = model.training
        model.eval()
        with autocast(device, self.bf16):
            sequences = model.generate(**enc, generation_config=gen_config)
        model.train(was_training)
        P = enc["input_ids"].shape[1]
        completion_ids, completion_mask = completion_masks(sequences[:, P:], tokenizer.eos_token_id,
                                                           tokenizer.pad_token_id)
        return Generation(
            input_ids=torch.cat([enc["input_ids"], completion_ids], dim=1),
            attention_mask=torch.cat([enc["attention_mask"], completion_mask], dim=1),
            completion_mask=completion_mask.float(),
            completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        )
