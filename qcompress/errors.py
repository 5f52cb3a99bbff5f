"""Exceptions raised by qcompress."""


class ConfigError(ValueError):
    """A config value is wrong. The message names the full key path, the bad value and what is allowed."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class NonFiniteError(FloatingPointError):
    """A tensor handed to a quantizer holds NaN or Inf; its scales would be meaningless."""
