"""`qcompress train` end to end on tiny Hugging Face models built here: every data format, both
tasks, every output file, exported == qat, --resume, torchrun with 2 ranks, and bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W8A8 = os.path.join(ROOT, "schedules", "w8a8.yaml")
FAST = ["--max-length", "16", "--batch-size", "8", "--eval-batch-size", "32", "--no-progress"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("job")
    bert = hf.tiny_bert_folder(str(base / "bert"))
    gpt2 = hf.tiny_gpt2_folder(str(base / "gpt2"))
    rows = hf.topic_texts(10)
    return dict(base=base, bert=bert, gpt2=gpt2, rows=rows)


def write_data(folder, fmt, rows):
    """The same (text, label) rows in each supported format; returns the --data path."""
    os.makedirs(folder, exist_ok=True)
    if fmt in ("csv", "tsv"):
        path = os.path.join(folder, f"data.{fmt}")
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh, delimiter="," if fmt == "csv" else "\t")
            w.writerow(["text", "label"])
            w.writerows(rows)
        return path
    if fmt == "jsonl":
        path = os.path.join(folder, "data.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for t, y in rows:
                fh.write(json.dumps({"text": t, "label": y}) + "\n")
        return path
    if fmt == "folders":
        path = os.path.join(folder, "classes")
        for i, (t, y) in enumerate(rows):
            os.makedirs(os.path.join(path, y), exist_ok=True)
            with open(os.path.join(path, y, f"{i:03d}.txt"), "w", encoding="utf-8") as fh:
                fh.write(t)
        return path
    if fmt == "txt":
        path = os.path.join(folder, "corpus.txt")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(t for t, _ in rows))
        return path
    if fmt == "txt-folder":
        path = os.path.join(folder, "texts")
        os.makedirs(path, exist_ok=True)
        for i in range(3):
            with open(os.path.join(path, f"part{i}.txt"), "w", encoding="utf-8") as fh:
                fh.write("\n".join(t for t, _ in rows[i::3]))
        return path
    raise ValueError(fmt)


class Interrupted(Exception):
    """Stands for a kill: raised inside the job, it leaves everything as a crash would."""


def train_until_qat_checkpoint(args, step, monkeypatch):
    """Run the job and interrupt it right after the compressed run saves its checkpoint at `step`."""
    from qcompress.train import loop

    real_save = loop.save

    saved = []

    def save_then_die(phase, at, *rest):
        real_save(phase, at, *rest)
        if phase.name == "qat" and at == step:
            saved.extend(rest)
            raise Interrupted()

    monkeypatch.setattr(loop, "save", save_then_die)
    try:
        with pytest.raises(Interrupted):
            train(args)
    finally:
        monkeypatch.setattr(loop, "save", real_save)
    return saved[0] if saved else None  # the QAT training seconds its checkpoint recorded


def train(args, capsys=None):
    code = cli_main(["train", *args])
    return code


def _warnings(notes):
    """The report's notes but the one on full-precision embedding tables, which any recipe that
    leaves embeddings unquantized gets on these tiny models (tests/train/test_embedding_note.py)."""
    return [n for n in notes if "embedding tables kept in full precision" not in n]


def check_outputs(out, task, steps):
    """Every file the issue names, with content that agrees with itself."""
    for name in (
        "report.json",
        "report.md",
        "metrics.csv",
        "plots/loss.png",
        "plots/bits.png",
        "export/config.json",
        "export/model.safetensors",
        "export/tokenizer_config.json",
    ):
        assert os.path.isfile(os.path.join(out, name)), name
    rep = json.load(open(os.path.join(out, "report.json")))
    metric = "accuracy" if task == "text-classification" else "perplexity"
    assert rep["task"] == task and rep["metric"] == metric
    st = rep["stages"]
    for stage in ("fp32", "ptq", "qat", "exported"):
        assert st[stage][metric] is not None, stage
    # the export reloaded by qcompress is the trained model, bit for bit
    assert st["exported"][metric] == st["qat"][metric]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert "transformers" in st and (st["transformers"][metric] is not None or st["transformers"]["reason"])
    files = [f for f in os.listdir(os.path.join(out, "export")) if f.endswith(".safetensors")]
    assert rep["sizes"]["export_bytes"] == sum(os.path.getsize(os.path.join(out, "export", f)) for f in files)
    assert 0 < rep["sizes"]["export_bytes"] < rep["sizes"]["fp32_bytes"]
    assert rep["final_bits"]["weight:w8"]["bits"] == 8
    rows = list(csv.DictReader(open(os.path.join(out, "metrics.csv"))))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(float(r["loss"])) and float(r["samples_per_s"]) > 0 for r in rows)
    assert {r["bits.w8"] for r in rows} == {"8"} and {r["act_bits.a8"] for r in rows} == {"8"}
    assert rep["training"]["steps"] == steps
    try:
        import tensorboard  # noqa: F401

        assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tensorboard", "qat")))
    except ImportError:
        print("tensorboard is not installed: no event files to check")
    md = open(os.path.join(out, "report.md")).read()
    assert "| qat |" in md and "| exported |" in md
    return rep


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "folders"])
def test_classification_every_format(folders, tmp_path, fmt):
    data = write_data(str(tmp_path / "d"), fmt, folders["rows"])
    out = str(tmp_path / "out")
    assert (
        train(
            [
                W8A8,
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "3",
                *FAST,
            ]
        )
        == 0
    )
    rep = check_outputs(out, "text-classification", 3)
    assert rep["data"]["labels"] == sorted(hf.TOPICS)
    cfg = json.load(open(os.path.join(out, "export", "config.json")))
    # the label mapping and the class actually exported reach the export's config
    assert cfg["id2label"] == {str(i): y for i, y in enumerate(sorted(hf.TOPICS))}
    assert cfg["architectures"] == ["BertForSequenceClassification"]


@pytest.mark.parametrize("fmt", ["txt", "txt-folder", "jsonl"])
def test_causal_lm_formats(folders, tmp_path, fmt):
    data = write_data(str(tmp_path / "d"), fmt, folders["rows"] * 2)
    out = str(tmp_path / "out")
    assert (
        train(
            [
                W8A8,
                "--model",
                folders["gpt2"],
                "--data",
                data,
                "--task",
                "causal-lm",
                "--out",
                out,
                "--max-steps",
                "2",
                *FAST,
            ]
        )
        == 0
    )
    rep = check_outputs(out, "causal-lm", 2)
    # perplexity is exp of the mean token loss of the same stage
    for stage in ("fp32", "qat"):
        assert rep["stages"][stage]["perplexity"] == pytest.approx(math.exp(rep["stages"][stage]["loss"]))


def test_baseline_and_distillation(folders, tmp_path):
    """--baseline adds an FP32 fine-tune of the same budget; distillation fills distill_loss with
    total = (1 - alpha) task + alpha KD."""
    cfg = tmp_path / "kd.yaml"
    cfg.write_text(
        "compression_training:\n  distillation:\n    enabled: true\n    teacher: self\n"
        "    temperature: 2.0\n    alpha: 0.25\n"
    )
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    assert (
        train(
            [
                W8A8,
                str(cfg),
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "3",
                "--baseline",
                *FAST,
            ]
        )
        == 0
    )
    rep = check_outputs(out, "text-classification", 3)
    assert rep["stages"]["fp32_finetuned"]["accuracy"] is not None
    assert rep["training"]["distillation"] is True
    rows = list(csv.DictReader(open(os.path.join(out, "metrics.csv"))))
    for r in rows:
        total, task, kd = float(r["loss"]), float(r["task_loss"]), float(r["distill_loss"])
        assert total == pytest.approx(0.75 * task + 0.25 * kd, rel=1e-4)
    base = list(csv.DictReader(open(os.path.join(out, "metrics_fp32.csv"))))
    assert len(base) == 3
    # a second run borrows the checked baseline instead of training it again; teacher: baseline
    # distils from that FP32 fine-tune
    kd2 = tmp_path / "kd2.yaml"
    kd2.write_text("compression_training:\n  distillation: {enabled: true, teacher: baseline, alpha: 1.0}\n")
    out2 = str(tmp_path / "out2")
    common = ["--model", folders["bert"], "--data", data, "--task", "text-classification", "--max-steps", "3", *FAST]
    assert train([W8A8, str(kd2), *common, "--out", out2, "--baseline-from", out]) == 0
    rep2 = json.load(open(os.path.join(out2, "report.json")))
    assert rep2["stages"]["fp32_finetuned"] == rep["stages"]["fp32_finetuned"]
    assert any("--baseline-from" in n for n in rep2["notes"])
    rows2 = list(csv.DictReader(open(os.path.join(out2, "metrics.csv"))))
    assert all(float(r["loss"]) == pytest.approx(float(r["distill_loss"]), rel=1e-5) for r in rows2)
    # another budget: the baseline does not fit and is refused
    assert (
        train(
            [
                W8A8,
                *common[: -len(FAST) - 2],
                "--max-steps",
                "4",
                *FAST,
                "--out",
                str(tmp_path / "o3"),
                "--baseline-from",
                out,
            ]
        )
        == 2
    )
    assert train([W8A8, str(kd2), *common, "--out", str(tmp_path / "o4")]) == 2  # baseline teacher, none


def _export_tensors(out):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "export", "model.safetensors"))


def test_resume_after_interruption_matches_uninterrupted(folders, tmp_path, monkeypatch):
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    args = [
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--max-steps",
        "6",
        "--save-steps",
        "2",
        *FAST,
    ]
    whole = str(tmp_path / "whole")
    assert train([*args, "--out", whole]) == 0

    cut = str(tmp_path / "cut")
    t0 = time.perf_counter()
    first = train_until_qat_checkpoint([*args, "--out", cut], 4, monkeypatch)
    first_attempt = time.perf_counter() - t0
    assert not os.path.exists(os.path.join(cut, "report.json"))  # nothing presented as done
    assert train([*args, "--out", cut]) == 2  # the folder holds a run
    t0 = time.perf_counter()
    assert train([*args, "--out", cut, "--resume"]) == 0
    second_attempt = time.perf_counter() - t0
    # the report's times add the attempts up: QAT training includes the 4 steps trained before the
    # interruption (the seconds its checkpoint recorded), the total both attempts' stages
    times = json.load(open(os.path.join(cut, "report.json")))["wall_time_s"]
    assert first is not None and 0 < first < times["qat_train"]
    stages = sum(v for k, v in times.items() if k != "total")
    assert stages <= times["total"] <= first_attempt + second_attempt, times
    a, b = _export_tensors(whole), _export_tensors(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra = list(csv.DictReader(open(os.path.join(whole, "metrics.csv"))))
    rb = list(csv.DictReader(open(os.path.join(cut, "metrics.csv"))))
    assert [(r["step"], r["loss"]) for r in ra] == [(r["step"], r["loss"]) for r in rb]
    # other options than the interrupted run: refused, not mixed
    assert train([*args[: -len(FAST)], "--seed", "1", *FAST, "--out", cut, "--resume"]) == 2


def test_torchrun_two_ranks_rank0_writes(folders, tmp_path):
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from tests.helpers.dist_utils import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "qcompress",
        "train",
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--out",
        out,
        "--max-steps",
        "3",
        *FAST,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = check_outputs(out, "text-classification", 3)
    assert rep["training"]["world_size"] == 2
    assert rep["training"]["micro_batch_size"] == 4  # 8 samples a step over 2 ranks
    assert proc.stdout.count("| qat |") == 1  # one report printed: rank 0's
    leftovers = [f for f in os.listdir(out) if ".tmp" in f]
    assert not leftovers


def test_bad_input_exit_2(folders, tmp_path, capsys):
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    base = ["--task", "text-classification", "--max-steps", "1", *FAST]

    def run(*args):
        code = train([*args, *base] if "--task" not in args else list(args))
        return code, capsys.readouterr().err

    code, err = run(W8A8, "--model", str(tmp_path / "nope"), "--data", data, "--out", str(tmp_path / "o1"))
    assert code == 2 and "nope" in err and "no such folder" in err
    code, err = run(
        W8A8, "--model", folders["bert"], "--data", data, "--out", str(tmp_path / "o2"), "--text-column", "body"
    )
    assert code == 2 and "body" in err and "text" in err and "label" in err  # names the columns there
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    code, err = run(W8A8, "--model", folders["bert"], "--data", str(empty), "--out", str(tmp_path / "o3"))
    assert code == 2 and "empty.csv" in err
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("compression_training: {weight_quantization: [unclosed\n")
    code, err = run(str(bad_cfg), "--model", folders["bert"], "--data", data, "--out", str(tmp_path / "o4"))
    assert code == 2 and "bad.yaml" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("compression_training:\n  weight_quantisation: {}\n")
    code, err = run(str(typo), "--model", folders["bert"], "--data", data, "--out", str(tmp_path / "o5"))
    assert code == 2 and "weight_quantisation" in err and "weight_quantization" in err
    code, err = run(
        str(tmp_path / "missing.yaml"), "--model", folders["bert"], "--data", data, "--out", str(tmp_path / "o6")
    )
    assert code == 2 and "missing.yaml" in err
    # a model that cannot do the task: a vision transformer folder asked for causal-lm
    import transformers

    vit = tmp_path / "vit"
    hf.write_tokenizer(str(vit))
    transformers.ViTModel(
        transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4
        )
    ).save_pretrained(str(vit))
    code, err = run(
        W8A8,
        "--model",
        str(vit),
        "--data",
        data,
        "--out",
        str(tmp_path / "o7"),
        "--task",
        "causal-lm",
        "--max-steps",
        "1",
        *FAST,
    )
    assert code == 2 and "causal-lm" in err and "vit" in err.lower()
    for o in ("o1", "o2", "o3", "o4", "o5", "o6", "o7"):
        assert not os.path.exists(tmp_path / o / "report.json")


def test_ternary_recipe_targets_the_blocks(folders):
    """schedules/w2a8_kd.yaml: ternary weights in the transformer blocks, 8 bits elsewhere."""
    import qcompress as qc
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(folders["bert"], num_labels=3)
    qc.init_compression(model, qc.load_config(os.path.join(ROOT, "schedules", "w2a8_kd.yaml")))
    bits = {n: m.qc_wq.bits for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert bits and all((b == 2) == (".layer." in n) for n, b in bits.items()), bits
    assert bits["classifier"] == 8 and bits["bert.embeddings.word_embeddings"] == 8


def test_baseline_fingerprint_names_files_not_how_they_were_spelled(tmp_path, monkeypatch):
    """--baseline-from must match a run given the same model/data/eval files by relative or absolute
    path (eval_data was compared as spelled), and must not match another eval file."""
    from qcompress.train.job import JobOptions

    (tmp_path / "m").mkdir()
    for name in ("train.txt", "heldout.txt", "other.txt"):
        (tmp_path / name).write_text("x\n")
    monkeypatch.chdir(tmp_path)
    rel = JobOptions(configs=[], model="m", data="train.txt", task="causal-lm", out="o", eval_data="heldout.txt")
    ab = JobOptions(
        configs=[],
        model=str(tmp_path / "m"),
        data=str(tmp_path / "train.txt"),
        task="causal-lm",
        out="o2",
        eval_data=str(tmp_path / "heldout.txt"),
    )
    other = JobOptions(configs=[], model="m", data="train.txt", task="causal-lm", out="o", eval_data="other.txt")
    assert rel.baseline_fingerprint({}) == ab.baseline_fingerprint({})
    assert rel.baseline_fingerprint({}) != other.baseline_fingerprint({})


@pytest.mark.parametrize("task", ["text-classification", "causal-lm"])
def test_int8_forward_export_equals_the_trained_model(folders, tmp_path, task):
    """Trained with int8_forward, the export reloads in fast mode (the same int8 kernels) and
    reproduces the trained model bit for bit; the exact reload would differ by float rounding."""
    from qcompress.quant import lowbit

    if not lowbit.available():
        pytest.skip("the C++ extension with the low-bit kernels is not built")
    frag = tmp_path / "int8.yaml"
    frag.write_text(
        "compression_training:\n  activation_quantization:\n    shared_parameters:\n      int8_forward: true\n"
    )
    model = folders["bert"] if task == "text-classification" else folders["gpt2"]
    rows = folders["rows"] if task == "text-classification" else folders["rows"] * 2
    data = write_data(str(tmp_path / "d"), "jsonl", rows)
    out = str(tmp_path / "out")
    assert (
        train(
            [W8A8, str(frag), "--model", model, "--data", data, "--task", task, "--out", out, "--max-steps", "2", *FAST]
        )
        == 0
    )
    rep = check_outputs(out, task, 2)
    assert rep["stages"]["exported"]["reload_mode"] == "fast"


def _tree(folder):
    """{relative path: bytes} of every file below folder."""
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def test_inputs_checked_before_out_is_touched(folders, tmp_path, capsys):
    """A model that cannot load, a config the model reveals as wrong (a module claimed twice) and a
    bad --baseline-from stop the job before --out is created, and --overwrite loses nothing of the
    run already there (these were checked only after the folder was made, the old run deleted and
    the FP32 stages trained)."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    common = ["--data", data, "--task", "text-classification", "--max-steps", "1", *FAST]
    prev = str(tmp_path / "prev")
    assert train([W8A8, "--model", folders["bert"], *common, "--out", prev, "--baseline"]) == 0
    before = _tree(prev)
    assert "report.json" in before and "export/model.safetensors" in before
    capsys.readouterr()

    no_weights = tmp_path / "no_weights"
    hf.write_tokenizer(str(no_weights))
    (no_weights / "config.json").write_text(open(os.path.join(folders["bert"], "config.json")).read())
    twice = tmp_path / "twice.yaml"  # a second group over every module: claims what w8 claimed
    twice.write_text(
        "compression_training:\n  weight_quantization:\n    different_groups:\n"
        "      w4: {params: {start_bits: 4, target_bits: 4}}\n"
    )
    cases = [
        ([W8A8, "--model", str(no_weights)], "no_weights"),
        ([W8A8, str(twice), "--model", folders["bert"]], "twice.yaml"),
        ([W8A8, "--model", folders["bert"], "--baseline-from", str(tmp_path / "nowhere")], "nowhere"),
        # the baseline to reuse is the run --overwrite would delete
        ([W8A8, "--model", folders["bert"], "--baseline-from", prev], "--out folder itself"),
    ]
    for args, named in cases:
        if prev not in args:
            fresh = str(tmp_path / "fresh")
            assert train([*args, *common, "--out", fresh]) == 2, args
            err = capsys.readouterr().err
            assert named in err, err
            assert not os.path.exists(fresh), (args, os.listdir(fresh))
        assert train([*args, *common, "--out", prev, "--overwrite"]) == 2, args
        err = capsys.readouterr().err.strip()
        assert named in err and "\n" not in err, err
        assert _tree(prev) == before, args


