"""transformers Trainer integration (qcompress.hf): CompressionCallback and DistillationTrainer on
tiny BERT / GPT-2 folders from hf_fixtures.

Oracles: DeepSpeed's doubling rule written out step by step (start 8, target 4, period 2: drops
2, 4, 8 ... optimizer steps after the offset), the number of distinct weight values (at most
2^bits), an uninterrupted run compared tensor by tensor with a resumed one, the model's own
logits against the exported checkpoint's, and the distillation loss written out by hand."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.hf_fixtures import tiny_bert_folder, tiny_gpt2_folder, topic_texts

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)
pytest.importorskip(
    "accelerate", reason='the transformers Trainer needs accelerate (pip install -e ".[hf]" in the checkout)'
)

import qcompress as qc  # noqa: E402
from qcompress.hf import CompressionCallback, DistillationTrainer  # noqa: E402
from qcompress.hf.callback import STATE_JSON, STATE_TENSORS  # noqa: E402
from qcompress.pruning.distill import hidden_state_mse  # noqa: E402

QUERY = "bert.encoder.layer.0.attention.self.query"
CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True},
            "different_groups": {
                "wq": {
                    "params": {"start_bits": 8, "target_bits": 4, "quantization_period": 2},
                    "modules": ["encoder", "classifier"],
                }
            },
        }
    }
}
# DeepSpeed's rule written out: one bit less 2, 4, 8 steps after offset 0
EXPECTED_BITS = {0: 8, 1: 8, 2: 7, 3: 7, 4: 6, 5: 6, 6: 6}
STEPS, SAVE_AT, ACCUM = 6, 3, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread; on a shared machine several threads mostly
    wait for each other (a Trainer run here: ~2 s on one thread, ~25 s on two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tiny_bert_folder(str(tmp_path_factory.mktemp("bert")), num_labels=3)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = topic_texts(n_per_class=8)  # 24 samples: 6 optimizer steps of 2 x 2
    names = sorted({label for _, label in texts})
    data = [dict(tok(t, truncation=True, max_length=16), labels=names.index(label)) for t, label in texts]
    return folder, tok, data


class Recorder(transformers.TrainerCallback):
    """After every optimizer step: the step, the query layer's bits and its distinct weight
    values, and how many micro-batches the model saw; bits at every accumulation micro-step."""

    def __init__(self, cb, model):
        self.cb, self.steps, self.micro = cb, [], []
        self.forwards = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def _bits(self):
        return self.cb.scheduler.current_bits()[QUERY]

    def on_step_end(self, args, state, control, model=None, **kw):
        weight = dict(model.named_modules())[QUERY].weight
        self.steps.append((state.global_step, self._bits(), weight.unique().numel(), self.forwards))
        self.forwards = 0

    def on_substep_end(self, args, state, control, **kw):
        self.micro.append((state.global_step, self._bits()))


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(base, out, *, export=None, stop_at=None, resume=None, model=None, load_from=None):
    folder, tok, data = base
    model = model or transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    cb = CompressionCallback(CFG, export_dir=export)
    rec = Recorder(cb, model)
    args = transformers.TrainingArguments(
        out,
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model,
        args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[cb, rec] + ([StopAt(stop_at)] if stop_at else []),
    )
    if load_from:
        cb.resume_from(load_from)
    trainer.train(resume_from_checkpoint=resume)
    return model, cb, rec


@pytest.fixture(scope="module")
def full(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    export = os.path.join(str(root), "export")
    model, cb, rec = run(base, os.path.join(str(root), "out"), export=export)
    return model, cb, rec, export


def test_bits_drop_at_scheduled_optimizer_steps_under_accumulation(full):
    model, cb, rec, _ = full
    assert [s for s, *_ in rec.steps] == list(range(1, STEPS + 1))
    for step, bits, distinct, forwards in rec.steps:
        assert forwards == ACCUM  # each optimizer step saw 2 micro-batches
        assert bits == EXPECTED_BITS[step], (step, bits)
        assert distinct <= 2**bits  # the weight really sits on a `bits` grid
    assert [d for _, b, d, _ in rec.steps if b == 8][0] > 2**7  # and uses it (not a coarser one)
    # micro-steps between two optimizer steps keep the bits of the last optimizer step
    assert rec.micro == [(s, EXPECTED_BITS[s]) for s in range(STEPS)]
    assert cb.scheduler.training_steps == STEPS


def test_resume_from_checkpoint_continues_exactly(base, full, tmp_path):
    model_full, cb_full, rec_full, _ = full
    out = str(tmp_path / "out")
    _, cb_half, rec_half = run(base, out, stop_at=SAVE_AT)
    assert [s for s, *_ in rec_half.steps] == [1, 2, 3]
    ckpt = os.path.join(out, f"checkpoint-{SAVE_AT}")
    assert {STATE_JSON, STATE_TENSORS} <= set(os.listdir(ckpt))
    with open(os.path.join(ckpt, STATE_JSON)) as fh:
        assert json.load(fh)["training_steps"] == SAVE_AT

    model_res, cb_res, rec_res = run(base, out, resume=True)
    assert [(s, b) for s, b, *_ in rec_res.steps] == [(s, b) for s, b, *_ in rec_full.steps[SAVE_AT:]]
    assert cb_res.scheduler.current_bits() == cb_full.scheduler.current_bits()
    full_sd, res_sd = model_full.state_dict(), model_res.state_dict()
    assert full_sd.keys() == res_sd.keys()
    for name in full_sd:
        assert torch.equal(full_sd[name], res_sd[name]), name
    a, b = cb_full.scheduler.state_dict(), cb_res.scheduler.state_dict()
    assert a["training_steps"] == b["training_steps"] == STEPS
    masters = 0
    for name, entry in a["modules"].items():
        for key in ("master", "applied"):
            if key in entry.get("wq", {}):
                assert torch.equal(entry["wq"][key], b["modules"][name]["wq"][key]), (name, key)
                masters += 1
    assert masters == 2 * 13  # 12 encoder Linears + the classifier, master and applied

    # a checkpoint kept outside output_dir: resume_from(folder) continues exactly too
    kept = str(tmp_path / "kept")
    shutil.copytree(ckpt, kept)
    model_kept, cb_kept, _ = run(base, str(tmp_path / "elsewhere"), resume=kept, load_from=kept)
    assert cb_kept.scheduler.current_bits() == cb_full.scheduler.current_bits()
    for name, value in model_kept.state_dict().items():
        assert torch.equal(full_sd[name], value), name

    # the same checkpoint without its compression state: resuming would restart the schedule
    os.remove(os.path.join(ckpt, STATE_JSON))
    with pytest.raises(FileNotFoundError, match=STATE_JSON) as err:
        run(base, out, resume=ckpt)
    assert "resume from the checkpoint before" in str(err.value)  # what a killed save leaves


def test_export_loads_and_gives_the_trained_logits(base, full):
    folder, tok, _ = base
    model, _, _, export = full
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(export))
    fresh = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    qc.load_quantized(export, fresh)
    batch = tok([t for t, _ in topic_texts(n_per_class=2, seed=5)], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        want, got = model(**batch).logits, fresh(**batch).logits
    assert torch.equal(want, got)
    assert not torch.equal(
        want, transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()(**batch).logits
    )  # the trained, quantized model, not the start
    again = transformers.AutoTokenizer.from_pretrained(export)
    assert again.get_vocab() == tok.get_vocab()


def _trainer(base, out, callbacks, model=None, cls=transformers.Trainer, **kw):
    folder, tok, data = base
    model = model or transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    args = transformers.TrainingArguments(
        out,
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return cls(model, args, train_dataset=data, processing_class=tok, callbacks=callbacks, **kw)


def test_callback_rewrites_once_and_accepts_a_rewritten_model(base, tmp_path):
    folder = base[0]
    cb = CompressionCallback(CFG)
    trainer = _trainer(base, str(tmp_path / "a"), [cb])
    query = dict(trainer.model.named_modules())[QUERY]
    assert query.qc_wq is not None and query.qc_wq.bits == 8  # rewritten at on_init_end
    assert trainer.optimizer is None  # before the optimizer exists

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    qc.init_compression(model, CFG)
    state = dict(model.named_modules())[QUERY].qc_wq
    cb2 = CompressionCallback(CFG)
    _trainer(base, str(tmp_path / "b"), [cb2], model=model)
    assert dict(model.named_modules())[QUERY].qc_wq is state  # not rewritten a second time
    assert cb2.scheduler.model is model


def test_export_dir_in_use_fails_before_training(base, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="config.json"):
        _trainer(base, str(tmp_path / "out"), [CompressionCallback(CFG, export_dir=str(export))])


# --- DistillationTrainer -----------------------------------------------------------------------

KD = {"enabled": True, "temperature": 2.0, "alpha": 0.4, "hidden_mse": 0.5}


def _manual_kd(student_out, teacher_out, mask=None):
    """(1 - a) * task + a * (T^2 KL(teacher || student) + w * sum of hidden MSEs), by hand."""
    T, a, w = KD["temperature"], KD["alpha"], KD["hidden_mse"]
    pt = F.softmax(teacher_out.logits.double() / T, -1)
    kl = (pt * (pt.log() - F.log_softmax(student_out.logits.double() / T, -1))).sum(-1)
    kl = kl[mask].mean() if mask is not None else kl.mean()
    mse = sum(
        ((s.double() - t.double()) ** 2).mean() for s, t in zip(student_out.hidden_states, teacher_out.hidden_states)
    )
    kd = T * T * kl + w * mse
    return (1 - a) * student_out.loss.double() + a * kd, kd


def test_distillation_trainer_loss_and_logs(base, tmp_path):
    folder, tok, data = base
    cfg = {**CFG, "compression_training": {**CFG["compression_training"], "distillation": KD}}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )  # one forward = the next
    trainer = _trainer(
        base,
        str(tmp_path / "out"),
        [CompressionCallback(cfg)],
        model=model,
        cls=DistillationTrainer,
        compression_config=cfg,
    )
    teacher, student = trainer.distiller.teacher, trainer.model
    assert type(dict(teacher.named_modules())[QUERY]) is torch.nn.Linear  # full-precision copy
    assert dict(student.named_modules())[QUERY].qc_wq is not None
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())

    batch = trainer.data_collator(data[:4])
    student.train()
    total = trainer.compute_loss(student, dict(batch))
    with torch.no_grad():
        s_out = student(**batch, output_hidden_states=True)
        t_out = teacher(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True)
    want, _ = _manual_kd(s_out, t_out)
    assert total.item() == pytest.approx(want.item(), rel=1e-5)
    assert hidden_state_mse(s_out.hidden_states, t_out.hidden_states, [0, 1]).item() > 0

    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2 and all({"task_loss", "distill_loss"} <= set(r) for r in logs)
    for r in logs:
        assert r["loss"] == pytest.approx(0.6 * r["task_loss"] + 0.4 * r["distill_loss"], rel=1e-3, abs=1e-4)


def test_distillation_trainer_causal_lm_uses_positions_with_a_label(tmp_path):
    folder = tiny_gpt2_folder(str(tmp_path / "gpt2"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = {"compression_training": {"distillation": KD}}
    enc = tok(["the game team win", "market bank profit shares price growth"], padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    labels[0, 1] = -100  # a prompt token without a target, too
    batch = {**enc, "labels": labels}
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True
    )
    trainer = DistillationTrainer(
        model, args, compression_config=cfg, teacher=transformers.AutoModelForCausalLM.from_pretrained(folder)
    )
    with torch.no_grad():
        torch.nn.init.normal_(trainer.distiller.teacher.lm_head.weight)  # a teacher that disagrees
    model.train()
    total = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        s_out = model(**batch, output_hidden_states=True)
        t_out = trainer.distiller.teacher(**enc, output_hidden_states=True)
    # logits at position i predict labels[i + 1]
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != -100
    want, kd = _manual_kd(s_out, t_out, mask)
    assert total.item() == pytest.approx(want.item(), rel=1e-5)
    wrong, _ = _manual_kd(s_out, t_out, labels != -100)  # unshifted: a different number
    assert abs(wrong.item() - want.item()) > 1e-4
    with pytest.raises(ValueError, match="distillation.enabled is false"):
        DistillationTrainer(model, args, compression_config={}, teacher=trainer.distiller.teacher)


def test_qcompress_does_not_import_transformers_and_hf_says_what_to_install():
    code = (
        "import sys\n"
        "import qcompress, qcompress.train.distill\n"
        "assert 'transformers' not in sys.modules, 'qcompress imported transformers'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    import qcompress.hf\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and 'pip install -e ".[hf]"' in res.stdout


# --- accumulation, folder teachers, the best checkpoint, config vs TrainingArguments ------------


def _lm_data(tok, n, length=10, seed=0):
    """n causal-LM samples of `length` tokens each (equal lengths: no padding)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(5, len(tok), (n, length), generator=g).tolist()]


