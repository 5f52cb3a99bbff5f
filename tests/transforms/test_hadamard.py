"""Hadamard blocks and block-diagonal rotations, against compressed-tensors' constructions and an
explicit block-diagonal matrix."""

import pytest
import torch

from qcompress.transforms.hadamard import (
    block_for,
    largest_power_of_two_block,
    rotate_dim,
    sylvester,
    unnormalized_block,
)


@pytest.mark.parametrize("b", [1, 2, 4, 8, 64, 128])
def test_sylvester_equals_compressed_tensors_deterministic_hadamard(b):
    ct = pytest.importorskip(
        "compressed_tensors.transform.utils.hadamard", reason="compressed-tensors is not installed"
    )
    assert torch.equal(sylvester(b), ct.deterministic_hadamard_matrix(b, torch.float64))


def test_blocks_are_orthogonal_after_normalising():
    g = torch.Generator().manual_seed(0)
    for kind in ("hadamard", "random-hadamard"):
        h = unnormalized_block(32, kind, g)
        assert set(h.unique().tolist()) == {-1.0, 1.0}
        q = h / 32**0.5
        assert torch.allclose(q @ q.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    r1 = unnormalized_block(16, "random-hadamard", torch.Generator().manual_seed(1))
    r2 = unnormalized_block(16, "random-hadamard", torch.Generator().manual_seed(2))
    assert not torch.equal(r1, r2) and not torch.equal(r1, sylvester(16))


def test_largest_power_of_two_block_and_forced_blocks():
    assert largest_power_of_two_block(576) == 64 and largest_power_of_two_block(1536) == 512
    assert largest_power_of_two_block(48) == 16 and largest_power_of_two_block(7) == 1
    assert block_for(576, None) == 64 and block_for(576, 32) == 32 and block_for(576, 128) is None


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_rotate_dim_is_the_block_diagonal_product(dim):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(12, 12, dtype=torch.float64, generator=g)
    block = torch.randn(4, 4, dtype=torch.float64, generator=g)
    m = torch.block_diag(block, block, block)
    scale = torch.rand(12, dtype=torch.float64, generator=g)
    want = (t * scale) @ m if dim in (1, -1) else m.T @ (scale[:, None] * t)
    assert torch.allclose(rotate_dim(t, dim, block, scale), want, atol=1e-12)


def test_rotate_dim_of_a_3d_tensor_acts_on_each_slice():
    g = torch.Generator().manual_seed(4)
    t = torch.randn(3, 8, 6, dtype=torch.float64, generator=g)
    block = torch.randn(8, 8, dtype=torch.float64, generator=g)
    out = rotate_dim(t, 1, block)
    for e in range(3):
        assert torch.allclose(out[e], block.T @ t[e], atol=1e-12)
