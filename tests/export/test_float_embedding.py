"""Float formats on the layers beside nn.Linear: an nn.Embedding table (groups along the hidden
dim, as a Linear's input dim) and transformers' Conv1D export in compressed-tensors' layouts and
reload exactly; convolutions are refused at init_compression by name. Oracles: the compressed
model's effective weights and its outputs, and compressed-tensors' own decompressors."""

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress.errors import ConfigError
from qcompress.export import export_quantized, load_quantized

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)"
)
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# weight params of each float format; the block case spans row blocks of the table
FORMATS = {
    "fp8_tensor": dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="tensor"),
    "fp8_channel": dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="channel"),
    "fp8_group": dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="group", group_size=32),
    "fp8_block": dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="block"),
    "nvfp4": dict(start_bits=4, target_bits=4, format="nvfp4"),
    "mxfp4": dict(start_bits=4, target_bits=4, format="mxfp4"),
    "mxfp8": dict(start_bits=8, target_bits=8, format="mxfp8"),
}
ROWS, DIM = 300, 288  # ragged 128 x 128 blocks in both dims; a multiple of 16 and 32


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def config(params):
    return qc.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                    "different_groups": {"g": {"params": dict(params)}},
                }
            }
        }
    )


def compress(model, params):
    cfg = config(params)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    return model.eval()


def embedding(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(ROWS, DIM)).to(dtype)


def ct_weight(out_dir, prefix):
    """compressed-tensors' decompressor applied to the module `prefix` of an export. The config
    poisons its groups for transformers (it quantizes Linear layers only), so the scheme is built
    from the manifest record's weight args, compressed-tensors' QuantizationArgs."""
    rec = json.loads((out_dir / "config.json").read_text())["qcompress"]["modules"][prefix]
    fmt = rec["format"]
    scheme = QuantizationScheme(targets=["Linear"], weights=rec["weights"], format=fmt)
    comp = BaseCompressor.get_value_from_registry(fmt)
    tensors = load_file(str(out_dir / "model.safetensors"))
    local = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    names = set(comp.compression_param_names(scheme))
    assert names <= set(local), (names, sorted(local))
    return comp.decompress({k: local[k] for k in names}, scheme)["weight"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_embedding_round_trip(tmp_path, name, dtype):
    model = compress(embedding(dtype), FORMATS[name])
    eff = model[0].effective_weight().detach()
    assert not torch.equal(eff, model[0].weight.detach())  # the format changed the table
    # rows from every 128-row block, the last (ragged) one included, in a 2-D batch
    ids = torch.tensor([[0, 1, 127, 128], [255, 256, 299, 5]])
    with torch.no_grad():
        want = model(ids)
    assert torch.equal(want, F.embedding(ids, eff))
    export_quantized(model, tmp_path / "out")
    dense = ct_weight(tmp_path / "out", "0")
    assert torch.equal(dense, eff.to(dense.dtype)), name  # its FP4 decompressors return bf16
    for mode in ("exact", "fast"):
        back = load_quantized(tmp_path / "out", embedding(dtype), mode=mode)
        assert torch.equal(back[0].weight, eff), (name, mode)
        with torch.no_grad():
            assert torch.equal(back(ids), want), (name, mode)
            every = torch.arange(ROWS)
            assert torch.equal(back(every), eff), (name, mode)


def gpt2_mlp(dtype):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    return nn.Sequential(Conv1D(160, 64), nn.GELU(), Conv1D(64, 160)).to(dtype)


@pytest.mark.parametrize("name", list(FORMATS))
def test_hf_conv1d_round_trip(tmp_path, name):
    """transformers' Conv1D stores W [in, out]; export writes W^T [out, in] as a Linear's."""
    pytest.importorskip("transformers", reason="transformers' Conv1D is the layer under test")
    dtype = torch.bfloat16
    model = compress(gpt2_mlp(dtype), FORMATS[name])
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = model(x)
    export_quantized(model, tmp_path / "out")
    for i in (0, 2):
        eff = model[i].effective_weight().detach()
        assert torch.equal(ct_weight(tmp_path / "out", str(i)), eff.t()), (name, i)
    for mode in ("exact", "fast"):
        back = load_quantized(tmp_path / "out", gpt2_mlp(dtype), mode=mode)
        for i in (0, 2):
            assert torch.equal(back[i].weight, model[i].effective_weight().detach()), (name, mode, i)
        with torch.no_grad():
            assert torch.equal(back(x), want), (name, mode)


@pytest.mark.parametrize(
    "conv",
    [lambda: nn.Conv2d(32, 48, 3), lambda: nn.Conv1d(4, 48, 32), lambda: nn.Conv2d(64, 48, 1)],
    ids=["conv2d", "conv1d_k32", "conv2d_1x1"],
)
@pytest.mark.parametrize("name", list(FORMATS))
def test_conv_is_refused_at_init(tmp_path, name, conv):
    """compressed-tensors defines no float layout for a conv kernel: refused before anything trains."""
    model = nn.Sequential(nn.Linear(64, 64), conv())
    before = model[1].weight.detach().clone()
    with pytest.raises(ConfigError) as err:
        qc.init_compression(model, config(FORMATS[name]))
    msg = str(err.value)
    assert "compression_training.weight_quantization.different_groups.g.modules" in msg
    assert "module '1'" in msg and "conv" in msg
    assert torch.equal(model[1].weight, before)
