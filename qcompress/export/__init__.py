"""Quantized checkpoint export (compressed-tensors layout) and loading back."""

from .errors import CheckpointError, ExportError
from .inspect import inspect_checkpoint
from .reader import load_quantized, pickle_globals
from . import fast, fuse  # noqa: F401  (they register their classes and mode="fast" with quantized.py)
from .writer import export_quantized
from .cli import cli_export, cli_inspect, main_export, main_inspect

__all__ = [
    "export_quantized",
    "load_quantized",
    "pickle_globals",
    "inspect_checkpoint",
    "CheckpointError",
    "ExportError",
    "cli_export",
    "cli_inspect",
    "main_export",
    "main_inspect",
]
