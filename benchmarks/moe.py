"""Mixture-of-experts compression on a small MoE causal LM pretrained here (no download).

    python benchmarks/moe.py                      # pretrain (pinned steps), then every measurement
    python benchmarks/moe.py --steps 600 --qat-steps 150 --threads 1

1. A Qwen3-MoE (2 layers x 128, 8 experts, top-2, router aux loss on) is pretrained from random
   weights on the Jane Austen corpus (model_zoo/lm_corpus.py, 5 % of its sections held out, seeded)
   for --steps optimizer steps with the tokenizer and schedule of benchmarks/pretrain_gpt2.py: the
   same steps and data order on any machine. It is kept in --out and reused on later runs.
2. Held-out perplexity (FP32 evaluation, the first --eval-blocks blocks of --context tokens) of:
   FP32 (and FP32 fine-tuned as long as QAT, to separate the extra steps' effect); PTQ and QAT
   (--qat-steps fine-tuning steps through the fake quantizers) at W4 g32 and at W8A8 (channel
   weights, per-token activations), all on the experts only (routers, attention and embeddings
   stay FP32).
3. Export size: the experts, every Linear and the embedding at W4 g128 (symmetric) vs the FP32
   checkpoint, and the experts' bytes alone.
4. Batch-1 decode: greedy generation of --decode-tokens tokens with the KV cache, the W4 g128
   experts export loaded with load_quantized(mode="fast") (each expert on its routed tokens through
   the low-bit kernels) vs the FP32 model, interleaved rounds (benchmarks/common.py).

Writes section "tiny-qwen3-moe" of benchmarks/results/moe.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import pretrain_gpt2 as pt  # noqa: E402

import torch  # noqa: E402

import qcompress  # noqa: E402
from model_zoo import lm_corpus  # noqa: E402

EXPERTS = r"mlp\.experts"


def moe_config(vocab: int, eot: int, context: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=context,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=False,
    )


def pretrain(args, log):
    """The pretrained model folder (made once, pinned to --steps)."""
    done = os.path.join(args.out, "pretrain_report.json")
    if os.path.exists(done):
        with open(done) as f:
            if json.load(f)["steps"] == args.steps:
                return
    from transformers import Qwen3MoeForCausalLM

    train_text, heldout_text = lm_corpus.split_corpus(lm_corpus.load_corpus("austen", args.cache), 0.05, 0)
    tok = pt.train_tokenizer(pt.paragraphs(train_text), args.vocab_size, args.context)
    ids = pt.token_stream(tok, train_text)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(moe_config(len(tok), tok.eos_token_id, args.context))
    opt = torch.optim.AdamW(pt.param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = pt.lr_at(step, step / args.steps, args.lr, 30)
        batch = pt.random_windows(ids, args.batch_size, args.context, gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            log(f"pretrain step {step}: loss {float(loss.detach()):.3f} ({time.time() - t0:.0f} s)")
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(args.out)) or ".")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, text in (("train.txt", train_text), ("heldout.txt", heldout_text)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(tmp, "pretrain_report.json"), "w") as f:
        json.dump(
            {
                "steps": args.steps,
                "seconds": round(time.time() - t0, 1),
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            f,
        )
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.replace(tmp, args.out)


def load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.out)
    return model.eval(), tok


def wcfg(bits, gran, group=None, abits=None, modules=(EXPERTS,)):
    params = {"start_bits": bits, "target_bits": bits, "granularity": gran}
    if group:
        params["group_size"] = group
    cc = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": params, "modules": list(modules)}},
        }
    }
    if abits:
        cc["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": abits}, "modules": list(modules)}},
        }
    return {"compression_training": cc}


def ppl(model, blocks):
    return math.exp(pt.mean_nll(model, blocks, batch_size=16))


def qat(model, cfg, ids, args):
    """QAT fine-tuning through the fake quantizers (AdamW, constant lr), then eval mode; cfg None:
    the same fine-tuning in FP32 (what the extra steps alone do)."""
    if cfg is not None:
        qcompress.init_compression(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.qat_lr)
    gen = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(args.qat_steps):
        batch = pt.random_windows(ids, args.batch_size, args.context, gen)
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def folder_bytes(path, match=lambda k: True):
    from safetensors import safe_open

    total = 0
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as fh:
                for k in fh.keys():
                    if match(k):
                        t = fh.get_slice(k)
                        total += (
                            math.prod(t.get_shape())
                            * {"F32": 4, "I32": 4, "I64": 8, "I8": 1, "BF16": 2, "F16": 2}[t.get_dtype()]
                        )
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(common.ROOT, "runs", "moe-austen"))
    p.add_argument("--cache", default=os.path.join(common.ROOT, ".cache"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--qat-steps", type=int, default=120)
    p.add_argument("--qat-lr", type=float, default=3e-4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-blocks", type=int, default=160)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print, do not write the results page")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    pretrain(args, log)
    model, tok = load(args)
    with open(os.path.join(args.out, "heldout.txt"), encoding="utf-8") as f:
        heldout = pt.full_blocks(pt.token_stream(tok, f.read()), args.context)[: args.eval_blocks]
    with open(os.path.join(args.out, "train.txt"), encoding="utf-8") as f:
        ids = pt.token_stream(tok, f.read())
    n_params = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rows = [
        ("FP32", "-", ppl(model, heldout)),
        ("FP32", f"fine-tuned {args.qat_steps} steps", ppl(qat(copy.deepcopy(model), None, ids, args), heldout)),
    ]
    for label, cfg in (("W4 g32", wcfg(4, "group", 32)), ("W8A8", wcfg(8, "channel", abits=8))):
        ptq = qcompress.init_compression(copy.deepcopy(model), cfg)
        rows.append((label, "PTQ", ppl(ptq, heldout)))
        rows.append((label, f"QAT {args.qat_steps} steps", ppl(qat(copy.deepcopy(model), cfg, ids, args), heldout)))
        log(f"{rows[-2]} {rows[-1]}")
    # export size, W4 g128: the experts, every Linear (attention, lm_head) and the embedding
    work = tempfile.mkdtemp()
    fp_dir, q_dir = os.path.join(work, "fp32"), os.path.join(work, "w4")
    model.save_pretrained(fp_dir)
    q = qcompress.init_compression(
        copy.deepcopy(model), wcfg(4, "group", 128, modules=(EXPERTS, "proj", "lm_head", "embed_tokens"))
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(q, q_dir)
    is_expert = lambda k: ".experts." in k  # noqa: E731
    size = {
        "fp": folder_bytes(fp_dir),
        "q": folder_bytes(q_dir),
        "fp_e": folder_bytes(fp_dir, is_expert),
        "q_e": folder_bytes(q_dir, is_expert),
    }
    # batch-1 decode: the export in fast mode vs the FP32 model
    from transformers import AutoModelForCausalLM

    fast = qcompress.load_quantized(q_dir, AutoModelForCausalLM.from_pretrained(fp_dir), mode="fast")
    exact = qcompress.load_quantized(q_dir, AutoModelForCausalLM.from_pretrained(fp_dir))
    prompt = heldout[:1, :8]

    def gen(m):
        return lambda: m.generate(
            prompt,
            max_new_tokens=args.decode_tokens,
            min_new_tokens=args.decode_tokens,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )

    with torch.no_grad():
        same = torch.equal(gen(fast)(), gen(exact)())
        times = common.interleaved({"fp32": gen(model), "fast": gen(fast)}, repeats=7)
    shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"Qwen3-MoE 2 layers x 128, 8 experts top-2 ({n_params / 1e6:.2f}M parameters, experts "
        f"{n_experts / n_params:.0%}), pretrained {args.steps} steps on Jane Austen (context {args.context}, "
        f"vocabulary {len(tok)}); held-out perplexity over {heldout.shape[0]} blocks. Quantized: the "
        "experts only; QAT: AdamW lr {:g}, batch {} x {}.".format(args.qat_lr, args.batch_size, args.context),
        "",
        "| experts | method | held-out perplexity |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c:.2f} |" for a, b, c in rows]
    lines += [
        "",
        f"Export at W4 g128 (symmetric; experts, attention projections, lm_head and the embedding; "
        f"norms and routers FP32): {size['q'] / 1e6:.2f} MB vs {size['fp'] / 1e6:.2f} MB FP32 = "
        f"{size['q'] / size['fp']:.3f}x; the experts alone {size['q_e'] / size['fp_e']:.3f}x.",
        "",
        f"Batch-1 greedy decode of {args.decode_tokens} tokens (KV cache), the W4 g128 export in "
        f'load_quantized(mode="fast") vs the FP32 model: FP32 {times["fp32"].ms(1)} ms, fast '
        f"{times['fast'].ms(1)} ms; fast / FP32 {common.ratio(times, 'fast', 'fp32')} (median "
        f"[range] of 7 interleaved rounds); fast mode's tokens equal exact mode's: {same}.",
        "",
        f"Total run {time.time() - t0:.0f} s wall, {args.threads} torch thread(s).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        common.write_section("moe", "tiny-qwen3-moe", text, title="Mixture-of-experts compression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
