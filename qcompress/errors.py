"""Exceptions raised by qcompress, and the install advice its messages give."""


def install_hint(extra: str) -> str:
    """How to add an optional part: from the checkout, as no qcompress distribution is published
    (the PyPI package named qcompress is an unrelated project)."""
    return f'pip install -e ".[{extra}]" in the qcompress checkout'


class ConfigError(ValueError):
    """A config value is wrong. The message names the full key path, the bad value and what is allowed."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self):
        # rebuilt from its two arguments, so it crosses process boundaries (spawned ranks) intact
        return type(self), (self.path, self.message)


class CheckpointError(ValueError):
    """A checkpoint on disk (an export folder or an engine checkpoint) is truncated, corrupted,
    incomplete, or does not fit the model / engine it is loaded into. The message names the file
    and, where one is at fault, the tensor."""


class NonFiniteError(FloatingPointError):
    """A tensor handed to a quantizer holds NaN or Inf; its scales would be meaningless."""
