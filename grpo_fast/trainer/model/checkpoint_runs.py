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

With ``activation_offloading`` each run's first input (every layer's, with k = 1) waits in
host memory too: copied out to pinned memory on a side CUDA stream once its layer's forward is
done, its device storage freed, and copied back on that stream when the gradient reaches the
run after it (one run ahead, so the copy overlaps that run's backward). The last run's input is
kept (its backward comes first). The device then holds about k - 1 layer inputs for the
layers' backward instead of N / k + k - 1, for two copies of N / k inputs over PCIe a step.
On CPU the host copy is in the same memory: nothing is saved there, only the mechanics tested.
"""

import contextlib

import torch

from grpo_fast.base_model import base_model


class _Run:
    """One forward's run of layers: its first layer's input (kept, or waiting in host memory),
    every layer's call, and the inputs freed, until the backward refills them."""

    def __init__(self, first: torch.Tensor, before: "_Run | None", offload: "_Offload | None"):
        self.first, self.before, self.offload = first, before, offload
        self.host = None  # the first input's copy in host memory, while its storage is freed
        self.fetched = None  # its copy back under way on CUDA: the event that ends it
        self.calls = []  # (function, autocast, rng) of each layer in the run, in order
        self.freed = []  # the input of the run's layer k + 1 (or None where it was kept)

    def stow(self) -> None:
        """Moves the first input to host memory and frees its storage (unless its storage is
        shared with another tensor: it stays)."""
        hidden = self.first
        if _whole(hidden):
            self.host = self.offload.out(hidden)
            hidden.untyped_storage().resize_(0)

    def fetch(self) -> None:
        """Starts the first input's copy back from host memory (at most once: the copy drops it)."""
        if self.host is not None:
            self.fetched = self.offload.back(self.first, self.host)
            self.host = None

    def refill(self, _grad=None) -> None:
        """Brings the run's first input back, starts the run before it on its way back (it is
        the next whose gradient arrives), and recomputes the run's freed inputs into place."""
        if self.first is None:  # refilled already, by an earlier layer's hook
            return
        self.fetch()
        _Offload.wait(self.fetched, self.first.device)
        if self.before is not None:
            self.before.fetch()
        hidden, calls, freed = self.first, self.calls, self.freed
        self.first = self.calls = self.freed = self.before = self.fetched = None  # nothing past this backward
        device = hidden.device
        with torch.no_grad():
            for (function, autocast, rng), target in zip(calls, freed):
                with replayed(device, autocast, rng):
                    hidden = _hidden(function(hidden))
                if target is not None:
                    target.untyped_storage().resize_(hidden.untyped_storage().nbytes())
                    target.untyped_storage().copy_(hidden.untyped_storage())


class _Offload:
    """Where a run's first input waits between its forward and its backward: pinned host memory,
    copied out and back on a side CUDA stream so that the copies overlap the layers' compute.
    On CPU the copy is another tensor in the same memory: the mechanics, for tests."""

    def __init__(self):
        self.stream = None

    def _side(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def out(self, hidden: torch.Tensor) -> torch.Tensor:
        """A host copy of ``hidden`` (under way on CUDA: its storage may be freed at once)."""
        if hidden.device.type != "cuda":
            return hidden.detach().clone()  # its strides kept: the storage is copied back as bytes
        side, compute = self._side(hidden.device), torch.cuda.current_stream(hidden.device)
        host = torch.empty_strided(hidden.shape, hidden.stride(), dtype=hidden.dtype, pin_memory=True)
        side.wait_stream(compute)  # hidden is written
        with torch.cuda.stream(side):
            host.copy_(hidden, non_blocking=True)
        hidden.record_stream(side)  # its memory is not reused before the copy is done
        return host

    def back(self, hidden: torch.Tensor, host: torch.Tensor):
        """Refills ``hidden``'s storage from ``host``: on CUDA on the side stream (the event that
        says it is done), on CPU at once (None)."""
        storage = hidden.untyped_storage()
        if hidden.device.type != "cuda":
            storage.resize_(host.untyped_storage().nbytes())
            storage.copy_(host.untyped_storage())  # the storage, not the tensor: autograd sees no write
            return None
        side, compute = self._side(hidden.device), torch.cuda.current_stream(hidden.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            storage.resize_(host.untyped_storage().nbytes())
            storage.copy_(host.untyped_storage(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        hidden.record_stream(compute)  # allocated on the side stream, used and freed on the compute stream
        return done

    @staticmethod
    def wait(fetched, device: torch.device) -> None:
        """The compute stream waits for a copy back under way (``fetched``: its event; None: none)."""
        if fetched is not None:
            torch.cuda.current_stream(device).wait_event(fetched)


class CheckpointRuns:
    """The decoder layers' checkpoint functions, each wrapped as its place in a run of ``every``
    says (see the module's docstring); with ``offload``, each run's first input waits in host
    memory, except the last run's (its backward comes first)."""

    def __init__(self, every: int, layers: int, offload: bool):
        self.every, self.layers = every, layers
        self.offload = _Offload() if offload else None
        self.run = None

    def wrap(self, index: int, checkpoint):
        def layer_checkpoint(function, hidden, *args, **kwargs):
            if not torch.is_grad_enabled():
                return checkpoint(function, hidden, *args, **kwargs)
            first = index % self.every == 0
            if first:
                self.run = _Run(hidden, self.run if index else None, self.offload)
            run, state = self.run, forward_state(hidden.device)
            out = checkpoint(function, hidden, *args, **kwargs)
            run.calls.append((function, *state))
            # no gradient through the layer (all of it frozen): no recompute, nothing to free
            differentiable = _hidden(out).requires_grad
            if not first:
                freed = _free(hidden) if differentiable else None
                run.freed.append(freed)
                if freed is not None:
                    _hidden(out).register_hook(run.refill)
            elif differentiable:
                # every run's first input waits in host memory but the last run's (its backward
                # comes first); the hook refills the run (a no-op if a later layer's did) and
                # drops it, so that no run outlives its backward
                if self.offload and index + self.every < self.layers:
                    run.stow()
                _hidden(out).register_hook(run.refill)
            return out

        return layer_checkpoint


def checkpoint_runs(model, every: int, offload: bool = False) -> None:
    """Makes ``model`` (gradient checkpointing enabled, a peft model or not) keep one decoder
    layer's input in ``every``, in host memory with ``offload``. every = 1 without offload
    leaves it as it is."""
    if every == 1 and not offload:
        return
    option = f"checkpoint_every={every}" if every > 1 else "activation_offloading=True"
    layers = decoder_layers(model, option)
    if not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
        raise ValueError(
            f"{option} needs a model whose decoder's layers are transformers'"
            f" GradientCheckpointingLayer with gradient checkpointing enabled; {type(layers[0]).__name__} is not"
        )
    runs = CheckpointRuns(every, len(layers), offload)
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = runs.wrap(index, layer._gradient_checkpointing_func)


def decoder_layers(model, option: str):
    """``model``'s decoder layers (a peft model's: its base model's), or a ValueError that names
    ``option`` (the setting that needs them)."""
    base = base_model(model)
    layers = getattr(base.get_decoder(), "layers", None) if hasattr(base, "get_decoder") else None
    if not layers:
        raise ValueError(
            f"{option} needs a model with decoder layers (get_decoder().layers); {type(base).__name__} has none"
        )
    return layers


def _hidden(out):
    """A decoder layer's hidden states: its output, or the output's first element."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _whole(hidden: torch.Tensor) -> bool:
    """Whether ``hidden`` alone owns its whole storage (freeing it frees no other tensor's)."""
    storage = hidden.untyped_storage()
    whole = hidden.storage_offset() == 0 and storage.nbytes() == hidden.numel() * hidden.element_size()
    return hidden._base is None and whole


def _free(hidden: torch.Tensor):
    """Frees ``hidden``'s storage and returns it, or returns None (kept) where the storage is
    shared with another tensor."""
    if not _whole(hidden):
        return None
    hidden.untyped_storage().resize_(0)
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
