"""GRPOConfig: every knob of a run, from defaults, a YAML file and command-line overrides, in
the sections of :mod:`grpo_fast.trainer.sections`.

The defaults are the built-in demo (``grpo-fast train`` with no arguments): a tiny model
learning single-digit addition on a CPU in about 15 seconds (2 cores). Every field carries a
one-line help, which ``grpo-fast train --help`` prints beside its default.
"""

import dataclasses
import keyword
import os
import types

from grpo_fast.environments.verifiers import is_verifiers
from grpo_fast.spec import LossConfig, option, option_default
from grpo_fast.tasks import TASK_SETTINGS
from grpo_fast.trainer import checks
from grpo_fast.trainer.checks import require
from grpo_fast.trainer.sections import (
    AsyncConfig,
    CheckpointConfig,
    DataConfig,
    DeviceConfig,
    EngineConfig,
    EvalConfig,
    LogConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SpeedConfig,
    ToolConfig,
)
from grpo_fast.trainer.trl_names import TRL_ALIASES, from_trl_names

# The sections in the order of the flat config's fields, of ``--help`` and of the docs' flag
# table: the YAML name of each (``optim:`` in a file groups its keys), its attribute on the
# config (``config.optim``; ``async`` is Python's keyword) and its class.
SECTIONS = {
    "data": DataConfig,
    "rewards": RewardConfig,
    "tooling": ToolConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "async": AsyncConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "speed": SpeedConfig,
    "devices": DeviceConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "eval": EvalConfig,
}
# A run's defaults that differ from its section's: a GRPO run keeps its policy near a reference
# model, the loss alone (grpo_loss) computes no KL term unless asked.
RUN_DEFAULTS = {"beta": 0.005}


def attribute(section: str) -> str:
    """The config's attribute of a section: its name, ``async_`` for ``async``."""
    return section + "_" if keyword.iskeyword(section) else section


def title(section: str) -> str:
    """A section's ``--help`` topic and docs heading: its class's title (the loss's: its name)."""
    return getattr(SECTIONS[section], "title", section)


TOPICS = tuple(title(name) for name in SECTIONS)


def _with_sections(cls: type) -> type:
    """``cls`` with a property per section: ``config.optim`` builds that section from the
    current values and checks it (the loss's is :attr:`RunConfig.loss`)."""
    for name, section in SECTIONS.items():
        if section is not LossConfig:
            doc = f"{section.__doc__} (:class:`{section.__name__}`, built and checked when read)"
            setattr(cls, attribute(name), property(section.of, doc=doc))
    return cls


