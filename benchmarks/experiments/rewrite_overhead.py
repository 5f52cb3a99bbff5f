"""Training-step overhead of the compress-aware modules: FP32 vs W8A8 (fake quantization in
forward, dynamic 8-bit inputs) on a small CNN and a small transformer, each built from plain torch
layers (fast path) and from subclasses with their own forward (composed path: TF-"same" padding
convs, weight-standardized conv, scaled / LoRA / fused-QKV Linears).

    .venv/bin/python benchmarks/experiments/rewrite_overhead.py [--threads 1] [--rounds 7] [--steps 5] [--label after]

One step = forward + backward + SGD step (+ CompressionScheduler.step when compressed). FP32 and
compressed copies alternate round by round, so machine load hits both alike; the table gives the
best round's ms per step (the least disturbed by other jobs) and the ratio. A second table times
one layer whose class only defers to nn.Linear / nn.Conv2d's forward: compressed on the fast path
(inherited forward) and on the composed path (own forward), the same math, so the difference is
what the composed mechanism costs per call. Prints markdown.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qcompress as qc  # noqa: E402


# --- subclassed layers, as real model ports write them --------------------------------------------


def _same(size, k, s, d):
    total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


class Conv2dSame(nn.Conv2d):
    """timm's Conv2dSame: TensorFlow "SAME" padding computed per input."""

    def forward(self, x):
        ph = _same(x.shape[-2], self.weight.shape[-2], self.stride[0], self.dilation[0])
        pw = _same(x.shape[-1], self.weight.shape[-1], self.stride[1], self.dilation[1])
        return F.conv2d(
            F.pad(x, [pw[0], pw[1], ph[0], ph[1]]), self.weight, self.bias, self.stride, 0, self.dilation, self.groups
        )


class WSConv2d(nn.Conv2d):
    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / torch.sqrt(w.var((1, 2, 3), keepdim=True, unbiased=False) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class ScaledLinear(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.scale = nn.Parameter(torch.ones(o, 1))

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


class LoRALinear(nn.Linear):
    def __init__(self, i, o, r=8):
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(o, r))

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


class QKVLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x).chunk(3, dim=-1)


# --- models ------------------------------------------------------------------------------------------


class CNN(nn.Module):
    def __init__(self, sub, c=32):
        super().__init__()
        conv = (
            (lambda i, o, k, **kw: Conv2dSame(i, o, k, **kw))
            if sub
            else (lambda i, o, k, **kw: nn.Conv2d(i, o, k, padding=k // 2, **kw))
        )
        self.stem = conv(3, c, 3)
        self.ws = (WSConv2d if sub else nn.Conv2d)(c, c, 3, padding=1)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "dw": conv(c, c, 3, groups=c, bias=False),
                        "bn1": nn.BatchNorm2d(c),
                        "pw": nn.Conv2d(c, c, 1, bias=False),
                        "bn2": nn.BatchNorm2d(c),
                    }
                )
            )
        self.head = (ScaledLinear if sub else nn.Linear)(c, 10)

    def forward(self, x):
        x = F.relu(self.ws(F.relu(self.stem(x))))
        for b in self.blocks:
            x = x + b["bn2"](b["pw"](F.relu6(b["bn1"](b["dw"](x)))))
        return self.head(x.mean((2, 3)))


class Transformer(nn.Module):
    def __init__(self, sub, vocab=256, d=128, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(d),
                        "qkv": (QKVLinear if sub else nn.Linear)(d, 3 * d),
                        "out": (LoRALinear if sub else nn.Linear)(d, d),
                        "ln2": nn.LayerNorm(d),
                        "fc1": (ScaledLinear if sub else nn.Linear)(d, 4 * d),
                        "fc2": nn.Linear(4 * d, d),
                    }
                )
            )
        self.lm_head = nn.Linear(d, vocab)
        self.sub = sub

    def forward(self, ids):
        x = self.emb(ids)
        for L in self.layers:
            b, t, d = x.shape
            qkv = L["qkv"](L["ln1"](x))
            q, k, v = qkv if self.sub else qkv.chunk(3, dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + L["out"](a)
            x = x + L["fc2"](F.gelu(L["fc1"](L["ln2"](x))))
        return self.lm_head(x)


W8A8 = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": 8}}},
        },
    }
}


