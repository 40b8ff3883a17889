"""Llama's and Gemma 3's RMSNorm in the input's dtype, for the float64 tests of shared prefixes.

transformers' LlamaRMSNorm and Gemma3RMSNorm compute in float32 whatever the input. A shared
prompt's norm backward then rounds once for the sum of its G completions' gradients where whole
rows round G times: both are right to float32, and the float64 tests (1e-10) are of the layout,
so they run the norms in float64. For float32 inputs they compute what the originals do.
"""

from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama


def _rms(hidden, eps):
    return hidden * (hidden.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def _llama_norm(self, hidden):
    return self.weight * _rms(hidden, self.variance_epsilon)


def _gemma3_norm(self, hidden):
    return _rms(hidden, self.eps) * (1.0 + self.weight)


NORMS = ((modeling_llama.LlamaRMSNorm, _llama_norm), (modeling_gemma3.Gemma3RMSNorm, _gemma3_norm))


def patch_llama_norms(monkeypatch=None) -> None:
    """Swaps the norms' forwards (through ``monkeypatch`` when given, undone after the test;
    else for the process: a test's worker)."""
    for cls, forward in NORMS:
        if monkeypatch is None:
            cls.forward = forward
        else:
            monkeypatch.setattr(cls, "forward", forward)
