"""`qcompress export` / `qcompress inspect` entry points (qcompress/cli.py dispatches here).

export builds the model with a user factory `package.module:function` (called with no
arguments), applies the qcompress config with init_compression, loads the trained state (a
state_dict .safetensors with --weights, or an engine checkpoint with --checkpoint, which also
holds static activation ranges), puts every quantized module at its group's target_bits (the end
of the bit schedule), bakes with redundancy_clean, and writes the export.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys

from .errors import ExportError


class FactoryError(ExportError):
    """--model names no importable callable; `qcompress export` prints it and exits with status 2."""


def _import_factory_module(spec: str, mod: str):
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as err:
        # only a miss of the named module (or its package) is the user's spelling; a missing
        # dependency inside their module keeps its traceback
        if err.name is None or not (mod == err.name or mod.startswith(err.name + ".")):
            raise
        raise FactoryError(
            f"--model {spec}: no module named {err.name!r} (looked in the current "
            f"directory {os.getcwd()} and on sys.path)"
        ) from None


@contextlib.contextmanager
def _cwd_on_path():
    """The current directory first on sys.path while the factory is imported and called, as
    `python -m qcompress` has it (the console script alone would not see a local mymodels.py)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _factory(spec: str):
    """The callable `package.module:function` names (call inside _cwd_on_path)."""
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise FactoryError(f"--model must look like 'package.module:function', got {spec!r}")
    module = _import_factory_module(spec, mod)
    if not hasattr(module, fn):
        names = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(fn, names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FactoryError(
            f"--model {spec}: module {mod!r} ({getattr(module, '__file__', '?')}) has no attribute {fn!r}{hint}"
        )
    factory = getattr(module, fn)
    if not callable(factory):
        raise FactoryError(
            f"--model {spec}: {mod}.{fn} is a {type(factory).__name__}, not a callable that builds the model"
        )
    return factory


def _build_model(spec: str):
    import torch.nn as nn

    with _cwd_on_path():
        model = _factory(spec)()
    if not isinstance(model, nn.Module):
        raise FactoryError(f"--model {spec}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def cli_export(args) -> int:
    """args: model ('module:function'), weights (.safetensors, optional), config, out,
    max_shard_size ('2GB'), force (bool)."""
    import qcompress

    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint and getattr(args, "weights", None):
        raise SystemExit("qcompress export: give --weights or --checkpoint, not both")
    model = _build_model(args.model)
    if getattr(args, "weights", None):
        load_weights(model, args.weights)
    cfg = qcompress.load_config(args.config)
    qcompress.init_compression(model, cfg)
    if checkpoint:
        sched = _load_engine_checkpoint(model, cfg, checkpoint, getattr(args, "tag", None))
    else:
        sched = qcompress.CompressionScheduler(model, cfg)
    sched.finish()  # target bits (requantized from the master copy in optimizer-step mode)
    qcompress.redundancy_clean(model, cfg)
    out = qcompress.export_quantized(
        model,
        args.out,
        cfg,
        max_shard_size=getattr(args, "max_shard_size", "2GB"),
        force=bool(getattr(args, "force", False)),
    )
    print(f"wrote {out}")
    return 0


def load_weights(model, path: str) -> None:
    """Load the state_dict file `path` (--weights) into `model`, strictly, with errors that name
    the file and tensors (CheckpointError: `qcompress export` prints it and exits 2).

    Tied parameters (GPT-2's lm_head / wte) are one tensor under several state_dict names, and
    safetensors stores only one of them (`save_model`, transformers' `save_pretrained`): a name
    missing from the file is fine when another name of the same tensor is there."""
    from . import safetensors_io as sio
    from .errors import CheckpointError

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"--weights {path}: no such file")
    state, _ = sio.read_safetensors(path)  # header, truncation and CRC checks, no pickle
    own = model.state_dict(keep_vars=True)
    names_of = {}
    for k, t in own.items():
        names_of.setdefault(id(t), []).append(k)
    for k, t in own.items():
        if k not in state:
            alias = next((a for a in names_of[id(t)] if a in state), None)
            if alias is not None:
                state[k] = state[alias]
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:

        def some(keys):
            return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

        parts = [f"{len(missing)} tensors of the model are not in the file ({some(missing)})"] if missing else []
        parts += (
            [f"{len(unexpected)} tensors of the file are not in the model ({some(unexpected)})"] if unexpected else []
        )
        raise CheckpointError(f"{path}: does not fit the --model model ({type(model).__name__}): " + "; ".join(parts))
    for k, t in own.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{path}: tensor {k!r} is {list(state[k].shape)}, the model's is {list(t.shape)}")
    model.load_state_dict(state, strict=True)


def _load_engine_checkpoint(model, cfg, directory, tag):
    """Load a `engine.save_checkpoint` directory (any ZeRO stage, any world size) into a single-process
    stage-0 engine around `model`: weights and the compression state (static activation ranges,
    master copies, schedule position), which a plain state_dict lacks. Returns its scheduler."""
    import torch
    import qcompress
    from ..config.training import take_auto

    raw = take_auto(cfg.raw)[0]  # "auto" training values: nothing here trains
    zero = dict(raw.get("zero_optimization") or {})
    zero.update(stage=0, offload_optimizer={"device": "none"}, offload_param={"device": "none"})
    # one process, no optimizer state: the batch split and the optimizer only have to be valid
    raw.update(
        zero_optimization=zero, train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1
    )
    for key in ("tensorboard", "csv_monitor", "tensor_parallel", "pipeline"):  # no training logs, no mesh
        raw.pop(key, None)
    client = None if cfg.optimizer is not None else (lambda params: torch.optim.SGD(params, lr=0.0))
    engine = qcompress.initialize(model, raw, optimizer=client)
    engine.load_checkpoint(directory, tag, load_optimizer_states=False)
    return engine.compression_scheduler


def cli_inspect(args) -> int:
    """args: an argparse.Namespace with `path` (or the path itself)."""
    from .inspect import inspect_checkpoint

    path = args if isinstance(args, str) else args.path
    print(inspect_checkpoint(path))
    return 0


def export_parser(p=None):
    p = p or argparse.ArgumentParser(prog="qcompress export")
    p.add_argument(
        "--model",
        required=True,
        help="factory 'package.module:function' building the model "
        "(modules in the current directory are found, as with python -m)",
    )
    p.add_argument("--weights", help="state_dict .safetensors of the trained model")
    p.add_argument(
        "--checkpoint",
        help="an engine.save_checkpoint directory instead of --weights: also "
        "restores static activation ranges and the compression schedule",
    )
    p.add_argument("--tag", help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--config", required=True, help="qcompress / DeepSpeed config (json or yaml)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-shard-size", dest="max_shard_size", default="2GB")
    p.add_argument("--force", action="store_true", help="overwrite an existing export")
    return p


def inspect_parser(p=None):
    p = p or argparse.ArgumentParser(prog="qcompress inspect")
    p.add_argument("path", help="export folder")
    return p


def main_export(argv=None) -> int:
    return cli_export(export_parser().parse_args(sys.argv[1:] if argv is None else argv))


def main_inspect(argv=None) -> int:
    return cli_inspect(inspect_parser().parse_args(sys.argv[1:] if argv is None else argv))
