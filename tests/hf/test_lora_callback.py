"""LoRA in a transformers Trainer (qcompress.hf): the CompressionCallback adds the adapters before the
Trainer builds its optimizer, so it holds state for them only; the export at the end loads with peft
onto the base and gives the trained logits. DistillationTrainer distills into the adapters, the
teacher ('self') staying the uncompressed model."""

import os

import pytest
import torch

from tests.helpers.hf_fixtures import tiny_gpt2_folder, topic_texts

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate (pip install -e '.[hf]')")
peft = pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")

import qcompress as qc  # noqa: E402
from qcompress.hf import CompressionCallback, DistillationTrainer  # noqa: E402


def _cfg(mode, distill=False):
    cc = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 16}, "modules": ["attn", "mlp"]}
            },
        },
        "lora": {"enabled": True, "r": 4, "alpha": 8, "mode": mode},
    }
    if distill:
        cc["distillation"] = {"enabled": True, "teacher": "self", "alpha": 0.5, "temperature": 2.0}
    return {"compression_training": cc}


def _setup(tmp_path):
    folder = tiny_gpt2_folder(str(tmp_path / "gpt2"))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    data = []
    for text, _ in topic_texts(n_per_class=4):
        enc = tok(text, truncation=True, max_length=16, padding="max_length")
        data.append(dict(enc, labels=[t if m else -100 for t, m in zip(enc["input_ids"], enc["attention_mask"])]))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        logging_steps=1,
    )
    return folder, tok, data, model, args


def test_callback_trains_adapters_and_exports_them(tmp_path):
    folder, tok, data, model, args = _setup(tmp_path)
    export = str(tmp_path / "export")
    trainer = transformers.Trainer(
        model,
        args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[CompressionCallback(_cfg("qlora"), export_dir=export)],
    )
    trainer.train()
    held = {n for n, p in model.named_parameters() if p.requires_grad}
    assert held and all(n.endswith(("lora_A", "lora_B")) for n in held)
    names = {p: n for n, p in model.named_parameters()}
    assert {names[p] for p in trainer.optimizer.state} == held  # optimizer state for the adapters only
    assert os.path.isfile(os.path.join(export, "adapter_model.safetensors"))
    x = tok(["market bank profit shares price"], return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        want = model(input_ids=x).logits
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder)
    back = peft.PeftModel.from_pretrained(qc.load_quantized(export, fresh), export).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, want)


def test_distillation_trains_the_adapters_against_the_uncompressed_model(tmp_path):
    folder, tok, data, model, args = _setup(tmp_path)
    cfg = _cfg("qat", distill=True)
    trainer = DistillationTrainer(
        model,
        args,
        compression_config=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[CompressionCallback(cfg)],
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    teacher = trainer.distiller.teacher
    assert not any("qc_lora" in m.__dict__ or hasattr(m, "qc_wq") for m in teacher.modules())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != n.endswith(("lora_A", "lora_B")), n
    logs = [r for r in trainer.state.log_history if "distill_loss" in r]
    assert logs
