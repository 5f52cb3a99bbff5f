"""Compression keeps each module's own forward: real-world Linear / Conv / Embedding
subclasses, written here, compressed, trained a step, exported and reloaded.

The oracle is the uncompressed model class itself: a fresh instance with the same state_dict, its
weights replaced by qcompress.quant.fake_quantize (reference backend) and its compressed modules'
inputs fake-quantized by forward pre-hooks. The module's own forward (padding, standardization,
scaling, adapters) then runs exactly as the compressed model must run it.
"""

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress import ConfigError, init_compression
from qcompress.nn.layers import _ComposedForward, _ConvForward, _LinearForward, own_forward
from qcompress.quant import fake_quantize


# --- real-world module patterns ----------------------------------------------------------------


def same_pads(size, k, stride, dilation):
    """TensorFlow "SAME": output ceil(size / stride); the odd pixel of padding goes after."""
    total = max((math.ceil(size / stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class Conv2dSameDynamic(nn.Conv2d):
    """timm's Conv2dSame: padding computed from each input's size, then F.conv2d."""

    def forward(self, x):
        ph = same_pads(x.shape[-2], self.weight.shape[-2], self.stride[0], self.dilation[0])
        pw = same_pads(x.shape[-1], self.weight.shape[-1], self.stride[1], self.dilation[1])
        x = F.pad(x, [pw[0], pw[1], ph[0], ph[1]])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Conv2dSameStatic(nn.Conv2d):
    """EfficientNet-PyTorch's Conv2dStaticSamePadding: the image size is known when building."""

    def __init__(self, cin, cout, k, stride=1, image_size=16, **kw):
        super().__init__(cin, cout, k, stride, padding=0, **kw)
        ph = same_pads(image_size, k, stride, self.dilation[0])
        pw = same_pads(image_size, k, stride, self.dilation[1])
        self.static_padding = nn.ZeroPad2d((pw[0], pw[1], ph[0], ph[1]))

    def forward(self, x):
        return super().forward(self.static_padding(x))


class WSConv2d(nn.Conv2d):
    """Weight-standardized convolution (BiT, NFNet): zero mean, unit variance per output channel."""

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return self._conv_forward(x, (w - mean) / torch.sqrt(var + 1e-5), self.bias)


class EqualizedLinear(nn.Linear):
    """StyleGAN's equalized learning rate: the stored weight is scaled at run time."""

    def __init__(self, cin, cout, lr_mul=0.5):
        super().__init__(cin, cout)
        nn.init.normal_(self.weight, std=1.0 / lr_mul)
        self.scale = lr_mul / math.sqrt(cin)
        self.lr_mul = lr_mul

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias * self.lr_mul)


class ScaledLinear(nn.Linear):
    """A learnable per-output scale: F.linear(x, self.weight * self.scale)."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, cout).unsqueeze(1))

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


class LoRALinear(nn.Linear):
    """A frozen-style base Linear plus a low-rank adapter (peft's pattern)."""

    def __init__(self, cin, cout, r=4):
        super().__init__(cin, cout)
        self.lora_A = nn.Parameter(torch.randn(r, cin) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(cout, r) * 0.1)

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * 0.5


class QKVLinear(nn.Linear):
    """A fused attention projection whose forward returns the three heads' inputs."""

    def forward(self, x):
        return super().forward(x).chunk(3, dim=-1)


class ScaledEmbedding(nn.Embedding):
    """T5/Gemma-style embedding multiplied by sqrt(dim)."""

    def forward(self, ids):
        return super().forward(ids) * math.sqrt(self.embedding_dim)


class DepthwiseSeparable(nn.Module):
    """MobileNet / EfficientNet block: depthwise conv, BN, pointwise conv, BN, residual."""

    def __init__(self, c, dw):
        super().__init__()
        self.dw = dw
        self.bn1 = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, c, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.pw(F.relu6(self.bn1(self.dw(x)))))


class TFStyleCNN(nn.Module):
    """A TF-ported CNN: static-SAME stem with stride 2, weight-standardized conv, residual
    depthwise-separable blocks with dynamic-SAME (stride 1, 5x5) and plain depthwise convs."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = Conv2dSameStatic(3, c, 3, stride=2, image_size=16)
        self.ws = WSConv2d(c, c, 3, padding=1)
        self.block1 = DepthwiseSeparable(c, Conv2dSameDynamic(c, c, 5, groups=c, bias=False))
        self.block2 = DepthwiseSeparable(c, nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False))
        self.reduce = Conv2dSameDynamic(c, c, 3, stride=2)
        self.head = EqualizedLinear(c, 5)

    def forward(self, x):
        x = F.relu(self.ws(F.relu(self.stem(x))))
        x = self.block2(self.block1(x))
        x = F.relu(self.reduce(x))
        return self.head(x.mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = QKVLinear(d, 3 * d)
        self.out = LoRALinear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, d))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=2):
        super().__init__()
        self.emb = ScaledEmbedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(d),
                        "attn": Attention(d, heads),
                        "ln2": nn.LayerNorm(d),
                        "fc1": ScaledLinear(d, 2 * d),
                        "fc2": nn.Linear(2 * d, d),
                    }
                )
            )
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) * 0.1
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x))))
        return self.lm_head(x)


def make_model(name, seed=0):
    torch.manual_seed(seed)
    model = TFStyleCNN() if name == "cnn" else TinyTransformer()
    if name == "cnn":  # non-trivial BatchNorm statistics, so eval mode does not hide errors
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.2, 0.2)
                    m.running_var.uniform_(0.5, 1.5)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def make_input(name, seed=1):
    g = torch.Generator().manual_seed(seed)
    if name == "cnn":
        return torch.randn(2, 3, 16, 16, generator=g)
    return torch.randint(0, 40, (2, 7), generator=g)


MODELS = ["cnn", "transformer"]
SUBCLASSED = {
    "cnn": ["stem", "ws", "block1.dw", "reduce", "head"],
    "transformer": ["emb"] + [f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.out", "fc1")],
}


# --- configs and the oracle --------------------------------------------------------------------


def wq_cfg(conv_bits, linear_bits, act_bits=None, in_forward=True):
    groups = {
        "convs": {
            "params": {"start_bits": conv_bits, "target_bits": conv_bits, "granularity": "channel"},
            "modules": [r"stem|ws|dw|pw|reduce"],
        },
        "linears": {
            "params": {"start_bits": linear_bits, "target_bits": linear_bits, "group_size": 8},
            "modules": [r"head|qkv|out|fc"],
        },
        "emb": {"params": {"start_bits": linear_bits, "target_bits": linear_bits}, "modules": [r"^emb$"]},
    }
    ct = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": in_forward},
            "different_groups": groups,
        }
    }
    if act_bits:
        ct["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": act_bits}}},
        }
    return {"compression_training": ct}


W8 = {
    "compression_training": {
        "weight_quantization": {  # every compressible module, 8 bits
            "shared_parameters": {"enabled": True},
            "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}}},
        }
    }
}


def compress(model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # groups matching nothing in one of the two models
        return init_compression(model, cfg)


def compressed_modules(model):
    return {n: m for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}


def oracle_of(name, model, quantize_weights=True):
    """The uncompressed class, same state_dict, weights and inputs fake-quantized by hand."""
    ref = make_model(name, seed=123)
    ref.load_state_dict(model.state_dict())
    mods = dict(ref.named_modules())
    for n, m in model.named_modules():
        wq, aq = getattr(m, "qc_wq", None), getattr(m, "qc_aq", None)
        r = mods[n]
        if wq is not None and wq.active and quantize_weights:
            kw = dict(granularity=wq.granularity, group_size=wq.group_size)
            with torch.no_grad():
                r.weight.copy_(fake_quantize(r.weight, wq.bits, backend="reference", **kw))
        if aq is not None and aq.active:
            gran = "channel" if aq.per == "sample" else "token"
            r.register_forward_pre_hook(
                lambda mod, args, b=aq.bits, g=gran: (
                    (fake_quantize(args[0], b, granularity=g, backend="reference"),) + args[1:]
                )
            )
    return ref.eval()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


# --- the mechanism -----------------------------------------------------------------------------


def test_fast_path_for_library_forwards_composed_for_own_forwards():
    class Tagged(nn.Linear):  # inherits forward: may use the fast path
        def extra_repr(self):
            return "tagged " + super().extra_repr()

    class OwnConvForward(nn.Conv2d):  # overrides only _conv_forward: composed
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, w * 2.0, b)

    model = nn.ModuleDict(
        {
            "lin": nn.Linear(4, 4),
            "conv": nn.Conv2d(2, 2, 3),
            "tag": Tagged(4, 4),
            "eq": EqualizedLinear(4, 4),
            "same": Conv2dSameDynamic(2, 2, 3),
            "own": OwnConvForward(2, 2, 3),
            "conv3": nn.Conv3d(2, 2, 3),
        }
    )
    assert [own_forward(type(m)) for m in model.values()] == [
        None,
        None,
        None,
        "forward",
        "forward",
        "_conv_forward",
        None,
    ]
    model = init_compression(model, W8)
    fast = {k: isinstance(m, (_LinearForward, _ConvForward)) for k, m in model.items()}
    composed = {k: isinstance(m, _ComposedForward) for k, m in model.items()}
    assert fast == {"lin": True, "conv": True, "tag": True, "eq": False, "same": False, "own": False, "conv3": True}
    assert composed == {k: not v for k, v in fast.items()}
    # the overridden _conv_forward sees the quantized weight (doubled), as written
    own = model["own"]
    x = torch.randn(1, 2, 5, 5)
    want = F.conv2d(x, fake_quantize(own.weight.detach(), 8, backend="reference") * 2.0, own.bias)
    assert torch.equal(own(x).detach(), want)


@pytest.mark.parametrize("name", MODELS)
def test_16bit_weights_match_the_original_model(name):
    model = make_model(name)
    orig = copy.deepcopy(model)
    x = make_input(name)
    compress(model, wq_cfg(16, 16))
    mods = compressed_modules(model)
    composed = [n for n, m in mods.items() if isinstance(m, _ComposedForward)]
    assert composed == SUBCLASSED[name]  # the subclasses were compressed
    for m in mods.values():  # and their weights do change
        assert not torch.equal(m.effective_weight(), m.weight)
    with torch.no_grad():
        got, want = model(x), orig(x)
    assert got.shape == want.shape
    assert rel_err(got, want) < 2e-4, rel_err(got, want)
    # at 4 bits the same comparison is far off: the 16-bit agreement is not vacuous
    low = compress(copy.deepcopy(orig), wq_cfg(4, 4))
    with torch.no_grad():
        assert rel_err(low(x), want) > 1e-2


def _train_step(model, name, x):
    sched = qc.CompressionScheduler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    out = model(x)
    loss = out.square().mean()
    loss.backward()
    for n, m in compressed_modules(model).items():
        g = m.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, n
    opt.step()
    opt.zero_grad()
    sched.step()
    model.eval()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("in_forward", [True, False], ids=["in_forward", "optimizer_step"])
def test_compressed_train_export_reload(name, in_forward, tmp_path):
    model = make_model(name)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    x = make_input(name)
    compress(model, wq_cfg(8, 4, act_bits=8, in_forward=in_forward))
    _train_step(model, name, x)
    assert {n: p for n, p in model.named_parameters()} == params and list(model.state_dict()) == keys
    assert all(type(p) is nn.Parameter for p in model.parameters())

    with torch.no_grad():
        got = model(x)
    # optimizer-step mode holds the quantized weight in the Parameter itself
    oracle = oracle_of(name, model, quantize_weights=in_forward)
    with torch.no_grad():
        assert torch.equal(got, oracle(x))
    if not in_forward:
        for m in compressed_modules(model).values():
            q, s, z, spec = m.quantized_weight()
            gs = spec.group_size if spec.granularity == "group" else None
            assert torch.equal(qc.quant.dequantize(q, s, z, group_size=gs).reshape(m.weight.shape), m.weight.detach())

    out_dir = tmp_path / "export"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # conv / embedding records: qcompress-only
        qc.export_quantized(model, out_dir)
    for mode in ("exact", "fast"):
        loaded = qc.load_quantized(out_dir, make_model(name, seed=99), mode=mode)
        with torch.no_grad():
            if mode == "exact":
                assert torch.equal(loaded(x), got), mode
            else:  # fused low-bit kernels sum in another order (bound: README, Export, fast mode)
                torch.testing.assert_close(loaded(x), got, rtol=1e-4, atol=1e-5)


# --- conv variants -----------------------------------------------------------------------------

CONVS = {
    "conv1d_grouped_dilated_reflect": (
        lambda: nn.Conv1d(4, 6, 3, dilation=2, padding=2, groups=2, padding_mode="reflect"),
        (2, 4, 11),
    ),
    "conv2d_depthwise_circular": (
        lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode="circular"),
        (2, 4, 7, 7),
    ),
    "conv2d_same_dilated_replicate": (
        lambda: nn.Conv2d(4, 6, 3, padding="same", dilation=2, padding_mode="replicate"),
        (2, 4, 9, 8),
    ),
    "conv3d_grouped_strided": (lambda: nn.Conv3d(4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 5, 6, 5)),
    "conv2d_same_dynamic_depthwise_dilated": (
        lambda: Conv2dSameDynamic(4, 8, 3, stride=2, dilation=2, groups=4),
        (2, 4, 9, 10),
    ),
}


@pytest.mark.parametrize("case", CONVS)
def test_conv_variants_quantize_export_and_reload(case, tmp_path):
    build, shape = CONVS[case]
    torch.manual_seed(0)
    model = nn.Sequential(build())
    ref = copy.deepcopy(model)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "channel"}}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"a": {"params": {"bits": 8}}},
            },
        }
    }
    init_compression(model, cfg)
    with torch.no_grad():
        ref[0].weight.copy_(fake_quantize(ref[0].weight, 4, granularity="channel", backend="reference"))
        want = ref(fake_quantize(x, 8, granularity="channel", backend="reference"))
        got = model(x)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qc.export_quantized(model, tmp_path / "q")
    loaded = qc.load_quantized(tmp_path / "q", nn.Sequential(build()))
    with torch.no_grad():
        assert torch.equal(loaded(x), got)


def test_conv_transpose_is_refused_by_name_or_skipped_with_warning():
    def net():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 3, 2, stride=2))

    wq = {
        "shared_parameters": {"enabled": True},
        "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": [r"\d"]}},
    }
    with pytest.raises(ConfigError, match=r"different_groups\.g\.modules\[0\].*'1'.*ConvTranspose2d.*transposed"):
        init_compression(net(), {"compression_training": {"weight_quantization": wq}})
    del wq["different_groups"]["g"]["modules"]
    model = net()
    with pytest.warns(UserWarning, match=r"skipping 1 module.*'1' \(ConvTranspose2d"):
        init_compression(model, {"compression_training": {"weight_quantization": wq}})
    assert type(model[1]) is nn.ConvTranspose2d and model[0].qc_wq is not None


def test_parametrized_and_computed_weights_are_refused():
    from torch.nn.utils import parametrizations

    wq = {
        "shared_parameters": {"enabled": True},
        "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["proj"]}},
    }
    model = nn.ModuleDict({"proj": parametrizations.weight_norm(nn.Linear(4, 4))})
    with pytest.raises(ConfigError, match=r"'proj'.*ParametrizedLinear.*parametrize"):
        init_compression(model, {"compression_training": {"weight_quantization": wq}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = nn.ModuleDict({"proj": torch.nn.utils.weight_norm(nn.Linear(4, 4))})
    with pytest.raises(ConfigError, match=r"'proj'.*Linear.*not a registered Parameter"):
        init_compression(model, {"compression_training": {"weight_quantization": wq}})


def test_grouped_conv_channel_pruning_is_refused_naming_the_module():
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8))

    cp = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
        "different_groups": {"c": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^1$"]]}},
    }
    with pytest.raises(ConfigError, match=r"channel_pruning.*related_modules.*'1'.*grouped.*groups=8"):
        init_compression(net(), {"compression_training": {"channel_pruning": cp}})
    cp["different_groups"]["c"].pop("related_modules")
    cp["different_groups"]["c"]["modules"] = ["^1$"]  # the depthwise conv itself (pruning/setup.py)
    with pytest.raises(ConfigError, match=r"channel_pruning.*modules.*'1'.*grouped.*groups=8"):
        init_compression(net(), {"compression_training": {"channel_pruning": cp}})
    cp["different_groups"]["c"]["modules"] = ["^0$"]  # masks on the dense conv feeding it work
    model = init_compression(net(), {"compression_training": {"channel_pruning": cp}})
    dead = model[0](torch.randn(2, 3, 5, 5)).detach().abs().sum((0, 2, 3)) == 0
    assert int(dead.sum()) == 4


# --- what the mechanism cannot see is reported -------------------------------------------------


class PretransposedLinear(nn.Linear):
    """An inference-optimized port that reads a pre-transposed copy, never self.weight."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout)
        self.register_buffer("weight_t", self.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x):
        return x @ self.weight_t + self.bias


def test_forward_that_never_reads_the_weight_warns_naming_the_class():
    model = nn.Sequential(PretransposedLinear(4, 3), PretransposedLinear(3, 3))
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4}}},
            }
        }
    }
    init_compression(model, cfg)
    with pytest.warns(UserWarning, match=r"^0: .*PretransposedLinear\.forward ran without reading self\.weight"):
        model(torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        model(torch.randn(2, 4))
    # a forward that does read it stays silent
    eq = init_compression(nn.Sequential(EqualizedLinear(4, 3)), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eq(torch.randn(2, 4))


def test_exception_in_own_forward_puts_the_parameters_back():
    class Picky(nn.Linear):
        def forward(self, x):
            if x.shape[0] == 0:
                raise ValueError("empty batch")
            return super().forward(x)

    model = nn.Sequential(Picky(4, 4))
    w, b = model[0].weight, model[0].bias
    init_compression(model, W8)
    with pytest.raises(ValueError, match="empty batch"):
        model(torch.randn(0, 4))
    assert model[0]._parameters["weight"] is w and model[0]._parameters["bias"] is b


def test_input_passed_by_keyword_is_quantized():
    class Kw(nn.Linear):
        def forward(self, inputs, shift=0.0):
            return super().forward(inputs) + shift

    model = nn.Sequential(Kw(4, 3))
    cfg = {
        "compression_training": {
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"a": {"params": {"bits": 4}}},
            }
        }
    }
    init_compression(model, cfg)
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = (
            F.linear(fake_quantize(x, 4, granularity="token", backend="reference"), model[0].weight, model[0].bias)
            + 1.0
        )
        assert torch.equal(model[0](inputs=x, shift=1.0), want)
        assert torch.equal(model[0](x, shift=1.0), want)