def setup(kind, sub):
    torch.manual_seed(0)
    if kind == "cnn":
        model, x = CNN(sub), torch.randn(16, 3, 32, 32)
        loss_fn = lambda out: F.cross_entropy(out, torch.arange(16) % 10)  # noqa: E731
    else:
        model, x = Transformer(sub), torch.randint(0, 256, (8, 64))
        loss_fn = lambda out: F.cross_entropy(out.flatten(0, 1), x.flatten())  # noqa: E731
    return model.train(), x, loss_fn


def stepper(model, x, loss_fn, sched):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()

    return step


def per_step_ms(step, steps):
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) * 1000 / steps


class PassLinear(nn.Linear):
    """Own forward that only defers to nn.Linear's: the same math as the fast path."""

    def forward(self, x):
        return super().forward(x)


class PassConv2d(nn.Conv2d):
    def forward(self, x):
        return super().forward(x)


def per_call_us(modules, x, rounds, calls=100):
    """Best-of-rounds microseconds of forward + backward of each layer, the layers interleaved."""
    best = [float("inf")] * len(modules)
    for _ in range(rounds):
        for i, module in enumerate(modules):
            t = time.perf_counter()
            for _ in range(calls):
                module(x).sum().backward()
            best[i] = min(best[i], (time.perf_counter() - t) * 1e6 / calls)
    return best


def mechanism_rows(rounds):
    """(layer, input, FP32 us, fast-path W8A8 us, composed-path W8A8 us) for one layer each."""
    rows = []
    for name, cls, plain, args, shape in (
        ("Linear(4, 4) (fixed cost)", PassLinear, nn.Linear, (4, 4), (1, 4)),
        ("Linear(256, 256)", PassLinear, nn.Linear, (256, 256), (32, 256)),
        ("Conv2d(32, 32, 3)", PassConv2d, nn.Conv2d, (32, 32, 3), (8, 32, 16, 16)),
    ):
        torch.manual_seed(0)
        x = torch.randn(*shape)
        fp32 = plain(*args)
        fast = qc.init_compression(nn.Sequential(copy.deepcopy(fp32)), W8A8)[0]
        own = cls(*args)
        own.load_state_dict(fp32.state_dict())
        composed = qc.init_compression(nn.Sequential(own), W8A8)[0]
        assert torch.equal(fast(x), composed(x))  # same math on both paths
        times = per_call_us([fp32, fast, composed], x, rounds)
        rows.append((name, "x".join(map(str, shape)), *times))
    return rows


def measure(kind, sub, rounds, steps):
    model, x, loss_fn = setup(kind, sub)
    fp32 = stepper(copy.deepcopy(model), x, loss_fn, None)
    try:
        qc.init_compression(model, W8A8)
        comp = stepper(model, x, loss_fn, qc.CompressionScheduler(model))
        comp()  # warm-up (and: does it run at all?)
    except Exception as e:  # the pre-issue-16 rewrite breaks TF-"same" residual nets
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    fp32()
    a, b = [], []
    for _ in range(rounds):
        a.append(per_step_ms(fp32, steps))
        b.append(per_step_ms(comp, steps))
    return min(a), min(b), ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), best of "
        f"{args.rounds} rounds x {args.steps} steps; code: {args.label or ROOT}"
    )
    print()
    print("| model | layers | FP32 ms/step | W8A8 ms/step | W8A8 / FP32 | note |")
    print("|---|---|---:|---:|---:|---|")
    for kind in ("cnn", "transformer"):
        for sub in (False, True):
            f, c, err = measure(kind, sub, args.rounds, args.steps)
            layers = "subclasses (own forward)" if sub else "plain torch"
            if err:
                print(f"| {kind} | {layers} | - | - | - | fails: {err} |")
            else:
                print(f"| {kind} | {layers} | {f:.2f} | {c:.2f} | {c / f:.2f} | |")
    if hasattr(qc.nn.layers, "own_forward"):  # the composed path exists in this version
        print()
        print(
            "| one layer, fwd+bwd | input | FP32 us | W8A8 fast path us | W8A8 composed path us | composed - fast us |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for name, shape, f, fast, comp in mechanism_rows(args.rounds):
            print(f"| {name} | {shape} | {f:.1f} | {fast:.1f} | {comp:.1f} | {comp - fast:+.1f} |")
    print(f"\nload average after the run: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
