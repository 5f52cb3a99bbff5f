"""R1 and R2 fused into the weights (and R4's weight half), after folding the norms.

R1, residual stream, Q (hidden x hidden, orthogonal): every norm's weight g is folded into the
tensors reading its output (their input axis scaled by g; the norm's weight set to 1), then
tensors reading the stream get W Q on their input axis, tensors writing it Q^T W on their output
axis (biases too), the embedding E Q. RMSNorm(x Q) = RMSNorm(x) Q once the weights are 1, so the
logits do not change. A head tied to the embedding stays tied when the final norm's weight is all
ones (both become E Q); otherwise it gets its own copy (untied), reported in the summary.
R2, per head, H (head_dim x head_dim): v_proj's output rows H^T V per head, o_proj's input columns
O H per head; attention mixes positions, not channels, so softmax(..) V H = (softmax(..) V) H.
Per-head q / k norms (Qwen3) act on q and k only and keep R1 and R2 valid.
R4: down_proj's input columns W T; T runs online on its input (transforms/online.py).

All products are computed in float64 and written once into each tensor in its own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from . import learned, online
from .families import PATH, Layout, Site, resolve
from .hadamard import block_for, rotate_dim, unnormalized_block

RECORD = "_qc_rotation"  # root.__dict__: what was rotated (a plain dict)
_STREAMS = {"R1": 0, "R2": 1, "R4": 2}  # each rotation draws its signs from its own seed


@dataclass
class Op:
    dim: int
    rotation: str  # R1 | R2 | R4
    norm: Optional[str] = None  # the norm whose weight is folded into this axis first


@dataclass
class Edit:
    module: str
    param: str
    ops: List[Op] = field(default_factory=list)
    layer: Optional[int] = None  # R2's learned factor is per layer


@dataclass
class Plan:
    layout: Layout
    rotations: Tuple[str, ...]
    kind: str
    block_size: Optional[int]
    seed: int
    learned: bool
    blocks: Dict[str, int]
    edits: Dict[str, Edit]
    online: List[str]
    head_dims: List[int]

    def settings(self) -> dict:
        return {
            "rotations": list(self.rotations),
            "type": self.kind,
            "block_size": self.block_size,
            "learned": self.learned,
            "seed": self.seed,
        }


def _block_error(module: str, what: str, width: int, block_size: int):
    raise ConfigError(
        f"{PATH}.block_size",
        f"{block_size} does not divide {what} of module {module!r} "
        f"({width}); choose a power of two that divides it, or leave block_size unset "
        "(the largest power of two that divides each width)",
    )


def plan(root: nn.Module, rot) -> Plan:
    """Check that `rot` (config.rotation.Rotation) can rotate `root` and say how; changes nothing."""
    layout = resolve(root)
    modules = dict(root.named_modules())
    names = set(rot.rotations)
    bs = rot.block_size
    blocks: Dict[str, int] = {}
    if "R1" in names:
        b = block_for(layout.hidden, bs)
        if b is None:
            _block_error(layout.embed.module, "the residual width", layout.hidden, bs)
        blocks["R1"] = b
    head_dims = [lay.head_dim for lay in layout.layers]
    if "R2" in names:
        found = []
        for lay in layout.layers:
            b = block_for(lay.head_dim, bs)
            if b is None:
                _block_error(lay.values[0].module, "the head dim", lay.head_dim, bs)
            found.append(b)
        if len(set(head_dims)) > 1:
            raise ConfigError(
                f"{PATH}.rotations",
                f"R2: the layers' head dims differ ({sorted(set(head_dims))}); R2 needs one head dim",
            )
        blocks["R2"] = min(found)
    on = []
    if "R4" in names:
        found = []
        for lay in layout.layers:
            if lay.down is None:
                raise ConfigError(
                    f"{PATH}.rotations",
                    f"R4 cannot rotate module {lay.down_experts!r}: it runs "
                    "online on a Linear's input, and this layer's down projections are fused "
                    "experts (3-D Parameters), which compressed-tensors and vLLM give no online "
                    "transforms; drop R4 for this model (R1 and R2 work)",
                )
            width = modules[lay.down].in_features
            b = block_for(width, bs)
            if b is None:
                _block_error(lay.down, "the input width", width, bs)
            found.append(b)
            on.append(lay.down)
        blocks["R4"] = min(found)  # one transform weight for every down_proj (one scheme)
    edits: Dict[str, Edit] = {}

    def add(site: Site, op: Op, layer: Optional[int] = None):
        e = edits.setdefault(site.key, Edit(site.module, site.param))
        e.ops.append(op)
        if layer is not None:
            e.layer = layer

    if "R1" in names:
        add(layout.embed, Op(layout.embed.dim, "R1"))
        for lay in layout.layers:
            for s in lay.attn_reads:
                add(s, Op(s.dim, "R1", lay.attn_norm))
            for s in lay.attn_writes:
                add(s, Op(s.dim, "R1"))
            for s in lay.mlp_reads:
                add(s, Op(s.dim, "R1", lay.mlp_norm))
            for s in lay.mlp_writes:
                add(s, Op(s.dim, "R1"))
        for s in layout.heads:
            add(s, Op(s.dim, "R1", layout.final_norm))
    if "R2" in names:
        for lay in layout.layers:
            for s in lay.values + lay.head_inputs:
                add(s, Op(s.dim, "R2"), lay.index)
    for name in on:
        add(Site(name, "weight", -1), Op(-1, "R4"))
    return Plan(layout, tuple(rot.rotations), rot.type, bs, rot.seed, rot.learned, blocks, edits, on, head_dims)


def blocks_of(p: Plan, device=None) -> Dict[str, torch.Tensor]:
    """{rotation: its unnormalized +-1 block (float64)}; each drawn from its own seeded stream."""
    out = {}
    for name, b in p.blocks.items():
        g = torch.Generator().manual_seed(p.seed * 3 + _STREAMS[name])
        out[name] = unnormalized_block(b, p.kind, g).to(device)
    return out


class Applied:
    """What execute() changed, to put back when the rest of init_compression fails."""

    def __init__(self, root):
        self.root = root
        self.saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.untied = None  # (head name, its shared Parameter, the tie flag, transformers' tie entry)
        self.online: List[nn.Module] = []

    @torch.no_grad()
    def undo(self) -> None:
        learned.unwire(self.root)
        for lin in self.online:
            online.detach(lin)
        for p, old in reversed(self.saved):
            p.copy_(old)
        if self.untied is not None:
            name, shared, flag, entry = self.untied
            self.root.get_submodule(name)._parameters["weight"] = shared
            _set_tie_flag(self.root, flag)
            if entry is not None:
                self.root.all_tied_weights_keys[f"{name}.weight"] = entry
        self.root.__dict__.pop(RECORD, None)
        self.saved.clear()

    def release(self) -> None:
        """The rewrite succeeded: drop the copies kept for undo."""
        self.saved.clear()


def _set_tie_flag(root: nn.Module, value: bool) -> None:
    """transformers ties (and from_pretrained re-ties) by config.tie_word_embeddings."""
    cfg = getattr(root, "config", None)
    if cfg is None:
        return
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for c in (cfg, text):
        if hasattr(c, "tie_word_embeddings"):
            c.tie_word_embeddings = value


def _untie(root: nn.Module, head_name: str, applied: Applied) -> None:
    head = root.get_submodule(head_name)
    shared = head._parameters["weight"]
    flag = bool(getattr(getattr(root, "config", None), "tie_word_embeddings", True))
    head._parameters["weight"] = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    _set_tie_flag(root, False)
    tied_keys = getattr(root, "all_tied_weights_keys", None)  # transformers' record of the tie
    entry = tied_keys.pop(f"{head_name}.weight", None) if isinstance(tied_keys, dict) else None
    applied.untied = (head_name, shared, flag, entry)


@torch.no_grad()
def execute(root: nn.Module, p: Plan) -> Applied:
    """Fold, rotate, attach R4 and (learned) the factors; returns what to undo on a later failure."""
    applied = Applied(root)
    modules = dict(root.named_modules())
    lay = p.layout
    try:
        untie = None
        if "R1" in p.rotations and lay.tied is not None:
            g = modules[lay.final_norm].weight
            if not bool((g == 1).all()):
                untie = lay.tied[0]
                _untie(root, untie, applied)
                modules = dict(root.named_modules())
        device = modules[lay.embed.module].weight.device
        raw = blocks_of(p, device)
        normal = {k: v / torch.tensor(float(v.shape[0]), dtype=torch.float64).sqrt() for k, v in raw.items()}
        norms = (
            {n: modules[n].weight.detach().to(torch.float64).clone() for n in lay.norms} if "R1" in p.rotations else {}
        )
        done = set()
        for key, e in p.edits.items():
            param = modules[e.module]._parameters[e.param]
            if id(param) in done:  # a head still tied to the embedding: rotated once, as E Q
                continue
            done.add(id(param))
            t = param.detach().to(torch.float64)
            for op in e.ops:
                t = _apply_op(t, op, normal, norms)
            applied.saved.append((param, param.detach().clone()))
            param.copy_(t.to(param.dtype))
        for n in norms:
            w = modules[n].weight
            applied.saved.append((w, w.detach().clone()))
            w.fill_(1.0)
        for name in p.online:
            applied.online.append(modules[name])
            online.attach(modules[name], raw["R4"].to(torch.float32), p.kind)
        if p.learned:
            _wire_learned(root, p)
        root.__dict__[RECORD] = _record(p, untie)
        return applied
    except BaseException:
        applied.undo()
        raise


def _apply_op(t, op: Op, normal, norms):
    scale = norms.get(op.norm) if op.norm else None
    return rotate_dim(t, op.dim, normal[op.rotation].to(t.device), scale=None if scale is None else scale.to(t.device))


def _wire_learned(root: nn.Module, p: Plan) -> None:
    some = next(iter(root.parameters()))
    dtype = some.dtype if some.is_floating_point() else torch.float32
    factors = learned.LearnedRotations()
    if "R1" in p.rotations:
        factors.add_module("R1", learned.Cayley(p.layout.hidden, dtype, some.device))
    if "R2" in p.rotations:
        factors.add_module("R2", nn.ModuleList(learned.Cayley(d, dtype, some.device) for d in p.head_dims))
    if "R4" in p.rotations:
        factors.add_module("R4", learned.Cayley(p.blocks["R4"], dtype, some.device))
    sites: Dict[str, list] = {}
    for e in p.edits.values():
        for op in e.ops:
            key = f"R2.{e.layer}" if op.rotation == "R2" else op.rotation
            sites.setdefault(e.module, []).append((e.param, op.dim, key))
    modules = dict(root.named_modules())
    learned.wire(root, sites, factors, {n: modules[n]._modules[online.CHILD] for n in p.online})


def _record(p: Plan, untied: Optional[str]) -> dict:
    lay = p.layout
    return {
        **p.settings(),
        "family": lay.family,
        "blocks": dict(p.blocks),
        "fused_tensors": sum(1 for e in p.edits.values() if any(o.rotation != "R4" for o in e.ops)),
        "folded_norms": len(lay.norms) if "R1" in p.rotations else 0,
        "layers": len(lay.layers),
        "online": list(p.online),
        "untied": None if untied is None else {"head": untied, "embedding": lay.tied[1]},
        "tied_kept": lay.tied is not None and untied is None and "R1" in p.rotations,
    }


def record_of(root: nn.Module) -> Optional[dict]:
    return root.__dict__.get(RECORD)


def describe(rec: Optional[dict]) -> str:
    """One line on what was rotated (summary(), the train report)."""
    if not rec:
        return ""
    parts = []
    b = rec["blocks"]
    if "R1" in b:
        parts.append(
            f"R1 (residual stream, block {b['R1']}) fused into {rec['fused_tensors']} tensors after "
            f"folding {rec['folded_norms']} norms"
        )
    if "R2" in b:
        parts.append(f"R2 (per head, block {b['R2']}) fused into v_proj / o_proj of {rec['layers']} layers")
    if "R4" in b:
        parts.append(f"R4 (block {b['R4']}) online on the input of {len(rec['online'])} down_proj")
    head = ""
    if rec.get("untied"):
        u = rec["untied"]
        head = f"; {u['head']} untied from {u['embedding']} (the final norm's weight, folded into it, differs from one)"
    elif rec.get("tied_kept"):
        head = "; the tied embedding / head stay tied (the final norm's weight is one)"
    how = f"{rec['type']}{', learned (Cayley)' if rec['learned'] else ''}"
    return f"rotations ({how}): " + "; ".join(parts) + head
