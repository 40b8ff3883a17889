"""A virtual environment that stands in for the GPU machine's Python on this CPU machine.

The GPU machine's image has python3 (no ``python``), torch 2.11 (CUDA 13), triton 3.6,
transformers 5.17 and pytest-benchmark; nothing can be installed there and the project runs
from ``PYTHONPATH``, not installed. Here: the same triton and transformers, torch 2.13.0's
CPU build in place of 2.11+cu130, and numpy < 2.4, because triton 3.6's interpreter (which
the dry run uses; the real CUDA run does not) breaks with numpy >= 2.4. The project is not
installed in it, and it does not see this machine's site-packages.

Built once under ``$GRPO_FAST_CACHE`` (default ``~/.cache/grpo_fast``), keyed by the
requirements, and reused; pip's own cache makes a rebuild cheap.
"""

import hashlib
import os
import shutil
import subprocess
import sys

REQUIREMENTS = (
    "torch==2.13.0",
    "triton==3.6.0",
    "numpy<2.4",
    "transformers==5.17.0",
    "pytest",
    "pytest-benchmark",
    "pyyaml",
    "tqdm",
    "matplotlib",
)
CACHE = os.environ.get("GRPO_FAST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "grpo_fast"))


def venv_dir() -> str:
    """Builds the environment if it is missing; returns its folder."""
    key = hashlib.sha256(" ".join(REQUIREMENTS + (sys.version,)).encode()).hexdigest()[:12]
    path = os.path.join(CACHE, f"device-image-venv-{key}")
    if os.path.exists(os.path.join(path, "ready")):
        return path
    building = f"{path}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", building], check=True)
    pip = [os.path.join(building, "bin", "python3"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS], check=True, timeout=1200)
    open(os.path.join(building, "ready"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.rename(building, path)  # atomic: a half-built environment is never reused
    return path


def python3() -> str:
    return os.path.join(venv_dir(), "bin", "python3")


def shell_env(repo: str, **extra) -> dict:
    """An environment for running the device script as the GPU machine would: ``python3`` is
    the emulating venv's and the only Python on PATH, the project comes from PYTHONPATH."""
    shim = os.path.join(venv_dir(), "path-shim")
    os.makedirs(shim, exist_ok=True)
    link = os.path.join(shim, "python3")
    if not os.path.lexists(link):
        os.symlink(python3(), link)
    path = os.pathsep.join([shim, "/usr/bin", "/bin"])
    if shutil.which("python", path=path):  # this machine has a system `python`: hide it
        with open(os.path.join(shim, "python"), "w") as f:
            f.write("#!/bin/sh\necho 'python: command not found' >&2\nexit 127\n")
        os.chmod(os.path.join(shim, "python"), 0o755)
    env = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(PATH=path, PYTHONPATH=repo, PYTHONNOUSERSITE="1", **extra)
    return env
