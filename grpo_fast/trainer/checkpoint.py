"""Checkpoints: one file per step, written atomically, holding everything a resume needs.

``<output_dir>/checkpoints/step-000050.pt`` holds the trainable weights, optimizer,
scheduler, every RNG state, the step and the data position. It is written to a temporary
file in the same directory and renamed into place, so a crash mid-write never leaves a
file that looks like a checkpoint.
"""

import os
import random
import re
import tempfile

import numpy as np
import torch

_NAME = re.compile(r"step-(\d+)\.pt")
REQUIRED_KEYS = ("step", "data_position", "model", "optimizer", "scheduler", "rng", "config")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or is missing parts of the state."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj, path: str) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step-{step:06d}.pt")


def list_checkpoints(output_dir: str) -> list:
    """Checkpoint paths in ``output_dir``, oldest first."""
    directory = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    steps = sorted(int(m.group(1)) for m in map(_NAME.fullmatch, os.listdir(directory)) if m)
    return [checkpoint_path(output_dir, s) for s in steps]


def save_checkpoint(output_dir: str, state: dict, keep: int) -> str:
    """Writes ``state`` (with the REQUIRED_KEYS) for ``state["step"]``; keeps the newest ``keep``."""
    path = checkpoint_path(output_dir, state["step"])
    atomic_save(state, path)
    for old in list_checkpoints(output_dir)[:-keep]:
        os.remove(old)
    return path


def load_checkpoint(path: str) -> dict:
    """Reads a checkpoint; a truncated, corrupt or incomplete file is a :class:`CheckpointError`."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path!r} is corrupt or unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} does not hold a state dict, got {type(state).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is missing {missing}")
    return state


def latest_checkpoint(output_dir: str) -> str | None:
    paths = list_checkpoints(output_dir)
    return paths[-1] if paths else None
