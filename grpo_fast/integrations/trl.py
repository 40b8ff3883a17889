"""TRL's GRPOTrainer with grpo_fast's fused LM-head loss: change one import.

    from grpo_fast.integrations.trl import GRPOTrainer      # was: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

The subclass of ``trl.GRPOTrainer`` (TRL 1.16; with another TRL, importing this module raises
one ``UnsupportedTRLError`` that names what differs, ``trl_support.py``) keeps its constructor,
``GRPOConfig``, generation, rewards and advantages (``scale_rewards``,
``multi_objective_aggregation``, ``mask_truncated_completions`` stay TRL's own) and replaces
two things:

- **The loss.** TRL computes per-token log-probs with its chunked LM head, then the loss on
  [B, T] tensors, and its backward recomputes every logits tile. Here the model's forward runs
  the backbone and hands the last hidden states to :func:`grpo_fast.fused_linear_grpo_loss`,
  which computes the loss and every gradient in one sweep of the vocabulary (two for
  sequence-level ratios), never holding the [B, T, V] logits. The options come from
  ``GRPOConfig``: loss_type, importance_sampling_level, epsilon, epsilon_high, delta, beta,
  use_bias_correction_kl, temperature, max_completion_length (dr_grpo), sapo_temperature_*,
  top_entropy_quantile and the vLLM importance-sampling correction (the batch's
  ``importance_sampling_ratio`` multiplies the policy term, grpo_fast's
  ``importance_weights``). The gradient-accumulation normalisation is TRL's: the loss is divided
  by ``current_gradient_accumulation_steps``, or for dapo/cispo the token sum by
  ``num_items_in_batch / num_processes * accumulation steps / steps_per_generation``.
- **The no-grad log-prob passes** (old-policy and reference log-probs):
  :func:`grpo_fast.fused_linear_token_logprobs` from the last hidden states.

Shared prompts (``GRPOTrainer(..., shared_prefix=True)``, the default): each backbone pass
(the loss, the old-policy and the reference log-probs) packs its rows with
:func:`grpo_fast.packing.pack_by_prompt`, so that the rows repeating a prompt (a group's
completions, wherever TRL's shuffle put them) forward it once, each completion attending to
the prompt and itself only, at the padded forward's positions. The LM head and the loss see
the same hidden states, so the numbers are TRL's; rows with distinct prompts, and models that
cannot take the layout (``shared_layout_blocker``), run the padded rows.

The loss runs inside the model's forward (through ``model(...)``, as TRL's own fused head
does), so DDP, FSDP and DeepSpeed hooks see a normal forward, and the metrics are TRL's names
and reductions through ``self.accelerator``: ``kl``, ``entropy``, ``clip_ratio/low_mean``,
``clip_ratio/low_min``, ``clip_ratio/high_mean``, ``clip_ratio/high_max``,
``clip_ratio/region_mean``, ``cispo_clip_ratio``. The clip ratios use grpo_fast's definitions,
which differ from TRL's on purpose in two corner cases (docs/design.md): with ``delta`` the
high clip ratio is taken on the unclamped ratio, and at T = 1 token-level values are averaged
over active tokens.

``top_entropy_quantile < 1``: TRL masks the policy term to the tokens whose entropy is in
the top quantile over all processes, which needs every token's entropy before the loss. They
come from one no-grad sweep of the LM head over the same hidden states (no second backbone
pass), TRL's ``get_high_entropy_mask`` turns them into the mask, and the mask multiplies the
policy term through ``importance_weights``, as in TRL.

Tools (``tools=[...]``, ``environment_factory``, a ``rollout_func``'s ``env_mask``): TRL's tool
loop runs unchanged (parsing, tool calls, ``max_tool_calling_iterations``, the
``tools/call_frequency`` and ``tools/failure_frequency`` metrics). Its ``tool_mask`` (1 for the
model's tokens, 0 for the tool results') multiplies the completion mask as in TRL's
``_compute_loss``: tool-result tokens are attended to but are out of the loss, the KL, the
sequence-level ratio, the importance-sampling correction, the entropy quantile and the
metrics, and never go through the LM head; the dapo/cispo normaliser is TRL's
``num_items_in_batch``, which counts the model's tokens only.

What the fused loss does not cover defers to TRL's own path, with one warning per reason,
never a silent change of the math: loss types grpo_fast does not have (vespo), the
off-policy sequence mask, the entropy bonus, MoE auxiliary losses, models whose forward takes
extra inputs (images, token types), models that scale or soft-cap their logits, and options
that grpo_fast rejects (e.g. ``delta <= 1``). ``use_liger_kernel`` is compatible: in TRL 1.16
it only patches the backbone's layers, which this forward runs.

Two differences in what is computed, neither in the loss or its gradient: under autocast the
LM head runs in the autocast dtype with a float32 weight-gradient accumulator (TRL: the same);
and the old/reference log-probs of padded completion positions are the model's values
where TRL stores 0 (they are masked out of the loss and the metrics either way).
"""