def test_fine_tuned_head_keeps_its_classes_under_sorted_labels(tmp_path):
    """A checkpoint whose head already fits but lists its classes in another order than the sorted
    data labels: each class keeps its own logit (transformers' output for that name), not the one
    at the same position (the head was reused as is, so 'tech' answered as 'business')."""
    import transformers
    from qcompress.train.models import load_model

    folder = hf.tiny_bert_folder(str(tmp_path / "clf"), num_labels=3)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    ckpt_order = ["tech", "business", "sport"]
    cfg["id2label"] = {str(i): n for i, n in enumerate(ckpt_order)}
    cfg["label2id"] = {n: i for i, n in enumerate(ckpt_order)}
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tok(["the market and the bank", "phone software", "team win the cup"], return_tensors="pt", padding=True)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        want = ref(**batch).logits
    labels = sorted(ckpt_order)
    model = load_model(folder, "text-classification", labels).eval()
    assert not model.qc_fresh_head
    assert model.config.id2label == dict(enumerate(labels))
    with torch.no_grad():
        got = model(**batch).logits
    for i, name in enumerate(labels):
        assert torch.equal(got[:, i], want[:, ckpt_order.index(name)]), name
    # the data's own order already: nothing moves
    same = load_model(folder, "text-classification", ckpt_order).eval()
    with torch.no_grad():
        assert torch.equal(same(**batch).logits, want)


