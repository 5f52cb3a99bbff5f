"""The integer recipes quantize what serving loaders read (Linear layers, not embeddings or lm_head),
their exports load in transformers, and `qcompress train` warns before training when a user's
groups quantize modules no serving loader reads."""

import json
import os
import warnings

import pytest
import torch

import qcompress as qc
from qcompress.cli import main as cli_main
from qcompress.export import reach

hf = pytest.importorskip("tests.helpers.hf_fixtures", reason="transformers is not installed")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINEAR_RECIPES = ("w8a8", "w8a8_static", "w4a8_g128", "w4a8_progressive", "w4a16_g128", "w4a16_g32", "w3a16_g32")
WITH_ACTIVATIONS = ("w8a8", "w8a8_static", "w4a8_g128", "w4a8_progressive")


def recipe(*names):
    return qc.load_config(*(os.path.join(ROOT, "schedules", f"{n}.yaml") for n in names))


def bert():
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval()


def llama():
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(conf).eval()


def compressed(model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qc.init_compression(model, cfg)


def with_state(model, attr):
    return {n for n, m in model.named_modules() if getattr(m, attr, None) is not None}


@pytest.mark.parametrize("build", [bert, llama], ids=["bert", "llama"])
@pytest.mark.parametrize("name", LINEAR_RECIPES)
def test_integer_recipes_quantize_linear_layers_but_not_lm_head(name, build):
    # oracle: the plain model's nn.Linear modules, lm_head left out as compressed-tensors' presets do
    want = {n for n, m in build().named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    model = compressed(build(), recipe(name))
    assert with_state(model, "qc_wq") == want
    if name in WITH_ACTIVATIONS:
        assert with_state(model, "qc_aq") == want
    assert reach.unreadable(model) == []


@pytest.mark.parametrize("name", ["w1a8_xtc", "w2a8_kd"])
def test_deepspeed_mirrors_keep_their_embeddings_and_say_so(name):
    # XTC / TernaryBERT quantize the word embeddings on purpose; the check names them
    model = compressed(bert(), recipe(name))
    embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert embeddings and embeddings <= with_state(model, "qc_wq")
    assert set(reach.unreadable(model)) == {(n, "embedding") for n in embeddings}


def test_with_embeddings_fragment_opts_in_embeddings_and_lm_head():
    model = compressed(llama(), recipe("w4a16_g32", "with_embeddings"))
    bits = {n: m.qc_wq.target_bits for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert bits["model.embed_tokens"] == 8 and bits["lm_head"] == 8
    assert {n for n, b in bits.items() if b == 4} == {
        n for n, m in llama().named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    # lm_head is an nn.Linear (loaders read it); the embedding table is not
    assert reach.unreadable(model) == [("model.embed_tokens", "embedding")]


def test_gpt2_conv1d_and_partial_groups_are_named():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    )
    from transformers.pytorch_utils import Conv1D

    conv1d = {n for n, m in gpt2.named_modules() if isinstance(m, Conv1D)}
    found = dict(reach.unreadable(compressed(gpt2, recipe("w4a16_g32"))))
    assert found == {n: "transformers Conv1D" for n in conv1d}
    # a Linear of 32 inputs in groups of 128: one padded group, which compressed-tensors cannot hold
    small = bert_hidden(32)
    want = {
        n: f"in_features {m.in_features} not a multiple of group_size 128"
        for n, m in small.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert dict(reach.unreadable(compressed(small, recipe("w4a16_g128")))) == want


def bert_hidden(hidden):
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf)


@pytest.mark.parametrize("name", ["w8a8", "w4a8_g128"])
def test_recipe_exports_load_in_transformers_with_load_quantized_logits(name, tmp_path):
    from qcompress.export.hf_compat import dequantize_config
    from qcompress.export.layout import REFUSAL_GROUP

    cfg = recipe(name)
    model = compressed(bert(), cfg)
    qc.CompressionScheduler(model, cfg).step()
    out = tmp_path / name
    qc.export_quantized(model, out, cfg)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert REFUSAL_GROUP not in groups
    ours = qc.load_quantized(out, bert())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: the passed config overrides the file's
        theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
            out, dtype=torch.float32, quantization_config=dequantize_config()
        ).eval()
    loaded = {n: m for n, m in ours.named_modules() if getattr(m, "qx_rec", None) is not None}
    assert set(loaded) == {n for n, m in bert().named_modules() if isinstance(m, torch.nn.Linear)}
    for n, m in loaded.items():
        assert torch.equal(theirs.get_submodule(n).weight, m.weight), n
        # dequantize=True runs activations unquantized: so must the oracle
        m.qx_rec = dict(m.qx_rec, input_activations=None)
    ids = torch.randint(0, 60, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=ids).logits, ours(input_ids=ids).logits)


class _Stop(BaseException):
    """Ends the job once the check has run (nothing after it matters here)."""


def test_train_warns_before_training_when_groups_quantize_unreadable_modules(tmp_path, monkeypatch):
    from qcompress.train import job

    folder = hf.tiny_bert_folder(str(tmp_path / "bert"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in hf.topic_texts(4)))
    seen = []

    def prepare_out(*args, **kwargs):  # runs before --out is touched and any stage trains
        seen.extend(str(w.message) for w in caught if "no serving loader reads" in str(w.message))
        raise _Stop

    monkeypatch.setattr(job, "prepare_out", prepare_out)
    args = [
        "--model",
        folder,
        "--data",
        str(data),
        "--task",
        "text-classification",
        "--out",
        str(tmp_path / "o"),
        "--max-steps",
        "1",
        "--max-length",
        "16",
        "--no-progress",
    ]
    for names, expect in ((("w8a8",), False), (("w8a8", "with_embeddings"), True)):
        seen.clear()
        with warnings.catch_warnings(record=True) as caught, pytest.raises(_Stop):
            warnings.simplefilter("always")
            cli_main(["train", *(os.path.join(ROOT, "schedules", f"{n}.yaml") for n in names), *args])
        if not expect:
            assert seen == []
            continue
        assert len(seen) == 1, seen
        msg = seen[0]
        for emb in (
            "bert.embeddings.word_embeddings",
            "bert.embeddings.position_embeddings",
            "bert.embeddings.token_type_embeddings",
        ):
            assert f"{emb} (embedding)" in msg
        assert "with_embeddings.yaml" in msg and "qcompress.load_quantized still reads" in msg


def test_integer_recipes_take_the_moe_experts_too():
    conf = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    plain = transformers.MixtralForCausalLM(conf)
    # oracle: the fused experts' 3-D Parameters and the attention Linears (the router stays float)
    experts = {
        f"{n}.{p}"
        for n, m in plain.named_modules()
        if n.endswith("mlp.experts")
        for p, w in m.named_parameters(recurse=False)
        if w.dim() == 3
    }
    attention = {n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in n}
    model = compressed(plain, recipe("w4a16_g128"))
    assert experts and with_state(model, "qc_wq") == experts | attention
    assert reach.unreadable(model) == []
