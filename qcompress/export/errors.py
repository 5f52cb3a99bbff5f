"""Errors raised by export and loading."""


class ExportError(ValueError):
    """The model cannot be exported as asked; the message names the module and the config key."""


class CheckpointError(ValueError):
    """A checkpoint on disk is truncated, corrupted, or disagrees with its config.json.

    The message names the file and, where one is at fault, the tensor.
    """
