"""`qcompress train` and DeepSpeed's seed / activation_checkpointing: the config's seed orders the
data unless --seed is given; --gradient-checkpointing adds the section; neither flag changes what
a resumed run must share except the seed itself."""

import json

import pytest

from qcompress.train.args import build_parser, options_from
from qcompress.train.job import job_config
from qcompress.train.batches import step_indices

RECIPE = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"w8": {"params": {"start_bits": 8, "target_bits": 8}}},
        }
    }
}


def _opts(tmp_path, doc, *flags):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    ns = build_parser().parse_args(
        [
            str(path),
            "--model",
            "m",
            "--data",
            "d",
            "--out",
            str(tmp_path / "o"),
            "--task",
            "text-classification",
            *flags,
        ]
    )
    return options_from(ns)


@pytest.mark.parametrize("flags,config_seed,want", [((), 17, 17), (("--seed", "3"), 17, 3), ((), None, 0)])
def test_the_config_seed_orders_the_data_unless_seed_is_given(tmp_path, flags, config_seed, want):
    doc = dict(RECIPE, **({"seed": config_seed} if config_seed is not None else {}))
    opts = _opts(tmp_path, doc, *flags)
    job_config(opts)
    assert opts.seed == want
    # the data order the loop draws follows that seed (oracle: the sampler called with it directly)
    assert step_indices(100, 8, opts.seed, 0) == step_indices(100, 8, want, 0)
    if want != 0:
        assert step_indices(100, 8, opts.seed, 0) != step_indices(100, 8, 0, 0)


def test_gradient_checkpointing_adds_the_section_and_keeps_the_fingerprint(tmp_path):
    plain = _opts(tmp_path, RECIPE)
    ckpt = _opts(tmp_path, RECIPE, "--gradient-checkpointing")
    assert "activation_checkpointing" not in job_config(plain)
    assert job_config(ckpt)["activation_checkpointing"] == {}
    assert plain.fingerprint("x") == ckpt.fingerprint("x")
    # a section the config gives is kept as it is
    given = _opts(
        tmp_path, dict(RECIPE, activation_checkpointing={"number_checkpoints": 1}), "--gradient-checkpointing"
    )
    assert job_config(given)["activation_checkpointing"] == {"number_checkpoints": 1}
