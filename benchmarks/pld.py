"""Progressive layer drop: time to reach the FP32 baseline's loss, with and without PLD, when
pre-training a small GPT-2 from scratch here.

    nice -n 10 .venv/bin/python benchmarks/pld.py [--steps 400] [--theta 0.5] [--gamma 0.01] [--write-results]

Data: Jane Austen's novels (model_zoo/lm_corpus.py, cached under --cache), split into train /
held-out sections, tokenized by characters (the ~90 symbols of the train side). Model: a pre-LN
GPT-2 (--layers x --width, context 64, no dropout) built by transformers from random weights, trained
through qcompress.initialize with AdamW (lr 1e-3, WarmupLR over 40 steps), batch 16 x 64 tokens.

The two runs start from the same weights and see the same batches. They run side by side in one
process, alternating optimizer steps, so the shared machine's load falls on both alike; each step is
timed alone and evaluation time is left out. The baseline runs --steps steps; its held-out loss at
the end is the target. The PLD run (`progressive_layer_drop: {enabled, theta, gamma}`) goes on until
its held-out loss (evaluated every --eval-every steps) reaches the target, or 2 x --steps.
Reported: training seconds and samples to the target, samples per second, the share of block
calls PLD ran. Prints markdown; --write-results replaces its section of benchmarks/results/engine.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SECTION = "## Progressive layer drop: time to the baseline's loss"
CONTEXT, BATCH = 64, 16


def load_text(cache):
    from model_zoo import lm_corpus

    return lm_corpus.split_corpus(lm_corpus.load_corpus("austen", cache), held_out_fraction=0.05, seed=0)


def encode(train_text, heldout_text):
    import torch

    vocab = sorted(set(train_text))
    index = {c: i for i, c in enumerate(vocab)}
    unk = len(vocab)
    ids = lambda t: torch.tensor([index.get(c, unk) for c in t], dtype=torch.long)  # noqa: E731
    return ids(train_text), ids(heldout_text), len(vocab) + 1


def make_model(vocab, layers, width, seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=CONTEXT,
        n_embd=width,
        n_layer=layers,
        n_head=max(1, width // 32),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    return transformers.GPT2LMHeadModel(cfg)


def ds_config(pld=None):
    cfg = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 40},
        },
        "gradient_clipping": 1.0,
    }
    if pld is not None:
        cfg["progressive_layer_drop"] = pld
    return cfg


def batch_at(tokens, step, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - CONTEXT - 1, (BATCH,), generator=g)
    return torch.stack([tokens[s : s + CONTEXT] for s in starts.tolist()])


def held_out_loss(model, tokens, windows=64):
    import torch

    n = min(windows, (tokens.numel() - 1) // CONTEXT)
    x = tokens[: n * CONTEXT].view(n, CONTEXT)
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=x[i : i + 16], labels=x[i : i + 16]).loss.item() for i in range(0, n, 16)]
    model.train()
    return sum(losses) / len(losses)


class Run:
    def __init__(self, name, engine, heldout):
        self.name, self.engine, self.heldout = name, engine, heldout
        self.train_s, self.steps, self.curve = 0.0, 0, []  # curve: (step, seconds, held-out loss)
        self.block_calls = [0, 0]  # run, decided

    def step(self, x):
        import torch

        eng = self.engine
        eng.train()
        pld = eng.pld
        t0 = time.perf_counter()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
        self.train_s += time.perf_counter() - t0
        self.steps += 1
        if pld is not None:
            n = len(pld.blocks)
            self.block_calls[0] += round(pld.last_share * n)
            self.block_calls[1] += n
        return float(out.loss.detach()) if torch.is_tensor(out.loss) else out.loss

    def evaluate(self):
        loss = held_out_loss(self.engine.module, self.heldout)
        self.curve.append((self.steps, self.train_s, loss))
        return loss


def first_reach(curve, target):
    for step, secs, loss in curve:
        if loss <= target:
            return step, secs, loss
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--theta", type=float, default=0.5)
    ap.add_argument("--gamma", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=os.path.join(ROOT, ".cache"))
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()

    import torch
    import qcompress as qc

    torch.set_num_threads(a.threads)
    train_text, heldout_text = load_text(a.cache)
    train_ids, heldout_ids, vocab = encode(train_text, heldout_text)
    pld_section = {"enabled": True, "theta": a.theta, "gamma": a.gamma}
    base = Run("FP32", qc.initialize(make_model(vocab, a.layers, a.width), ds_config()), heldout_ids)
    pld = Run("PLD", qc.initialize(make_model(vocab, a.layers, a.width), ds_config(pld_section)), heldout_ids)
    assert pld.engine.pld is not None and len(pld.engine.pld.blocks) == a.layers
    for r in (base, pld):
        r.evaluate()
    t_start = time.time()
    for step in range(a.steps):
        x = batch_at(train_ids, step)
        for r in (base, pld) if step % 2 == 0 else (pld, base):  # alternate who goes first
            r.step(x)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            for r in (base, pld):
                r.evaluate()
            print(
                f"step {step + 1}: FP32 {base.curve[-1][2]:.4f} ({base.train_s:.0f} s)  "
                f"PLD {pld.curve[-1][2]:.4f} ({pld.train_s:.0f} s)",
                file=sys.stderr,
            )
    target = base.curve[-1][2]
    step = a.steps
    while first_reach(pld.curve, target) is None and step < 2 * a.steps:
        pld.step(batch_at(train_ids, step))
        step += 1
        if step % a.eval_every == 0:
            pld.evaluate()
            print(
                f"step {step}: PLD {pld.curve[-1][2]:.4f} ({pld.train_s:.0f} s), target {target:.4f}", file=sys.stderr
            )
    text = report(a, base, pld, target, vocab, time.time() - t_start)
    print(text)
    if a.write_results:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import common

        common.write_section("engine", "pld", text, title="Engine costs")


def report(a, base, pld, target, vocab, wall):
    import torch

    n_params = sum(p.numel() for p in base.engine.module.parameters())
    reach = first_reach(pld.curve, target)
    b_sps = BATCH * base.steps / base.train_s
    # PLD's own throughput over the steps both runs made
    p_steps = [c for c in pld.curve if c[0] <= base.steps]
    p_secs = p_steps[-1][1]
    p_sps = BATCH * p_steps[-1][0] / p_secs
    share = pld.block_calls[0] / max(1, pld.block_calls[1])
    load = os.getloadavg()
    lines = [
        SECTION,
        "",
        f"`nice -n 10 python benchmarks/pld.py --steps {a.steps} --theta {a.theta} --gamma {a.gamma}` "
        f"(torch {torch.__version__}, {platform.machine()}, {a.threads} torch thread(s), 2 CPUs shared with "
        f"other agents' jobs, load average {load[0]:.1f} at the end, {wall / 60:.1f} min in all). "
        f"Pre-LN GPT-2, {a.layers} layers x {a.width}, {n_params / 1e6:.2f}M parameters, character "
        f"vocabulary of {vocab}, context {CONTEXT}, batch {BATCH}, AdamW lr 1e-3, trained from scratch on "
        f"Jane Austen's novels; held-out loss on 64 windows of the 5% held-out sections. Both runs "
        f"alternate steps in one process (same batches, same start).",
        "",
        "| run | steps | train s | samples/s | held-out loss at end | steps to FP32's final loss | "
        "train s to it | samples to it |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| FP32 baseline | {base.steps} | {base.train_s:.0f} | {b_sps:.1f} | {base.curve[-1][2]:.4f} | "
        f"{base.steps} | {base.train_s:.0f} | {BATCH * base.steps} |",
    ]
    if reach is not None:
        r_step, r_secs, _ = reach
        lines.append(
            f"| PLD theta {a.theta}, gamma {a.gamma} | {pld.steps} | {pld.train_s:.0f} | {p_sps:.1f} | "
            f"{pld.curve[-1][2]:.4f} | {r_step} | {r_secs:.0f} | {BATCH * r_step} |"
        )
    else:
        lines.append(
            f"| PLD theta {a.theta}, gamma {a.gamma} | {pld.steps} | {pld.train_s:.0f} | {p_sps:.1f} | "
            f"{pld.curve[-1][2]:.4f} | not reached in {pld.steps} | - | - |"
        )
    theta_end = (1 - a.theta) * math.exp(-a.gamma * (base.steps - 1)) + a.theta
    lines += [
        "",
        f"PLD ran {100 * share:.1f}% of the block calls over its {pld.steps} steps (theta falls from 1 to "
        f"{theta_end:.2f} by step {base.steps}; the last block keeps with theta, the first with "
        f"1 - (1 - theta)/{a.layers}). Samples/s over the first {base.steps} steps: PLD "
        f"{p_sps / b_sps:.2f}x the baseline's. ",
    ]
    if reach is not None:
        lines[-1] += (
            f"To the baseline's final held-out loss: {reach[1] / base.train_s:.2f}x the baseline's "
            f"training time, {reach[0] / base.steps:.2f}x its samples."
        )
    lines += [
        "",
        "Held-out loss against training seconds (every "
        f"{a.eval_every} steps): FP32 "
        + ", ".join(f"{s:.0f}s {l:.3f}" for _, s, l in base.curve[1::4])
        + "; PLD "
        + ", ".join(f"{s:.0f}s {l:.3f}" for _, s, l in pld.curve[1::4])
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
