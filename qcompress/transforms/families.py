"""Where the residual stream, the heads and the MLPs are in each decoder family that rotations know.

`resolve(model)` reads a model into a `Layout`: every tensor that reads the residual stream (the
norm it follows, the axis that lives in the stream), every tensor that writes it, each layer's
value / output projections (R2) and dense down projections (R4). Every parameter of the model must
be accounted for; one that is not means a layout the table does not know, and rotating around it
would change the model, so `resolve` raises a ConfigError naming it. Nothing is changed here.

The families are pre-norm decoders whose norms are RMSNorms scaling by their weight
(y = weight * x / rms(x)): rms(x Q) = rms(x) for an orthogonal Q, so once the weight is folded
into the following layers the norm commutes with the rotation. A LayerNorm subtracts the mean,
which a rotation does not keep (GPT-2, OPT, BERT are refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError

PATH = "compression_training.rotation"


@dataclass(frozen=True)
class Family:
    """What differs between the families: extra per-head norms on q / k (Qwen3), attention sinks
    and biases (gpt-oss), transposed fused experts (gpt-oss stores each expert [in, out])."""

    qk_norm: bool = False
    sinks: bool = False
    experts_transposed: bool = False


FAMILIES: Dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
    "qwen2_moe": Family(),
    "qwen3_moe": Family(qk_norm=True),
    "mixtral": Family(),
    "gpt_oss": Family(sinks=True, experts_transposed=True),
}

# families we know cannot be rotated this way, and why (the message names the reason)
REFUSED = {
    "gpt2": "its LayerNorms subtract the mean, which a rotation of the residual stream does not keep",
    "opt": "its LayerNorms subtract the mean, which a rotation of the residual stream does not keep",
    "bert": "it is post-norm (LayerNorm after each residual add): there is no norm in front of the "
    "layers to fold, and LayerNorm subtracts the mean",
    "gemma": "its RMSNorm scales by (1 + weight), a form the norm folding does not handle",
    "gemma2": "its RMSNorm scales by (1 + weight) and it has norms after the sublayers",
    "gemma3": "its RMSNorm scales by (1 + weight) and it has norms after the sublayers",
}


@dataclass
class Site:
    """One tensor and the axis of it that lives in a rotated space."""

    module: str
    param: str
    dim: int

    @property
    def key(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param


@dataclass
class Layer:
    index: int
    attn_norm: str
    mlp_norm: str
    attn_reads: List[Site]  # q, k, v weights (the norm's output)
    attn_writes: List[Site]  # o_proj weight / bias
    mlp_reads: List[Site]  # gate / up / router / experts' gate_up / shared expert
    mlp_writes: List[Site]  # down projections, experts' down, their biases
    values: List[Site]  # R2, output side: v_proj weight rows, bias (per head)
    head_inputs: List[Site]  # R2, input side: o_proj weight columns (per head)
    head_dim: int
    down: Optional[str] = None  # a dense down_proj Linear (R4)
    down_experts: Optional[str] = None  # fused experts' down projection (R4 cannot run there)


@dataclass
class Layout:
    family: str
    hidden: int
    embed: Site
    final_norm: str
    heads: List[Site]  # lm_head / score weight (reads the final norm)
    layers: List[Layer]
    tied: Optional[Tuple[str, str]] = None  # (head module, embedding module) sharing one weight
    norms: List[str] = field(default_factory=list)


def _fail(module: str, reason: str):
    raise ConfigError(PATH, f"cannot rotate module {module!r}: {reason}")


def _linear(parent: nn.Module, prefix: str, name: str, in_features: Optional[int] = None) -> nn.Linear:
    mod = getattr(parent, name, None)
    where = f"{prefix}.{name}"
    if not isinstance(mod, nn.Linear):
        _fail(where, f"expected an nn.Linear here, found {type(mod).__name__}: unknown attention / MLP layout")
    if in_features is not None and mod.in_features != in_features:
        _fail(where, f"it takes {mod.in_features} inputs, not the residual width {in_features}")
    return mod


def check_norm(mod: nn.Module, name: str, width: int) -> None:
    """`mod` must compute weight * x / sqrt(mean(x^2) + eps) (checked on a probe input), with no
    bias: otherwise its weight cannot be folded into the next layers."""
    w = getattr(mod, "_parameters", {}).get("weight")
    if w is None or w.dim() != 1 or w.shape[0] != width:
        _fail(name, f"expected an RMSNorm with a weight of {width}, found {type(mod).__name__}: no norm to fold")
    if getattr(mod, "bias", None) is not None:
        _fail(name, f"{type(mod).__name__} has a bias, which no rotation of the residual stream keeps")
    if w.is_meta:
        return
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(eps, (int, float)):
        _fail(name, f"{type(mod).__name__} names no epsilon (variance_epsilon / eps): not a known RMSNorm")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, width, generator=g) + 0.5).to(w.device, w.dtype)  # a non-zero mean: LayerNorm shows
    with torch.no_grad():
        y = mod(x).float()
        xf = x.float()
        want = w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # the families normalise in float32 whatever the weight's dtype
    tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 2e-2
    if not torch.allclose(y, want, rtol=tol, atol=tol):
        _fail(
            name,
            f"{type(mod).__name__} does not compute weight * x / rms(x) (a LayerNorm subtracts the "
            "mean, a (1 + weight) norm adds one): no norm to fold",
        )


def _base(root: nn.Module) -> Tuple[nn.Module, str]:
    prefix = getattr(root, "base_model_prefix", "") or ""
    inner = getattr(root, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and hasattr(inner, "layers"):
        return inner, prefix
    if hasattr(root, "layers") and hasattr(root, "embed_tokens"):
        return root, ""
    _fail(type(root).__name__, "no decoder (model.embed_tokens, model.layers, model.norm) found")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def resolve(model: nn.Module) -> Layout:
    """The model's Layout, or a ConfigError naming the module that does not fit and why."""
    root = model
    config = getattr(root, "config", None)
    family = getattr(config, "model_type", None)
    if family in REFUSED:
        _fail(type(root).__name__, f"model family {family!r}: {REFUSED[family]}")
    if family not in FAMILIES:
        _fail(
            type(root).__name__,
            f"model family {family!r} has an attention / norm layout the rotations do not "
            f"know; known families: {sorted(FAMILIES)}",
        )
    spec = FAMILIES[family]
    base, bp = _base(root)
    embed = getattr(base, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        _fail(_join(bp, "embed_tokens"), f"expected an nn.Embedding, found {type(embed).__name__}")
    hidden = embed.embedding_dim
    norm = getattr(base, "norm", None)
    final_norm = _join(bp, "norm")
    check_norm(norm, final_norm, hidden)
    accounted = {id(embed.weight), id(norm.weight)}
    layers = []
    for i, layer in enumerate(base.layers):
        lp = _join(bp, f"layers.{i}")
        layers.append(_layer(layer, lp, i, hidden, spec, accounted))
    heads = []
    tied = None
    for name, child in root.named_children():
        if child is base:
            continue
        params = list(child.parameters())
        if not params:
            continue
        if not isinstance(child, nn.Linear) or child.in_features != hidden:
            _fail(
                name,
                f"{type(child).__name__} outside the decoder reads the hidden states in a way the "
                "rotations do not know (a head must be an nn.Linear of the hidden width)",
            )
        if child.bias is not None:
            accounted.add(id(child.bias))
        heads.append(Site(name, "weight", -1))
        accounted.add(id(child.weight))
        if child.weight is embed.weight:
            tied = (name, _join(bp, "embed_tokens"))
    for n, p in root.named_parameters(remove_duplicate=True):
        if id(p) not in accounted and not n.startswith("qc_rotations."):
            _fail(
                n.rsplit(".", 1)[0],
                f"its parameter {n!r} is not in the {family} layout the rotations "
                "know, so rotating around it would change the model",
            )
    norms = [final_norm] + [n for lay in layers for n in (lay.attn_norm, lay.mlp_norm)]
    return Layout(family, hidden, Site(_join(bp, "embed_tokens"), "weight", -1), final_norm, heads, layers, tied, norms)


def _layer(layer, lp, i, hidden, spec: Family, accounted) -> Layer:
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        _fail(lp, "no self_attn: unknown attention layout")
    ap = f"{lp}.self_attn"
    for nn_name in ("input_layernorm", "post_attention_layernorm"):
        check_norm(getattr(layer, nn_name, None), f"{lp}.{nn_name}", hidden)
        accounted.add(id(getattr(layer, nn_name).weight))
    q, k, v = (_linear(attn, ap, n, hidden) for n in ("q_proj", "k_proj", "v_proj"))
    o = _linear(attn, ap, "o_proj")
    if o.out_features != hidden:
        _fail(f"{ap}.o_proj", f"it writes {o.out_features} outputs, not the residual width {hidden}")
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or v.out_features % head_dim or o.in_features % head_dim:
        _fail(
            ap,
            f"head_dim {head_dim!r} does not split v_proj's {v.out_features} outputs and o_proj's "
            f"{o.in_features} inputs into heads: unknown attention layout",
        )
    if (o.in_features // head_dim) % (v.out_features // head_dim):
        _fail(ap, "the query heads are not a whole multiple of the key / value heads")
    for mod in (q, k, v, o):
        accounted.update(id(p) for p in mod.parameters())
    if spec.qk_norm:
        for nn_name in ("q_norm", "k_norm"):
            m = getattr(attn, nn_name, None)
            if m is None:
                _fail(f"{ap}.{nn_name}", "the family has per-head q / k norms, but this layer has none")
            accounted.update(id(p) for p in m.parameters())  # act on q / k only: R1, R2 keep them
    if spec.sinks:
        s = getattr(attn, "sinks", None)
        if isinstance(s, nn.Parameter):
            accounted.add(id(s))  # one logit per head: no rotated axis
    attn_reads = [Site(f"{ap}.{n}", "weight", -1) for n in ("q_proj", "k_proj", "v_proj")]
    attn_writes = [Site(f"{ap}.o_proj", "weight", 0)] + (
        [Site(f"{ap}.o_proj", "bias", 0)] if o.bias is not None else []
    )
    values = [Site(f"{ap}.v_proj", "weight", 0)] + ([Site(f"{ap}.v_proj", "bias", 0)] if v.bias is not None else [])
    head_inputs = [Site(f"{ap}.o_proj", "weight", -1)]
    reads, writes, down, down_experts = _mlp(getattr(layer, "mlp", None), f"{lp}.mlp", hidden, spec, accounted)
    return Layer(
        i,
        f"{lp}.input_layernorm",
        f"{lp}.post_attention_layernorm",
        attn_reads,
        attn_writes,
        reads,
        writes,
        values,
        head_inputs,
        head_dim,
        down,
        down_experts,
    )


def _dense(mlp, mp, hidden, accounted):
    gate, up = _linear(mlp, mp, "gate_proj", hidden), _linear(mlp, mp, "up_proj", hidden)
    down = _linear(mlp, mp, "down_proj")
    if down.out_features != hidden:
        _fail(f"{mp}.down_proj", f"it writes {down.out_features} outputs, not the residual width {hidden}")
    for mod in (gate, up, down):
        accounted.update(id(p) for p in mod.parameters())
    reads = [Site(f"{mp}.gate_proj", "weight", -1), Site(f"{mp}.up_proj", "weight", -1)]
    writes = [Site(f"{mp}.down_proj", "weight", 0)] + (
        [Site(f"{mp}.down_proj", "bias", 0)] if down.bias is not None else []
    )
    return reads, writes


def _mlp(mlp, mp, hidden, spec: Family, accounted):
    if mlp is None:
        _fail(mp, "no mlp: unknown layer layout")
    if hasattr(mlp, "gate_proj") and hasattr(mlp, "down_proj") and not hasattr(mlp, "experts"):
        reads, writes = _dense(mlp, mp, hidden, accounted)
        return reads, writes, f"{mp}.down_proj", None
    experts = getattr(mlp, "experts", None)
    gu = getattr(experts, "_parameters", {}).get("gate_up_proj")
    dn = getattr(experts, "_parameters", {}).get("down_proj")
    if gu is None or dn is None or gu.dim() != 3 or dn.dim() != 3:
        _fail(
            mp,
            f"{type(mlp).__name__} is neither a gate / up / down MLP nor a block of fused experts "
            "(gate_up_proj, down_proj 3-D Parameters): unknown MLP layout",
        )
    ep = f"{mp}.experts"
    if spec.experts_transposed:  # [E, in, out]
        gu_dim, dn_dim = 1, 2
    else:  # [E, out, in], as nn.Linear stores each expert
        gu_dim, dn_dim = 2, 1
    if gu.shape[gu_dim] != hidden or dn.shape[dn_dim] != hidden:
        _fail(
            ep,
            f"gate_up_proj {list(gu.shape)} / down_proj {list(dn.shape)} do not have the residual width "
            f"{hidden} where the {'transposed ' if spec.experts_transposed else ''}expert layout puts it",
        )
    reads = [Site(ep, "gate_up_proj", gu_dim)]
    writes = [Site(ep, "down_proj", dn_dim)]
    accounted.update((id(gu), id(dn)))
    for pname, p in experts._parameters.items():
        if p is None or pname in ("gate_up_proj", "down_proj"):
            continue
        if pname == "down_proj_bias" and p.dim() == 2 and p.shape[1] == hidden:
            writes.append(Site(ep, pname, 1))
        elif pname != "gate_up_proj_bias":  # gate_up's bias lives in the expert's own width
            _fail(ep, f"its parameter {pname!r} is not in the experts layout the rotations know")
        accounted.add(id(p))
    router_name = next((n for n in ("gate", "router") if hasattr(mlp, n)), None)
    router = getattr(mlp, router_name, None) if router_name else None
    rw = getattr(router, "_parameters", {}).get("weight") if router is not None else None
    if rw is None or rw.dim() != 2 or rw.shape[1] != hidden:
        _fail(f"{mp}.{router_name or 'gate'}", "no router with a [experts, hidden] weight: unknown MoE layout")
    reads.append(Site(f"{mp}.{router_name}", "weight", 1))
    accounted.update(id(p) for p in router.parameters())  # a router bias is per expert: unrotated
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        s_reads, s_writes = _dense(shared, f"{mp}.shared_expert", hidden, accounted)
        reads += s_reads
        writes += s_writes
        sg = _linear(mlp, mp, "shared_expert_gate", hidden)
        reads.append(Site(f"{mp}.shared_expert_gate", "weight", -1))
        accounted.update(id(p) for p in sg.parameters())
    return reads, writes, None, ep