import functools
import types
import warnings

import torch
import trl
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from trl.trainer import utils as trl_utils

from grpo_fast.integrations.trl_support import MODEL_INPUT_KEYS, check_trl
from grpo_fast.model_files import model_folder
from grpo_fast.ops import fused_linear_token_logprobs
from grpo_fast.ops.fused_linear_grpo_loss import fused_linear_loss_with_tokens
from grpo_fast.ops.policy import LossInputs
from grpo_fast.packing import pack_by_prompt, packed_hidden, shared_layout_blocker, to_grid, use_packed_attention
from grpo_fast.spec import LOSS_TYPES, LossConfig

# Before anything reads TRL's internals: one clear error for a TRL this module is not written for.
check_trl()

# Config fields by which a model scales or soft-caps its logits (TRL's fused head reads the same).
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def add_hidden_state_head(model) -> None:
    """Lets ``model(..., grpo_fast_head=head)`` run the backbone and return
    ``head(hidden [B, T, H], lm_head)`` instead of the logits, ``hidden`` the last hidden
    states that predict the T = ``head.ids.shape[1]`` completion tokens. With
    ``grpo_fast_pack`` (a :func:`~grpo_fast.packing.pack_by_prompt` of the rows)
    the backbone runs on the pack instead of the padded rows, each shared prompt once, and
    ``hidden`` is 0 where a row has no token. Without the keywords the forward is the
    previous one (generation and TRL's own fused head unchanged)."""
    previous = model.forward

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def forward(self, *args, grpo_fast_head=None, grpo_fast_pack=None, **kwargs):
        if grpo_fast_head is None:
            return previous(*args, **kwargs)
        if grpo_fast_pack is not None:
            hidden = to_grid(packed_hidden(self, grpo_fast_pack).unsqueeze(0), grpo_fast_pack)
        else:
            for unused in ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep"):  # PEFT passes them
                kwargs.pop(unused, None)
            kwargs["use_cache"] = False
            T = grpo_fast_head.ids.shape[1]
            hidden = self.base_model(*args, **kwargs).last_hidden_state[:, -T - 1 : -1]
        return grpo_fast_head(hidden, self.get_output_embeddings())

    model.forward = types.MethodType(forward, model)


