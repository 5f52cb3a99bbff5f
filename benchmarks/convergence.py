"""Convergence of the communication-compressed optimizers on a real-text LM, through the engine.

    python benchmarks/convergence.py [--worlds 2 4] [--steps 300] [--no-shape] [--write-results]

A character-level GPT (4 layers x 128, benchmarks/zoadam_gap.CharGPT, ~0.8M parameters) on Jane
Austen's novels (model_zoo.lm_corpus, 5 % of the sections held out), trained by qcompress.initialize
on P gloo ranks (1 thread each), ZeRO stage 0 (DDP), fp32. The global batch is the same at every P
(32 sequences of 64 characters drawn from one seeded generator per step; rank r takes its slice),
so the runs at 2 and 4 ranks see the same data. lr: 5 % linear warmup, cosine to 10 %; no weight
decay. Each compressed optimizer runs at its uncompressed base's lr:

  AdamW (base)      lr 2e-3
  1-bit Adam        freeze_step = 20 % of the steps (DeepSpeed's 15-25 %); one 1-bit scale per
                    tensor (the default), and a second run with one scale per flat bucket
                    (scale_per_tensor false: DeepSpeed's fp16 layout)
  0/1 Adam          var_freeze_step 20 %, var_update_scaler 16, local_step_scaler 20 %,
                    local_step_clipper 16 (the tutorial's schedule scaled to the run)
  LAMB (base)       lr 2e-2
  1-bit LAMB        freeze_step 20 %

Validation loss (held-out text, 8 batches of 32 x 64 split over the ranks) every --eval-every steps
after engine.eval() (which synchronizes 0/1 Adam's ranks). Whole-run bytes: Engine.comm_bytes()
(DDP's gradient all-reduce, broadcasts and the compressed path), max over ranks. Whole-run time:
the training steps only (evaluation excluded), max over ranks, on the loopback shaped to --rate
with tbf in a private network namespace (root, `ip` and `tc` needed; otherwise said so).
--write-results replaces its section of benchmarks/results/comm.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

SECTION = "## Compressed optimizers: convergence"
CTX, GLOBAL_BATCH, VAL_BATCHES = 64, 32, 8
ADAM_LR, LAMB_LR = 2e-3, 2e-2
RUNS = ("adamw", "onebitadam", "onebitadam_pt", "zerooneadam", "lamb", "onebitlamb")
LABEL = {
    "adamw": "AdamW",
    "onebitadam": "1-bit Adam, one scale (scale_per_tensor false)",
    "onebitadam_pt": "1-bit Adam (default: scale per tensor)",
    "zerooneadam": "0/1 Adam (default: scale per tensor)",
    "lamb": "LAMB",
    "onebitlamb": "1-bit LAMB",
}
BASE = {"onebitadam": "adamw", "onebitadam_pt": "adamw", "zerooneadam": "adamw", "onebitlamb": "lamb"}


def optimizer_cfg(name, steps):
    freeze = max(1, steps // 5)
    return {
        "adamw": {"type": "AdamW", "params": {"lr": ADAM_LR, "weight_decay": 0.0}},
        "onebitadam": {
            "type": "OneBitAdam",
            "params": {"lr": ADAM_LR, "freeze_step": freeze, "scale_per_tensor": False},
        },
        "onebitadam_pt": {"type": "OneBitAdam", "params": {"lr": ADAM_LR, "freeze_step": freeze}},
        "zerooneadam": {
            "type": "ZeroOneAdam",
            "params": {
                "lr": ADAM_LR,
                "var_freeze_step": freeze,
                "var_update_scaler": 16,
                "local_step_scaler": freeze,
                "local_step_clipper": 16,
            },
        },
        "lamb": {"type": "Lamb", "params": {"lr": LAMB_LR}},
        "onebitlamb": {"type": "OneBitLamb", "params": {"lr": LAMB_LR, "freeze_step": freeze}},
    }[name]


def peak_lr(name):
    return LAMB_LR if "lamb" in name else ADAM_LR


def lr_at(step, steps, peak):
    warm = max(1, steps // 20)
    if step <= warm:
        return peak * step / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# ------------------------------------------------------------------------------------------- data
def load_data():
    import torch

    from model_zoo import lm_corpus

    train, held = lm_corpus.split_corpus(
        lm_corpus.load_corpus("austen", os.path.join(ROOT, ".cache")), held_out_fraction=0.05, seed=0
    )
    vocab = sorted(set(train))
    index = {c: i for i, c in enumerate(vocab)}
    ids = lambda t: torch.tensor([index.get(c, len(vocab)) for c in t], dtype=torch.long)  # noqa: E731
    return ids(train), ids(held), len(vocab) + 1


def global_batch(data, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - CTX - 1, (GLOBAL_BATCH,), generator=g).tolist()
    x = torch.stack([data[s : s + CTX] for s in starts])
    y = torch.stack([data[s + 1 : s + CTX + 1] for s in starts])
    return x, y


# ------------------------------------------------------------------------------------------- ranks
def _rank(rank, world, a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import qcompress as qc
    from zoadam_gap import CharGPT

    train, held, vocab = load_data()
    per = GLOBAL_BATCH // world
    mine = slice(rank * per, (rank + 1) * per)
    out = {}
    for name in a["runs"]:
        torch.manual_seed(0)
        model = CharGPT(vocab)
        cfg = {
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": per,
            "optimizer": optimizer_cfg(name, a["steps"]),
        }
        engine = qc.initialize(model, cfg)
        curve, seconds = [], 0.0
        for t in range(1, a["steps"] + 1):
            for g in engine.optimizer.param_groups:
                g["lr"] = lr_at(t, a["steps"], peak_lr(name))
            x, y = global_batch(train, 1000 + t)
            t0 = time.perf_counter()
            logits = engine(x[mine])
            engine.backward(F.cross_entropy(logits.flatten(0, 1), y[mine].flatten()))
            engine.step()
            seconds += time.perf_counter() - t0
            if t % a["eval_every"] == 0 or t == a["steps"]:
                engine.eval()  # 0/1 Adam: the ranks synchronize here
                total = torch.zeros(1, dtype=torch.float64)
                with torch.no_grad():
                    for i in range(rank, VAL_BATCHES, world):
                        vx, vy = global_batch(held, 7 + i)
                        total += float(F.cross_entropy(engine.module(vx).flatten(0, 1), vy.flatten()))
                dist.all_reduce(total)
                curve.append((t, float(total) / VAL_BATCHES))
                if rank == 0:
                    print(f"[{world} ranks] {name} step {t}: val {curve[-1][1]:.4f} ({seconds:.0f} s)", flush=True)
                engine.train()
        worst = torch.tensor([seconds])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = {
            "curve": curve,
            "seconds": float(worst),
            "bytes": engine.comm_bytes(),
            "params": sum(p.numel() for p in model.parameters()),
        }
        del engine, model
    return out


def run_here(a):
    from ranks import run_ranks

    d = {"runs": a.runs.split(","), "steps": a.steps, "eval_every": a.eval_every}
    return {str(w): run_ranks(_rank, w, d, timeout=a.timeout, threads=1) for w in a.worlds}


def run_shaped(a, argv):
    import comm_train  # the shaped-namespace runner, shared

    return comm_train.run_shaped(a, argv, script=__file__, name="conv")


# ------------------------------------------------------------------------------------------- report
def render(res, a, link, cmd):
    lines = [
        SECTION,
        "",
        f"`{cmd}`: a character-level GPT (4 x 128, {next(iter(next(iter(res.values()))[0].values()))['params']:,} "
        f"parameters) on Jane Austen's novels (5 % of the sections held out), trained through "
        f"qcompress.initialize (ZeRO stage 0 = DDP, fp32) on P gloo ranks (1 thread each), {link}. "
        f"Global batch {GLOBAL_BATCH} x {CTX} characters at every P (the same data at 2 and 4 ranks), "
        f"{a.steps} steps, lr 5 % warmup then cosine to 10 % of the peak (AdamW family {ADAM_LR}, LAMB family "
        f"{LAMB_LR}), no weight decay; 1-bit Adam / 1-bit LAMB freeze at step {a.steps // 5}; 0/1 Adam "
        f"var_freeze_step {a.steps // 5}, var_update_scaler 16, local_step_scaler {a.steps // 5}, "
        f"local_step_clipper 16. Validation loss on {VAL_BATCHES} held-out batches after engine.eval() "
        f"(which synchronizes 0/1 Adam's ranks). Bytes: Engine.comm_bytes() (DDP's gradient all-reduce, "
        f"the start-up broadcasts and the compressed path), sent by the busiest rank over the whole run. "
        f"Time: training steps only, max over ranks; the machine (2 cores) was shared with other jobs "
        f"(1-min load average {os.getloadavg()[0]:.1f} at the end), so compare times within a table only. "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    for world, ranks in res.items():
        r0 = ranks[0]
        sent = {n: max(r[n]["bytes"]["bytes_sent"] for r in ranks) for n in r0}
        lines += [
            f"### {world} ranks",
            "",
            "| optimizer | final val loss | vs base | target <= 1.01x | bytes sent (max rank) | vs base "
            "| of which DDP | time (s) | vs base |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for n in r0:
            f = r0[n]["curve"][-1][1]
            b = BASE.get(n)
            ddp = max(r[n]["bytes"]["by_kind"]["ddp"]["bytes_sent"] for r in ranks)
            if b in r0:
                fb = r0[b]["curve"][-1][1]
                rel, ok = f"{f / fb:.4f}x", ("met" if f / fb <= 1.01 else "**missed**")
                bytes_rel = f"{sent[n] / sent[b]:.3f}x"
                time_rel = f"{r0[n]['seconds'] / r0[b]['seconds']:.2f}x"
            else:
                rel, ok, bytes_rel, time_rel = "base", "", "", ""
            lines.append(
                f"| {LABEL[n]} | {f:.4f} | {rel} | {ok} | {sent[n] / 1e6:.2f} MB | {bytes_rel} | "
                f"{ddp / 1e6:.2f} MB | {r0[n]['seconds']:.1f} | {time_rel} |"
            )
        steps = [t for t, _ in r0[next(iter(r0))]["curve"]]
        lines += [
            "",
            "Validation loss by step:",
            "",
            "| step | " + " | ".join(LABEL[n] for n in r0) + " |",
            "|---|" + "---:|" * len(r0),
        ]
        for i, t in enumerate(steps):
            lines.append(f"| {t} | " + " | ".join(f"{r0[n]['curve'][i][1]:.4f}" for n in r0) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--no-shape", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", help="also save the raw results here")
    p.add_argument("--from-json", help="render saved results instead of training")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--inner-json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.inner_json:
        res = run_here(a)
        with open(a.inner_json + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(a.inner_json + ".tmp", a.inner_json)
        return 0
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        res, link, cmd = saved["results"], saved["link"], saved["cmd"]
    else:
        shown = [x for i, x in enumerate(argv) if x != "--json" and (i == 0 or argv[i - 1] != "--json")]
        cmd = "python benchmarks/convergence.py " + " ".join(shown)
        why = "--no-shape" if a.no_shape else ("not root" if os.geteuid() != 0 else "")
        if why:
            res, link = run_here(a), f"plain loopback (not shaped: {why})"
        else:
            inner = [x for x in argv if x != "--write-results"]
            inner = [x for i, x in enumerate(inner) if x != "--json" and (i == 0 or inner[i - 1] != "--json")]
            res = run_shaped(a, inner)
            link = f"loopback shaped to {a.rate} (tbf, private network namespace; both directions share the queue)"
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"results": res, "link": link, "cmd": cmd, "platform": platform.machine()}, f)
    text = render(res, a, link, cmd.strip())
    print(text)
    if a.write_results:
        import common

        common.write_section("comm", "convergence", text, title="Communication")
    return 0


if __name__ == "__main__":
    sys.exit(main())
