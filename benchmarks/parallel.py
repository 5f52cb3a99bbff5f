"""Tensor and pipeline parallelism with compression against one process, on gloo ranks (CPU).

A tiny Llama-style decoder trains for --steps optimizer steps of one global batch (the same
samples in the same order on every mesh) with W8A8 (per-channel weights, per-token dynamic
activations) and W4 g32 (asymmetric groups of 32), through engine.train_batch. For each mesh:
the final loss against one process's, the largest per-step loss difference, the median step
time and the peak resident memory of each rank (ru_maxrss: the whole process, Python and torch
included). Writes benchmarks/results/parallel.md (section "tiny-llama").

    .venv/bin/python benchmarks/parallel.py [--steps 200]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import common
from ranks import run_ranks

SCHEMES = {
    "W8A8": dict(bits=8, granularity="channel", symmetric=True, act=True),
    "W4 g32": dict(bits=4, granularity="group", group_size=32, symmetric=False, act=False),
}
MESHES = [("1 process", 1, 1, 1), ("TP2", 2, 2, 1), ("PP2", 2, 1, 2), ("PP2 x TP2", 4, 2, 2)]
MICRO, GAS, SEQ = 2, 4, 32


def _doc(scheme: dict, tp: int, pp: int) -> dict:
    params = {"start_bits": scheme["bits"], "target_bits": scheme["bits"], "quantization_period": 1,
              "granularity": scheme["granularity"]}
    if "group_size" in scheme:
        params["group_size"] = scheme["group_size"]
    kind = "symmetric" if scheme["symmetric"] else "asymmetric"
    comp = {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantization_type": kind},
        "different_groups": {"w": {"params": params, "modules": ["proj"]}}}}
    if scheme["act"]:
        comp["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": 8}, "modules": ["proj"]}}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp}, "compression_training": comp}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ, attn_implementation="eager"))


def _data(steps: int) -> torch.Tensor:
    # a partly learnable stream: sequences count up from a random start (modulo the vocabulary),
    # a quarter of the tokens replaced by random ones, so the loss stays well above zero and
    # relative differences are not those of a vanishing loss
    g = torch.Generator().manual_seed(1)
    n = steps * GAS * MICRO
    seq = (torch.randint(0, 256, (n, 1), generator=g) + torch.arange(SEQ)) % 256
    noise = torch.rand(n, SEQ, generator=g) < 0.25
    return torch.where(noise, torch.randint(0, 256, (n, SEQ), generator=g), seq)


def train(rank: int, world: int, scheme: dict, tp: int, pp: int, steps: int):
    import qcompress as qc
    torch.set_num_threads(1)        # every rank one thread, the single process too: comparable times
    doc = _doc(scheme, tp, pp)
    engine = qc.initialize(qc.init_compression(_model(), qc.load_config(doc)), doc)
    data = _data(steps)
    it = ({"input_ids": data[i * MICRO:(i + 1) * MICRO], "labels": data[i * MICRO:(i + 1) * MICRO]}
          for i in range(steps * GAS))
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(it)))
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[1:]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = ["| scheme | mesh | ranks | final loss | vs 1 process | largest step diff (abs) | step time (median) "
            "| peak RSS per rank |", "|---|---|---|---|---|---|---|---|"]
    for sname, scheme in SCHEMES.items():
        base = None
        for mname, world, tp, pp in MESHES:
            out = run_ranks(train, world, scheme, tp, pp, args.steps, timeout=3600) if world > 1 else \
                [train(0, 1, scheme, tp, pp, args.steps)]
            losses = out[0][0]
            base = base or losses
            rel = (losses[-1] - base[-1]) / base[-1]
            worst = max(abs(a - b) for a, b in zip(losses, base))
            step = max(o[1] for o in out)
            rss = " / ".join(f"{o[2] / 2 ** 20:.0f}" for o in out)
            rows.append(f"| {sname} | {mname} | {world} | {losses[-1]:.4f} | {100 * rel:+.4f} % | "
                        f"{worst:.2e} | {1e3 * step:.1f} ms | {rss} MiB |")
            print(rows[-1], flush=True)
    text = (f"Tiny Llama (4 blocks, hidden 128), {args.steps} optimizer steps of {GAS} micro-batches x {MICRO} "
            f"sequences of {SEQ} tokens, AdamW 3e-3, gloo on CPU; every mesh one data-parallel replica "
            "(the same global batch). Loss = the mean train_batch loss of the step.\n\n" + "\n".join(rows) + "\n")
    common.write_section("parallel", "tiny-llama", text, title="Tensor and pipeline parallelism")


if __name__ == "__main__":
    main()