def _lm_args(out, **kw):
    return transformers.TrainingArguments(
        out,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **kw,
    )


def _dropout_free_gpt2(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def test_distillation_trainer_without_distillation_trains_like_the_trainer_under_accumulation(tmp_path):
    """Oracle: transformers.Trainer itself. A causal LM's loss comes normalised over the whole
    accumulated batch (num_items_in_batch); the DistillationTrainer divided it by the accumulation
    steps once more, so losses, gradients and the plain run's clipping were 2x smaller."""
    folder = tiny_gpt2_folder(str(tmp_path / "gpt2"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    data = _lm_data(tok, 8)
    runs = []
    for cls, kw in ((transformers.Trainer, {}), (DistillationTrainer, {"compression_config": {}})):
        model = _dropout_free_gpt2(folder)
        trainer = cls(model, _lm_args(str(tmp_path / cls.__name__), max_steps=2), train_dataset=data, **kw)
        trainer.train()
        runs.append(([(r["loss"], r["grad_norm"]) for r in trainer.state.log_history if "loss" in r], model))
    (logs_hf, model_hf), (logs_kd, model_kd) = runs
    assert len(logs_hf) == 2 and logs_kd == logs_hf
    for (name, a), b in zip(model_hf.state_dict().items(), model_kd.state_dict().values()):
        assert torch.equal(a, b), name


def test_distillation_gradient_under_accumulation_is_the_mean_over_micro_batches(tmp_path):
    """Oracle: the loss written out by hand over all four samples at once (equal lengths, so the
    mean of the two micro-batch means is the mean over the whole batch), one backward."""
    folder = tiny_gpt2_folder(str(tmp_path / "gpt2"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    data = _lm_data(tok, 4, seed=1)
    teacher = _dropout_free_gpt2(folder)
    with torch.no_grad():
        torch.nn.init.normal_(teacher.lm_head.weight)  # a teacher that disagrees
    model = _dropout_free_gpt2(folder)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {"compression_training": {"distillation": KD}}
    grads = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = DistillationTrainer(
        model,
        _lm_args(str(tmp_path / "out"), max_steps=1, max_grad_norm=0.0),
        compression_config=cfg,
        teacher=teacher,
        train_dataset=data,
        callbacks=[Grab()],
    )
    trainer.train()

    ref = _dropout_free_gpt2(folder)
    ref.load_state_dict(start)
    ids = torch.tensor([d["input_ids"] for d in data])
    s_out = ref(input_ids=ids, output_hidden_states=True)
    with torch.no_grad():
        t_out = trainer.distiller.teacher(input_ids=ids, output_hidden_states=True)
    task = F.cross_entropy(s_out.logits[:, :-1].reshape(-1, s_out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    T, a, w = KD["temperature"], KD["alpha"], KD["hidden_mse"]
    pt = F.softmax(t_out.logits[:, :-1] / T, -1)
    kl = (pt * (pt.log() - F.log_softmax(s_out.logits[:, :-1] / T, -1))).sum(-1).mean()
    mse = sum(((s - t) ** 2).mean() for s, t in zip(s_out.hidden_states, t_out.hidden_states))
    ((1 - a) * task + a * (T * T * kl + w * mse)).backward()
    checked = 0
    for name, p in ref.named_parameters():
        if p.grad is not None and name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
    assert checked >= 10


def test_folder_teacher_that_does_not_fit_the_student_is_refused(tmp_path):
    """from_pretrained fills what a folder lacks with random weights: an encoder checkpoint
    without the task's head (noise logits, silently) or another architecture (an IndexError at
    the first step). Both are refused up front, naming the folder; fitting folders load."""
    student_folder = tiny_bert_folder(str(tmp_path / "student"), num_labels=3)
    student = transformers.AutoModelForSequenceClassification.from_pretrained(student_folder)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True
    )

    def build(folder, model=student):
        cfg = {"compression_training": {"distillation": {"enabled": True, "teacher": folder}}}
        return DistillationTrainer(model, args, compression_config=cfg)

    headless = tiny_bert_folder(str(tmp_path / "encoder"))  # a BertModel checkpoint
    with pytest.raises(
        ValueError,
        match=r"encoder has no weights for 2 tensors of "
        r"BertForSequenceClassification \(classifier.bias, classifier.weight\)",
    ):
        build(headless)
    gpt2 = tiny_gpt2_folder(str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match="holds a 'gpt2' model, the student is 'bert'"):
        build(gpt2)
    with pytest.raises(ValueError, match="not a transformers model folder"):
        build(str(tmp_path))
    teacher = build(tiny_bert_folder(str(tmp_path / "fine-tuned"), num_labels=3, seed=1)).distiller.teacher
    want = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "fine-tuned"))
    for (name, a), b in zip(want.state_dict().items(), teacher.state_dict().values()):
        assert torch.equal(a, b), name
    lm = build(gpt2, model=transformers.AutoModelForCausalLM.from_pretrained(gpt2)).distiller.teacher
    assert lm.lm_head.weight is lm.transformer.wte.weight  # tied head: not "missing"


@pytest.mark.parametrize("in_forward", [False, True])
def test_load_best_model_at_end_keeps_the_best_checkpoints_compression(base, tmp_path, in_forward):
    """load_best_model_at_end: the Trainer reloads the best checkpoint's weights at the end. The
    compression state has to come with them: the model left (and exported) must be the one the
    best evaluation saw. Before, optimizer-step mode failed to export ('integers do not
    reproduce') and forward mode exported the best weights at the last step's bits."""
    folder, tok, data = base
    cfg = json.loads(json.dumps(CFG))
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_weight_in_forward"] = in_forward
    probe = transformers.DataCollatorWithPadding(tok)(data[:6])
    probe = {k: v for k, v in probe.items() if k != "labels"}
    seen, evals = {}, []

    class Snapshot(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kw):
            model.eval()
            with torch.no_grad():
                seen[state.global_step] = model(**probe).logits

    def first_is_best(_):
        evals.append(len(evals))
        return {"rank": -len(evals)}  # the first evaluation (step 2) scores best

    export = str(tmp_path / "export")
    cb = CompressionCallback(cfg, export_dir=export)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="rank",
        greater_is_better=True,
        disable_tqdm=True,
        seed=0,
    )
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    trainer = transformers.Trainer(
        model,
        args,
        train_dataset=data,
        eval_dataset=data[:6],
        processing_class=tok,
        callbacks=[cb, Snapshot()],
        compute_metrics=first_is_best,
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2") and sorted(seen) == [2, 4, 6]
    assert cb.scheduler.training_steps == 2 and cb.scheduler.current_bits()[QUERY] == EXPECTED_BITS[2]
    assert not torch.equal(seen[2], seen[6])  # the last step's model differs
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**probe).logits, seen[2])
    fresh = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    qc.load_quantized(export, fresh)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(**probe).logits, seen[2])


def test_config_that_disagrees_with_the_training_arguments_is_refused(base, tmp_path):
    """The Trainer trains by its TrainingArguments; a ds_config's batch, accumulation, precision
    or clipping values that differ were ignored silently. Refused when the Trainer is built,
    every mismatch named (as transformers' own DeepSpeed integration does); agreeing values and
    unset keys pass; sections the Trainer does not read are a warning."""
    wq = CFG["compression_training"]
    args = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0)

    def build(doc, **kw):
        targs = transformers.TrainingArguments(
            str(tmp_path / "out"),
            use_cpu=True,
            report_to=[],
            max_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            **{**args, **kw},
        )
        model = transformers.AutoModelForSequenceClassification.from_pretrained(base[0])
        return transformers.Trainer(
            model, targs, train_dataset=base[2], callbacks=[CompressionCallback({**doc, "compression_training": wq})]
        )

    with pytest.raises(qc.ConfigError) as err:
        build(
            {
                "train_batch_size": 16,
                "gradient_accumulation_steps": 4,
                "fp16": {"enabled": True},
                "gradient_clipping": 0.5,
            }
        )
    msg = str(err.value)
    assert err.value.path == "fp16.enabled"
    for part in (
        "fp16.enabled is True but TrainingArguments.fp16 is False",
        "gradient_accumulation_steps is 4 but TrainingArguments.gradient_accumulation_steps is 2",
        "train_batch_size is 16 but per_device_train_batch_size x gradient_accumulation_steps "
        "x world size (4 x 2 x 1) is 8",
        "gradient_clipping is 0.5 but TrainingArguments.max_grad_norm is 1.0",
    ):
        assert part in msg, (part, msg)
    with pytest.raises(
        qc.ConfigError,
        match="train_micro_batch_size_per_gpu is 2 but TrainingArguments.per_device_train_batch_size is 4",
    ):
        build({"train_micro_batch_size_per_gpu": 2})
    with pytest.raises(qc.ConfigError, match="bf16.enabled is True but TrainingArguments.bf16 is False"):
        build({"bf16": {"enabled": True}})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "bf16": {"enabled": True},
                "fp16": {"enabled": False},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            },
            bf16=True,
        )
    assert dict(trainer.model.named_modules())[QUERY].qc_wq is not None
    assert any("optimizer section(s) are not used" in str(w.message) for w in caught)


