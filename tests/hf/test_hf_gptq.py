"""observer: gptq through the transformers Trainer: CompressionCallback solves the weights on the first
training batches before the first step (here a BERT encoder, whose layers are called with their
attention mask: the blocks run one at a time)."""

import copy

import pytest
import torch

from tests.helpers.hf_fixtures import tiny_bert_folder, topic_texts

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate (pip install -e '.[hf]')")

from qcompress.hf import CompressionCallback  # noqa: E402

QUERY = "bert.encoder.layer.1.attention.self.query"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_callback_solves_gptq_before_the_first_step(tmp_path):
    folder = tiny_bert_folder(str(tmp_path / "bert"), num_labels=3)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = topic_texts(n_per_class=4)
    names = sorted({label for _, label in texts})
    data = [dict(tok(t, truncation=True, max_length=16), labels=names.index(label)) for t, label in texts]
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "w": {
                        "params": {"start_bits": 4, "target_bits": 4, "group_size": 16, "observer": "gptq"},
                        "modules": ["encoder"],
                    }
                },
            }
        }
    }
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    before = dict(model.named_modules())[QUERY].weight.detach().clone()
    cb = CompressionCallback(copy.deepcopy(cfg))
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
    transformers.Trainer(model, args, train_dataset=data, processing_class=tok, callbacks=[cb]).train()
    query = dict(model.named_modules())[QUERY]
    assert query.qc_wq.solved is not None
    assert not torch.equal(query.weight.detach(), before)  # GPTQ's compensated weights
    s, _ = query.qc_wq.solved
    assert s.shape == (query.out_features * query.in_features // 16,)