def test_resume_knows_the_data_not_how_paths_are_spelled(folders, tmp_path, monkeypatch, capsys):
    """--resume refuses a data file edited since the run started (it was accepted: the fingerprint
    held the path only) and accepts the same files and configs named from another folder."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    args = ["--model", folders["bert"], "--task", "text-classification", "--max-steps", "1", *FAST]
    monkeypatch.chdir(tmp_path)
    assert train([W8A8, *args, "--data", os.path.relpath(data), "--out", "out", "--baseline"]) == 0
    report = json.load(open(os.path.join(out, "report.json")))
    # the same run named by absolute paths from elsewhere, and the config through another spelling
    monkeypatch.chdir(tmp_path / "d")
    same_cfg = os.path.join(os.path.relpath(os.path.dirname(W8A8)), ".", os.path.basename(W8A8))
    assert train([same_cfg, *args, "--data", data, "--out", out, "--baseline", "--resume"]) == 0
    assert "done in an earlier run" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "report.json")))["stages"] == report["stages"]
    # the data file edited in place: one label changed
    rows = [list(r) for r in folders["rows"]]
    rows[0][1] = rows[1][1] if rows[0][1] != rows[1][1] else rows[2][1]
    write_data(str(tmp_path / "d"), "csv", rows)
    assert train([W8A8, *args, "--data", data, "--out", out, "--baseline", "--resume"]) == 2
    assert "other options, data or configs" in capsys.readouterr().err
    # nor does an edited file lend its run's baseline
    assert train([W8A8, *args, "--data", data, "--out", str(tmp_path / "o2"), "--baseline-from", out]) == 2
    assert "another model, data" in capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe, said",
    [
        # pruning alone: the export (a quantized checkpoint) failed with a traceback after training
        (
            "compression_training:\n  sparse_pruning:\n    shared_parameters: {enabled: true, schedule_offset: 0, "
            "method: l1}\n    different_groups:\n      sp: {params: {dense_ratio: 0.5}}\n",
            "quantize no module",
        ),
        # weights quantized only from step 50 of a 3-step run: nothing active to export at the end
        (
            "compression_training:\n  weight_quantization:\n"
            "    shared_parameters: {enabled: true, schedule_offset: 50}\n"
            "    different_groups:\n      w8: {params: {start_bits: 8, target_bits: 8}}\n",
            "starts at step 50",
        ),
    ],
)
def test_nothing_to_export_is_refused_up_front(folders, tmp_path, capsys, recipe, said):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(recipe)
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    assert (
        train(
            [
                str(cfg),
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "3",
                *FAST,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert said in err and "recipe.yaml" in err and "\n" not in err, err
    assert not os.path.exists(out)
    # the same recipe long enough to reach the offset runs and exports
    if "50" in said:
        assert (
            train(
                [
                    str(cfg),
                    "--model",
                    folders["bert"],
                    "--data",
                    data,
                    "--task",
                    "text-classification",
                    "--out",
                    out,
                    "--max-steps",
                    "50",
                    "--save-steps",
                    "0",
                    *FAST,
                ]
            )
            == 0
        )
        rep = json.load(open(os.path.join(out, "report.json")))
        assert rep["final_bits"]["weight:w8"]["bits"] == 8
        assert rep["stages"]["exported"]["max_logit_diff_vs_qat"] == 0.0


def test_export_clears_what_a_killed_export_left(folders, tmp_path):
    """export_model swaps a whole folder in; the folders a killed export left (named by its pid)
    are removed by the next export instead of piling up beside it."""
    import qcompress as qc
    import transformers
    from qcompress.nn import int8_forward
    from qcompress.train.stages import export_model

    model = transformers.BertForSequenceClassification.from_pretrained(folders["bert"], num_labels=3)
    doc = qc.load_config(W8A8).raw
    qc.init_compression(model, doc)
    tok = transformers.AutoTokenizer.from_pretrained(folders["bert"])
    out = tmp_path / "run"
    stale = [out / ".export.tmp4242", out / ".export.old4242"]
    for d in stale:
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    (out / "export.keep").write_text("not ours")  # other names stay
    nbytes = export_model(model.eval(), doc, tok, str(out / "export"))
    assert sorted(os.listdir(out)) == ["export", "export.keep"]
    assert nbytes == os.path.getsize(out / "export" / "model.safetensors") > 0
    fresh = transformers.BertForSequenceClassification.from_pretrained(folders["bert"], num_labels=3)
    # the recipe's int8_forward: auto evaluates with the float forward: the exact reload
    assert int8_forward.reload_mode(model) == "exact"
    qc.load_quantized(str(out / "export"), fresh)
    batch = tok(["the market and the bank"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(fresh.eval()(**batch).logits, model(**batch).logits)


def test_a_schedule_cut_short_is_said(folders, tmp_path, capsys):
    """w4a8_progressive (8 -> 4 bits, period 30) trained 2 steps ends at 8 bits: the export is 8-bit
    while the ptq row is at 4; the run says so (it was silent) and a finished schedule says nothing."""
    from qcompress.schedule import bits_at

    progressive = os.path.join(ROOT, "schedules", "w4a8_progressive.yaml")
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    common = ["--model", folders["bert"], "--data", data, "--task", "text-classification", "--max-steps", "2", *FAST]
    out = str(tmp_path / "short")
    assert train([progressive, *common, "--out", out]) == 0
    rep = json.load(open(os.path.join(out, "report.json")))
    ended = bits_at(2, start=8, target=4, period=30, offset=0)
    assert ended == 8 and rep["final_bits"]["weight:w8_to_4"]["bits"] == ended
    said = [n for n in rep["notes"] if "w8_to_4" in n]
    assert len(said) == 1 and "8 bits" in said[0] and "target_bits 4" in said[0], rep["notes"]
    assert "warning: weight group 'w8_to_4'" in capsys.readouterr().out
    assert train([W8A8, *common, "--out", str(tmp_path / "w8")]) == 0
    assert not _warnings(json.load(open(tmp_path / "w8" / "report.json"))["notes"])


def test_max_length_beyond_the_position_table_is_refused(folders, tmp_path, capsys):
    """position_limit is the longest input each model runs (one more token fails in its forward:
    the oracle), and --max-length past it is one line, exit 2, before --out is made (it was an
    IndexError traceback in the fp32 stage)."""
    import transformers
    from qcompress.train.models import position_limit

    models = [
        transformers.BertModel(
            transformers.BertConfig(
                vocab_size=50,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=16,
                max_position_embeddings=40,
            )
        ),
        transformers.GPT2Model(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=40)),
        # RoBERTa's positions start after padding_idx: 40 rows hold 38 tokens
        transformers.RobertaModel(
            transformers.RobertaConfig(
                vocab_size=50,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=16,
                max_position_embeddings=40,
                pad_token_id=1,
            )
        ),
    ]
    for model in models:
        limit = position_limit(model.eval())
        with torch.no_grad():
            model(input_ids=torch.full((1, limit), 5))
            with pytest.raises((IndexError, RuntimeError)):
                model(input_ids=torch.full((1, limit + 1), 5))
    assert [position_limit(m) for m in models] == [40, 40, 38]
    data = write_data(str(tmp_path / "d"), "txt", folders["rows"] * 4)
    out = str(tmp_path / "out")
    assert (
        train(
            [
                W8A8,
                "--model",
                folders["gpt2"],
                "--data",
                data,
                "--task",
                "causal-lm",
                "--out",
                out,
                "--max-steps",
                "1",
                *FAST[2:],
                "--max-length",
                "129",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "--max-length 129" in err and "(128)" in err and "\n" not in err, err
    assert not os.path.exists(out)


def test_report_json_is_written_last(folders, tmp_path, monkeypatch):
    """A run that dies while drawing its plots has no report.json (it was written first, so the
    folder looked finished without plots); --resume then finishes it."""
    from qcompress.train import job

    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    args = [
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--out",
        str(tmp_path / "out"),
        "--max-steps",
        "1",
        *FAST,
    ]
    real = job.plot_bits

    def dies(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "plot_bits", dies)
    with pytest.raises(KeyboardInterrupt):
        train(args)
    assert not os.path.exists(tmp_path / "out" / "report.json")
    monkeypatch.setattr(job, "plot_bits", real)
    assert train([*args, "--resume"]) == 0
    check_outputs(str(tmp_path / "out"), "text-classification", 1)


def test_gpt2_without_pad_token_classifies_padded_batches(folders, tmp_path, capsys):
    """A GPT-2 checkpoint with no pad_token_id (as most are) as a text classifier: the job pads with
    eos and now records that id in the config, so each text's logits in a padded batch are those of
    the text alone (transformers refused batches > 1 with a traceback in the fp32 stage)."""
    import transformers
    from qcompress.train.data import collate
    from qcompress.train.models import load_model, load_tokenizer

    folder = str(tmp_path / "gpt2")
    tok = hf.write_tokenizer(folder)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    cfg_json = json.load(open(os.path.join(folder, "config.json")))
    assert cfg_json.get("pad_token_id") is None
    tok = load_tokenizer(folder)
    model = load_model(folder, "text-classification", ["a", "b", "c"], 0, tok.pad_token_id).eval()
    texts = ["the game", "the market and the bank were up", "phone"]
    items = [{k: torch.tensor(v) for k, v in tok(t).items()} for t in texts]
    batch = collate(items, tok.pad_token_id)
    with torch.no_grad():
        together = model(**batch).logits
        alone = torch.cat([model(**{k: v[None] for k, v in it.items()}).logits for it in items])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    assert (
        train(
            [
                W8A8,
                "--model",
                folder,
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "1",
                *FAST,
            ]
        )
        == 0
    )
    assert json.load(open(os.path.join(out, "export", "config.json")))["pad_token_id"] == tok.pad_token_id


def test_a_live_run_keeps_its_out_folder(folders, tmp_path, capsys):
    """While a job runs, its --out is flock-ed: a second job there (--overwrite, --resume) is one
    line and exit 2 and touches nothing (it deleted the live run's checkpoints, or appended its
    own rows to the same metrics.csv); once the holder is gone, --resume works."""
    import fcntl
    from qcompress.train.job import LOCK_NAME

    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = tmp_path / "out"
    args = [
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--out",
        str(out),
        "--max-steps",
        "1",
        *FAST,
    ]
    assert train(args) == 0
    before = _tree(out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(out / LOCK_NAME)!r}, 'a+')\n"
            "fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        for extra in ("--overwrite", "--resume"):
            assert train([*args, extra]) == 2, extra
            err = capsys.readouterr().err.strip()
            assert "in use by another qcompress train" in err and "\n" not in err, err
            assert _tree(out) == before, extra
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert train([*args, "--resume"]) == 0
    # and this process let go of it: another process can take the lock now
    with open(out / LOCK_NAME, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_baseline_from_on_a_rank_that_does_not_copy(folders, tmp_path, monkeypatch):
    """Under torchrun, rank 0 copies RUN's FP32 fine-tune into --out while the other ranks go on
    (no process group, so no barrier, yet): rank 1 loaded that copy and could find it missing
    (FileNotFoundError, 1 run in 2 here). Rank 1 alone, without a rank 0, now loads RUN's weights."""
    from safetensors.torch import load_file
    from qcompress.train import job

    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    common = ["--model", folders["bert"], "--data", data, "--task", "text-classification", "--max-steps", "1", *FAST]
    src = str(tmp_path / "src")
    assert train([W8A8, *common, "--out", src, "--baseline"]) == 0

    class Reached(Exception):
        pass

    def stop(model, cfg, calibrate):
        raise Reached(model)

    monkeypatch.setattr(job, "quantize_without_training", stop)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(Reached) as got:
        train([W8A8, *common, "--out", str(tmp_path / "out"), "--baseline-from", src])
    want = load_file(os.path.join(src, "checkpoints", "fp32_finetuned.safetensors"))
    sd = got.value.args[0].state_dict()
    assert want and all(torch.equal(sd[k], v) for k, v in want.items())
    assert not os.path.exists(tmp_path / "out")  # rank 1 writes nothing