def test_distillation_task_loss_is_the_trainers_own_label_smoothing_included(base, tmp_path):
    """Oracle: transformers.Trainer with label_smoothing_factor. The distillation path took the
    model's plain cross-entropy, so label smoothing (and a compute_loss_func) was ignored there."""
    folder, tok, data = base

    def run(cls, **kw):
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        args = transformers.TrainingArguments(
            str(tmp_path / cls.__name__),
            use_cpu=True,
            report_to=[],
            max_steps=2,
            per_device_train_batch_size=4,
            label_smoothing_factor=0.3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = cls(model, args, train_dataset=data, processing_class=tok, **kw)
        trainer.train()
        return [r for r in trainer.state.log_history if "loss" in r], model

    plain_logs, plain = run(transformers.Trainer)
    cfg = {"compression_training": {"distillation": {"enabled": True, "alpha": 0.0}}}  # task loss only
    kd_logs, kd = run(DistillationTrainer, compression_config=cfg)
    assert len(plain_logs) == 2
    for want, got in zip(plain_logs, kd_logs):
        assert got["loss"] == got["task_loss"] == pytest.approx(want["loss"], rel=1e-6)
    for (name, a), b in zip(plain.state_dict().items(), kd.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)

    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(labels.shape)
        return F.cross_entropy(outputs.logits, labels) * 0 + 7.0 + outputs.logits.sum() * 0

    cfg = {"compression_training": {"distillation": {"enabled": True, "alpha": 0.5}}}
    logs, _ = run(DistillationTrainer, compression_config=cfg, compute_loss_func=loss_func)
    assert seen and all(r["task_loss"] == pytest.approx(7.0) for r in logs)


def test_resuming_from_another_runs_checkpoint_is_refused(base, tmp_path):
    """train(resume_from_checkpoint=A) with output_dir holding another run's checkpoint of the
    same step read that run's compression state (masters, bits) next to A's weights, silently;
    resume_from(B) with train(resume_from_checkpoint=A) too. Both are refused now."""
    folder = base[0]
    out_a, out_b = str(tmp_path / "a"), str(tmp_path / "b")
    run(base, out_a, stop_at=SAVE_AT)
    other = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        other.classifier.weight.mul_(3.0)  # another run, same step numbers
    run(base, out_b, stop_at=SAVE_AT, model=other)
    ckpt_a, ckpt_b = (os.path.join(o, f"checkpoint-{SAVE_AT}") for o in (out_a, out_b))
    with pytest.raises(ValueError, match=r"checkpoint-3 is not the checkpoint the Trainer resumed from"):
        run(base, out_b, resume=ckpt_a)
    with pytest.raises(ValueError, match="resume_from"):
        run(base, str(tmp_path / "c"), resume=ckpt_a, load_from=ckpt_b)
    model, cb, _ = run(base, out_b, resume=ckpt_a, load_from=ckpt_a)  # the right pairing works
    assert cb.scheduler.training_steps == STEPS


RL_CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 4, "target_bits": 4, "range_learning": True, "granularity": "channel"},
                    "modules": ["attention.self.query", "attention.self.key"],
                }
            },
        }
    }
}


