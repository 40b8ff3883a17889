"""The config in sections: GRPOConfig's fields are its sections' (grpo_fast.trainer.sections and
the loss's LossConfig), in order; each side reads a section built from them and checked; a
YAML file may group its keys by section; validate() walks the sections, then checks what
spans them."""

import dataclasses

import pytest
import yaml

from grpo_fast import LossConfig
from grpo_fast.trainer.config import RUN_DEFAULTS, SECTIONS, TOPICS, GRPOConfig, attribute, flatten
from grpo_fast.trainer.sections import AsyncConfig, OptimConfig, RolloutConfig


def test_the_flat_config_is_the_sections_fields_in_order():
    flat = dataclasses.fields(GRPOConfig)
    sections = [(name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [f.name for f in flat] == [f.name for _, f in sections]  # so each name is in one section
    for f, (name, own) in zip(flat, sections):
        assert f.metadata["section"] == name and f.metadata["help"] == own.metadata["help"]
        assert f.type == own.type
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        own_default = own.default_factory() if own.default_factory is not dataclasses.MISSING else own.default
        assert default == RUN_DEFAULTS.get(f.name, own_default), f.name
    assert GRPOConfig().beta == 0.005 and LossConfig().beta == 0.0  # a run keeps a reference model
    # the help topics are the sections' titles, so a flag's heading is where its YAML key nests
    assert TOPICS[0] == "model and data" and "loss" in TOPICS and len(TOPICS) == len(SECTIONS)
    assert all(f.metadata["topic"] == TOPICS[list(SECTIONS).index(f.metadata["section"])] for f in flat)
    assert not issubclass(GRPOConfig, LossConfig)


def test_each_side_reads_a_frozen_checked_section_of_the_current_values():
    config = GRPOConfig(learning_rate=0.01, batch_size=32, group_size=8, max_staleness=1, loss_type="dr_grpo")
    assert config.optim == OptimConfig.of(config) and config.optim.learning_rate == 0.01
    assert isinstance(config.rollout, RolloutConfig) and config.rollout.prompts_per_step == 4
    assert isinstance(config.async_, AsyncConfig) and config.async_.correction_mode() == "token_truncate"
    assert config.loss.max_completion_length == config.max_new_tokens  # dr_grpo's normaliser follows it
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optim.learning_rate = 1.0
    config.learning_rate = 0.5  # the flat config is edited; the next section read sees it
    assert config.optim.learning_rate == 0.5
    for name in SECTIONS:
        section = getattr(config, attribute(name))
        assert {f.name for f in dataclasses.fields(section)} == {f.name for f in dataclasses.fields(SECTIONS[name])}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("group_size", 1, "group_size"),  # rollout
        ("vllm_sleep_level", 3, "vllm_sleep_level"),  # engine
        ("sampling_correction_min", -1.0, "sampling_correction_min"),  # async
        ("eps_low", 1.5, "eps_low"),  # loss
        ("learning_rate", 0.0, "learning_rate"),  # optim
        ("precision", "fp8", "precision"),  # speed
        ("parallel", "tp", "parallel"),  # devices
        ("keep_checkpoints", 0, "keep_checkpoints"),  # checkpoint
        ("report_to", ["nowhere"], "nowhere"),  # log
        ("eval_samples", 0, "eval_samples"),  # eval
        ("reward_weights", [1.0], "reward_weights"),  # rewards
        ("micro_batch_size", 1000, "micro_batch_size"),  # spans optim and rollout
        ("eval_every", 1000, "eval_every"),  # spans eval and rollout
    ],
)
def test_validate_walks_every_section_and_what_spans_them(field, value, message):
    config = GRPOConfig(**{field: value})  # a config is edited freely: nothing is checked yet
    with pytest.raises(ValueError, match=message):
        config.validate()
    section = config.__dataclass_fields__[field].metadata["section"]
    if field not in ("micro_batch_size", "eval_every"):  # its own section rejects it when read
        with pytest.raises(ValueError, match=message):
            getattr(config, attribute(section))


def test_a_yaml_file_may_group_its_keys_by_section(tmp_path):
    flat = {"learning_rate": 0.02, "num_generations": 8, "batch_size": 16, "eval_every": 2}
    grouped = {"optim": {"learning_rate": 0.02}, "rollout": {"num_generations": 8, "batch_size": 16}}
    grouped["eval_every"] = 2  # sections and flat keys mix
    path = tmp_path / "grouped.yaml"
    path.write_text(yaml.safe_dump(grouped))
    from_file, from_flat = GRPOConfig.from_yaml(str(path)), GRPOConfig.from_dict(flat)
    assert from_file.to_dict() == from_flat.to_dict() and from_file.group_size == 8
    assert from_file.sources["learning_rate"] == f"file {path}"
    with pytest.raises(ValueError, match=r"config section 'optim' has no keys \['group_size'\]"):
        flatten({"optim": {"group_size": 4}})
    # the run folder's config.yaml: every field under its section's name, read back as it was
    config = GRPOConfig(task="guess_number", learning_rate=0.03)
    text = config.to_yaml()
    assert [line[2:] for line in text.splitlines() if line[2:] in SECTIONS] == list(SECTIONS)
    saved = tmp_path / "config.yaml"
    saved.write_text(text)
    assert GRPOConfig.from_yaml(str(saved)).to_dict() == config.to_dict()
