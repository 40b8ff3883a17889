"""The environment's own reward: what the episode's steps gave, summed (``rollout/turns.py``)."""


def environment_reward(prompts: list, completions: list, environment_reward: list, **columns) -> list:
    """Each episode's reward from its environment (the sum of its steps' rewards; 0 for an
    episode an error ended; None where the environment gave none). A run with an environment
    passes ``environment_reward`` as a column; name this function among ``reward_funcs`` to
    weigh it beside others (it is the default with an environment)."""
    if len(environment_reward) != len(completions):
        raise ValueError(
            f"environment_reward: {len(environment_reward)} episode rewards for {len(completions)} completions"
        )
    return list(environment_reward)
