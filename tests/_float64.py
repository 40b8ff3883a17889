"""Llama's RMSNorm in the input's dtype, for the float64 tests of shared prefixes.

transformers' LlamaRMSNorm computes in float32 whatever the input. A shared prompt's norm
backward then rounds once for the sum of its G completions' gradients where whole rows round
G times: both are right to float32, and the float64 tests (1e-10) are of the layout, so they
run the norm in float64. For float32 inputs it computes what the original does.
"""

from transformers.models.llama import modeling_llama


def _norm(self, hidden):
    return self.weight * hidden * (hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).rsqrt()


def patch_llama_norms(monkeypatch=None) -> None:
    """Swaps the norm's forward (through ``monkeypatch`` when given, undone after the test;
    else for the process: a test's worker)."""
    if monkeypatch is None:
        modeling_llama.LlamaRMSNorm.forward = _norm
    else:
        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _norm)