# --- what already held still holds -------------------------------------------------------------


def test_pickle_dtype_and_device_moves_keep_the_own_forward():
    model = make_model("cnn")
    x = make_input("cnn")
    compress(model, wq_cfg(8, 8, act_bits=8))
    with torch.no_grad():
        want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    from qcompress.nn.layers import _new_compress_aware
    from qcompress.nn.state import MasterState, WeightQuant, ActQuant
    from qcompress.quant.static_range import StaticRange
    from qcompress.quant.reference import Spec

    allowed = [_new_compress_aware, WeightQuant, MasterState, ActQuant, StaticRange, Spec]
    from qcompress.nn.layers import base_class

    classes = {
        c
        for m in model.modules()
        for c in (type(m), base_class(type(m)) if isinstance(m, qc.nn.CompressMixin) else type(m))
    }
    with torch.serialization.safe_globals(allowed + sorted(classes, key=str)):
        back = torch.load(buf, weights_only=True)
    assert type(back.stem) is type(model.stem) and isinstance(back.stem, _ComposedForward)
    with torch.no_grad():
        assert torch.equal(back(x), want)
    model.double()
    assert model.stem.weight.dtype == torch.float64
    with torch.no_grad():
        got = model(x.double())
        assert got.dtype == torch.float64
        assert torch.equal(got, oracle_of("cnn", model).double()(x.double()))