@_with_sections
class RunConfig:
    """What :class:`GRPOConfig` does beside its fields (which the sections define)."""

    def __new__(cls, *args, **kwargs):
        # the fields given (by name, or by position in field order), which no task's settings replace
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls)[: len(args)]]
        object.__setattr__(self, "_given", frozenset(names) | kwargs.keys())
        return self

    def __post_init__(self):
        """Fields may be edited one by one: validation waits for ``validate()``. Each value
        comes from a layer, a later one winning: the field's default, a built-in task's own
        settings (``TASK_SETTINGS``: the tool task's trajectory needs max_new_tokens 32, not the
        demo's 4), then what the caller gives (:meth:`from_layers`: a YAML file, then flags).
        ``sources`` names each field's layer. A verifiers environment (``verifiers:<taskset
        id>``) without a dataset plays its taskset's tasks."""
        given = getattr(self, "_given", frozenset())
        task = TASK_SETTINGS.get(self.task, {})
        self.sources = {}
        for f in dataclasses.fields(self):
            if f.name in given:
                self.sources[f.name] = "argument"
            elif f.name in task:
                setattr(self, f.name, task[f.name])
                self.sources[f.name] = f"task {self.task}"
            else:
                self.sources[f.name] = "default"
        if self.dataset is None and self.task is None and is_verifiers(self.environment):
            self.dataset = self.environment
            self.sources["dataset"] = f"environment {self.environment}"

    @property
    def loss(self) -> LossConfig:
        """The loss's section: one frozen, validated :class:`LossConfig` (dr_grpo's
        max_completion_length defaults to max_new_tokens)."""
        return LossConfig.of(self, max_completion_length=self.max_completion_length or self.max_new_tokens)

    @classmethod
    def from_dict(cls, values: dict) -> "GRPOConfig":
        """Builds and validates a config; TRL's names of our settings are taken as ours
        (``trl_names.TRL_ALIASES``), and unknown keys are a ValueError that names them."""
        values = from_trl_names(flatten(values))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys are {sorted(known)}")
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def from_layers(cls, *layers: tuple) -> "GRPOConfig":
        """Builds and validates a config from ``(name, values)`` layers above the defaults and
        the task's settings, a later layer winning where two give a field (a YAML file, then the
        flags given); ``sources`` names each field's layer."""
        values, sources = {}, {}
        for name, layer in layers:
            layer = from_trl_names(flatten(layer))
            values.update(layer)
            sources.update(dict.fromkeys(layer, name))
        config = cls.from_dict(values)
        config.sources.update(sources)
        return config

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "GRPOConfig":
        """A YAML file's config keys (:func:`read_yaml`), then ``overrides`` (None ones skipped)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls.from_layers((f"file {path}", read_yaml(path)), ("argument", given))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The settings as YAML in field order, each with the layer it came from as a comment
        (``max_new_tokens: 32  # task tool_arithmetic``), each section under a comment that names
        it; :meth:`from_yaml` reads it back."""
        import yaml

        lines, section = [], None  # the comment after a one-line value, above a longer one
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if f.metadata.get("section", section) != section:
                section = f.metadata["section"]
                lines.append(("\n" if lines else "") + f"# {section}\n")
            text = yaml.safe_dump({name: value}, sort_keys=False, width=float("inf"))
            source = self.sources[name]
            lines.append(f"{text[:-1]}  # {source}\n" if text.count("\n") == 1 else f"# {name}: {source}\n{text}")
        return "".join(lines)

    def validate(self) -> None:
        """Builds every section, each checking its own fields, then checks what spans sections;
        raises ValueError naming the first inconsistent setting."""
        for name in SECTIONS:
            getattr(self, attribute(name))
        if self.micro_batch_size is not None:
            require(
                isinstance(self.micro_batch_size, int) and 1 <= self.micro_batch_size <= self.batch_size,
                f"micro_batch_size must be an int in [1, batch_size={self.batch_size}], got {self.micro_batch_size!r}",
            )
        checks.check_asynchrony(self)
        self.check_tools(self.tools)
        require(
            self.eval_every <= self.steps,
            f"eval_every={self.eval_every} is larger than the run (steps={self.steps}): it would evaluate only at "
            "the end; pass eval_every <= steps",
        )

    def check_tools(self, tools) -> None:
        """The task, ``tools`` (the config's, or the functions given to the trainer) and the
        environment: see :func:`checks.check_turns` (before anything loads)."""
        checks.check_turns(self, tools)


def _fields():
    """GRPOConfig's fields: every section's, in order, with its help topic and section."""
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = RUN_DEFAULTS.get(f.name, option_default(f))
            spec = option(default, f.metadata["help"], topic=title(name))
            spec.metadata = types.MappingProxyType({**spec.metadata, "section": name})
            yield f.name, f.type, spec


GRPOConfig = dataclasses.make_dataclass(
    "GRPOConfig",
    list(_fields()),
    bases=(RunConfig,),
    namespace={
        "__module__": __name__,
        "__doc__": """A GRPO run: every section's fields in one mutable config, edited field by field
    and checked by ``validate()`` (:mod:`grpo_fast.trainer.sections`; the loss's options are
    :class:`grpo_fast.LossConfig`'s). ``GRPOConfig(learning_rate=1e-4)`` takes them by name, as
    the flags (``--learning-rate``) and YAML keys do; each side of the trainer reads its sections
    (``config.optim``, ``config.rollout``, ``config.loss``), built from them and checked.
    ``batch_size`` counts completions: ``batch_size // group_size`` prompts per step.""",
    },
)


def read_yaml(path: str) -> dict:
    """The mapping of config keys in the YAML file ``path``."""
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of keys to values, got {type(values).__name__}")
    return values


def flatten(values: dict) -> dict:
    """Config keys with a section's keys taken out of it (``optim: {learning_rate: 0.01}`` is
    ``learning_rate: 0.01``; TRL's names of its keys too); a key a section does not hold is a
    ValueError naming both."""
    out = {}
    for key, value in values.items():
        if key not in SECTIONS or not isinstance(value, dict):
            out[key] = value
            continue
        names = {f.name for f in dataclasses.fields(SECTIONS[key])}
        names |= {trl for trl, ours in TRL_ALIASES.items() if ours in names}
        unknown = sorted(set(value) - names)
        require(not unknown, f"config section {key!r} has no keys {unknown}; its keys are {sorted(names)}")
        out.update(value)
    return out
