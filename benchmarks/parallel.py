"""Tensor, pipeline and data parallelism with compression against one process, on gloo ranks (CPU).

A tiny Llama-style decoder trains for --steps optimizer steps of one global batch of 8 sequences
(the same samples on every mesh; each data-parallel replica its share) with W8A8 (per-channel
weights, per-token dynamic activations) and W4 g32 (asymmetric groups of 32), through
engine.train_batch, AdamW with a linear warmup and a linear decay to zero (WarmupDecayLR).
For each mesh: the final loss against one process's; per rank the model state (parameters,
gradients, optimizer state: bytes of the tensors this rank holds), the peak RSS, the median step
time and the bytes sent per step by each process group (benchmarks/collective_bytes.py).

`--drift` writes the reduction-order section instead: one process against itself with its
initial weights moved by one ulp, against one process whose row-parallel layers sum two halves
of their matmul (the order tensor parallelism adds them in), and against TP2. `--spread` writes
the final losses of single processes nudged by one ulp at the training setting (section "spread").

    .venv/bin/python benchmarks/parallel.py [--steps 200] [--meshes ...] [--drift | --spread]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

# the sibling modules by name, run as a script or loaded from its file (tests/benchmarks does)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from ranks import run_ranks  # noqa: E402

SCHEMES = {
    "none": None,
    "W8A8": dict(bits=8, granularity="channel", symmetric=True, act=True),
    "W4 g32": dict(bits=4, granularity="group", group_size=32, symmetric=False, act=False),
}
# name -> (tp, pp, dp)
MESHES = {
    "1 process": (1, 1, 1),
    "DP2": (1, 1, 2),
    "DP4": (1, 1, 4),
    "TP2": (2, 1, 1),
    "PP2": (1, 2, 1),
    "PP2 x TP2": (2, 2, 1),
    "TP2 x DP2": (2, 1, 2),
    "PP2 x DP2": (1, 2, 2),
    "PP2 x TP2 x DP2": (2, 2, 2),
}
GLOBAL, MICRO, SEQ = 8, 2, 32  # sequences per optimizer step, per micro-batch, tokens each
TAIL = 20  # steps averaged for the "last steps" loss


def _doc(scheme, tp: int, pp: int, dp: int, opts: dict) -> dict:
    doc = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
        "optimizer": {"type": "AdamW", "params": {"lr": opts["lr"]}},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp},
    }
    if opts.get("warmup"):
        doc["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": opts["lr"],
                "warmup_num_steps": opts["warmup"],
                "warmup_type": "linear",
                "total_num_steps": opts["steps"],
            },
        }
    if scheme is None:
        return doc
    params = {
        "start_bits": scheme["bits"],
        "target_bits": scheme["bits"],
        "quantization_period": 1,
        "granularity": scheme["granularity"],
    }
    if "group_size" in scheme:
        params["group_size"] = scheme["group_size"]
    kind = "symmetric" if scheme["symmetric"] else "asymmetric"
    comp = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantization_type": kind},
            "different_groups": {"w": {"params": params, "modules": ["proj"]}},
        }
    }
    if scheme["act"]:
        comp["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": 8}, "modules": ["proj"]}},
        }
    doc["compression_training"] = comp
    return doc


def _model(ulp_seed=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="eager",
        )
    )
    if ulp_seed is not None:
        nudge_one_ulp(model, ulp_seed)
    return model


def nudge_one_ulp(model, seed: int) -> None:
    """Move a random half of every parameter's elements one ulp up: the smallest change of the
    initial weights a float can express."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            pick = torch.rand(p.shape, generator=g) < 0.5
            p.copy_(torch.where(pick, torch.nextafter(p, torch.full_like(p, math.inf)), p))


def _halves_forward(self, x):
    """A Linear's forward that sums the matmuls of the two halves of its input features, as a
    row-parallel layer split over two ranks adds its partial outputs."""
    if hasattr(self, "quantize_input"):
        x, w, b = self.quantize_input(x), self.effective_weight(), self.effective_bias()
    else:
        w, b = self.weight, self.bias
    h = w.shape[1] // 2
    y = F.linear(x[..., :h], w[:, :h]) + F.linear(x[..., h:], w[:, h:])
    return y if b is None else y + b