def test_baseline_under_zero3(folders, tmp_path):
    """--baseline with ZeRO stage 3 (FSDP2, here its 1-rank group): the FP32 fine-tune is gathered
    whole, saved and used for PTQ (it died: DTensors have no data pointer to save, and FSDP modules
    refuse the deepcopy PTQ makes). Its weights are those of the same fine-tune at stage 0."""
    from safetensors.torch import load_file

    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    runs = {}
    for stage in (0, 3):
        cfg = tmp_path / f"z{stage}.json"
        cfg.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": stage}}))
        out = str(tmp_path / f"out{stage}")
        assert (
            train(
                [
                    str(cfg),
                    W8A8,
                    "--model",
                    folders["bert"],
                    "--data",
                    data,
                    "--task",
                    "text-classification",
                    "--out",
                    out,
                    "--max-steps",
                    "2",
                    "--baseline",
                    *FAST,
                ]
            )
            == 0
        ), stage
        runs[stage] = (
            load_file(os.path.join(out, "checkpoints", "fp32_finetuned.safetensors")),
            json.load(open(os.path.join(out, "report.json"))),
        )
    (w0, r0), (w3, r3) = runs[0], runs[3]
    assert w0.keys() == w3.keys()
    start = load_file(os.path.join(folders["bert"], "model.safetensors"))
    moved = [k for k in start if "bert." + k in w0 and not torch.equal(start[k], w0["bert." + k])]
    assert moved  # the baseline did train
    for k in w0:
        torch.testing.assert_close(w3[k], w0[k], rtol=1e-4, atol=1e-5)
    assert r3["stages"]["ptq"]["loss"] == pytest.approx(r0["stages"]["ptq"]["loss"], rel=1e-3)


