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