def sum_in_tp_order(model, names=("o_proj", "down_proj")) -> int:
    """Give the row-parallel layers (transformers' Llama plan) the two-halves forward; returns how many."""
    n = 0
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            mod.forward = types.MethodType(_halves_forward, mod)
            n += 1
    return n


def _data(steps: int) -> torch.Tensor:
    # a partly learnable stream: sequences count up from a random start (modulo the vocabulary),
    # a quarter of the tokens replaced by random ones, so the loss stays well above zero and
    # relative differences are not those of a vanishing loss
    g = torch.Generator().manual_seed(1)
    n = steps * GLOBAL
    seq = (torch.randint(0, 256, (n, 1), generator=g) + torch.arange(SEQ)) % 256
    noise = torch.rand(n, SEQ, generator=g) < 0.25
    return torch.where(noise, torch.randint(0, 256, (n, SEQ), generator=g), seq)


def _micro_batches(data, steps: int, replica: int, replicas: int):
    """This replica's micro-batches, step by step: its contiguous share of each global batch."""
    share = GLOBAL // replicas
    for s in range(steps):
        first = s * GLOBAL + replica * share
        for j in range(share // MICRO):
            rows = data[first + j * MICRO : first + (j + 1) * MICRO]
            yield {"input_ids": rows, "labels": rows}


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(optimizer) -> int:
    """Bytes of the parameters this rank's optimizer holds, one gradient of the parameter's dtype
    each, and the optimizer state tensors (this rank's shards of DTensors)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    total = sum(2 * _local(p).numel() * p.element_size() for p in params)
    for st in optimizer.state.values():
        total += sum(_local(v).numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def train(rank: int, world: int, scheme_name: str, tp: int, pp: int, steps: int, opts: dict):
    import qcompress as qc
    from collective_bytes import CollectiveBytes, mesh_labels

    torch.set_num_threads(1)  # every rank one thread, the single process too: comparable times
    scheme = SCHEMES[scheme_name]
    dp = world // (tp * pp)
    opts = dict(opts, steps=steps)
    doc = _doc(scheme, tp, pp, dp, opts)
    model = _model(opts.get("ulp_seed"))
    if scheme is not None:
        model = qc.init_compression(model, qc.load_config(doc))
    engine = qc.initialize(model, doc)
    if opts.get("tp_order"):
        assert sum_in_tp_order(model) == 8
    it = _micro_batches(_data(steps), steps, engine.data_parallel_rank, engine.data_parallel_world_size)
    count = CollectiveBytes(mesh_labels(engine))
    losses, times = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        if s == 1:  # one step counted (the mode slows every op down): not timed
            with count:
                losses.append(float(engine.train_batch(it)))
        else:
            losses.append(float(engine.train_batch(it)))
        times.append(time.perf_counter() - t0)
    timed = [t for s, t in enumerate(times) if s >= 2]
    return dict(
        losses=losses,
        step_s=statistics.median(timed) if timed else float("nan"),
        rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        state=state_bytes(engine.optimizer),
        sent=dict(count.sent),
        unknown=dict(count.unknown),
    )


def run_mesh(scheme_name: str, mesh: str, steps: int, opts: dict, timeout: float = 3600):
    tp, pp, dp = MESHES[mesh]
    world = tp * pp * dp
    if world == 1:
        return [train(0, 1, scheme_name, tp, pp, steps, opts)]
    return run_ranks(train, world, scheme_name, tp, pp, steps, opts, timeout=timeout)


def tail_mean(losses) -> float:
    return statistics.fmean(losses[-TAIL:])


def _pct(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.2f} %"


def _kib(out, group: str) -> str:
    vals = [o["sent"].get(group, 0) for o in out]
    return "-" if not any(vals) else " / ".join(f"{v / 1024:.0f}" for v in vals)


def _cost_row(sname, mesh, out, dp_time) -> str:
    step = max(o["step_s"] for o in out)
    vs = f"{step / dp_time:.2f}x" if dp_time else "-"
    state = " / ".join(f"{o['state'] / 2**20:.2f}" for o in out)
    rss = " / ".join(f"{o['rss'] / 2**20:.0f}" for o in out)
    sent = " | ".join(_kib(out, g) for g in ("tp", "pp", "dp", "world"))
    return f"| {sname} | {mesh} | {len(out)} | {1e3 * step:.0f} ms | {vs} | {state} | {rss} | {sent} |"


def training_section(args) -> str:
    opts = dict(lr=args.lr, warmup=args.warmup)
    loss_rows = [
        "| scheme | mesh | ranks | final loss | vs 1 process | mean of the last 20 steps vs 1 process |",
        "|---|---|---|---|---|---|",
    ]
    cost_rows = [
        "| scheme | mesh | ranks | step time (median, slowest rank) | vs DP-only on as many ranks "
        "| model state per rank (MiB) | peak RSS per rank (MiB) | KiB sent per step per rank: tp "
        "| pp | dp | world |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sname in args.schemes:
        base = run_mesh(sname, "1 process", args.steps, opts)
        b = base[0]["losses"]
        loss_rows.append(f"| {sname} | 1 process | 1 | {b[-1]:.4f} | 0 | 0 |")
        nudged = [
            run_mesh(sname, "1 process", args.steps, dict(opts, ulp_seed=s))[0]["losses"]
            for s in range(1, args.ulp_runs + 1)
        ]
        if nudged:
            fin = sorted((x[-1] - b[-1]) / b[-1] for x in nudged)
            tail = sorted((tail_mean(x) - tail_mean(b)) / tail_mean(b) for x in nudged)
            loss_rows.append(
                f"| {sname} | 1 process, initial weights +1 ulp ({len(nudged)} runs) | 1 | "
                f"{min(x[-1] for x in nudged):.4f} .. {max(x[-1] for x in nudged):.4f} | "
                f"{100 * fin[0]:+.2f} .. {100 * fin[-1]:+.2f} % | "
                f"{100 * tail[0]:+.2f} .. {100 * tail[-1]:+.2f} % |"
            )
        dp_times = {1: base[0]["step_s"]}
        cost_rows.append(_cost_row(sname, "1 process", base, None))
        for mesh in args.meshes:
            out = run_mesh(sname, mesh, args.steps, opts)
            if out[0]["unknown"]:
                raise RuntimeError(f"{mesh}: collectives the byte counter cannot size: {out[0]['unknown']}")
            l0 = out[0]["losses"]
            tp, pp, dp = MESHES[mesh]
            if tp == pp == 1:
                dp_times[dp] = max(o["step_s"] for o in out)
            loss_rows.append(
                f"| {sname} | {mesh} | {len(out)} | {l0[-1]:.4f} | {_pct(l0[-1], b[-1])} | "
                f"{_pct(tail_mean(l0), tail_mean(b))} |"
            )
            cost_rows.append(_cost_row(sname, mesh, out, dp_times.get(len(out)) if tp * pp > 1 else None))
            print(loss_rows[-1], cost_rows[-1], sep="\n", flush=True)
    n = sum(p.numel() for p in _model().parameters())
    return (
        f"Tiny Llama (4 blocks, hidden 128, {n / 1e6:.2f} M parameters), {args.steps} optimizer steps of {GLOBAL} "
        f"sequences of {SEQ} tokens (micro-batches of {MICRO}; each data-parallel replica its share), "
        f"AdamW, LR warmed up linearly to {args.lr:g} over {args.warmup} steps then decayed linearly to 0; "
        "gloo on CPU, one thread per rank. Loss = the mean train_batch loss of the step.\n\n"
        + "\n".join(loss_rows)
        + "\n\n"
        + "\n".join(cost_rows)
        + "\n"
    )


def drift_section(args) -> str:
    at = [1, 2, 5, 10, 20, 50, args.drift_steps]
    rows = [
        "| scheme | run | " + " | ".join(f"step {s}" for s in at) + " | final vs 1 process "
        "| mean of the last 20 steps vs 1 process |",
        "|---|---|" + "---|" * (len(at) + 2),
    ]
    opts = dict(lr=args.lr, warmup=0)
    for sname in args.drift_schemes:
        base = run_mesh(sname, "1 process", args.drift_steps, opts)[0]["losses"]
        runs = [
            (f"initial weights +1 ulp (seed {s})", "1 process", dict(opts, ulp_seed=s))
            for s in range(1, args.ulp_runs + 1)
        ]
        runs += [
            ("row-parallel layers summed as two halves", "1 process", dict(opts, tp_order=True)),
            ("TP2", "TP2", opts),
        ]
        for label, mesh, o in runs:
            x = run_mesh(sname, mesh, args.drift_steps, o)[0]["losses"]
            diffs = " | ".join(f"{abs(x[s - 1] - base[s - 1]):.1e}" for s in at)
            rows.append(
                f"| {sname} | {label} | {diffs} | {_pct(x[-1], base[-1])} | {_pct(tail_mean(x), tail_mean(base))} |"
            )
            print(rows[-1], flush=True)
    return (
        f"The same model and data, {args.drift_steps} steps at a constant LR {args.lr:g} (AdamW), one "
        "data-parallel replica. Each run against the unperturbed single process: the absolute "
        "difference of the step's loss at the steps named, then the final and the tail-mean "
        "loss.\n\n" + "\n".join(rows) + "\n"
    )


def spread_section(args) -> str:
    """Single processes whose initial weights differ by one ulp, at the training section's setting:
    how far apart runs end that differ only by float noise."""
    opts = dict(lr=args.lr, warmup=args.warmup)
    rows = [
        "| scheme | initial weights | final loss | vs unperturbed | mean of the last 20 steps vs unperturbed |",
        "|---|---|---|---|---|",
    ]
    for sname in args.schemes:
        base = run_mesh(sname, "1 process", args.steps, opts)[0]["losses"]
        finals = [base[-1]]
        rows.append(f"| {sname} | as initialised | {base[-1]:.4f} | 0 | 0 |")
        for s in range(1, args.ulp_runs + 1):
            x = run_mesh(sname, "1 process", args.steps, dict(opts, ulp_seed=s))[0]["losses"]
            finals.append(x[-1])
            rows.append(
                f"| {sname} | +1 ulp (seed {s}) | {x[-1]:.4f} | {_pct(x[-1], base[-1])} | "
                f"{_pct(tail_mean(x), tail_mean(base))} |"
            )
            print(rows[-1], flush=True)
        mean, sd = statistics.fmean(finals), statistics.stdev(finals)
        rows.append(
            f"| {sname} | all {len(finals)} runs | {mean:.4f} +- {sd:.4f} (sd) | "
            f"{min(finals):.4f} .. {max(finals):.4f} "
            f"| range {100 * (max(finals) - min(finals)) / mean:.2f} % of the mean |"
        )
    return (
        f"The training section's setting ({args.steps} steps, warmup {args.warmup}, peak LR {args.lr:g}, "
        "linear decay to 0), one process, a random half of every initial weight moved one ulp up "
        "(a different half per seed).\n\n" + "\n".join(rows) + "\n"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--schemes", nargs="+", default=["W8A8", "W4 g32"], choices=list(SCHEMES))
    ap.add_argument(
        "--meshes",
        nargs="+",
        default=[m for m in MESHES if m != "1 process"],
        choices=[m for m in MESHES if m != "1 process"],
    )
    ap.add_argument("--ulp-runs", type=int, default=2, help="single-process runs with weights nudged by 1 ulp")
    ap.add_argument("--drift", action="store_true", help="write the reduction-order section instead")
    ap.add_argument("--drift-steps", type=int, default=100)
    ap.add_argument("--drift-schemes", nargs="+", default=["none", "W8A8"], choices=list(SCHEMES))
    ap.add_argument("--spread", action="store_true", help="write the 1-ulp spread section instead")
    args = ap.parse_args()
    if args.spread:
        common.write_section("parallel", "spread", spread_section(args), title="Tensor and pipeline parallelism")
    elif args.drift:
        common.write_section("parallel", "drift", drift_section(args), title="Tensor and pipeline parallelism")
    else:
        common.write_section("parallel", "tiny-llama", training_section(args), title="Tensor and pipeline parallelism")


if __name__ == "__main__":
    main()