def head_operands(hidden, lm_head, fp32: bool):
    """(hidden, weight, bias) of the LM head in the dtype it runs in: float32 with
    ``cast_lm_head_to_fp32``, else the autocast dtype under autocast, else the weight's."""
    weight, bias = lm_head.weight, lm_head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards the head
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    device = hidden.device.type
    if fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = weight.dtype
    return (hidden.to(weight.device, dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


class LogprobsHead:
    """The no-grad head: per-token log-probs (and entropies) of the completion tokens ``ids``."""

    def __init__(self, ids, temperature, return_entropy, fp32):
        self.ids, self.temperature, self.return_entropy, self.fp32 = ids, temperature, return_entropy, fp32

    def __call__(self, hidden, lm_head):
        with trl_utils.maybe_gather_lm_head_ctx(lm_head.weight, lm_head.bias):
            hidden, weight, bias = head_operands(hidden, lm_head, self.fp32)
            with torch.autocast(hidden.device.type, enabled=False):
                return fused_linear_token_logprobs(
                    hidden,
                    weight,
                    self.ids,
                    bias=bias,
                    temperature=self.temperature,
                    return_entropy=self.return_entropy,
                )


class LossHead:
    """The loss head: ``fused_linear_grpo_loss`` of the completion positions.

    Returns the loss before TRL's gradient-accumulation normaliser (for dapo/cispo the
    masked token sum); keeps the per-token values behind it (``TokenValues``: the ratio and
    KL of each swept token, computed once) and the entropies [B, T] for the metrics.
    """

    def __init__(self, trainer, config: LossConfig, ids, mask, advantages, old, ref, weights):
        self.trainer, self.config, self.ids, self.mask = trainer, config, ids, mask
        self.advantages, self.old, self.ref, self.weights = advantages, old, ref, weights
        self.tokens = self.entropy = None

    def __call__(self, hidden, lm_head):
        config, ids, mask = self.config, self.ids, self.mask
        with trl_utils.maybe_gather_lm_head_ctx(lm_head.weight, lm_head.bias):
            hidden, weight, bias = head_operands(hidden, lm_head, self.trainer.args.cast_lm_head_to_fp32)
            with torch.autocast(hidden.device.type, enabled=False):
                weights, entropy = self.weights, None
                if self.trainer.top_entropy_quantile < 1.0:
                    _, entropy = fused_linear_token_logprobs(
                        hidden.detach(),
                        weight.detach(),
                        ids,
                        bias=bias,
                        temperature=config.temperature,
                        return_entropy=True,
                    )
                    high = self.trainer.get_high_entropy_mask(entropy, mask, 1 - self.trainer.top_entropy_quantile)
                    weights = high if weights is None else weights * high
                # dapo/cispo: the token sum (normaliser 1); TRL's normaliser divides it afterwards
                num_items = 1 if config.kind.aggregation == "global_tokens" else None
                if weights is not None and weights.shape[1] == 1:  # TRL's sequence-level [B, 1]: the op's [B]
                    weights = weights.squeeze(1)
                inputs = LossInputs(self.advantages, mask, self.old, self.ref, weights, num_items)
                # fused_linear_grpo_loss, keeping the per-token values that TRL's per-sequence metrics need
                out, self.tokens = fused_linear_loss_with_tokens(
                    hidden, weight, bias, ids, inputs, config, return_entropy=entropy is None
                )
        self.entropy = self.tokens.on_grid(self.tokens.entropy, mask.shape) if entropy is None else entropy
        return out.loss


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss and no-grad log-prob passes run grpo_fast's fused LM head.

    Same constructor, same ``trl.GRPOConfig``; see the module docstring for what is honoured
    and what defers to TRL. ``model`` may also be a ``.gguf`` file or ``package:<module>``
    (read from its converted folder, ``grpo_fast/model_files.py``), and TRL saves ordinary folders.
    """

    def __init__(self, model, *args, shared_prefix: bool = True, **kwargs):
        if not isinstance(shared_prefix, bool):
            raise TypeError(f"shared_prefix must be a bool, got {shared_prefix!r}")
        super().__init__(model_folder(model), *args, **kwargs)
        self._grpo_fast_warned = set()
        # Each prompt through the backbone once per micro-batch, where the model can take it.
        self.shared_prefix = shared_prefix and shared_layout_blocker(self.model) is None
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        for built in (base, self.ref_model):
            if built is not None:
                add_hidden_state_head(built)
                if self.shared_prefix:  # the packed passes' attention, set once (unpacked calls: as before)
                    use_packed_attention(built)
        text_config = self.model.config.get_text_config()
        self._logit_transform = [
            name for name in LOGIT_TRANSFORMS if getattr(text_config, name, None) not in (None, 1, 1.0)
        ]

    # ------------------------------------------------------------------ what the fused path covers

    def _unsupported_model(self, inputs: dict):
        """Why TRL's own log-prob path must run for this model and batch (a short phrase), or None."""
        if self._logit_transform:
            return f"a model that transforms its logits ({', '.join(self._logit_transform)})"
        extra = [key for key in MODEL_INPUT_KEYS if inputs.get(key) is not None]
        if extra:
            return f"extra model inputs ({', '.join(extra)})"
        return None

    def _unsupported_loss(self, inputs: dict):
        """Why TRL's own loss must run (a short phrase), or None."""
        if self.loss_type not in LOSS_TYPES:
            return f"loss_type={self.loss_type!r}"
        if self.off_policy_mask_threshold is not None:
            return "off_policy_mask_threshold"
        if self._entropy_bonus_enabled:
            return "the entropy bonus (entropy_coef, use_adaptive_entropy)"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss (router_aux_loss_coef)"
        return self._unsupported_model(inputs)

    def _grpo_fast_defer(self, reason: str) -> None:
        if reason not in self._grpo_fast_warned:
            self._grpo_fast_warned.add(reason)
            warnings.warn(
                f"grpo_fast: {reason} is not covered by the fused loss; TRL's own path computes it", stacklevel=3
            )

    def loss_config(self) -> LossConfig:
        """The run's loss options as a :class:`grpo_fast.LossConfig` (raises ValueError for
        options grpo_fast rejects)."""
        args = self.args
        return LossConfig(
            beta=self.beta,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            delta=args.delta,
            temperature=self.temperature,
            loss_type=self.loss_type,
            importance_sampling=self.importance_sampling_level,
            kl_bias_correction=bool(args.use_bias_correction_kl),
            max_completion_length=self.max_completion_length,
            sapo_tau_pos=args.sapo_temperature_pos,
            sapo_tau_neg=args.sapo_temperature_neg,
        )

    def _backbone_inputs(self, input_ids, attention_mask, num_completion_tokens: int) -> dict:
        """The backbone's inputs for rows [B, L] whose last ``num_completion_tokens`` columns
        are completions: packed with each repeated prompt once (``shared_prefix``; positions
        are the padded columns, as TRL's forward has them), else the padded rows."""
        if self.shared_prefix:
            packed = pack_by_prompt(input_ids, attention_mask, num_completion_tokens, padded_positions=True)
            if packed.prefix is not None:
                return {"grpo_fast_pack": packed}
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    # ------------------------------------------------------------------ the overridden steps

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        reason = self._unsupported_model(model_inputs)
        if torch.is_grad_enabled() or compute_aux_loss or reason is not None:
            if reason is not None:
                self._grpo_fast_defer(reason)
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **model_inputs,
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            head = LogprobsHead(
                input_ids[rows, -logits_to_keep:], self.temperature, compute_entropy, self.args.cast_lm_head_to_fp32
            )
            with self.accelerator.autocast():
                out = model(
                    **self._backbone_inputs(input_ids[rows], attention_mask[rows], logits_to_keep), grpo_fast_head=head
                )
            logp, entropy = out if compute_entropy else (out, None)
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _compute_loss(self, model, inputs):
        reason = self._unsupported_loss(inputs)
        if reason is None:
            try:
                config = self.loss_config()
            except ValueError as error:
                reason = f"an option grpo_fast rejects ({error})"
        if reason is not None:
            self._grpo_fast_defer(reason)
            return super()._compute_loss(model, inputs)

        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        # TRL's loss mask: tool-result tokens (tool_mask 0) are attended to, never in the loss
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = inputs["importance_sampling_ratio"]  # [B, T] or [B, 1]
        head = LossHead(
            self,
            config,
            completion_ids,
            mask,
            inputs["advantages"],
            inputs.get("old_per_token_logps"),
            inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
            weights,
        )
        ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        with self.accelerator.autocast():
            loss = model(**self._backbone_inputs(ids, attention, completion_ids.shape[1]), grpo_fast_head=head)
        self._grpo_fast_metrics(mode, config, head)
        return loss / self._loss_normalizer(config, inputs, mode)

    # ------------------------------------------------------------------ TRL's normaliser and metrics

    def _loss_normalizer(self, config: LossConfig, inputs, mode: str):
        """What TRL divides the micro-batch loss by (gradient accumulation; dapo/cispo: the
        generation batch's token count rescaled to one accumulation window and one process)."""
        train = mode == "train"
        if config.kind.aggregation != "global_tokens":
            return self.current_gradient_accumulation_steps if train else 1.0
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if train:
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _grpo_fast_metrics(self, mode: str, config: LossConfig, head: LossHead) -> None:
        """TRL's loss metrics, gathered and reduced across processes as TRL does."""
        tokens, shape = head.tokens, head.mask.shape
        ev, batch = tokens.evaluation, tokens.batch
        mask = tokens.on_grid(batch.mask, shape)  # the per-token values of the loss's own evaluation, [B, T]
        kl = None if ev.kl is None else tokens.on_grid(ev.kl, shape)
        w = tokens.on_grid(ev.w, shape) if ev.w_seq is None else ev.w_seq.unsqueeze(1)
        adv = tokens.on_grid(batch.adv, shape) if batch.seq_adv is None else batch.seq_adv.unsqueeze(1)

        def per_sequence(x):  # [B, 1]: one value per sequence (grpo_fast's rule, also at T = 1)
            return x.shape[-1] == 1 and config.importance_sampling == "sequence"

        def global_mean(x):
            if per_sequence(x):
                local = torch.stack([x.sum().float(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum().float(), mask.sum().float()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def sequence_means(x):  # NaN for an empty row, which nanmin/nanmax skip
            return x.squeeze(1) if per_sequence(x) else (x * mask).sum(-1) / mask.sum(-1)

        metrics = self._metrics[mode]
        if config.beta != 0.0:
            metrics["kl"].append(global_mean(kl))
        metrics["entropy"].append(global_mean(head.entropy))
        low, high = (flag.to(mask.dtype) for flag in config.kind.clip_flags(w, adv, config))
        if config.kind.clipped:
            metrics["clip_ratio/low_mean"].append(global_mean(low))
            metrics["clip_ratio/high_mean"].append(global_mean(high))
            metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
            metrics["clip_ratio/low_min"].append(trl_utils.nanmin(self.accelerator.gather(sequence_means(low))).item())
            metrics["clip_ratio/high_max"].append(
                trl_utils.nanmax(self.accelerator.gather(sequence_means(high))).item()
            )
        elif config.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(global_mean(high))
