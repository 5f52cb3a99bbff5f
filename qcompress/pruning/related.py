"""Related modules: which modules follow each pruned (primary) module, and how.

Shared by setup.py (checked at init_compression, BatchNorms hooked) and clean.py (sliced at
redundancy_clean). Related modules pair by position: within group G, for the i-th `modules`
regex and each regex in related_modules[i], the j-th matched related module gets the j-th
matched primary's mask.
"""

from __future__ import annotations

import re
from typing import Dict, List

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..nn.layers import kind_of

RELATED_KINDS = {
    "row_pruning": ("linear", "hf_conv1d"),
    "head_pruning": ("linear", "hf_conv1d"),
    "channel_pruning": ("conv", "batchnorm"),
}
PRIMARY_KINDS = {
    "row_pruning": ("linear", "hf_conv1d"),
    "head_pruning": ("linear", "hf_conv1d"),
    "channel_pruning": ("conv",),
}


def related_of(technique, group, name, modules):
    """Names of the related modules paired with primary `name` (ConfigError if counts differ)."""
    kinds = PRIMARY_KINDS[technique]
    primaries = [
        n
        for n, m in modules.items()
        if n and kind_of(m) in kinds and (group.modules is None or any(re.search(p, n) for p in group.modules))
    ]
    for prim, rels in pairs(technique, group, primaries, modules):
        if name in prim:
            return [names[prim.index(name)] for _, names in rels]
    return []


def weight_matrix(mod) -> torch.Tensor:
    """The weight as [out, in] (transformers' Conv1D stores it transposed)."""
    w = mod.weight.data
    return w.t() if kind_of(mod) == "hf_conv1d" else w


# --- pairing by position ------------------------------------------------------------------


def pairs(tech: str, group, primaries: List[str], modules: Dict[str, nn.Module]):
    """[(primary names, [(related regex, related names)])], one entry per `modules` regex."""
    path = f"compression_training.{tech}.different_groups.{group.name}.related_modules"
    patterns = group.modules if group.modules is not None else (None,)
    related = group.related_modules
    if len(related) != len(patterns):
        raise ConfigError(
            path, f"has {len(related)} entries but the group has {len(patterns)} module patterns; they pair by position"
        )
    kinds = RELATED_KINDS[tech]
    taken = set()
    out = []
    for pat, rel_patterns in zip(patterns, related):
        prim = [n for n in primaries if n not in taken and (pat is None or re.search(pat, n))]
        taken.update(prim)
        rels = []
        for rp in rel_patterns:
            names = [n for n, m in modules.items() if n and kind_of(m) in kinds and re.search(rp, n)]
            if len(names) != len(prim):
                raise ConfigError(
                    path,
                    f"related regex {rp!r} matches {len(names)} module(s) "
                    f"{names[:6]}{'...' if len(names) > 6 else ''} but modules "
                    f"regex {pat!r} matched {len(prim)} pruned module(s) "
                    f"{prim[:6]}{'...' if len(prim) > 6 else ''}; the j-th related "
                    "module takes the j-th primary's mask, so the counts must "
                    "be equal (tighten the regex)",
                )
            rels.append((rp, names))
        out.append((prim, rels))
    return out


def head_sections(rname: str, out: int, oname: str, inp: int):
    """(number of [Q; K; V] sections in related module `rname`, None) or (0, why it cannot
    follow the O-projection `oname`'s heads).

    Each section must be exactly as wide as the O-projection's input: a fused projection holds
    one block per head in each of its sections (GPT-2's c_attn: Q, K, V one after the other;
    Bloom / GPT-NeoX: interleaved per head, which _slice handles). A narrower one is grouped-query
    K / V (a key/value head serves several query heads, so removing one query head's block
    of rows would remove a head other query heads still read); slicing it silently changed
    the model's outputs.
    """
    if out >= inp and out % inp == 0:
        return out // inp, None
    return 0, (
        f"{rname!r} has {out} outputs, not a multiple of the {inp} head inputs of {oname!r}: "
        "its heads are not the O-projection's (grouped-query K/V share a head among several "
        "query heads and cannot follow a per-query-head mask); leave related_modules out to "
        "zero the pruned heads without slicing"
    )


class ChannelMaskHook:
    """Forward hook on a BatchNorm2d that follows a channel-pruned conv: zero the pruned channels.

    Without it, BN turns the conv's zeroed channels into a constant beta - gamma*mean/std that the
    next layer consumes, so the masked model would differ from the sliced one redundancy_clean
    makes. It holds the conv itself (not a closure) so deepcopy keeps the pairing.
    """

    def __init__(self, conv):
        self.conv = conv

    def __call__(self, bn, inputs, output):
        state = self.conv.qc_pruning.get("channel_pruning")
        if state is None or not state.active:
            return output
        m = state.mask(self.conv).reshape(1, -1, *([1] * (output.dim() - 2)))
        return output * m.to(output.dtype)
