"""Schema of `compression_training.rotation`: Hadamard rotations of a decoder (QuaRot / SpinQuant).

R1 rotates the residual stream and R2 each attention head's values; both are fused into the
weights (the model computes the same function). R4 rotates the input of each MLP's down
projection online, in the forward, and is exported as compressed-tensors' `transform_config`.
The rewrite lives in qcompress/transforms/; docs/gptq-and-rotations.md says when to use which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError
from .schema import did_you_mean, field, join

ROTATIONS = ("R1", "R2", "R4")
TYPES = ("hadamard", "random-hadamard")


def _parse_rotations(value, path):
    """A list of rotation names (R1, R2, R4; any case), each at most once, in the canonical order."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(path, f"expected a non-empty list of {list(ROTATIONS)}, got {value!r}")
    seen = []
    for i, name in enumerate(value):
        key = name.upper() if isinstance(name, str) else name
        if key not in ROTATIONS:
            hint = did_you_mean(key, ROTATIONS) if isinstance(key, str) else ""
            raise ConfigError(
                join(path, i),
                f"{name!r} is not a rotation; choose from {list(ROTATIONS)}{hint} "
                "(R3, the online query / key rotation, is not offered)",
            )
        if key in seen:
            raise ConfigError(join(path, i), f"{name!r} is listed twice")
        seen.append(key)
    return tuple(r for r in ROTATIONS if r in seen)


@dataclass(frozen=True)
class Rotation:
    """ext: rotations applied by init_compression before its module rewrite (qcompress.transforms)."""

    enabled: bool = field(False)
    rotations: Tuple[str, ...] = field(
        ("R1", "R2"),
        parse=_parse_rotations,
        doc="R1 (residual stream, fused), R2 (per head values / outputs, fused), R4 (down_proj input, online)",
    )
    type: str = field(
        "hadamard",
        choices=TYPES,
        lower=True,
        doc="Sylvester Hadamard blocks; random-hadamard: with random signs drawn from `seed`",
    )
    block_size: Optional[int] = field(
        None, ge=2, doc="Hadamard block; default: the largest power of two dividing each rotated width (576 -> 64)"
    )
    learned: bool = field(
        False, doc="train the rotations with the model (Cayley parametrization), fused / exported at the end"
    )
    seed: int = field(0, ge=0, doc="random signs of random-hadamard")

    def _validate(self, path):
        b = self.block_size
        if b is not None and b & (b - 1):
            raise ConfigError(
                join(path, "block_size"),
                f"{b} is not a power of two; Sylvester Hadamard blocks have 2^k rows (e.g. 64 or 128)",
            )


def check_with(cc, path: str) -> None:
    """What the rotations need from the rest of `compression_training` (cc)."""
    rot = cc.rotation
    if not rot.enabled:
        return
    where = join(path, "rotation")
    wq = cc.weight_quantization
    if rot.learned and wq.enabled and not wq.shared.quantize_weight_in_forward:
        raise ConfigError(
            join(where, "learned"),
            "learned rotations change the weights the quantizer sees "
            "at every forward; set weight_quantization.shared_parameters."
            "quantize_weight_in_forward: true (the optimizer-step mode quantizes the stored "
            "weight once per step)",
        )
    kd = cc.distillation
    if "R1" in rot.rotations and kd.enabled and kd.hidden_mse > 0:
        raise ConfigError(
            join(where, "rotations"),
            "R1 rotates the residual stream, so the student's hidden "
            "states no longer line up with the teacher's for distillation.hidden_mse; drop R1 "
            "or set hidden_mse: 0 (the logits' KL term is unaffected)",
        )
