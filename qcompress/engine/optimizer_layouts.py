"""How a checkpoint stores the optimizer state, one class per layout; the engine's placement names
the one it uses (placement.optimizer_layout), engine/checkpoint.py records it in engine.json.

- "dcp" (single process, DDP, FSDP2 and the split placements): torch's get/set_optimizer_state_dict,
  keyed by parameter name; FSDP2's sharded state reshards on load, so another world size works.
- "zero1" (ZeroRedundancyOptimizer): each rank writes the state of the parameters it owns under
  the same names; loading allocates from the checkpoint's metadata what the new owner needs.
- "per_rank" (1-bit optimizers): each rank's full optimizer.state_dict() (their compression
  errors differ per rank); a rank missing from the checkpoint starts from rank 0's.
"dcp" and "zero1" checkpoints load into each other.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ..errors import CheckpointError
from ..serialize import flatten, tensor_keys, unflatten

Install = Optional[Callable[[Dict[str, torch.Tensor]], None]]


def read_json(path: str) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(
            f"{path}: cannot read this checkpoint file ({type(e).__name__}: {e}); "
            "the checkpoint is damaged or incomplete, load another tag"
        ) from e


def alloc_from_metadata(md, key: str) -> torch.Tensor:
    entry = md.state_dict_metadata.get(key)
    if entry is None or not hasattr(entry, "size"):
        raise CheckpointError(
            f"tensor {key!r} is named by the checkpoint's JSON files but not in its "
            ".metadata index: the checkpoint is damaged or mixes files of two saves"
        )
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


def _group_hparams(groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _saved_optimizer(ometa) -> Dict[str, Any]:
    """What engine.json holds of the optimizer: {"param_groups": hyper-parameters, "state":
    {name: {key: non-tensor value}}} (tensor entries are None here), for either save mode."""
    if ometa.get("skeleton") is not None:  # "dcp": the whole state-dict skeleton
        sk = unflatten(ometa["skeleton"], {k: None for k in tensor_keys(ometa["skeleton"])})
        return {"param_groups": _group_hparams(sk.get("param_groups", [])), "state": sk.get("state", {})}
    return {"param_groups": ometa.get("param_groups"), "state": {}}


def _saved_keys(md):
    return [k for k in md.state_dict_metadata if k.startswith("optim.state.")]


class OptimizerLayout:
    """collect() adds the optimizer's tensors to the save and its JSON to engine.json (`meta`) or
    this rank's file (`rank_extra`); plan_load() adds what to read to `target` and returns the
    function that installs it once read (None: nothing to install)."""

    name = ""

    def collect(
        self, engine, tensors: Dict[str, torch.Tensor], rank_extra: Dict[str, Any], meta: Dict[str, Any]
    ) -> None:
        raise NotImplementedError

    def plan_load(self, engine, ometa, md, target: Dict[str, torch.Tensor], rank_extra, path: str) -> Install:
        raise NotImplementedError


class DCP(OptimizerLayout):
    name = "dcp"

    def collect(self, engine, tensors, rank_extra, meta):
        sd = get_optimizer_state_dict(engine.placement.checkpoint_root, engine.optimizer)
        meta["skeleton"] = flatten(sd, "optim", tensors)

    def plan_load(self, engine, ometa, md, target, rank_extra, path):
        if not _saved_keys(md):
            return None  # saved before the first step: nothing to restore
        saved = _saved_optimizer(ometa)
        hparams = saved.get("param_groups")
        root = engine.placement.checkpoint_root
        current = get_optimizer_state_dict(root, engine.optimizer)  # allocates state if needed
        local: Dict[str, torch.Tensor] = {}
        skel = flatten(current, "optim", local)
        for key, t in local.items():
            if key not in md.state_dict_metadata:
                raise CheckpointError(
                    f"{path}: optimizer tensor {key!r} is not in the checkpoint (the model "
                    "or optimizer differs from the one saved; load_optimizer_states=False "
                    "loads the weights alone)"
                )
            target[key] = t

        def install(loaded):
            sd = unflatten(skel, loaded)
            for fqn, st in saved.get("state", {}).items():  # non-tensor state values
                for k, v in st.items():
                    if v is not None and fqn in sd["state"]:
                        sd["state"][fqn][k] = v
            for g_now, g_saved in zip(sd["param_groups"], hparams or []):
                g_now.update(g_saved)
            set_optimizer_state_dict(root, engine.optimizer, sd)

        return install


class Zero1(OptimizerLayout):
    name = "zero1"

    @staticmethod
    def owned(engine):
        """(fqn, param) for the parameters whose state this rank's ZeroRedundancyOptimizer shard holds."""
        names = engine.param_names
        for group in engine.optimizer.optim.param_groups:
            for p in group["params"]:
                yield names[p], p

    def collect(self, engine, tensors, rank_extra, meta):
        scalars = {}
        for fqn, p in self.owned(engine):
            for k, v in engine.optimizer.optim.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.state.{fqn}.{k}"] = v
                else:
                    scalars.setdefault(fqn, {})[k] = v
        rank_extra["optim_scalars"] = scalars
        meta["param_groups"] = _group_hparams(engine.optimizer.param_groups)

    def plan_load(self, engine, ometa, md, target, rank_extra, path):
        saved_keys = _saved_keys(md)
        if not saved_keys:
            return None
        hparams = _saved_optimizer(ometa).get("param_groups")
        # this rank allocates the state of the parameters it owns now
        owned = list(self.owned(engine))
        for fqn, _ in owned:
            prefix = f"optim.state.{fqn}."
            for key in saved_keys:
                if key.startswith(prefix) and "." not in key[len(prefix) :]:
                    target[key] = alloc_from_metadata(md, key)
        scalars = dict(rank_extra.get("optim_scalars", {}))
        for fname in sorted(os.listdir(os.path.join(path, "ranks"))):  # owners may have changed
            other = unflatten(read_json(os.path.join(path, "ranks", fname)), {})
            for fqn, vals in other.get("optim_scalars", {}).items():
                scalars.setdefault(fqn, vals)

        def install(loaded):
            zopt = engine.optimizer
            if hparams:
                for g_now, g_saved in zip(zopt.param_groups, hparams):
                    g_now.update(g_saved)
            for fqn, p in owned:
                prefix = f"optim.state.{fqn}."
                st = {}
                for key, t in loaded.items():
                    if key.startswith(prefix) and "." not in key[len(prefix) :]:
                        name = key[len(prefix) :]
                        st[name] = t if name == "step" else t.to(p.device)
                st.update(scalars.get(fqn, {}))
                if st:
                    zopt.optim.state[p] = st

        return install


class PerRank(OptimizerLayout):
    name = "per_rank"

    def collect(self, engine, tensors, rank_extra, meta):
        sd = engine.optimizer.state_dict()
        rank_extra["optim_skeleton"] = flatten(sd, f"optim.rank{engine.rank}", tensors)

    def plan_load(self, engine, ometa, md, target, rank_extra, path):
        skel = rank_extra["optim_skeleton"]
        check = getattr(engine.optimizer, "check_state_dict", None)
        if check is not None:  # before dcp.load writes the saved weights into the model
            try:
                check(unflatten(skel, {k: None for k in tensor_keys(skel)}))
            except ValueError as e:
                raise CheckpointError(
                    f"{path}: the optimizer state does not load into this engine: {e} "
                    "(load_optimizer_states=False loads the weights alone)"
                ) from e
        for key in tensor_keys(skel):
            target[key] = alloc_from_metadata(md, key)

        def install(loaded):
            engine.optimizer.load_state_dict(unflatten(skel, loaded))

        return install


LAYOUTS: Dict[str, OptimizerLayout] = {cls.name: cls() for cls in (DCP, Zero1, PerRank)}