def test_torch_compile_runs_the_own_forward():
    torch.manual_seed(0)
    model = nn.Sequential(
        Conv2dSameDynamic(3, 4, 3, stride=2), nn.ReLU(), WSConv2d(4, 4, 3, padding=1), nn.Flatten(), ScaledLinear(64, 3)
    )
    x = make_input("cnn")[:, :, :8, :8]
    cfg = copy.deepcopy(W8)
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_weight_in_forward"] = True
    cfg["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {"a": {"params": {"bits": 8}}},
    }
    init_compression(model, cfg)
    assert all(isinstance(model[i], _ComposedForward) for i in (0, 2, 4))
    eager = model(x)
    eager.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    assert torch.equal(out, eager)
    out.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_non_linear_module_with_a_weight_is_left_alone_and_reported():
    class RawProj(nn.Module):  # not a Linear subclass: nothing to attach to
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.scale = 0.5

        def forward(self, x):
            return F.linear(x, self.weight * self.scale)

    model = nn.ModuleDict({"raw": RawProj()})
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["raw"]}},
            }
        }
    }
    with pytest.warns(UserWarning, match="matches no compressible module"):
        init_compression(model, cfg)
    assert type(model["raw"]) is RawProj


# --- FSDP2 (ZeRO stage 3) --------------------------------------------------------------------------


