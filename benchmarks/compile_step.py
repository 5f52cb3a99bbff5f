"""The compiled QAT training step against the compiled FP32 step on the CPU, eager steps beside them.

    nice -n 10 .venv/bin/python benchmarks/compile_step.py [--models bert,llama] [--hidden 256]
        [--layers 2] [--batch 8] [--seq 128] [--backend inductor] [--rounds 5] [--threads 2]
        [--write-results] [--json PATH]

One step = forward + cross-entropy loss + backward (the compiled part: torch.compile(fullgraph=True)
of the loss function) + AdamW step (eager, as the engine runs it). Models: a BERT (masked LM head)
and a Llama-style decoder built from transformers configs with random weights. Variants: FP32 and
the recipes schedules/w8a8.yaml, w4a8_g128.yaml and w4a16_g128.yaml (the modules they select, as
users run them), each eager and compiled. All steps of one model take turns round by round
(benchmarks/common.py interleaved), after one compiling warm-up step each; the table gives the
median and range of the per-round step times and the ratios to the FP32 step of the same mode.

Under torch.compile the quantizers run on the composed path (the same csrc kernels as opaque custom
ops; the fused eager path's shared-codes cache is not traceable), so the compiled QAT step keeps
x^ and w^ for backward as the unfused eager path does (docs/compile.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402  (puts the repository root on sys.path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

RECIPES = {"w8a8": "w8a8.yaml", "w4a8_g128": "w4a8_g128.yaml", "w4_g128": "w4a16_g128.yaml"}
LABELS = {"fp32": "FP32", "w8a8": "W8A8", "w4a8_g128": "W4A8 g128", "w4_g128": "W4 g128 (weight-only)"}


def build(kind: str, hidden: int, layers: int, vocab: int, seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    if kind == "bert":
        cfg = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=max(seq, 32),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return transformers.BertForMaskedLM(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=(8 * hidden) // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max(seq, 32),
    )
    return transformers.LlamaForCausalLM(cfg)


def loss_of(model, ids):
    import torch

    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def make_step(model, ids, compiled: bool, backend: str):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    fn = torch.compile(loss_of, backend=backend, fullgraph=True) if compiled else loss_of

    def step():
        loss = fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def variants(kind, args, recipes):
    """{name: (model, compiled)}: FP32 and each recipe, eager and compiled, all from one init."""
    import qcompress as qc

    base = build(kind, args.hidden, args.layers, args.vocab, args.seq)
    out = {}
    for rec in ["fp32"] + recipes:
        model = copy.deepcopy(base)
        if rec != "fp32":
            qc.init_compression(model, qc.load_config(os.path.join(common.ROOT, "schedules", RECIPES[rec])))
        model.train()
        out[f"{rec}_eager"] = (model, False)
        out[f"{rec}_compiled"] = (copy.deepcopy(model), True)
    return out


def measure(kind, args, recipes):
    import torch
    from qcompress.engine.compile import raise_recompile_limit

    raise_recompile_limit()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    steps, compile_s = {}, {}
    for name, (model, compiled) in variants(kind, args, recipes).items():
        steps[name] = make_step(model, ids, compiled, args.backend)
        t = time.perf_counter()
        steps[name]()  # compiles (compiled variants); allocates the optimizer state
        compile_s[name] = time.perf_counter() - t
        print(f"  {kind} {name}: first step {compile_s[name]:.1f} s", flush=True)
    times = common.interleaved(steps, repeats=args.rounds, warmup=1)
    return times, compile_s


def table(kind, times, compile_s, recipes, args) -> str:
    rows = [
        f"### {kind}: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq} tokens",
        "",
        "| variant | eager step ms | compiled step ms | eager / FP32 eager | compiled / FP32 compiled "
        "| compiled / eager | first compiled step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in ["fp32"] + recipes:
        e, c = f"{rec}_eager", f"{rec}_compiled"
        rows.append(
            f"| {LABELS[rec]} | {times[e].ms(1)} | {times[c].ms(1)} | "
            f"{common.ratio(times, e, 'fp32_eager')} | {common.ratio(times, c, 'fp32_compiled')} | "
            f"{common.ratio(times, c, e)} | {compile_s[c]:.0f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,llama")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the raw numbers to this JSON file")
    p.add_argument("--write-results", action="store_true", help="write benchmarks/results/train_step.md's section")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
    text, raw = [], {}
    for kind in [m for m in args.models.split(",") if m]:
        if kind not in ("bert", "llama"):
            p.error(f"--models: {kind!r} is not bert or llama")
        times, compile_s = measure(kind, args, recipes)
        text.append(table(kind, times, compile_s, recipes, args))
        raw[kind] = {
            n: {"median_s": t.median, "min_s": t.lo, "max_s": t.hi, "first_step_s": compile_s[n]}
            for n, t in times.items()
        }
        print(text[-1], flush=True)
    intro = (
        f"One step: forward, loss, backward (compiled part: `torch.compile(fullgraph=True, backend="
        f'"{args.backend}")`), AdamW step (eager). {args.rounds} interleaved rounds; median [min-max] '
        "per step, ratios are medians [range] of per-round ratios. Compiled quantizers run the composed "
        "path (docs/compile.md).\n\n"
    )
    if args.json:
        common.atomic_write(args.json, json.dumps({"args": vars(args), "results": raw}, indent=1) + "\n")
    if args.write_results:
        path = common.write_section(
            "train_step",
            "compile-cpu",
            "## Compiled QAT step vs compiled FP32 step (CPU)\n\n" + intro + "\n".join(text),
            title="QAT training step vs FP32",
        )
        print("wrote", path)


if __name__ == "__main__":
    main()
