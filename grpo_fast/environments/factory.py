"""The factory that makes a fresh environment per episode, from a name, a class or a callable:
ours (:class:`~grpo_fast.environments.protocol.Environment`), TRL's ``environment_factory``
classes (wrapped in :class:`~grpo_fast.environments.protocol.TRLEnvironment`), or a verifiers
taskset (``verifiers:<id>``, ``verifiers.py``)."""

import importlib
import sys
from dataclasses import replace

from grpo_fast.environments.protocol import Environment, TRLEnvironment
from grpo_fast.tools.registry import resolve_tools

# The built-in environments: name -> "module:Class", imported when a configuration picks the name.
ENVIRONMENTS = {
    "guess_number": "grpo_fast.environments.guess_number:GuessNumber",
    "code_feedback": "grpo_fast.environments.code_feedback:CodeFeedback",
}


class EnvironmentFactory:
    """Makes a fresh :class:`Environment` per episode from ``spec``: a built-in name
    (:data:`ENVIRONMENTS`), ``"package.module:Class"``, a class / zero-argument callable (TRL's
    ``environment_factory``), or a verifiers taskset (``"verifiers:<taskset id>"`` or a
    ``vf.Taskset``). One probe instance, made here, checks it and gives the
    tools' schemas (before any model loads).

    Attributes:
        spec: what it was made from (a rollout worker makes its own factory from it).
        name: the environment's class name (its errors and log lines say it).
        tools: the :class:`Tool` s its episodes offer, with their schemas (the prompts show them).
        scores: whether its episodes score themselves (our protocol: step's rewards; TRL's:
            ``get_reward``), giving the ``environment_reward`` column.
    """

    def __init__(self, spec):
        if isinstance(spec, dict):
            raise ValueError(
                "environment: a dict of factories (TRL's several environments routed by an 'environment' column) "
                "is not supported; give one environment class"
            )
        self.spec, self.make = spec, _factory_of(spec)
        probe = self.make()
        cls = type(probe)
        self.name = cls.__name__
        self.trl = not isinstance(probe, Environment)
        if not callable(getattr(probe, "reset", None)):
            raise TypeError(f"environment {self.name}: an environment needs a reset method (TRL's and ours alike)")
        if not self.trl and type(probe).step is Environment.step:
            raise TypeError(f"environment {self.name}: an Environment subclass must implement step(message)")
        self.scores = not self.trl or callable(getattr(probe, "get_reward", None))
        self.tools = resolve_tools(self._wrap(probe).tools())

    def __call__(self) -> Environment:
        return self._wrap(self.make())

    def _wrap(self, env) -> Environment:
        return TRLEnvironment(env) if self.trl else env

    def episode_tools(self, env: Environment) -> dict:
        """``{name: Tool}`` of episode ``env``: this factory's tools, bound to that episode."""
        bound = {getattr(fn, "__name__", None): fn for fn in env.tools()}
        return {tool.name: replace(tool, function=bound[tool.name]) for tool in self.tools}


def _factory_of(spec):
    """The zero-argument callable that ``spec`` names or is."""
    if isinstance(spec, str):
        path = ENVIRONMENTS.get(spec, spec)
        module, sep, name = path.partition(":")
        if not sep:
            raise ValueError(
                f"environment {spec!r}: give a built-in name ({', '.join(sorted(ENVIRONMENTS))}), "
                "package.module:Class, or verifiers:<taskset id>"
            )
        if module == "verifiers":
            from grpo_fast.environments.verifiers import verifiers_factory

            return verifiers_factory(name)
        try:
            spec = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment {path!r} cannot be imported: {exc}") from exc
    verifiers = sys.modules.get("verifiers.v1")  # a taskset object: verifiers is imported
    if verifiers is not None and isinstance(spec, verifiers.Taskset):
        from grpo_fast.environments.verifiers import verifiers_factory

        return verifiers_factory(spec)
    if not callable(spec):
        raise TypeError(f"environment must be a class or a zero-argument callable, got {spec!r}")
    return spec


def load_environment(spec) -> EnvironmentFactory | None:
    """The :class:`EnvironmentFactory` of ``spec`` (None: none); an existing factory as it is."""
    if spec is None or isinstance(spec, EnvironmentFactory):
        return spec
    return EnvironmentFactory(spec)