def test_resume_on_another_world_size_says_so(folders, tmp_path, monkeypatch):
    """A run interrupted in one process and resumed under torchrun with 2 continues (same samples
    per step) but cannot be bit-identical to an uninterrupted run: it said nothing; now the report
    notes it, and the uninterrupted world size gets no such note."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "cut")
    args = [
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        *FAST,
        "--out",
        out,
    ]
    train_until_qat_checkpoint(args, 2, monkeypatch)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from tests.helpers.dist_utils import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "qcompress",
        "train",
        *args,
        "--resume",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.load(open(os.path.join(out, "report.json")))
    assert rep["training"]["world_size"] == 2
    said = [n for n in rep["notes"] if "resumed with 2 process(es)" in n]
    assert len(said) == 1 and "had 1" in said[0], rep["notes"]
    assert proc.stdout.count("warning: resumed with 2") == 1


def test_eval_data_that_is_the_training_data_is_said(folders, tmp_path, capsys):
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    same = os.path.join(os.path.dirname(data), ".", os.path.basename(data))  # another spelling
    assert (
        train(
            [
                W8A8,
                "--model",
                folders["bert"],
                "--data",
                data,
                "--eval-data",
                same,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "1",
                *FAST,
            ]
        )
        == 0
    )
    assert "warning: --eval-data is --data" in capsys.readouterr().out
    assert any("training data" in n for n in json.load(open(os.path.join(out, "report.json")))["notes"])


def test_teacher_folder_checked_up_front_and_a_headless_one_said(folders, tmp_path, capsys):
    """A distillation teacher folder that does not exist stopped the job with a FileNotFoundError
    traceback after the FP32 stages; a teacher whose checkpoint has no head for the labels (a plain
    BertModel) distilled from a random head, silently."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    common = ["--model", folders["bert"], "--data", data, "--task", "text-classification", "--max-steps", "1", *FAST]
    kd = tmp_path / "kd.yaml"
    kd.write_text(f"compression_training:\n  distillation: {{enabled: true, teacher: {tmp_path / 'nowhere'}}}\n")
    out = str(tmp_path / "o1")
    assert train([W8A8, str(kd), *common, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "distillation.teacher" in err and "kd.yaml" in err and "nowhere" in err and "\n" not in err, err
    assert not os.path.exists(out)
    kd.write_text(f"compression_training:\n  distillation: {{enabled: true, teacher: {folders['bert']}}}\n")
    out = str(tmp_path / "o2")
    assert train([W8A8, str(kd), *common, "--out", out]) == 0
    assert "no classification head for these 3 labels" in capsys.readouterr().out
    assert any("logits are noise" in n for n in json.load(open(os.path.join(out, "report.json")))["notes"])
    # a teacher fine-tuned for these labels: no such note
    clf = hf.tiny_bert_folder(str(tmp_path / "clf"), num_labels=3)
    cfg = json.load(open(os.path.join(clf, "config.json")))
    names = sorted({y for _, y in folders["rows"]})
    cfg["id2label"], cfg["label2id"] = {str(i): n for i, n in enumerate(names)}, {n: i for i, n in enumerate(names)}
    json.dump(cfg, open(os.path.join(clf, "config.json"), "w"))
    kd.write_text(f"compression_training:\n  distillation: {{enabled: true, teacher: {clf}}}\n")
    out = str(tmp_path / "o3")
    assert train([W8A8, str(kd), *common, "--out", out]) == 0
    assert not _warnings(json.load(open(os.path.join(out, "report.json")))["notes"])


def test_out_on_a_file_system_without_flock_still_runs(folders, tmp_path, monkeypatch):
    """flock failing with ENOLCK (some network / FUSE file systems) is no lock, not a live run."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    assert (
        train(
            [
                W8A8,
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                str(tmp_path / "out"),
                "--max-steps",
                "1",
                *FAST,
            ]
        )
        == 0
    )
    assert os.path.isfile(tmp_path / "out" / "report.json")


def test_divergence_stops_with_one_line(folders, tmp_path, capsys):
    """--lr 1e6 blows the weights up: the FP32 baseline went on with NaN losses to NaN metrics and a
    NaN export, and the compressed run died in a quantizer with a NonFiniteError traceback. Both
    now stop at the first non-finite step with one line naming the phase and the step."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    common = [
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--max-steps",
        "6",
        "--lr",
        "1e6",
        *FAST,
    ]
    for extra, phase, csv_name in ((["--baseline"], "fp32_finetuned", "metrics_fp32.csv"), ([], "qat", "metrics.csv")):
        out = tmp_path / phase
        code = train([W8A8, *common, "--out", str(out), *extra])
        err = capsys.readouterr().err.strip()
        assert code == 1 and f"[{phase}] training diverged at step" in err and "\n" not in err, err
        step = int(err.split("at step ")[1].split(":")[0])
        rows = list(csv.DictReader(open(out / csv_name)))
        assert 1 < step <= 6 and len(rows) in (step - 1, step)
        assert all(math.isfinite(float(r["loss"])) for r in rows[: step - 1])
        assert not (out / "report.json").exists()


def test_transformers_stage_after_a_resume_still_compares_with_the_export(folders, tmp_path, monkeypatch):
    """A run interrupted after its 'exported' stage and resumed had no load_quantized model to
    compare transformers' load with: the transformers row lost max_logit_diff_vs_exported. The
    resumed run reloads the export for it; the oracle is the uninterrupted run's row."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    recipe = tmp_path / "w8_encoder.json"  # Linears only: an export transformers loads
    recipe.write_text(
        json.dumps(
            {
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                        "different_groups": {
                            "w8": {
                                "params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"},
                                "modules": ["encoder"],
                            }
                        },
                    }
                }
            }
        )
    )
    args = [
        str(recipe),
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--max-steps",
        "2",
        *FAST,
    ]
    whole = str(tmp_path / "whole")
    assert train([*args, "--out", whole]) == 0
    want = json.load(open(os.path.join(whole, "report.json")))["stages"]["transformers"]
    assert want.get("max_logit_diff_vs_exported") is not None

    from qcompress.train import job

    def dies(*a, **k):
        raise Interrupted()

    cut = str(tmp_path / "cut")
    real = job.transformers_attempts
    monkeypatch.setattr(job, "transformers_attempts", dies)
    with pytest.raises(Interrupted):
        train([*args, "--out", cut])
    monkeypatch.setattr(job, "transformers_attempts", real)
    assert train([*args, "--out", cut, "--resume"]) == 0
    got = json.load(open(os.path.join(cut, "report.json")))["stages"]["transformers"]
    assert got["max_logit_diff_vs_exported"] == want["max_logit_diff_vs_exported"]
    assert got["max_weight_diff_vs_exported"] == want["max_weight_diff_vs_exported"]


def test_demo_summary_says_why_a_cell_is_empty(folders, tmp_path):
    # make demo's table prints "—" for a stage without a metric; the line under it gives the
    # stage's reason from report.json (here: transformers cannot load quantized embeddings, which
    # schedules/with_embeddings.yaml opts in)
    from model_zoo.demo_bbc import summary_table, table_notes

    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    out = str(tmp_path / "out")
    embeddings = os.path.join(ROOT, "schedules", "with_embeddings.yaml")
    assert (
        train(
            [
                W8A8,
                embeddings,
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--max-steps",
                "1",
                "--out",
                out,
                *FAST,
            ]
        )
        == 0
    )
    rep = json.load(open(os.path.join(out, "report.json")))
    reason = rep["stages"]["transformers"]["reason"]
    assert "—" in summary_table([("W8A8", rep)])
    assert table_notes([("W8A8", rep)]) == [f"— W8A8, transformers: {reason}"]


def test_device_option_is_checked_up_front(folders, tmp_path, capsys):
    """--device names where the job runs; one torch cannot use is refused before --out is touched
    (this suite sees no GPU: conftest hides it from tests not marked cuda)."""
    data = write_data(str(tmp_path / "d"), "csv", folders["rows"])
    base = [
        W8A8,
        "--model",
        folders["bert"],
        "--data",
        data,
        "--task",
        "text-classification",
        "--max-steps",
        "1",
        *FAST,
    ]
    for dev, said in (
        ("cuda", "no CUDA device"),
        ("cuda:1", "no CUDA device"),
        ("tpu", "'cpu', 'cuda' or 'cuda:N'"),
        ("gpu0", "'cpu', 'cuda' or 'cuda:N'"),
    ):
        out = tmp_path / f"o_{dev.replace(':', '_')}"
        assert train([*base, "--out", str(out), "--device", dev]) == 2
        err = capsys.readouterr().err
        assert "--device" in err and repr(dev) in err and said in err, err
        assert not out.exists()
    out = str(tmp_path / "cpu")
    assert train([*base, "--out", out, "--device", "cpu"]) == 0
    assert "training on the CPU" in capsys.readouterr().out


def test_ptq_range_steps_adds_a_stage_and_changes_nothing_else(folders, tmp_path, capsys):
    """--ptq-range-steps N: a ptq_learned stage (the PTQ model's learned ranges trained on the loss,
    qcompress.learn_ranges) beside ptq; the FP32, PTQ and QAT stages are those of the same run
    without it. Without learned ranges in the configs it is refused before anything runs."""
    data = write_data(str(tmp_path / "d"), "txt", folders["rows"] * 2)
    rl = tmp_path / "rl.yaml"
    rl.write_text("compression_training:\n  weight_quantization:\n    shared_parameters:\n      range_learning: true\n")
    w4 = os.path.join(ROOT, "schedules", "w4a16_g32.yaml")
    base = [
        w4,
        str(rl),
        "--model",
        folders["gpt2"],
        "--data",
        data,
        "--task",
        "causal-lm",
        "--max-steps",
        "2",
        "--lr",
        "0.1",
        *FAST,
    ]
    assert train([*base, "--out", str(tmp_path / "plain")]) == 0
    assert train([*base, "--out", str(tmp_path / "learned"), "--ptq-range-steps", "3"]) == 0
    plain = json.load(open(tmp_path / "plain" / "report.json"))["stages"]
    learned = json.load(open(tmp_path / "learned" / "report.json"))["stages"]
    assert "ptq_learned" not in plain
    for stage in ("fp32", "ptq", "qat", "exported"):
        assert learned[stage]["perplexity"] == plain[stage]["perplexity"], stage
    assert math.isfinite(learned["ptq_learned"]["perplexity"])
    assert learned["ptq_learned"]["perplexity"] != learned["ptq"]["perplexity"]  # the ranges moved
    assert "| ptq_learned |" in open(tmp_path / "learned" / "report.md").read()
    capsys.readouterr()
    code = train(
        [
            W8A8,
            "--model",
            folders["gpt2"],
            "--data",
            data,
            "--task",
            "causal-lm",
            "--max-steps",
            "1",
            "--out",
            str(tmp_path / "refused"),
            "--ptq-range-steps",
            "2",
            *FAST,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--ptq-range-steps" in err and "range_learning: true" in err
    assert not os.path.exists(tmp_path / "refused" / "report.json")


def test_ptq_range_steps_under_torchrun_equals_one_process(folders, tmp_path):
    """Under torchrun every rank trains the same ranges on the same batches (learn_ranges averages
    the ranks' gradients): ptq_learned is the one-process figure, and the job ends cleanly."""
    data = write_data(str(tmp_path / "d"), "txt", folders["rows"] * 2)
    rl = tmp_path / "rl.yaml"
    rl.write_text("compression_training:\n  weight_quantization:\n    shared_parameters:\n      range_learning: true\n")
    w4 = os.path.join(ROOT, "schedules", "w4a16_g32.yaml")
    args = [
        w4,
        str(rl),
        "--model",
        folders["gpt2"],
        "--data",
        data,
        "--task",
        "causal-lm",
        "--max-steps",
        "2",
        "--lr",
        "0.1",
        "--ptq-range-steps",
        "3",
        *FAST,
    ]
    assert train([*args, "--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from tests.helpers.dist_utils import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "qcompress",
        "train",
        *args,
        "--out",
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = json.load(open(tmp_path / "one" / "report.json"))["stages"]
    two = json.load(open(tmp_path / "two" / "report.json"))["stages"]
    assert json.load(open(tmp_path / "two" / "report.json"))["training"]["world_size"] == 2
    for stage in ("ptq", "ptq_learned"):
        assert two[stage]["perplexity"] == pytest.approx(one[stage]["perplexity"], rel=1e-6), stage
    assert two["ptq_learned"]["perplexity"] != two["ptq"]["perplexity"]
