"""The Hugging Face ``generate`` engine: KV-cached sampling, stop at EOS, on any causal LM.

A multi-turn rollout (tools) continues each row from its token ids: every turn is one
``generate`` call over the rows still going, left-padded, which prefills them anew (our sampler
keeps its KV cache across turns instead)."""

import torch

from grpo_fast.trainer.rollout.engines import (
    Generation,
    Generator,
    Turns,
    assemble,
    continue_turns,
    encode_prompts,
    evaluating,
    left_padded,
)


class HFGenerator(Generator):
    """Samples with ``model.generate`` (temperature, top-k, top-p), each prompt tokenized once
    and repeated G times (G prefills of it). Randomness comes from torch's global generator."""

    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list | None = None, turns: Turns | None = None):
        model, tokenizer, settings = self.model, self.tokenizer, self.settings
        device = next(model.parameters()).device
        ids, mask = (
            x.repeat_interleave(group_size, dim=0).to(device)
            for x in encode_prompts(tokenizer, prompts, settings.max_prompt_length)
        )
        if turns is not None:
            return self._generate_turns(ids, mask, turns)
        sequences = self._sample(ids, mask, settings.max_new_tokens, [tokenizer.eos_token_id])
        return assemble(tokenizer, ids, mask, sequences[:, ids.shape[1] :])

    def _sample(self, ids, mask, max_new_tokens: int, stop_ids: list) -> torch.Tensor:
        """``model.generate`` of the left-padded rows ``ids`` [n, L], stopping at ``stop_ids``."""
        from transformers import GenerationConfig

        settings, tokenizer = self.settings, self.tokenizer
        gen_config = GenerationConfig(
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_ids if len(stop_ids) > 1 else stop_ids[0],
            use_cache=True,
        )
        with evaluating(self.model), self.runtime.autocast():
            return self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)

    def _generate_turns(self, ids, mask, turns: Turns) -> Generation:
        """Each turn one ``generate`` call over the rows still going, from their whole sequences."""
        tokenizer, device = self.tokenizer, ids.device

        def sample(rows: list, sequences: list, rooms: list, stop_ids: list) -> list:
            with left_padded(tokenizer):
                enc = tokenizer.pad({"input_ids": sequences}, return_tensors="pt")
            out = self._sample(enc["input_ids"].to(device), enc["attention_mask"].to(device), max(rooms), stop_ids)
            new = out[:, enc["input_ids"].shape[1] :].tolist()
            return [(_until_stop(tokens[:room], stop_ids), None) for tokens, room in zip(new, rooms)]

        return continue_turns(sample, tokenizer, ids, mask, turns, self.settings.max_new_tokens)


def _until_stop(tokens: list, stop_ids: list) -> list:
    """A row's sampled tokens up to and including its first stop token (generate pads a row
    after it stopped); a row that did not stop ran to the limit, unpadded."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens
