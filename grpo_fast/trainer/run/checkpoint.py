"""Checkpoints: one folder per step, written by every rank, complete or invisible.

    <output_dir>/checkpoints/step-000050/
        .metadata, __0_0.distcp, ...   the trainable weights and AdamW states, by name
                                       (torch.distributed.checkpoint: each rank writes its
                                       shards, a replicated tensor once): the policy's as
                                       model.* and optimizer.*, each part the run's strategy
                                       trains beside it under the part's name
        trainer.pt                     step, data position, LR schedules, config (rank 0)
        rng-0.pt, rng-1.pt, ...        each rank's RNG states
        manifest.json                  every other file's size and CRC-32s (rank 0, in the background)

Every rank writes into ``checkpoints/.tmp-step-000050``, each file flushed to the disk; when
all are done rank 0 renames the folder into place, so a crash mid-write never leaves a folder
that looks like a checkpoint. The manifest follows from a background thread while training goes
on (a pass over the files: on 2 cores it would double a save's time); the next save, the run's
end and the interpreter's exit wait for it, and a checkpoint without one loads with the older
checks only. A write that fails on any rank (a full disk) fails the save on every
rank (they agree, none waits for the others): its folder is removed, the previous checkpoint
is left as it was, and :class:`CheckpointSaveError` says where and why in one line. Loading
checks the manifest first, so a truncated or corrupted file is named before anything is read
(:func:`latest_valid_checkpoint` skips such a checkpoint for the one before). Tensors are stored
with their global shapes, so a checkpoint loads at any world size, under DDP or FSDP2
(resharded on load), and in a plain process without a process group.
"""

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from grpo_fast.trainer import distributed
from grpo_fast.trainer.run import hub
from grpo_fast.trainer.update.optimization import load_schedule_state, schedule_state

logger = logging.getLogger("grpo_fast")

_NAME = re.compile(r"step-(\d+)")
TRAINER_STATE = "trainer.pt"
MANIFEST = "manifest.json"
REQUIRED_KEYS = ("step", "data_position", "scheduler", "config")
# The manifest's CRC-32s are taken over pieces of this size, in parallel threads (zlib releases
# the GIL): the checksums of a checkpoint cost its size / (cores x ~3.7 GB/s).
_PIECE = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, is missing parts of the state or is another model's."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (its partial folder is gone, the previous one intact)."""


def rng_state() -> dict:
    """The global generators' states; of CUDA's, the current device's only (this rank's GPU:
    a job resumed where fewer GPUs are visible has no generator for the others)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step-{step:06d}")


def list_checkpoints(output_dir: str) -> list:
    """Checkpoint folders in ``output_dir``, oldest first."""
    directory = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    steps = sorted(int(m.group(1)) for m in map(_NAME.fullmatch, os.listdir(directory)) if m)
    return [checkpoint_path(output_dir, s) for s in steps]


def latest_checkpoint(output_dir: str) -> str | None:
    paths = list_checkpoints(output_dir)
    return paths[-1] if paths else None


def latest_valid_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint of ``output_dir`` that passes :func:`verify_checkpoint`, None when
    there is none; each one skipped is logged with the file that failed."""
    for path in reversed(list_checkpoints(output_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as exc:
            logger.warning("--resume auto skips it: %s", exc)
    return None


def _crc32s(path: str) -> list:
    """The CRC-32s of the file at ``path``, one per ``_PIECE`` bytes, hex."""
    size = os.path.getsize(path)

    def piece(start: int) -> str:
        with open(path, "rb") as f:
            f.seek(start)
            return f"{zlib.crc32(f.read(_PIECE)):08x}"

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(piece, range(0, max(size, 1), _PIECE)))


# The one thread that writes manifests, and the manifests it has yet to finish.
_MANIFESTS = ThreadPoolExecutor(1, thread_name_prefix="grpo_fast-manifest")
_pending: list = []


def wait_for_manifests() -> None:
    """Returns when every manifest a save started is written (a failed one was logged)."""
    while _pending:
        _pending.pop(0).result()


def _write_manifest_of(folder: str) -> None:
    try:
        _write_manifest(folder)
    except OSError as exc:  # the checkpoint stays loadable without it
        logger.warning("checkpoint %r has no manifest: %s", folder, exc)


def _write_manifest(folder: str) -> None:
    """``folder``'s manifest.json, through a temp name (a reader never sees half of one)."""
    files = sorted(name for name in os.listdir(folder) if not name.startswith(MANIFEST))
    entries = {
        name: dict(bytes=os.path.getsize(os.path.join(folder, name)), crc32=_crc32s(os.path.join(folder, name)))
        for name in files
    }
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    _write(lambda f: f.write(json.dumps(dict(files=entries), indent=1).encode()), tmp)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def verify_checkpoint(path: str) -> None:
    """Every file of the checkpoint at ``path`` is there with the size and CRC-32s its manifest
    records (a checkpoint written before manifests: only that its trainer state is there);
    raises :class:`CheckpointError` naming the first file that is not."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path!r} is corrupt or incomplete: {what}")

    wait_for_manifests()  # one this process is still writing
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        if not os.path.exists(os.path.join(path, TRAINER_STATE)):
            raise bad(f"{TRAINER_STATE} is missing")
        return
    try:
        with open(manifest) as f:
            entries = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise bad(f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})") from exc
    for name, entry in entries.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise bad(f"{name} is missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise bad(f"{name} has {size} bytes, its manifest {entry['bytes']} (truncated)")
        if _crc32s(file) != entry["crc32"]:
            raise bad(f"{name} fails its CRC-32 check")


def _model_and_optimizer(model, optimizer) -> dict:
    """``{"model": trainable weights by name, "optimizer": its states by parameter name}``:
    this rank's shards under FSDP2 (DTensors), whole tensors otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, states = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": weights, "optimizer": states}


def _stored_tensors(model, optimizer, more: dict) -> dict:
    """What a checkpoint stores: the policy's ``_model_and_optimizer`` at the top, each of
    ``more`` (``{name: (model, optimizer)}``) under its name."""
    tensors = _model_and_optimizer(model, optimizer)
    tensors.update({name: _model_and_optimizer(*pair) for name, pair in more.items()})
    return tensors


@contextlib.contextmanager
def _quiet_without_process_group():
    """DCP warns on each save and load without a process group that it assumes a single
    process: that is this module's plain-process case, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _write(write, path: str) -> None:
    """``write(f)`` into a new file at ``path``, flushed to the disk."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _save(obj, path: str) -> None:
    _write(lambda f: torch.save(obj, f), path)


def _attempt(write) -> BaseException | None:
    """The error ``write()`` raised (an OSError, or DCP's CheckpointException, a BaseException),
    None when it wrote."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except (Exception, CheckpointException) as exc:
        return exc
    return None


def _on_every_rank(ranks, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (every rank calls it: one all-reduce)."""
    return not ranks.max(int(not ok))


def _finite(modules: list, ranks) -> bool:
    """Whether every trainable weight of ``modules`` is finite, on every rank (its shards)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for m in modules for p in m.parameters() if p.requires_grad]
    return _on_every_rank(ranks, not local or bool(torch.stack([torch.isfinite(p).all() for p in local]).all()))


def save_checkpoint(output_dir: str, state: dict, model, optimizer, ranks, keep: int, more: dict | None = None) -> str:
    """Writes the checkpoint of ``state["step"]`` (``state`` holds the REQUIRED_KEYS) with the
    trainable weights of ``model`` and the states of ``optimizer``, and those of every other
    trained ``{name: (model, optimizer)}`` in ``more``; keeps the newest ``keep``. Every rank
    of ``ranks`` (a ``distributed.Ranks``) calls it. A weight that is not finite, or a write
    that fails on any rank, is a :class:`CheckpointSaveError` on every rank: nothing of this
    checkpoint is left, the others are as they were."""
    import torch.distributed.checkpoint as dcp

    wait_for_manifests()  # the previous save's: a pruned checkpoint must not be read meanwhile
    more = more or {}
    path = checkpoint_path(output_dir, state["step"])
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    if not _finite([model, *(m for m, _ in more.values())], ranks):
        raise CheckpointSaveError(f"checkpoint {path!r} not written: the weights hold a NaN or an infinity")
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
    ranks.barrier()

    def small_files():
        os.makedirs(tmp, exist_ok=True)
        _save(rng_state(), os.path.join(tmp, f"rng-{ranks.rank}.pt"))
        if ranks.is_main:
            _save(state, os.path.join(tmp, TRAINER_STATE))

    def tensors():
        with _quiet_without_process_group():  # DCP fails on every rank when one rank's write does
            dcp.save(_stored_tensors(model, optimizer, more), checkpoint_id=tmp)

    def publish():
        shutil.rmtree(path, ignore_errors=True)  # the same step written again by a resumed run
        os.replace(tmp, path)

    error = _attempt(small_files)
    written = _on_every_rank(ranks, error is None)
    if written:
        error = _attempt(tensors)
    if written and ranks.is_main and error is None:
        error = _attempt(publish)
    if not _on_every_rank(ranks, error is None):
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = (
            f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}" if error else "another rank's write failed"
        )
        raise CheckpointSaveError(
            f"checkpoint {path!r} not written ({cause}); its partial folder is removed, the newest checkpoint "
            f"is {latest_checkpoint(output_dir)!r}"
        ) from error
    if ranks.is_main:
        _pending.append(_MANIFESTS.submit(_write_manifest_of, path))
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    ranks.barrier()
    return path


def verify_on_rank_0(path: str, ranks) -> None:
    """:func:`verify_checkpoint` by rank 0 alone (one pass over the files, not one per rank);
    its :class:`CheckpointError` is raised on every rank."""
    error = None
    if ranks.is_main:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            error = str(exc)
    error = ranks.broadcast(error)
    if error is not None:
        raise CheckpointError(error)


def load_checkpoint(path: str, model, optimizer, ranks, more: dict | None = None, verified: bool = False) -> dict:
    """Restores the trainable weights of ``model`` and the states of ``optimizer`` (resharded
    to this job), those of each ``{name: (model, optimizer)}`` in ``more``, and this rank's RNG
    states (a rank the checkpoint did not have keeps its own seeding: copying another rank's
    would make the two draw alike); returns the trainer state (the REQUIRED_KEYS). A
    truncated, corrupt or incomplete checkpoint (its manifest checked first by rank 0, unless the
    caller has: ``verified``), or another model's, is a :class:`CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if not verified:
        verify_on_rank_0(path, ranks)
    try:
        state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=False)
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path!r} is corrupt or unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} does not hold a trainer state dict, got {type(state).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is missing {missing}")
    more = more or {}
    tensors = _stored_tensors(model, optimizer, more)
    _check_model(path, tensors["model"], stored, "model.")
    for name in more:
        _check_model(path, tensors[name]["model"], stored, f"{name}.model.")
    try:
        with _quiet_without_process_group():
            dcp.load(tensors, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; its last line is the cause
        cause = str(exc).strip().splitlines()[-1]
        raise CheckpointError(f"checkpoint {path!r} is corrupt or unreadable ({cause})") from exc
    options = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen weights are not stored; names checked
    for module, optim, part in [(model, optimizer, tensors), *((*pair, tensors[name]) for name, pair in more.items())]:
        set_state_dict(
            module, optim, model_state_dict=part["model"], optim_state_dict=part["optimizer"], options=options
        )
    rng = os.path.join(path, f"rng-{ranks.rank}.pt")
    if os.path.exists(rng):
        set_rng_state(torch.load(rng, weights_only=False))
    return state


def _check_model(path: str, weights: dict, stored: dict, prefix: str) -> None:
    """The checkpoint's weights (DCP metadata ``stored``, keys ``<prefix><name>``) have the
    model's trainable names and shapes."""
    shapes = {key[len(prefix) :]: list(meta.size) for key, meta in stored.items() if key.startswith(prefix)}
    if set(shapes) != set(weights):
        missing, extra = sorted(set(weights) - set(shapes)), sorted(set(shapes) - set(weights))
        what = "the model" if prefix == "model." else f"the {prefix.split('.')[0]} model"
        raise CheckpointError(
            f"checkpoint {path!r} does not match {what}: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, tensor in weights.items():
        if shapes[name] != list(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path!r}: {name} has shape {shapes[name]}, the model {list(tensor.shape)}"
            )


def full_model_state(model) -> dict:
    """The whole weights of an FSDP2-sharded ``model`` on rank 0's CPU (empty elsewhere); every
    rank calls it (it gathers). Tied weights (one parameter under two names) stay one tensor, so
    that ``save_pretrained`` stores them once, as it does for the unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first_name = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(param), name)
        if first != name and name in weights:
            weights[name] = weights[first]
    return weights


# ----------------------------------------------------------------------------- a trainer's
def save_trainer(trainer) -> str:
    """Writes ``trainer``'s checkpoint of its step: the policy and its optimizer, every part its
    strategy trains beside it (``trainer.strategy.parts()``) under the part's name, the step,
    the data position, the LR schedules and the config (every rank its shards)."""
    parts = trainer.strategy.parts()
    state = dict(
        step=trainer.step,
        data_position=trainer.data_position,
        scheduler=schedule_state(trainer.scheduler),
        config=trainer.config.to_dict(),
        **{f"{name}_scheduler": schedule_state(part.scheduler) for name, part in parts.items()},
    )
    more = {name: (part.module, part.optimizer) for name, part in parts.items()}
    ranks, keep = trainer.runtime.ranks, trainer.config.keep_checkpoints
    return save_checkpoint(trainer.output_dir, state, trainer.policy, trainer.optimizer, ranks, keep=keep, more=more)


def load_trainer(trainer, path: str, verified: bool = False) -> dict:
    """Restores what :func:`save_trainer` wrote into ``trainer`` (weights, optimizers, LR
    schedules, RNG states, step and data position); returns the checkpoint's state.
    ``verified``: its manifest is already checked (:func:`load_checkpoint`)."""
    parts = trainer.strategy.parts()
    more = {name: (part.module, part.optimizer) for name, part in parts.items()}
    state = load_checkpoint(path, trainer.policy, trainer.optimizer, trainer.runtime.ranks, more, verified)
    load_schedule_state(trainer.scheduler, state["scheduler"])
    for name, part in parts.items():
        load_schedule_state(part.scheduler, state[f"{name}_scheduler"])
    trainer.step, trainer.data_position = state["step"], state["data_position"]
    return state


def save_final(trainer) -> str:
    """``save_pretrained`` of ``trainer``'s policy and tokenizer to ``<output_dir>/final`` (via
    a temp dir) with its model card (README.md, ``hub.py``), by rank 0; under FSDP2 the whole
    weights are first gathered to its CPU. Returns the folder."""
    final = os.path.join(trainer.output_dir, "final")
    weights = full_model_state(trainer.policy) if distributed.is_sharded(trainer.modules.packed) else None
    if trainer.runtime.ranks.is_main:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.policy.save_pretrained(tmp, state_dict=weights)
        trainer.tokenizer.save_pretrained(tmp)
        hub.write_card(tmp, trainer.config, trainer.history, reward_names=trainer.reward_names, **trainer.card_options)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    trainer.runtime.ranks.barrier()
    return final
