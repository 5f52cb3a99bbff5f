"""clean_pruning: make pruning masks permanent and, with related_modules, slice them out.

Order: sparse, row, head, channel (DeepSpeed's). Every technique bakes its mask at the
configured dense_ratio, whatever step the schedule reached. Without related_modules, row /
head / channel pruning only zero the pruned weights (and biases). With them:
  row      primary drops output rows (+bias); related Linear drop those input columns
  head     primary (O-projection) drops pruned heads' input columns; related Q/K/V drop the
           heads' blocks of output rows (+bias; a fused Q/K/V: GPT-2's Conv1D c_attn per
           section, an nn.Linear head-major; grouped-query K/V are a ConfigError); a parent with
           num_attention_heads / all_head_size (HF attention) or num_heads (+ GPT-2's
           split_size) gets them updated
  channel  primary conv drops output channels (+bias); related conv drop input channels;
           related BatchNorm2d drop weight, bias, running stats and update num_features
Related modules pair by position: within group G, for the i-th `modules` regex and each regex
in related_modules[i], the j-th matched related module gets the j-th matched primary's mask.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..nn.layers import CompressMixin, kind_of
from .masks import ORDER
from .related import ChannelMaskHook, head_sections, pairs, weight_matrix


# --- tensor surgery ----------------------------------------------------------------------------


def _set_weight(mod, view: torch.Tensor) -> None:
    w = view.t() if kind_of(mod) == "hf_conv1d" else view
    old = mod.weight
    mod.weight = nn.Parameter(w.contiguous().clone(), requires_grad=old.requires_grad)


def _set_bias(mod, b: Optional[torch.Tensor]) -> None:
    if b is not None:
        mod.bias = nn.Parameter(b.contiguous().clone(), requires_grad=mod.bias.requires_grad)


def _slice_codes(mod, dim: int, keep: torch.Tensor) -> None:
    """Keep baked integer codes (for export) consistent with a sliced weight, or drop them."""
    wq = getattr(mod, "qc_wq", None)
    if wq is None or wq.codes is None:
        return
    q, s, z = wq.codes
    n = q.shape[dim]
    out = [q.index_select(dim, keep)]
    for t in (s, z):
        if t is None or t.dim() <= dim or t.shape[dim] == 1:
            out.append(t)
        elif t.shape[dim] == n:
            out.append(t.index_select(dim, keep))
        elif _whole_groups(wq, dim, n, t.shape[dim], keep) is not None:
            # group_size-wide scales along the inputs and the kept columns are whole groups
            # (heads a multiple of group_size wide): keep those groups' scales. Dropping the
            # codes made an asymmetric export fail (re-quantizing the baked weight is not exact)
            out.append(t.index_select(dim, _whole_groups(wq, dim, n, t.shape[dim], keep)))
        else:  # grouped scales along the sliced dim: no exact slice
            # say what follows: the export re-quantizes and refuses the inexact result
            warnings.warn(
                f"{getattr(mod, 'qc_name', '?')!r}: integer codes dropped after slicing "
                "(its scales cover groups of inputs that the pruned structure splits), so "
                "export_quantized will refuse this module; set compression_training."
                f"weight_quantization.different_groups.{wq.group}.params.granularity to "
                "'channel' (or, for head pruning, a group_size dividing the head width)",
                stacklevel=2,
            )
            wq.codes, wq.codes_spec = None, None
            return
    wq.codes = tuple(out)


def _whole_groups(wq, dim: int, n: int, groups: int, keep: torch.Tensor):
    """Indices of the input groups `keep` consists of, or None when it splits a group."""
    g = getattr(wq.codes_spec, "group_size", None)
    if dim != 1 or not g or groups * g != n or len(keep) % g:
        return None
    blocks = keep.reshape(-1, g)
    first = blocks[:, :1]
    if bool((first % g != 0).any()) or not torch.equal(blocks, first + torch.arange(g, device=keep.device)):
        return None
    return first.flatten() // g


def _drop_outputs(mod, keep: torch.Tensor) -> None:
    """Keep output rows/channels `keep` (index tensor) of a Linear / HF Conv1D / Conv."""
    _set_weight(mod, weight_matrix(mod).index_select(0, keep))
    if getattr(mod, "bias", None) is not None:
        _set_bias(mod, mod.bias.data.index_select(0, keep))
    _slice_codes(mod, 0, keep)
    n = len(keep)
    kind = kind_of(mod)
    if kind == "linear":
        mod.out_features = n
    elif kind == "hf_conv1d":
        mod.nf = n
    elif kind == "conv":
        mod.out_channels = n


def _drop_inputs(mod, keep: torch.Tensor) -> None:
    """Keep input columns/channels `keep` of a Linear / HF Conv1D / Conv."""
    if kind_of(mod) == "conv" and mod.groups != 1:
        raise ConfigError(
            "",
            f"{getattr(mod, 'qc_name', type(mod).__name__)}: cannot drop input "
            f"channels of a grouped convolution (groups={mod.groups})",
        )
    _set_weight(mod, weight_matrix(mod).index_select(1, keep))
    _slice_codes(mod, 1, keep)
    kind = kind_of(mod)
    if kind == "linear":
        mod.in_features = len(keep)
    elif kind == "hf_conv1d" and isinstance(getattr(mod, "nx", None), int):
        mod.nx = len(keep)  # only repr() reads it, but it should not show the old width
    elif kind == "conv":
        mod.in_channels = len(keep)


def _drop_bn(mod, keep: torch.Tensor) -> None:
    if mod.affine:
        _set_weight(mod, mod.weight.data.index_select(0, keep))
        _set_bias(mod, mod.bias.data.index_select(0, keep))
    for name in ("running_mean", "running_var"):
        buf = getattr(mod, name, None)
        if buf is not None:
            setattr(mod, name, buf.index_select(0, keep).clone())
    mod.num_features = len(keep)


def _check(cond, tech, group, msg):
    if not cond:
        raise ConfigError(f"compression_training.{tech}.different_groups.{group.name}.related_modules", msg)


# --- per technique -----------------------------------------------------------------------------


def _zero(mod, tech, state, mask: torch.Tensor) -> None:
    """Multiply the mask in permanently (no shape change)."""
    m = mask.to(mod.weight.dtype)
    view = weight_matrix(mod)
    if tech == "head_pruning":
        out, inp = view.shape
        view = (view.t().reshape(state.num_heads, -1) * m.reshape(-1, 1)).reshape(inp, out).t()
    else:
        view = view * m
    with torch.no_grad():
        mod.weight.data.copy_(view.t() if kind_of(mod) == "hf_conv1d" else view)
        if tech in ("row_pruning", "channel_pruning") and getattr(mod, "bias", None) is not None:
            mod.bias.data.mul_(m.reshape(-1))
    _zero_codes(mod, tech, state, mask)


def _zero_codes(mod, tech, state, mask) -> None:
    """Baked integer codes must dequantize to the zeroed weights: q <- zero_point where pruned."""
    wq = getattr(mod, "qc_wq", None)
    if wq is None or wq.codes is None:
        return
    q, s, z = wq.codes
    keep = mask.to(torch.bool)
    if tech == "head_pruning":
        out, inp = q.shape
        keep = keep.reshape(-1, 1).expand(state.num_heads, inp // state.num_heads * out)
        keep = keep.reshape(inp, out).t()
    zero = torch.zeros((), dtype=q.dtype, device=q.device) if z is None else z.to(q.dtype)
    try:
        wq.codes = (torch.where(keep.expand_as(q), q, zero), s, z)
    except RuntimeError:  # zero points laid out per group: no cheap broadcast
        warnings.warn(f"{getattr(mod, 'qc_name', '?')!r}: integer codes dropped after pruning clean", stacklevel=2)
        wq.codes, wq.codes_spec = None, None


def _slice(tech, group, name, mod, state, mask, rels, modules, parents_done):
    keep = mask.reshape(-1).nonzero().flatten()
    if tech in ("row_pruning", "channel_pruning"):
        n_out = weight_matrix(mod).shape[0]
        _drop_outputs(mod, keep)
        for rp, names in rels:
            r = modules[names[0]]
            if kind_of(r) == "batchnorm":
                _check(
                    r.num_features == n_out,
                    tech,
                    group,
                    f"{names[0]!r} has {r.num_features} features but {name!r} has {n_out} channels",
                )
                _drop_bn(r, keep)
            else:
                _check(
                    weight_matrix(r).shape[1] == n_out,
                    tech,
                    group,
                    f"{names[0]!r} takes {weight_matrix(r).shape[1]} inputs but {name!r} has {n_out} outputs",
                )
                _drop_inputs(r, keep)
        return
    # head pruning: primary is the O-projection
    h = state.num_heads
    inp = weight_matrix(mod).shape[1]
    cols = (keep.reshape(-1, 1) * (inp // h) + torch.arange(inp // h, device=keep.device)).flatten()
    _drop_inputs(mod, cols)
    for rp, names in rels:
        r = modules[names[0]]
        out = weight_matrix(r).shape[0]
        sections, msg = head_sections(names[0], out, name, inp)
        _check(msg is None, tech, group, msg)
        if kind_of(r) != "hf_conv1d":
            # A fused nn.Linear (Bloom's, GPT-NeoX's query_key_value) is laid out head-major,
            # [h, 3, d]: head blocks of out/h rows. GPT-2's Conv1D c_attn is section-major.
            sections = 1
        width = out // sections
        d = width // h
        rows = (keep.reshape(-1, 1) * d + torch.arange(d, device=keep.device)).flatten()
        rows = torch.cat([rows + k * width for k in range(sections)])
        _drop_outputs(r, rows)
        parent_name = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        if parent_name not in parents_done:
            parents_done.add(parent_name)
            _update_heads(modules.get(parent_name), len(keep))


def _update_heads(parent, kept: int) -> None:
    """Best effort: fix the head count of the attention module that owns Q/K/V."""
    if parent is None:
        return
    if isinstance(getattr(parent, "num_attention_heads", None), int):
        parent.num_attention_heads = kept
        if isinstance(getattr(parent, "attention_head_size", None), int):
            parent.all_head_size = kept * parent.attention_head_size
    elif isinstance(getattr(parent, "num_heads", None), int):
        parent.num_heads = kept
        # GPT-2 splits c_attn's output into Q, K, V with split_size (= heads * head_dim)
        if isinstance(getattr(parent, "split_size", None), int) and isinstance(getattr(parent, "head_dim", None), int):
            parent.split_size = kept * parent.head_dim


@torch.no_grad()
def clean_pruning(root: nn.Module, cfg) -> nn.Module:
    cc = cfg.compression
    for tech in ORDER:
        technique = getattr(cc, tech)
        modules = dict(root.named_modules())  # refreshed: earlier techniques replaced params
        for group in technique.groups:
            primaries = [
                n
                for n, m in modules.items()
                if isinstance(m, CompressMixin) and tech in m.qc_pruning and m.qc_pruning[tech].group == group.name
            ]
            masks = {n: modules[n].qc_pruning[tech].final_mask(modules[n]) for n in primaries}
            if tech != "sparse_pruning" and group.related_modules:
                parents_done = set()
                for prim, rels in pairs(tech, group, primaries, modules):
                    for j, n in enumerate(prim):
                        mod = modules[n]
                        _slice(
                            tech,
                            group,
                            n,
                            mod,
                            mod.qc_pruning[tech],
                            masks[n],
                            [(rp, [names[j]]) for rp, names in rels],
                            modules,
                            parents_done,
                        )
            else:
                for n in primaries:
                    _zero(modules[n], tech, modules[n].qc_pruning[tech], masks[n])
            for n in primaries:
                modules[n].qc_pruning[tech].remove(modules[n])
    _drop_stale_hooks(root)
    return root


def _drop_stale_hooks(root: nn.Module) -> None:
    """Remove BatchNorm channel-mask hooks whose conv no longer carries channel pruning."""
    for mod in root.modules():
        for key, hook in list(mod._forward_hooks.items()):
            if isinstance(hook, ChannelMaskHook) and "channel_pruning" not in getattr(hook.conv, "qc_pruning", {}):
                del mod._forward_hooks[key]
