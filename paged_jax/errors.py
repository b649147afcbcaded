"""Exceptions users can catch by name."""


class ModelLoadError(ValueError):
    """A model folder cannot be loaded: missing file, bad config, unsupported architecture or weights."""
