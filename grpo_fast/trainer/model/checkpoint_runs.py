"""Gradient checkpointing that keeps one decoder layer's input in ``every``.

Hugging Face's gradient checkpointing keeps each decoder layer's input for that layer's
recompute in backward: N layers x H floats a token, what a long completion's step holds most
of once the logits are gone (SmolLM2: 30 x 2,304 B of its 97 KB a token, benchmarks/NOTES.md).
With ``checkpoint_every = k`` the layers run in runs of k: the first layer's input is kept as
before; each other layer's input is freed as soon as that layer's forward is done, and when the
gradient reaches the run, the run's inputs are recomputed from its first one (k - 1 layer
forwards, without grad) before torch's checkpoint recomputes each layer from its input as
always. The step then holds about N / k + k - 1 layer inputs instead of N, for (k - 1) / k of
a layer's forward more per layer; every gradient is the same, bit for bit, as with k = 1,
since the recomputed inputs are computed as they first were: the same layers, inputs and
keyword arguments, under the autocast and from the random state that the first forward had.

How: each decoder layer's ``_gradient_checkpointing_func`` (what ``GradientCheckpointingLayer``
calls, torch's non-reentrant checkpoint under transformers 5) is wrapped. The wrapper calls it,
then frees the input's storage (``resize_(0)``: the tensor object stays, held by torch's
checkpoint for the recompute) and hooks the layer's output, whose gradient arrives just before
the layer's backward; the hook refills the run's freed inputs in place. An input whose storage
is shared with another tensor is kept.
"""

import contextlib

import torch


class _Run:
    """One forward's run of layers: its first layer's input (kept), every layer's call, and the
    inputs freed, until the backward refills them."""

    def __init__(self, first: torch.Tensor):
        self.first = first
        self.calls = []  # (function, autocast, rng) of each layer in the run, in order
        self.freed = []  # the input of the run's layer k + 1 (or None where it was kept)

    def refill(self, _grad=None) -> None:
        """Recomputes the run's inputs from its first one and writes the freed ones back."""
        if self.first is None:  # refilled already, by an earlier layer's hook
            return
        hidden, calls, freed = self.first, self.calls, self.freed
        self.first = self.calls = self.freed = None  # hold nothing past this backward
        device = hidden.device
        with torch.no_grad():
            for (function, autocast, rng), target in zip(calls, freed):
                with replayed(device, autocast, rng):
                    hidden = _hidden(function(hidden))
                if target is not None:
                    target.untyped_storage().resize_(hidden.untyped_storage().nbytes())
                    target.untyped_storage().copy_(hidden.untyped_storage())


class CheckpointRuns:
    """The decoder layers' checkpoint functions, each wrapped as its place in a run of ``every``
    says (see the module's docstring)."""

    def __init__(self, every: int):
        self.every = every
        self.run = None

    def wrap(self, index: int, checkpoint):
        def layer_checkpoint(function, hidden, *args, **kwargs):
            if not torch.is_grad_enabled():
                return checkpoint(function, hidden, *args, **kwargs)
            if index % self.every == 0:
                self.run = _Run(hidden)
            run, state = self.run, forward_state(hidden.device)
            out = checkpoint(function, hidden, *args, **kwargs)
            run.calls.append((function, *state))
            if index % self.every:
                # no gradient through the layer (all of it frozen): no recompute, nothing to free
                freed = _free(hidden) if _hidden(out).requires_grad else None
                run.freed.append(freed)
                if freed is not None:
                    _hidden(out).register_hook(run.refill)
            return out

        return layer_checkpoint


def checkpoint_runs(model, every: int) -> None:
    """Makes ``model`` (gradient checkpointing enabled, a peft model or not) keep one decoder
    layer's input in ``every``. every = 1 leaves it as it is."""
    if every == 1:
        return
    layers = decoder_layers(model, f"checkpoint_every={every}")
    if not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
        raise ValueError(
            f"checkpoint_every={every} needs a model whose decoder's layers are transformers'"
            f" GradientCheckpointingLayer with gradient checkpointing enabled; {type(layers[0]).__name__} is not"
        )
    runs = CheckpointRuns(every)
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = runs.wrap(index, layer._gradient_checkpointing_func)


def decoder_layers(model, option: str):
    """``model``'s decoder layers (a peft model's: its base model's), or a ValueError that names
    ``option`` (the setting that needs them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    layers = getattr(base.get_decoder(), "layers", None) if hasattr(base, "get_decoder") else None
    if not layers:
        raise ValueError(
            f"{option} needs a model with decoder layers (get_decoder().layers); {type(base).__name__} has none"
        )
    return layers


def _hidden(out):
    """A decoder layer's hidden states: its output, or the output's first element."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _free(hidden: torch.Tensor):
    """Frees ``hidden``'s storage and returns it, or returns None (kept) where the storage is
    shared with another tensor."""
    storage = hidden.untyped_storage()
    whole = hidden.storage_offset() == 0 and storage.nbytes() == hidden.numel() * hidden.element_size()
    if hidden._base is not None or not whole:
        return None
    storage.resize_(0)
    return hidden


def forward_state(device: torch.device) -> tuple:
    """What a layer's forward ran under, for its replay: autocast (enabled, dtype) on the
    device's type, and the random state (CPU's, and the device's on CUDA)."""
    kind = device.type
    autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if kind == "cuda" else None)
    return autocast, rng


@contextlib.contextmanager
def replayed(device: torch.device, autocast: tuple, rng: tuple):
    """Runs the block as a layer's first forward ran: under its autocast, from its random state
    (the caller's random state restored afterwards)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        yield
