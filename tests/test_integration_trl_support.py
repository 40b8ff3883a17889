"""The TRL that grpo_fast.integrations.trl is written against (grpo_fast/integrations/trl_support.py).

The installed TRL must match every listed signature, caller, attribute and helper, so that a TRL
upgrade fails here first, method by method, rather than inside a training step (this module
imports the drop-in only inside its tests, so that it still collects under such a TRL); the pin of
pyproject.toml's extras must be the module's range; and a TRL that differs (another version, a
changed signature, a renamed attribute) must stop the import with one error that names it.
"""

import dataclasses
import importlib
import os
import sys
import types

import pytest

trl = pytest.importorskip("trl", reason="TRL is in the [test] extra: pip install -e '.[test]'")
tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read with Python 3.11's tomllib")

from packaging.requirements import Requirement  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

from grpo_fast.integrations import trl_support  # noqa: E402
from grpo_fast.integrations.trl_support import (  # noqa: E402
    SIGNATURES,
    TRL_REQUIREMENT,
    UnsupportedTRLError,
    check_trl,
    plain_signature,
    trl_mismatches,
    version_mismatch,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_installed_trl_has_the_expected_signature(name):
    assert plain_signature(getattr(trl.GRPOTrainer, name)) == SIGNATURES[name], (
        f"TRL {trl.__version__} changed GRPOTrainer.{name}: check the drop-in's use of it, then trl_support.py"
    )


def test_installed_trl_is_supported():
    """Nothing differs: the version, the callers of the overrides, the constructor's attributes,
    GRPOConfig's fields and trl.trainer.utils' helpers."""
    assert trl_mismatches(trl.__version__, trl.GRPOTrainer, trl.GRPOConfig, trl_utils) == []
    check_trl()


def test_the_override_takes_what_trl_passes():
    """Ours takes TRL's parameters positionally (super() gets them so) and the model inputs by
    keyword, which trl_support's list of them covers."""
    from grpo_fast.integrations.trl import GRPOTrainer

    ours = plain_signature(GRPOTrainer._get_per_token_logps_and_entropies)
    theirs = SIGNATURES["_get_per_token_logps_and_entropies"]
    assert ours.endswith(", **model_inputs)")
    assert theirs.startswith(ours.removesuffix(", **model_inputs)"))
    assert plain_signature(GRPOTrainer._compute_loss) == SIGNATURES["_compute_loss"]


def test_pyproject_pins_the_supported_range():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    pins = [Requirement(line) for line in extras["trl"] if Requirement(line).name == "trl"]
    assert [str(pin.specifier) for pin in pins] == [str(Requirement(TRL_REQUIREMENT).specifier)]
    # the test extra takes TRL through the trl extra, never a pin of its own
    tests = [Requirement(line) for line in extras["test"]]
    assert not [r for r in tests if r.name == "trl"] and any("trl" in r.extras for r in tests if r.name == "grpo-fast")


@pytest.mark.parametrize(
    "version, supported",
    [("1.16.0", True), ("1.16.3", True), ("1.16.1.dev0", True), ("1.15.2", False), ("1.17.0", False)],
)
def test_version_range(version, supported):
    assert (version_mismatch(version) is None) == supported


def test_a_version_that_is_no_release_number_is_named():
    """TRL reports "unknown" when run from a source tree without package metadata."""
    assert version_mismatch("unknown") == "the version 'unknown' is not a release number"


def test_another_version_stops_the_import(monkeypatch):
    """Importing the drop-in under a TRL that reports 1.18.0 raises one ImportError naming the
    version and the range (the module is imported afresh; the test restores any loaded one)."""
    monkeypatch.setattr(trl, "__version__", "1.18.0")
    monkeypatch.delitem(sys.modules, "grpo_fast.integrations.trl", raising=False)
    with pytest.raises(UnsupportedTRLError) as raised:
        importlib.import_module("grpo_fast.integrations.trl")
    message = str(raised.value)
    assert isinstance(raised.value, ImportError)
    assert "the installed TRL is 1.18.0" in message and TRL_REQUIREMENT in message
    assert "the version is outside the supported range" in message


def test_a_changed_signature_is_named(monkeypatch):
    """The one difference is named, at a supported version (whatever TRL runs the test)."""

    def compute_loss(self, model, inputs, num_items_in_batch):  # a parameter more than the drop-in passes
        return self._get_per_token_logps_and_entropies(model, inputs, num_items_in_batch)

    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", compute_loss)
    with pytest.raises(UnsupportedTRLError) as raised:
        check_trl()
    found = str(raised.value).split("\n- ")[1:]
    assert found == [
        "GRPOTrainer._compute_loss(self, model, inputs, num_items_in_batch), expected (self, model, inputs)"
    ]
    assert "the installed TRL is 1.16.0" in str(raised.value)


def test_every_kind_of_difference_is_named():
    """A TRL whose compute_loss calls a renamed method, whose constructor sets none of the
    attributes, whose GRPOConfig lacks a field and whose utils lack a helper: all in one list."""

    class Renamed(trl.GRPOTrainer):
        def __init__(self):
            self._metrics = {}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return self._compute_policy_loss(model, inputs)

    config = dataclasses.make_dataclass(
        "GRPOConfig", [field.name for field in dataclasses.fields(trl.GRPOConfig) if field.name != "delta"]
    )
    utils = types.SimpleNamespace(maybe_gather_lm_head_ctx=None, nanmin=None)
    found = trl_mismatches("1.16.0", Renamed, config, utils)
    assert "GRPOTrainer.compute_loss no longer calls _compute_loss, which the drop-in overrides" in found
    assert "GRPOTrainer.__init__ no longer sets _entropy_bonus_enabled" in found
    assert "GRPOTrainer.__init__ no longer sets _metrics" not in found
    assert "GRPOConfig has no field delta" in found
    assert "trl.trainer.utils has no nanmax" in found
    assert len(found) == 3 + len(trl_support.INIT_ATTRIBUTES) - 1
