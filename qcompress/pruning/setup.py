"""enable_pruning: attach a pruning technique to one compress-aware module (init_compression)."""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..nn.layers import kind_of
from .masks import l1_scores, topk_mask

# PRIMARY_KINDS, related_of and the hook's old name stay importable from here
from .related import PRIMARY_KINDS, ChannelMaskHook, head_sections, related_of, weight_matrix  # noqa: F401
from .related import ChannelMaskHook as _ChannelMaskHook  # noqa: F401  (pickles name it here)
from .state import PruningState

TECHNIQUES = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


def _score_shape(technique, w, num_heads):
    if technique == "sparse_pruning":
        return tuple(w.shape)
    if technique == "row_pruning":
        return (w.shape[0], 1)
    if technique == "head_pruning":
        return (1, num_heads)
    return (w.shape[0],) + (1,) * (w.dim() - 1)  # channel


def enable_pruning(module, technique: str, shared, group, name: str, modules=None) -> PruningState:
    """Create the technique's state on `module` (already compress-aware) and return it.

    `modules` (dict name -> module of the whole model) is accepted for symmetry with clean;
    related modules are only used by redundancy_clean.
    """
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown pruning technique {technique!r}")
    path = f"compression_training.{technique}"
    method = shared.method
    if method == "snip_momentum":
        raise ConfigError(
            f"{path}.shared_parameters.method",
            "'snip_momentum' is delegated to Intel Neural Compressor in DeepSpeed and "
            "is not supported by qcompress; use 'l1' or 'topk'",
        )
    w = module.weight_matrix_view(module.weight)
    num_heads = getattr(shared, "num_heads", None) if technique == "head_pruning" else None
    if technique == "head_pruning":
        if w.dim() != 2 or w.shape[1] % num_heads:
            raise ConfigError(
                f"{path}.shared_parameters.num_heads",
                f"{num_heads} does not divide the {w.shape[1]} input features of "
                f"{name!r} (head pruning masks the O-projection's input columns)",
            )
    if technique == "channel_pruning" and getattr(module, "groups", 1) != 1:
        raise ConfigError(
            f"{path}.different_groups.{group.name}.modules",
            f"{name!r} is a grouped convolution (groups={module.groups}); channel pruning supports groups=1 only",
        )
    state = PruningState(
        technique=technique,
        group=group.name,
        method=method,
        dense_ratio=group.params.dense_ratio,
        offset=shared.schedule_offset,
        offset_end=getattr(shared, "schedule_offset_end", None) if technique == "sparse_pruning" else None,
        stride=getattr(shared, "schedule_offset_stride", 1) if technique == "sparse_pruning" else 1,
        num_heads=num_heads,
    )
    if method == "topk":
        scores = torch.empty(
            _score_shape(technique, w, num_heads),
            device=w.device,
            dtype=w.dtype if w.is_floating_point() else torch.float32,
        )
        nn.init.kaiming_uniform_(scores, a=math.sqrt(5))  # DeepSpeed's init
        state.scores_name = f"{technique}_scores"
        module.register_parameter(state.scores_name, nn.Parameter(scores))
    else:
        scores = l1_scores(technique, w)
        if state.offset_end is not None and state.offset_end > state.offset:
            state.l1_scores = scores  # gradual: mask depends on the step
        else:
            state.l1_mask = topk_mask(scores, state.dense_ratio)
    module.qc_pruning[technique] = state
    state.update(0)
    if technique != "sparse_pruning" and group.related_modules and modules is not None:
        _check_related(module, technique, group, name, modules)
    return state


def drop_excluded(technique, names):
    """`names` without the modules the technique's shared `excluded_modules` regexes (re.search)
    select (sparse pruning's; DeepSpeed's snip_momentum key, honoured for l1 and topk)."""
    excluded = getattr(technique.shared, "excluded_modules", ())
    return [n for n in names if not any(re.search(p, n) for p in excluded)]


# attention classes whose model-level ALiBi bias assumes every layer keeps the config's heads
_ALIBI_ATTENTION = {"BloomAttention", "MptAttention"}


def _check_related(module, technique, group, name, modules):
    """Validate the pairing at init (not only at clean); hook related BatchNorms for channels."""
    for rname in related_of(technique, group, name, modules):
        related = modules[rname]
        if technique == "head_pruning" and kind_of(related) in ("linear", "hf_conv1d"):
            out, inp = weight_matrix(related).shape[0], weight_matrix(module).shape[1]
            _, msg = head_sections(rname, out, name, inp)
            owner = modules.get(name.rpartition(".")[0])
            if msg is None and type(owner).__name__ in _ALIBI_ATTENTION:
                msg = (
                    f"the heads of {name.rpartition('.')[0]!r} ({type(owner).__name__}) cannot be sliced "
                    "away: the model builds its ALiBi slopes for the config's head count in every "
                    "layer; leave related_modules out to zero the pruned heads without slicing"
                )
            if msg is not None:  # found at init, not after training at redundancy_clean
                raise ConfigError(
                    f"compression_training.head_pruning.different_groups.{group.name}.related_modules", msg
                )
        if technique == "channel_pruning" and kind_of(related) == "batchnorm":
            related.register_forward_hook(ChannelMaskHook(module))
