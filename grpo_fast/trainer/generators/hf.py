"""The Hugging Face ``generate`` engine: KV-cached sampling, stop at EOS, on any causal LM."""

import torch

from grpo_fast.trainer.generators import Generation, Generator, assemble, encode_prompts, evaluating


class HFGenerator(Generator):
    """Samples with ``model.generate`` (temperature, top-k, top-p), each prompt tokenized once
    and repeated G times (G prefills of it). Randomness comes from torch's global generator."""

    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list | None = None) -> Generation:
        from transformers import GenerationConfig

        model, tokenizer, config = self.model, self.tokenizer, self.config
        device = next(model.parameters()).device
        ids, mask = (
            x.repeat_interleave(group_size, dim=0).to(device)
            for x in encode_prompts(tokenizer, prompts, config.max_prompt_length)
        )
        gen_config = GenerationConfig(
            do_sample=True,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        with evaluating(model), self.runtime.autocast():
            sequences = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        return assemble(tokenizer, ids, mask, sequences[:, ids.shape[1] :])
