"""Our own sampler: KV-cached decoding on any Hugging Face causal LM, built for GRPO's groups.

    prefill   the distinct prompts once, left-padded [num_prompts, P]; the last position's
              logits and the KV cache are then repeated G times (the group shares its prefix)
    decode    one token per live row per step: sample, record its log-prob; rows that sampled
              EOS leave the batch (their cache rows are dropped), so they cost nothing more

Sampling (``sampling.py``): temperature, top-k, top-p, by inverse CDF with a counter-based
uniform per (seed, key, sample, position), so a completion depends on its identity and the
weights only, never on what else is in the batch or on which rank it runs. The returned
log-probs are those of the temperature-scaled distribution at the sampled tokens.

With ``compile_generation`` (CUDA only) the decode step runs on a static cache of fixed
shape (the prompt width rounded up to a multiple of ``STATIC_PROMPT_MULTIPLE``), reused from
call to call, compiled by ``torch.compile(mode="reduce-overhead")``, which replays it as a
CUDA graph; finished rows then stay in the batch (a graph has fixed shapes) and the loop
stops when all are done.
"""

import inspect

import torch

from grpo_fast.base_model import base_model
from grpo_fast.trainer.rollout.engines import (
    Generation,
    Generator,
    Turns,
    assemble,
    assemble_turns,
    encode_prompts,
    evaluating,
    position_ids,
)
from grpo_fast.trainer.rollout.engines.sampling import sample_streams, sample_tokens, stream_uniforms

# With compile_generation, prompt widths are rounded up to a multiple of this, so that
# batches of slightly different prompt lengths reuse one cache and one compiled graph.
STATIC_PROMPT_MULTIPLE = 64


