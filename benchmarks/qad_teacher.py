"""The classifier's QAD against its teacher: what a student distilling the FP32 fine-tune learns in
the quality page's budget, with no quantization in the way.

    python benchmarks/qad_teacher.py [--steps 10] [--pairs 10:0.5,10:0.9,30:0.9] [--write-results]

benchmarks/quality.py's classifier QAD distils (KL at T 1) the FP32 fine-tune of the same budget
(`teacher: baseline`), starting the student from the pretrained checkpoint like every other
variant. Here an FP32 student (no quantizer) trains --steps steps with the same batches, seed and
AdamW as `qcompress train`, with qcompress's own Distiller, against an FP32 fine-tune of N steps
(TEACHER_STEPS:ALPHA pairs). The teachers are one FP32 run snapshotted at each N: at N = --steps
it is the quality job's FP32 fine-tune, and the alpha-0 student (the first line). Each line gives
held-out accuracy, the student's argmax agreement with its teacher and the mean top-class
probability (uniform over C classes: 1 / C).
--write-results replaces the `qad-teacher` section of benchmarks/results/quality.md.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import common  # noqa: E402


def parse_pairs(text: str) -> list:
    out = []
    for item in text.split(","):
        steps, _, alpha = item.partition(":")
        try:
            out.append((int(steps), float(alpha)))
        except ValueError:
            raise SystemExit(f"--pairs: {item!r} is not TEACHER_STEPS:ALPHA (e.g. 10:0.9)") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="the student's steps (the quality page's budget)")
    p.add_argument("--pairs", default="10:0.5,10:0.9,30:0.9", help="TEACHER_STEPS:ALPHA, comma list")
    p.add_argument("--train-samples", type=int, default=320)
    p.add_argument("--eval-samples", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write-results", action="store_true")
    a = p.parse_args(argv)
    pairs = parse_pairs(a.pairs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import torch.nn.functional as F
    from model_zoo.demo_bbc import workloads
    from qcompress.config.compression import Distillation
    from qcompress.train.batches import eval_batches, micro_batches
    from qcompress.train.data import prepare_data
    from qcompress.train.distill import Distiller, load_teacher
    from qcompress.train.models import load_model, load_tokenizer

    torch.set_num_threads(a.threads)
    model_dir, data_dir = workloads()
    tok = load_tokenizer(model_dir)
    data = prepare_data(
        "text-classification",
        data_dir,
        tok,
        seed=a.seed,
        max_length=a.max_length,
        max_train_samples=a.train_samples,
        max_eval_samples=a.eval_samples,
    )

    def fresh():
        return load_model(model_dir, "text-classification", data.labels, a.seed, tok.pad_token_id)

    @torch.no_grad()
    def probs(m):
        m.eval()
        ps, ys = [], []
        for b in eval_batches(data.eval, 64, tok.pad_token_id):
            ys.append(b.pop("labels"))
            ps.append(F.softmax(m(**b).logits.float(), -1))
        return torch.cat(ps), torch.cat(ys)

    def train(model, steps, start=0, opt=None, kd=None, snapshot=None):
        """`steps` optimizer steps as `qcompress train` takes them (its batches, AdamW, wd 0.01)."""
        opt = opt or torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        for step in range(start, steps):
            model.train()
            for b in micro_batches(
                data.train,
                step,
                seed=a.seed,
                train_batch_size=a.batch_size,
                micro=a.batch_size,
                accumulation=1,
                rank=0,
                world=1,
                pad_id=tok.pad_token_id,
            ):
                out = model(**b)
                loss = out.loss if kd is None else kd.loss(out, kd.teacher_outputs(b), out.loss)[0]
                opt.zero_grad()
                loss.backward()
                opt.step()
            if snapshot is not None and step + 1 in snapshot:
                snapshot[step + 1] = load_teacher("self", model, None)  # a frozen copy
        return opt

    # the teachers: one FP32 fine-tune, snapshotted at each teacher step count
    teachers = {n: None for n, _ in pairs}
    teachers.setdefault(a.steps, None)
    train(fresh(), max(teachers), snapshot=teachers)
    classes = len(data.labels)
    rows = []
    for n, t in sorted(teachers.items()):
        tp, y = probs(t)
        teachers[n] = (t, tp)
        print(
            f"teacher {n} steps: accuracy {(tp.argmax(-1) == y).float().mean():.4f}, "
            f"mean top-class probability {tp.max(-1).values.mean():.3f}",
            flush=True,
        )
    lines = [(a.steps, 0.0)] + [pr for pr in pairs if pr != (a.steps, 0.0)]
    for n, alpha in lines:
        t, tp = teachers[n]
        if alpha == 0.0 and n == a.steps:
            sp = tp  # no distillation: the student is the teacher's own run
        else:
            student = fresh()
            kd = Distiller(t, Distillation(enabled=True, teacher="self", temperature=1.0, alpha=alpha))
            train(student, a.steps, kd=kd)
            sp, _ = probs(student)
        row = dict(
            n=n,
            alpha=alpha,
            t_acc=float((tp.argmax(-1) == y).float().mean()),
            t_top=float(tp.max(-1).values.mean()),
            s_acc=float((sp.argmax(-1) == y).float().mean()),
            agree=float((sp.argmax(-1) == tp.argmax(-1)).float().mean()),
            s_top=float(sp.max(-1).values.mean()),
        )
        rows.append(row)
        print(row, flush=True)
    text = (
        f"## The classifier's QAD and its teacher\n\n"
        f"An FP32 student (no quantizer) trains {a.steps} steps of {a.batch_size} of the first "
        f"{a.train_samples} training articles (the quality table's budget, batches, seed and AdamW "
        f"{a.lr}), distilling (KL at T 1, qcompress's Distiller) an FP32 fine-tune of N steps; accuracy "
        f"on {len(data.eval)} held-out articles. Alpha 0 at N = {a.steps} is the quality job's FP32 "
        f"fine-tune itself. Uniform guessing over the {classes} classes: top-class probability "
        f"{1 / classes:.2f}.\n\n"
        "| teacher: FP32 fine-tune of N steps | teacher accuracy | teacher mean top-class probability "
        "| alpha | student accuracy | student agrees with teacher | student mean top-class probability |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        text += (
            f"| {r['n']} | {r['t_acc']:.4f} | {r['t_top']:.3f} | {r['alpha']:g} | {r['s_acc']:.4f} | "
            f"{r['agree']:.4f} | {r['s_top']:.3f} |\n"
        )
    print(text)
    if a.write_results:
        cmd = common.command([os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None else argv))
        print("written to", common.write_section("quality", "qad-teacher", text, title="Compression quality", cmd=cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
