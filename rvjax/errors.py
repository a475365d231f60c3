"""Project errors: bad user input or config raises one of these, with the offending value named."""


class RvjaxError(Exception):
    """Base class for errors that are the user's to fix (shown without a traceback by the CLIs)."""


class ModelNotFoundError(RvjaxError, ValueError):
    """An unknown model name or path, or a demo model whose package is not installed."""


class CheckpointError(RvjaxError, ValueError):
    """A checkpoint that does not match the model: missing, unused or wrongly shaped tensors."""


class ConfigError(RvjaxError, ValueError):
    """An engine option that cannot work: a bad dtype, max_model_len, KV budget."""


class InvalidRequestError(RvjaxError, ValueError):
    """A request the engine cannot serve: empty prompt, prompt too long, bad sampling parameters."""