def _cache_argument(model) -> str:
    """The name under which the model's forward takes a KV cache: ``cache`` (transformers >= 5.2x)
    or ``past_key_values`` (earlier)."""
    base = base_model(model)  # peft forwards **kwargs
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class Sampler(Generator):
    """KV-cached sampling with a shared prefill per group and EOS rows dropped from the batch.

    Args:
        model, tokenizer: the policy and its tokenizer (a pad token is required).
        settings: the :class:`EngineSettings`: seed, temperature, top_k, top_p, max_new_tokens,
            max_prompt_length, compile_generation.
        runtime: where it decodes and at which precision (default: float32).
        static_cache: decode on a preallocated ``StaticCache`` (no per-step copy of the cache;
            what CUDA graphs need); default: ``settings.compile_generation``. Runs eagerly on
            any device, where finished rows still leave the batch.
    """

    def __init__(self, model, tokenizer, settings, runtime=None, *, static_cache: bool | None = None):
        super().__init__(model, tokenizer, settings, runtime)
        self.device = next(model.parameters()).device
        if settings.compile_generation and self.device.type != "cuda":
            raise ValueError(
                f"compile_generation needs a CUDA device (a static cache replayed as a CUDA graph); "
                f"the policy is on {self.device.type}"
            )
        self.static_cache = settings.compile_generation if static_cache is None else static_cache
        self.cache_argument = _cache_argument(model)
        self._compiled, self._cache, self._cache_shape = None, None, None

    def _forward(self, **inputs):
        """The model's forward for one decode step; with compile_generation, the compiled one."""
        if self.settings.compile_generation:
            if self._compiled is None:
                self._compiled = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
            return self._compiled(**inputs)
        return self.model(**inputs)

    def _static_cache(self, rows: int, max_length: int):
        """An empty StaticCache of ``rows`` x ``max_length``. With compile_generation the same one
        is reset and reused while its shape holds: a CUDA graph replays on fixed addresses."""
        from transformers import StaticCache

        if not self.settings.compile_generation or self._cache_shape != (rows, max_length):
            self._cache = StaticCache(config=self.model.config, max_cache_len=max_length)
            self._cache_shape = (rows, max_length)
            return self._cache
        self._cache.reset()
        return self._cache

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, group_size: int, max_length: int):
        """Runs the distinct prompts [num_prompts, P] once; returns the last position's logits
        and a cache for the num_prompts * G rows, each prompt's repeated G times."""
        from transformers import DynamicCache

        prefix = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids(mask),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: prefix},
        )
        logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)  # [N, V]
        if not self.static_cache:
            prefix.batch_repeat_interleave(group_size)
            return logits, prefix
        cache = self._static_cache(logits.shape[0], max_length)
        for layer, shared in zip(cache.layers, prefix.layers):
            layer.update(
                shared.keys.repeat_interleave(group_size, dim=0), shared.values.repeat_interleave(group_size, dim=0)
            )
        return logits, cache

    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list, turns: Turns | None = None) -> Generation:
        """``group_size`` completions of each prompt; sample g of prompt i is a function of
        (settings.seed, keys[i], g) and the weights alone. Returns the rollout layout of
        :class:`Generation`, with the sampler's log-probs.

        With ``turns`` (a multi-turn rollout: tool calls) a row whose turn ends (EOS or one of
        ``turns.stop_token_ids``) waits while the others finish theirs; then ``turns`` gives
        each waiting row the tokens to append (tool results and the next turn's opening), which
        one forward writes into the KV cache, and decoding goes on from there: nothing earlier
        is prefilled again. A waiting row rides along in the batch on a masked slot."""
        settings, device = self.settings, self.device
        if len(keys) != len(prompts):
            raise ValueError(f"keys must give one key per prompt ({len(prompts)}), got {len(keys)}")
        if self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (prompts are left-padded): set tokenizer.pad_token")
        if turns is not None and self.static_cache:
            raise ValueError(
                "a multi-turn rollout (tools) needs the dynamic cache: its turns take more slots than P + T"
            )
        G, T = group_size, settings.max_new_tokens
        multiple = STATIC_PROMPT_MULTIPLE if self.settings.compile_generation else None
        prompt_ids, prompt_mask = (
            x.to(device) for x in encode_prompts(self.tokenizer, prompts, settings.max_prompt_length, multiple)
        )
        N, P = len(prompts) * G, prompt_ids.shape[1]
        pad, ends_turn = self.tokenizer.pad_token_id, self._turn_ends(turns)
        key_tensor = torch.as_tensor(keys, dtype=torch.long, device=device).repeat_interleave(G)
        streams = sample_streams(settings.seed, key_tensor, torch.arange(G, device=device).repeat(len(prompts)))
        # Row r's k-th completion token (sampled or a tool's) sits at position start[r] + k; it
        # is drawn with the uniform of (stream, k). A row's cache slots: P, then one per forward.
        start = prompt_mask.sum(1).repeat_interleave(G)
        mask = torch.cat([prompt_mask.repeat_interleave(G, dim=0), prompt_mask.new_ones(N, T)], dim=1)
        tokens = torch.full((N, T), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros(N, T, dtype=torch.float32, device=device)
        sampled = torch.zeros(N, T, dtype=torch.bool, device=device)  # the model's tokens
        written = torch.zeros(N, T, dtype=torch.bool, device=device)  # the model's and the tools'
        length = torch.zeros(N, dtype=torch.long, device=device)  # completion tokens written per row
        rows = torch.arange(N, device=device)  # the output row of each batch row
        waiting = torch.zeros(N, dtype=torch.bool, device=device)  # turn ended, awaiting its suffix
        slots, turn_start = P, [0] * N
        with evaluating(self.model), self.runtime.autocast():
            logits, cache = self._prefill(prompt_ids, prompt_mask, G, P + T)
            while True:
                token, logp = sample_tokens(
                    logits,
                    stream_uniforms(streams, length),
                    temperature=settings.temperature,
                    top_k=settings.top_k,
                    top_p=settings.top_p,
                )
                going = ~waiting
                at = (rows[going], length[going])
                tokens[at], logprobs[at], sampled[at], written[at] = token[going], logp[going], True, True
                length = length + going
                waiting = waiting | (going & ends_turn(token))
                done = length >= T if turns is not None else waiting | (length >= T)
                n_live = int((~done).sum())  # one host sync a step
                if n_live == 0:
                    break
                if not self.settings.compile_generation and n_live < len(done):  # finished rows leave the batch
                    keep = (~done).nonzero().squeeze(1)
                    cache.reorder_cache(keep)
                    rows, streams, start, length, mask, token, waiting, going = (
                        x[keep] for x in (rows, streams, start, length, mask, token, waiting, going)
                    )
                    turn_start = [turn_start[i] for i in keep.tolist()] if turns is not None else turn_start
                if turns is not None and bool(waiting.all()):  # every turn has ended: the tools answer
                    turn_ids = [tokens[r, a:b].tolist() for r, a, b in zip(rows.tolist(), turn_start, length.tolist())]
                    suffixes = turns.suffixes(rows.tolist(), turn_ids, (T - length).tolist())
                    keep = [i for i, suffix in enumerate(suffixes) if suffix]
                    if not keep:
                        break
                    # a turn's last token, sampled this step, is not in the cache yet: it leads the block
                    fed = [turn_ids[i][-1:] if fresh else [] for i, fresh in zip(keep, going[keep].tolist())]
                    if len(keep) < len(rows):
                        index = torch.as_tensor(keep, device=device)
                        cache.reorder_cache(index)
                        rows, streams, start, length, mask = (x[index] for x in (rows, streams, start, length, mask))
                    block, block_mask = _left_padded([f + suffixes[i] for f, i in zip(fed, keep)], pad, device)
                    S = block.shape[1]
                    for i, r in enumerate(rows.tolist()):  # the suffix is the completion's, not sampled
                        n = len(suffixes[keep[i]])
                        tokens[r, int(length[i]) : int(length[i]) + n] = block[i, S - n :]
                        written[r, int(length[i]) : int(length[i]) + n] = True
                    mask = _widen(mask, slots + S)
                    mask[:, slots : slots + S] = block_mask
                    first = length - torch.as_tensor([len(f) for f in fed], device=device)  # the block's first
                    positions = start.unsqueeze(1) + first.unsqueeze(1) + block_mask.cumsum(1) - 1
                    out = self.model(
                        input_ids=block,
                        attention_mask=mask[:, : slots + S],
                        position_ids=positions.clamp(min=0),
                        use_cache=True,
                        **{self.cache_argument: cache},
                    )
                    slots += S
                    length = length + torch.as_tensor([len(suffixes[i]) for i in keep], device=device)
                    turn_start = length.tolist()
                    logits, waiting = out.logits[:, -1], torch.zeros_like(length, dtype=torch.bool)
                    continue
                if turns is not None:  # a row that sampled nothing this step has a masked slot
                    mask = _widen(mask, slots + 1)
                    mask[:, slots] = going.long()
                step_mask = mask if self.static_cache else mask[:, : slots + 1]
                out = self._forward(
                    input_ids=token.where(going, pad).unsqueeze(1),
                    attention_mask=step_mask,
                    position_ids=(start + length - 1).unsqueeze(1),
                    use_cache=True,
                    **{self.cache_argument: cache},
                )
                slots += 1
                logits = out.logits[:, -1]
        ids, prompt_mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)
        if turns is None:
            width = int(length.max())
            return assemble(self.tokenizer, ids, prompt_mask, tokens[:, :width], logprobs[:, :width])
        return assemble_turns(self.tokenizer, ids, prompt_mask, tokens, logprobs, sampled, written)

    def _turn_ends(self, turns: Turns | None):
        """``f(token [n]) -> [n] bool``: the tokens that end a row's turn: EOS, and with
        ``turns`` its stop tokens (a tool call's end)."""
        ends = torch.as_tensor(
            [self.tokenizer.eos_token_id, *(turns.stop_token_ids if turns else [])], device=self.device
        )
        return lambda token: torch.isin(token, ends)


def _widen(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` [n, L] with zero columns appended up to ``width`` (as it is when wide enough)."""
    return mask if mask.shape[1] >= width else torch.nn.functional.pad(mask, (0, width - mask.shape[1]))


def _left_padded(sequences: list, pad: int, device) -> tuple:
    """``(ids [n, S], mask [n, S] long)`` of token lists, left-padded to the longest: a batch's
    last column is each row's last token, whose logits continue it."""
    S = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), S), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), S, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, S - len(seq) :], mask[i, S - len(seq) :] = torch.as_tensor(seq, dtype=torch.long), 1
    return ids.to(device), mask.to(device)