def fsdp_worker(rank, world, names):
    """Every rank trains on the same batch, so FSDP2's averaged gradient is the one-process gradient:
    stage 3 must give the losses and weights of a plain loop over the same compressed model
    (run_ranks(fsdp_worker, 2, MODELS) checks the same on two ranks)."""
    from qcompress.engine import initialize

    out = {}
    for name in names:
        x = make_input(name)
        ct = wq_cfg(8, 4, act_bits=8, in_forward=True)["compression_training"]
        cfg = {
            "train_batch_size": 2 * world,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "zero_optimization": {"stage": 3},
            "compression_training": ct,
        }
        ref = compress(make_model(name).train(), {"compression_training": ct})
        sched = qc.CompressionScheduler(ref)
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        engine = initialize(compress(make_model(name).train(), {"compression_training": ct}), cfg)
        losses, ref_losses = [], []
        for _ in range(2):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            ref_loss = ref(x).square().mean()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            ref_losses.append(ref_loss.item())
        params = dict(engine.module.named_parameters())
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in params.items()}
        want = {n: p.detach() for n, p in ref.named_parameters()}
        out[name] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "sharded": all(hasattr(p, "full_tensor") for p in params.values()),
            "max_diff": max(float((full[n] - want[n]).abs().max()) for n in want),
            "names": sorted(full) == sorted(want),
        }
    return out


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_stage3_runs_the_own_forward():
    """One rank in this process (spawning ranks costs ~15 s here): FSDP2 still shards every
    parameter into a DTensor and swaps the unsharded ones in and out around each forward."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        res = fsdp_worker(0, 1, MODELS)
    finally:
        dist.destroy_process_group()
    for name in MODELS:
        r = res[name]
        assert r["sharded"] and r["names"], name
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6), (name, r)
        assert r["max_diff"] < 1e-6, (name, r)
