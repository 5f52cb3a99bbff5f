"""Layer reduction (student initialised from teacher layers, by name) and the KD losses."""

import pytest
import torch
import torch.nn.functional as F

import qcompress as qc
from qcompress.config.compression import LayerReduction
from qcompress.errors import ConfigError
from qcompress.pruning import distill
from qcompress.pruning.layer_reduction import student_initialization

transformers = pytest.importorskip("transformers")


def bert(layers, seed, hidden=32, inter=40):
    torch.manual_seed(seed)
    conf = transformers.BertConfig(
        vocab_size=64,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=inter,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval()


LR = {
    "enabled": True,
    "keep_number_layer": 2,
    "module_name_prefix": "bert.encoder.layer",
    "teacher_layer": [1, 3],
    "other_module_name": ["bert.pooler", "bert.embeddings", "classifier"],
}


def test_student_gets_exactly_the_mapped_tensors():
    teacher, student = bert(4, seed=0), bert(2, seed=1)
    assert not torch.equal(
        student.bert.encoder.layer[0].output.dense.weight, teacher.bert.encoder.layer[1].output.dense.weight
    )
    qc.init_compression(student, {"compression_training": {"layer_reduction": LR}}, teacher_model=teacher)
    tsd = teacher.state_dict()
    for key, val in student.state_dict().items():
        if key.startswith("bert.encoder.layer."):
            i = int(key.split(".")[3])
            src = key.replace(f"bert.encoder.layer.{i}.", f"bert.encoder.layer.{[1, 3][i]}.", 1)
        else:
            src = key
        assert src in tsd, key
        assert torch.equal(val, tsd[src]), key
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        hs_t = teacher(input_ids=ids, output_hidden_states=True).hidden_states
        hs_s = student(input_ids=ids, output_hidden_states=True).hidden_states
    # the embeddings are copied, so student hidden 0 equals teacher hidden 0 exactly
    torch.testing.assert_close(hs_s[0], hs_t[0])


def test_layer_reduction_errors():
    teacher = bert(4, seed=0)
    with pytest.raises(ConfigError, match=r"layer_reduction\.teacher_layer\[1\].*bert\.encoder\.layer\.7"):
        student_initialization(
            bert(2, 1), teacher, LayerReduction(**{**LR, "teacher_layer": (1, 7), "other_module_name": ()})
        )
    with pytest.raises(ConfigError, match=r"layer_reduction\.teacher_layer.*3 teacher layers.*has 2"):
        student_initialization(
            bert(2, 1), teacher, LayerReduction(**{**LR, "teacher_layer": (0, 1, 2), "keep_number_layer": None})
        )
    wide = bert(2, 1, inter=48)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(ConfigError, match=r"teacher_layer\[0\].*intermediate\.dense\.weight.*\(48, 32\)"):
        student_initialization(wide, teacher, LayerReduction(**{**LR, "teacher_layer": (1, 3)}))
    # checked before copying: the student is untouched
    assert all(torch.equal(v, before[k]) for k, v in wide.state_dict().items())
    with pytest.raises(ConfigError, match=r"other_module_name\[0\].*no module 'bert.nothing'"):
        student_initialization(bert(2, 1), teacher, LayerReduction(**{**LR, "other_module_name": ("bert.nothing",)}))
    with pytest.raises(ConfigError, match="teacher_model"):
        qc.init_compression(bert(2, 1), {"compression_training": {"layer_reduction": LR}})


def test_distill_losses_against_closed_forms():
    torch.manual_seed(0)
    s, t = torch.randn(5, 4), torch.randn(5, 4)
    T = 2.0
    ref = -(F.softmax(t / T, -1) * F.log_softmax(s / T, -1)).sum(-1).mean()
    torch.testing.assert_close(distill.soft_cross_entropy(s, t, T), ref)
    # equals KL + teacher entropy
    p = F.softmax(t / T, -1)
    kl = F.kl_div(F.log_softmax(s / T, -1), p, reduction="batchmean")
    torch.testing.assert_close(distill.soft_cross_entropy(s, t, T), kl - (p * p.log()).sum(-1).mean())
    assert distill.hidden_state_map([1, 3]) == [0, 2, 4]
    th = [torch.full((2, 3), float(i)) for i in range(5)]
    sh = [torch.zeros(2, 3)] * 3
    torch.testing.assert_close(distill.hidden_state_mse(sh, th, [1, 3]), torch.tensor(0.0 + 4 + 16))
    ta = [torch.full((1, 2), float(i)) for i in range(4)]
    torch.testing.assert_close(distill.attention_mse([torch.zeros(1, 2)] * 2, ta, [1, 3]), torch.tensor(10.0))
    with pytest.raises(ValueError, match="hidden states"):
        distill.hidden_state_mse(sh[:2], th, [1, 3])


def test_failed_init_with_layer_reduction_puts_the_students_tensors_back():
    """Layer reduction copies the teacher's layers into the student before the rewrite; an error
    found later (here head pruning's num_heads not dividing the O-projection) left 17 student
    tensors overwritten, although a failed init_compression leaves the model as it was."""
    teacher, student = bert(4, 0), bert(2, 1)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    cfg = {
        "compression_training": {
            "layer_reduction": LR,
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": 5},
                "different_groups": {"hp": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"]}},
            },
        }
    }
    with pytest.raises(ConfigError, match="num_heads"):
        qc.init_compression(student, cfg, teacher_model=teacher)
    after = student.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