def test_compression_trainer_puts_learned_ranges_in_their_own_groups(base, tmp_path):
    # qcompress train's default (RANGE_LR_FACTOR x lr, no weight decay) for Trainer users: the
    # scales leave the weights' groups, and their lr follows the schedule at the factor
    from qcompress.hf import CompressionTrainer
    from qcompress.nn.range_groups import RANGE_LR_FACTOR, range_parameter_ids

    folder, tok, data = base
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.1,
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    trainer = CompressionTrainer(
        model, args, train_dataset=data, processing_class=tok, callbacks=[CompressionCallback(RL_CFG)]
    )
    trainer.train()
    ranges = range_parameter_ids(model)
    assert len(ranges) == 4  # weight_scale of 2 layers x 2 blocks
    groups = trainer.optimizer.param_groups
    with_ranges = [g for g in groups if any(id(p) in ranges for p in g["params"])]
    assert with_ranges and all(all(id(p) in ranges for p in g["params"]) for g in with_ranges)
    weights = [g for g in groups if g not in with_ranges]
    assert all(g["weight_decay"] == 0.0 for g in with_ranges)
    assert any(g["weight_decay"] == 0.1 for g in weights)
    for g in with_ranges:
        assert g["initial_lr"] == pytest.approx(1e-3 * RANGE_LR_FACTOR)
        assert g["lr"] == pytest.approx(weights[0]["lr"] * RANGE_LR_FACTOR)  # the schedule applies
    # a plain Trainer keeps them in the weights' group (the documented difference)
    plain = _trainer(base, str(tmp_path / "plain"), [CompressionCallback(RL_CFG)])
    plain.create_optimizer()
    assert len(plain.optimizer.param_groups) == 2
    # resuming rebuilds the same groups, so the saved optimizer state loads
    model2 = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    again = CompressionTrainer(
        model2, args, train_dataset=data, processing_class=tok, callbacks=[CompressionCallback(RL_CFG)]
    )
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_input_weighted_ranges_are_calibrated_on_training_batches_before_the_first_step(base, tmp_path):
    """observer_kwargs.weight_by: inputs through the Trainer: the callback records the moments on the
    first training batches (no 'no input statistics' warning at the steps), and the ranges are the
    observer's with them (oracle: mse_shrink with those moments on the weight as it was then)."""
    import copy
    import warnings
    from qcompress.quant import observers

    folder, tok, data = base
    cfg = copy.deepcopy(CFG)
    shared = cfg["compression_training"]["weight_quantization"]["shared_parameters"]
    shared.update(observer="mse", observer_kwargs={"weight_by": "inputs"}, quantize_weight_in_forward=True)
    cfg["compression_training"]["weight_quantization"]["different_groups"]["wq"]["params"].update(
        start_bits=4, target_bits=4, group_size=16
    )
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    query = dict(model.named_modules())[QUERY]
    w0 = query.weight.detach().clone()
    cb = CompressionCallback(cfg)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=0.0,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(model, args, train_dataset=data, processing_class=tok, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no input statistics.*")
        trainer.train()
    query = dict(model.named_modules())[QUERY]
    moments = query.qc_wq.store.input_moments
    assert moments is not None and moments.shape == (query.in_features // 16, 16, 16)
    cross = query.qc_wq.store.input_cross  # cross_groups (the default): the whole E[u u^T]
    assert cross is not None and cross.shape == (query.in_features, query.in_features)
    assert torch.equal(query.qc_wq.shrink, observers.mse_shrink(w0, query.qc_wq.spec(), moments=moments, cross=cross))
