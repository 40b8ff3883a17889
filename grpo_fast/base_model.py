"""The model under a peft wrapper: what code that reaches into a transformers model's own
modules and config (its attention implementation, its decoder layers, its generation keyword
arguments, the weights vLLM loads) looks at. Imports nothing: peft is optional."""


def base_model(model):
    """``model`` itself, or a peft model's base model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
