"""Activation checkpointing: peak memory and step time with and without, on a 6-layer GPT-2-shaped
decoder (random weights) at sequence 512, batch 8, trained through qcompress.initialize with a
W8A8 QAT recipe (fused QAT layers) and, as a reference, in FP32.

Memory: each (recipe, checkpointing) run is a fresh process; its figure is the peak resident set
(getrusage ru_maxrss) minus the resident set just before the first training step, so it holds
what training adds (activations, gradients, optimizer state, the recompute's working set), not
the interpreter, torch or the model's weights; glibc's mmap threshold is fixed at 128 KiB so freed
tensors leave the resident set. Time: the median training step after one warm-up
step, the processes of a round run back to back with the order alternating between rounds.

    .venv/bin/python benchmarks/activation_checkpointing.py [--rounds 2] [--steps 3] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, SEQ, BATCH, HIDDEN, HEADS, VOCAB = 6, 512, 8, 256, 4, 2048

W8A8 = {
    "weight_quantization": {
        "shared_parameters": {
            "enabled": True,
            "quantization_type": "symmetric",
            "schedule_offset": 0,
            "quantize_weight_in_forward": True,
        },
        "different_groups": {
            "w8": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0, "granularity": "channel"}}
        },
    },
    "activation_quantization": {
        "shared_parameters": {
            "enabled": True,
            "quantization_type": "symmetric",
            "range_calibration": "dynamic",
            "schedule_offset": 0,
        },
        "different_groups": {"a8": {"params": {"bits": 8}}},
    },
}


def child(recipe: str, checkpointing: bool, steps: int) -> dict:
    import resource
    import time

    import torch
    import transformers

    import qcompress

    def rss_kib() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    doc = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if recipe == "w8a8":
        doc["compression_training"] = W8A8
        qcompress.init_compression(model, doc)
    if checkpointing:
        doc["activation_checkpointing"] = {}
    engine = qcompress.initialize(model, doc)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    before = rss_kib()
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "added_mib": (peak - before) / 1024,
        "step_s": statistics.median(times[1:]),
        "blocks": engine.checkpointed_blocks,
        "loss": float(loss.detach()),
    }


def run_child(recipe: str, checkpointing: bool, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", recipe, str(int(checkpointing)), str(steps)]
    # a fixed mmap threshold: every large tensor is its own mapping, returned to the system when
    # freed, so the resident set follows the live tensors (glibc's adaptive threshold would keep
    # freed activations in the heap and hide what checkpointing saves)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up step)")
    p.add_argument("--recipes", default="w8a8,fp32")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], bool(int(a.child[1])), int(a.child[2]))))
        return
    rows = []
    for recipe in a.recipes.split(","):
        runs = {False: [], True: []}
        for r in range(a.rounds):
            for ck in (False, True) if r % 2 == 0 else (True, False):
                res = run_child(recipe, ck, a.steps)
                runs[ck].append(res)
                print(f"{recipe} checkpointing={ck}: {res}", file=sys.stderr)
        mem = {ck: statistics.median(x["added_mib"] for x in v) for ck, v in runs.items()}
        step = {ck: statistics.median(x["step_s"] for x in v) for ck, v in runs.items()}
        same_loss = runs[False][0]["loss"] == runs[True][0]["loss"]
        rows.append(
            f"| {recipe.upper()} | {mem[False]:.0f} | {mem[True]:.0f} | {mem[True] / mem[False]:.2f}x | "
            f"{step[False]:.2f} | {step[True]:.2f} | {step[True] / step[False]:.2f}x | "
            f"{'equal' if same_loss else 'differ'} |"
        )
    text = (
        f"## Activation checkpointing: memory and step time\n\n"
        f"GPT-2-shaped decoder, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, sequence {SEQ}, batch {BATCH}, "
        f"AdamW; every block checkpointed. Memory: peak RSS minus RSS before the first step, median of "
        f"{a.rounds} fresh processes. Step: median of {a.steps} steps after a warm-up, median over processes.\n\n"
        "| recipe | added MiB, plain | added MiB, checkpointed | ratio | step s, plain | step s, checkpointed "
        "| time ratio | loss |\n|---|---:|---:|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if a.write_results:
        sys.path.insert(0, HERE)
        import common

        common.write_section("engine", "activation-checkpointing", text, title="Engine costs")


if __name__ == "__main__":
    main()
