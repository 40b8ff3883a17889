"""Environments: stateful multi-turn episodes the model acts in.

An environment is one episode's state, made fresh for each episode by a factory (a class):

    env = factory()
    messages = env.reset(row)                          # the episode's first messages (its prompt)
    observations, done, reward = env.step(message)    # after each of the model's turns

Its observations join the sequence as tool results do (the chat template's suffix,
token-in/token-out) and stay out of the loss; the rollout loop that drives the episodes is
``grpo_fast.trainer.rollout.turns``. ``protocol.py`` holds the protocol and the adapter that
runs TRL's ``environment_factory`` classes unchanged, ``factory.py`` the factory; the built-in
environments (:data:`ENVIRONMENTS`) and the verifiers adapter sit beside them.

May import ``grpo_fast.tools``, ``grpo_fast.sandbox`` and ``grpo_fast.rewards``; never the
trainer or the tasks (a task may use an environment). Importing this package loads neither
torch nor transformers.
"""

from grpo_fast.environments.factory import ENVIRONMENTS, EnvironmentFactory, load_environment
from grpo_fast.environments.protocol import Environment, EnvStep, TRLEnvironment

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "EnvironmentFactory", "TRLEnvironment", "load_environment"]
