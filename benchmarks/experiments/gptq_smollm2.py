"""Does observer: gptq lower SmolLM2-135M's W4 g128 symmetric PTQ perplexity below round-to-nearest?

SmolLM2-135M-Instruct (model_zoo.smollm2), held-out Austen (model_zoo.lm_corpus's seeded 5 % split):
FP32, round-to-nearest (schedules/w4a16_g128.yaml) and GPTQ (schedules/w4a16_g128_gptq.yaml, with
the variants asked for), each on the same held-out sequences; GPTQ calibrated on sequences of the
train split. Prints perplexities, the share of RTN's excess over FP32 each recovers, and the wall
time of each calibration relative to one evaluation pass, measured in the same run.

    python -m benchmarks.experiments.gptq_smollm2 [--calib 128] [--heldout 64] [--seq 512]
        [--variants default,no_act_order]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTN = os.path.join(ROOT, "schedules", "w4a16_g128.yaml")
GPTQ = os.path.join(ROOT, "schedules", "w4a16_g128_gptq.yaml")
VARIANTS = {
    "default": {},
    "no_act_order": {"act_order": False},
    "mse": {"scale_observer": "mse"},
    "not_sequential": {"sequential": False},
}


def sequences(text: str, tok, n: int, seq: int) -> torch.Tensor:
    """n sequences of seq tokens, taken evenly spaced over the text's tokens."""
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    chunks = ids.numel() // seq
    if chunks < n:
        raise SystemExit(f"the text holds {chunks} sequences of {seq} tokens, fewer than {n}")
    starts = torch.linspace(0, chunks - 1, n).round().long() * seq
    return torch.stack([ids[s : s + seq] for s in starts])


@torch.no_grad()
def perplexity(model, data: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i : i + batch]
        out = model(x, labels=x)
        n = x.numel() - x.shape[0]
        total += float(out.loss) * n
        count += n
    return math.exp(total / count)


def gptq_config(kwargs: dict) -> dict:
    import qcompress as qc

    doc = copy.deepcopy(qc.load_config(GPTQ).raw)
    params = doc["compression_training"]["weight_quantization"]["different_groups"]["w4_g128"]["params"]
    params["observer_kwargs"] = {**params["observer_kwargs"], **kwargs}
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=128, help="calibration sequences from the train split")
    ap.add_argument("--heldout", type=int, default=64, help="held-out sequences evaluated")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward")
    ap.add_argument("--variants", default="default", help=f"comma-separated GPTQ variants: {','.join(VARIANTS)}")
    ap.add_argument("--cache", default=os.path.join(ROOT, ".cache"), help="lm_corpus cache folder")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    import qcompress as qc
    from model_zoo.lm_corpus import load_corpus, split_corpus
    from model_zoo.smollm2 import load_smollm2

    fp, tok = load_smollm2()
    train, held = split_corpus(load_corpus("austen", a.cache), 0.05, 0)
    calib = sequences(train, tok, a.calib, a.seq)
    test = sequences(held, tok, a.heldout, a.seq)
    print(
        f"SmolLM2-135M-Instruct, Austen held-out {test.shape[0]} x {a.seq} tokens; GPTQ calibrated on "
        f"{calib.shape[0]} x {a.seq} train tokens; torch threads {torch.get_num_threads()}"
    )
    t0 = time.perf_counter()
    ppl_fp = perplexity(fp, test, a.batch)
    t_eval = time.perf_counter() - t0
    rows = [("FP32", ppl_fp, None)]
    print(f"FP32 {ppl_fp:.3f}", flush=True)
    rtn = copy.deepcopy(fp)
    qc.init_compression(rtn, qc.load_config(RTN))
    ppl_rtn = perplexity(rtn, test, a.batch)
    rows.append(("RTN W4 g128 sym", ppl_rtn, None))
    print(f"RTN {ppl_rtn:.3f}", flush=True)
    del rtn
    batches = [calib[i : i + a.batch] for i in range(0, calib.shape[0], a.batch)]
    for name in a.variants.split(","):
        model = copy.deepcopy(fp)
        qc.init_compression(model, gptq_config(VARIANTS[name]))
        t0 = time.perf_counter()
        qc.calibrate_weight_ranges(model, batches)
        t_cal = time.perf_counter() - t0
        rows.append((f"GPTQ W4 g128 sym ({name})", perplexity(model, test, a.batch), t_cal / t_eval))
        print(f"GPTQ {name} {rows[-1][1]:.3f} (calibration {t_cal:.0f} s)", flush=True)
        del model
    print(
        "| weights | held-out perplexity | x FP32 | share of RTN's excess recovered "
        "| calibration / one FP32 eval pass |"
    )
    print("|---|---|---|---|---|")
    for name, ppl, ratio in rows:
        share = "" if name == "FP32" else f"{(ppl_rtn - ppl) / (ppl_rtn - ppl_fp):.0%}"
        print(f"| {name} | {ppl:.3f} | {ppl / ppl_fp:.4f} | {share} | {'' if ratio is None else f'{ratio:.1f}x'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
