"""The one error type every loader raises for a file or directory it cannot use."""


class ModelLoadError(ValueError):
    """A model path that is missing, corrupt, truncated or uses unsupported features."""
