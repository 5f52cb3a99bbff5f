"""DeepSpeed's `compile` section: initialize compiles the model in place, and a compiled QAT run
trains to the eager run's weights. Oracle: the same run with compile off (aot_eager keeps every
bit), torch._dynamo's compiled-frame counter."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import qcompress
from qcompress.errors import ConfigError


class _MLP(nn.Module):
    # a forward of its own: torch.compile starts its one frame here (nn.Sequential's forward is
    # torch's code, which dynamo skips as a top frame, compiling each layer's forward instead)
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 8)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else nn.functional.gelu(layer(x))
        return x


def _mlp(seed=0):
    torch.manual_seed(seed)
    return _MLP()


def _doc(compile_section=None, start_bits=4, period=0):
    doc = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
                "different_groups": {
                    "w": {
                        "params": {
                            "start_bits": start_bits,
                            "target_bits": 4,
                            "quantization_period": period,
                            "period_growth": "linear",
                            "group_size": 16,
                        }
                    }
                },
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
                "different_groups": {"a": {"params": {"bits": 8}}},
            },
        },
    }
    if compile_section is not None:
        doc["compile"] = compile_section
    return doc


def _train(model, doc, steps):
    qcompress.init_compression(model, doc)
    engine = qcompress.initialize(model, doc)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
    return engine


def test_compiled_engine_trains_to_the_eager_weights():
    model = _mlp()
    twin = copy.deepcopy(model)
    eager = _train(model, _doc(), 4)
    torch._dynamo.reset()
    compiled = _train(twin, _doc({"enabled": True, "backend": "aot_eager", "kwargs": {"fullgraph": True}}), 4)
    assert not eager.compiled and compiled.compiled
    assert getattr(twin, "_compiled_call_impl", None) is not None  # Module.compile, in place
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), n


def test_engine_compile_reuses_graphs_across_steps_and_recompiles_per_bit_level():
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    model = _mlp()
    # 6 -> 4 bits, one bit every 3 steps: 3 bit levels over 9 steps
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._dynamo, "list_backends", lambda exclude_tags=(): ["aot_eager", "counter"])
        doc = _doc({"enabled": True, "backend": "counter"}, start_bits=6, period=3)
        qcompress.init_compression(model, doc)
        real_compile = nn.Module.compile
        mp.setattr(nn.Module, "compile", lambda self, backend, **kw: real_compile(self, backend=counter, **kw))
        engine = qcompress.initialize(model, doc)
    g = torch.Generator().manual_seed(1)
    bits = []
    for _ in range(9):
        bits.append(model.layers[0].qc_wq.bits)
        loss = engine(torch.randn(4, 32, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
    assert len(set(bits)) == 3, bits
    assert counter.frame_count == 3
    assert torch._dynamo.config.recompile_limit >= 64


def test_unknown_backend_is_a_config_error_naming_the_key():
    model = _mlp()
    with pytest.raises(ConfigError, match=r"compile\.backend.*'inductr'.*did you mean 'inductor'"):
        _train(model, _doc({"enabled": True, "backend": "inductr"}), 0)


@pytest.mark.parametrize(
    "section,path",
    [
        ({"kwargs": {"fulgraph": True}}, r"compile\.kwargs\.fulgraph"),
        ({"kwargs": {"mode": "fastest"}}, r"compile\.kwargs\.mode"),
        ({"deepcompile": True}, r"compile\.deepcompile"),
        ({"enabeld": True}, r"compile\.enabeld"),
    ],
)
def test_bad_compile_keys_are_config_errors(section, path):
    with pytest.raises(ConfigError, match=path):
        qcompress.load_config(_doc(section))


def test_compile_off_by_default():
    assert qcompress.load_config(_doc()).compile.enabled is False
    assert qcompress.load_config(_doc({})).compile.backend == "inductor"


def test_train_compile_option_switches_the_section_on(tmp_path):
    from qcompress.train.args import build_parser, options_from
    from qcompress.train.jobconfig import job_config
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**_doc(), "compile": {"backend": "aot_eager", "kwargs": {"fullgraph": True}}}))
    base = [str(cfg), "--model", "m", "--data", "d", "--task", "causal-lm", "--out", str(tmp_path / "o")]
    off = job_config(options_from(build_parser().parse_args(base)))
    on = job_config(options_from(build_parser().parse_args(base + ["--compile"])))
    assert qcompress.load_config(off).compile.enabled is False
    section = qcompress.load_config(on).compile
    assert section.enabled and section.backend == "aot_eager" and section.kwargs == {"fullgraph": True}


def test_stochastic_rounding_with_learned_ranges_warns_that_each_step_compiles_anew():
    doc = _doc({"enabled": True, "backend": "aot_eager"})
    doc["compression_training"]["weight_quantization"]["shared_parameters"]["rounding"] = "stochastic"
    plain = _mlp()
    qcompress.init_compression(plain, doc)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compiles a new graph", category=UserWarning)
        qcompress.initialize(plain, doc)  # min/max ranges: the step is a graph input, no warning
    doc["compression_training"]["weight_quantization"]["shared_parameters"]["range_learning"] = True
    model = _mlp()
    qcompress.init_compression(model, doc)
    with pytest.warns(UserWarning, match=r"3 modules \(layers\.0, layers\.1, layers\.2\) use stochastic rounding"):
        qcompress.initialize(model, doc)
