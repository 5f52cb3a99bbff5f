"""Errors raised by export and loading."""

from ..errors import CheckpointError  # noqa: F401  (one class for export folders and engine checkpoints)


class ExportError(ValueError):
    """The model cannot be exported as asked; the message names the module and the config key."""
