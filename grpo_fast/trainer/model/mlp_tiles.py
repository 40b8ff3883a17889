"""Decoder MLPs computed in sequence tiles: their intermediates never exist for the whole sequence.

A decoder layer's MLP is position-wise, and its intermediates are the widest tensors a layer
makes: a gated MLP's gate, up, activation and product are 4 x I floats a token (SmolLM2: 24.6 KB
a token, Qwen2.5-7B: 296 KB), against the 4H bytes of the layer's input that checkpointing
keeps. Under gradient checkpointing the recomputed layer saves them all for its backward, for the
whole packed sequence: at long completions that is what a step's peak holds most of after the
layer inputs (benchmarks/NOTES.md, "The MLP in sequence tiles").

With ``mlp_tile_tokens = T`` each decoder layer's ``mlp`` runs T tokens (positions along the
sequence dimension, the input's dim -2) at a time:

- without grad (a checkpointed layer's first forward under the reentrant checkpoint, the
  reference and old-log-prob passes, the refills of ``checkpoint_runs``) it writes each tile's
  output into the whole output, so a tile's intermediates are freed before the next tile's;
- with grad, one autograd function saves only the MLP's input; its backward recomputes each
  tile's forward (under the forward's autocast, from its random state) and takes that tile's
  gradient before the next tile's, so at most one tile's intermediates exist. The parameters
  are the function's inputs, so their gradients reach DDP's and FSDP2's hooks once, summed
  over the tiles.

It costs one more MLP forward a layer, in the backward. The gradient is the untiled one up to
the order in which the parameters' gradient sums its tokens (float64: within 1e-12 relative).
"""

import functools

import torch

from grpo_fast.trainer.model.checkpoint_runs import decoder_layers, forward_state, replayed


class _TiledMLP(torch.autograd.Function):
    """``forward(x)`` in tiles of ``tokens`` along dim -2, saving only ``x``; ``params`` are the
    MLP's trainable parameters (inputs here only so that autograd delivers their gradients)."""

    @staticmethod
    def forward(ctx, forward, tokens: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.tokens, ctx.params = forward, tokens, params
        ctx.state = forward_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _tiles(forward, x, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        params, wants_x = ctx.params, ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if wants_x else None
        sums = [None] * len(params)  # each parameter's gradient, summed over the tiles in float32 or wider
        # the tiles are recomputed in the forward's order, so one replay of its random state gives
        # each tile the draws it had
        with replayed(x.device, *ctx.state), torch.enable_grad():
            for start in range(0, x.shape[-2], ctx.tokens):
                tile = x[..., start : start + ctx.tokens, :].detach().requires_grad_(wants_x)
                out, wrt = ctx.forward(tile), ((tile,) if wants_x else ()) + params
                with torch.autocast(x.device.type, enabled=False):  # a backward runs outside autocast
                    grads = torch.autograd.grad(out, wrt, grad[..., start : start + ctx.tokens, :], allow_unused=True)
                if wants_x:
                    grad_x[..., start : start + ctx.tokens, :] = grads[0]
                for i, g in enumerate(grads[wants_x:]):
                    if g is not None:
                        g = g.to(torch.promote_types(g.dtype, torch.float32))
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        param_grads = [s if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        return None, None, grad_x, *param_grads


def _tiles(forward, x: torch.Tensor, tokens: int) -> torch.Tensor:
    """``forward(x)`` computed ``tokens`` positions (dim -2) at a time into one output."""
    first = forward(x[..., :tokens, :])
    out = first.new_empty(*x.shape[:-1], first.shape[-1])
    out[..., :tokens, :] = first
    del first
    for start in range(tokens, x.shape[-2], tokens):
        out[..., start : start + tokens, :] = forward(x[..., start : start + tokens, :])
    return out


def _tiled_forward(mlp: torch.nn.Module, tokens: int, x: torch.Tensor) -> torch.Tensor:
    """``mlp``'s forward in tiles of ``tokens`` (module docstring): what each MLP's ``forward`` is."""
    forward = functools.partial(type(mlp).forward, mlp)
    if x.dim() < 2 or x.shape[-2] <= tokens:
        return forward(x)
    if not torch.is_grad_enabled():
        return _tiles(forward, x, tokens)
    params = tuple(p for p in mlp.parameters() if p.requires_grad)
    if not (x.requires_grad or params):  # nothing to differentiate: no tile need be kept
        return _tiles(forward, x, tokens)
    return _TiledMLP.apply(forward, tokens, x, *params)


def mlp_tiles(model, tokens: int) -> None:
    """Makes every decoder layer's ``mlp`` of ``model`` (a peft model or not) run in tiles of
    ``tokens`` positions. tokens = 0 leaves them whole.

    The forward is set on each MLP instance as a partial of the MLP itself, so a deep copy of the
    model (the reference) runs its own copy's weights."""
    if tokens == 0:
        return
    for layer in decoder_layers(model, f"mlp_tile_tokens={tokens}"):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, torch.nn.Module):
            raise ValueError(
                f"mlp_tile_tokens={tokens} needs decoder layers with an `mlp` module; {type(layer).__name__} has none"
            )
        mlp.forward = functools.partial(_tiled_forward, mlp, tokens)
