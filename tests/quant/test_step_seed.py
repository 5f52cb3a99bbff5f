"""The stochastic-rounding seed with the step as a tensor: the same bits as the int path, and a
compiled graph that takes the step as an input compiles once for every step."""

import pytest
import torch

from qcompress.quant import rng

_M32 = 0xFFFFFFFF


def _hash32(x: int) -> int:
    """lowbias32 in Python ints (independent of rng's int64 tensor arithmetic)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix(seed: int, step: int) -> int:
    return _hash32((seed & _M32) ^ ((step * 0x9E3779B1) & _M32))


STEPS = [0, 1, 2, 7, 63, 64, 1000, 123456, 2**31 - 1, 2**32 + 5]


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1, 2**40 + 3])
def test_mix_seed_tensor_equals_int_path_and_oracle(seed):
    steps = torch.tensor(STEPS, dtype=torch.int64)
    got = rng.mix_seed_tensor(seed, steps).tolist()
    assert got == [_mix(seed, t) for t in STEPS]
    assert got == [rng.mix_seed(seed, t) for t in STEPS]
    assert int(rng.mix_seed_tensor(seed, torch.tensor(STEPS[4]))) == _mix(seed, STEPS[4])  # 0-d


def test_uniform_takes_a_tensor_seed():
    for step in (0, 5, 99):
        s = rng.mix_seed(7, step)
        want = rng.uniform(s, 300)
        got = rng.uniform(rng.mix_seed_tensor(7, torch.tensor(step)), 300)
        assert torch.equal(got, want)


def test_compiled_step_seed_compiles_once():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    def noise(step):
        return rng.uniform(rng.mix_seed_tensor(11, step), 64)

    compiled = torch.compile(noise, backend=counter, fullgraph=True)
    step = torch.zeros((), dtype=torch.int64)
    for t in range(12):
        step.fill_(t)
        assert torch.equal(compiled(step), rng.uniform(rng.mix_seed(11, t), 64)), t
    assert counter.frame_count == 1


def _llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def _stochastic_recipe(abits):
    import qcompress as qc

    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": 0,
                    "quantize_weight_in_forward": True,
                    "rounding": "stochastic",
                    "seed": 5,
                },
                "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 32}}},
            }
        }
    }
    if abits:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": abits}}},
        }
    return qc.load_config(doc)


def _loss(model, x):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def _steps(model, cfg, fn, n):
    """(loss, grads) of n scheduler steps on one batch, no weight update: only the step, hence the
    rounding noise, changes from step to step."""
    import qcompress as qc

    sched = qc.CompressionScheduler(model, cfg)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(n):
        loss = fn(model, x)
        loss.backward()
        out.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
        sched.step()
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("abits", [0, 8])
def test_stochastic_qat_compiles_once_and_equals_eager(abits):
    import copy

    import qcompress as qc
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _llama()
    cfg = _stochastic_recipe(abits)
    qc.init_compression(model, cfg)
    model.train()
    twin = copy.deepcopy(model)
    eager = _steps(model, cfg, _loss, 6)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _steps(twin, cfg, torch.compile(_loss, backend=counter, fullgraph=True), 6)
    assert counter.frame_count == 1
    assert not torch.equal(
        eager[0][1]["model.layers.0.mlp.down_proj.weight"], eager[1][1]["model.layers.0.mlp.down_proj.weight"]
    )  # the step reached the noise
    for t, ((le, ge), (lc, gc)) in enumerate(zip(eager, compiled)):
        assert torch.equal(le, lc), t
        assert ge.keys() == gc.keys()
        for k in ge:
            assert torch.equal(ge[k], gc[k]), (t, k)
