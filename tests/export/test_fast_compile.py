"""Decoding a fast-loaded LLM under torch.compile, as docs/export.md shows (the model's forward
compiled whole with inductor's C++ wrapper, transformers' static KV cache).

Oracle: the same model decoding eagerly (itself checked against mode="exact" in
test_export_fast.py and test_lowbit_kernels.py) and torch._dynamo's own account of the graph
(explain: graphs and breaks). The compiled graph computes the same float32 math with fused
elementwise kernels, so the logits agree within float32 rounding of the norms and softmax
(1e-4 of their scale here) and the greedy tokens are the same."""

import pathlib

import pytest
import torch

import qcompress
from qcompress.export.fast import float_linear, plans_of
from qcompress.quant import lowbit

transformers = pytest.importorskip("transformers", reason='transformers is not installed (pip install -e ".[hf]")')

pytestmark = [
    pytest.mark.skipif(not lowbit.available(), reason="the qcompress C++ extension is not built"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


SCHEDULES = pathlib.Path(__file__).resolve().parents[2] / "schedules"


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=160,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def fast_model(tmp_path, recipe):
    model = tiny_llama()
    cfg = qcompress.load_config(SCHEDULES / f"{recipe}.yaml")
    qcompress.init_compression(model, cfg)
    qcompress.redundancy_clean(model, cfg)
    qcompress.export_quantized(model, tmp_path / recipe, cfg, force=True)
    fast = qcompress.load_quantized(tmp_path / recipe, tiny_llama(), mode="fast")
    fast.generation_config.eos_token_id = None
    return fast


@pytest.mark.parametrize("recipe", ["w4a16_g128", "w8a8"])
def test_fast_decoder_compiles_whole(tmp_path, recipe):
    model = fast_model(tmp_path, recipe)
    assert set(plans_of(model).values()) == {"lowbit" if recipe == "w4a16_g128" else "lowbit_a8"}
    assert type(model.lm_head) is float_linear.FastFloatLinear
    ids = torch.randint(0, 160, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ex = torch._dynamo.explain(model)(input_ids=ids)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [b.reason for b in ex.break_reasons]


def test_compiled_static_cache_decode_equals_eager(tmp_path):
    model = fast_model(tmp_path, "w4a16_g128")
    ids = torch.randint(0, 160, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        eager = model.generate(ids, **kw)
        model.forward = torch.compile(model.forward, fullgraph=True, options={"cpp_wrapper": True})
        compiled = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * float(b.abs().max()))
