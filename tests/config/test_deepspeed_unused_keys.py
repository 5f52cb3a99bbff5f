"""Every DeepSpeed key qcompress has no use for warns, naming the key and what happens instead;
the keys it implements parse without a warning. Oracle: the key lists of DeepSpeed's config
documentation (/work/shared/reference), written out here."""

import warnings

import pytest

from qcompress.config import load_config
from qcompress.config.deepspeed_keys import ACTIVATION_CHECKPOINTING, OFFLOAD, TOP_LEVEL, ZERO

UNUSED_ZERO = [
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_bucket_size",
    "allgather_partitions",
    "round_robin_gradients",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
]


def _warnings_of(doc):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config(doc)
    return cfg, [str(w.message) for w in seen if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("key", UNUSED_ZERO)
def test_unused_zero_keys_warn_by_name_with_what_happens_instead(key):
    value = (
        True
        if key
        in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients")
        else 1000
    )
    cfg, msgs = _warnings_of({"zero_optimization": {"stage": 2, key: value}})
    assert cfg.zero_optimization.stage == 2
    mine = [m for m in msgs if f"'zero_optimization.{key}'" in m]
    assert len(mine) == 1 and mine[0].endswith(ZERO[key]) and ZERO[key]


@pytest.mark.parametrize(
    "key", ["partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile"]
)
def test_unused_activation_checkpointing_keys_warn(key):
    cfg, msgs = _warnings_of({"activation_checkpointing": {key: True, "number_checkpoints": 2}})
    assert cfg.activation_checkpointing.number_checkpoints == 2
    assert [m for m in msgs if f"'activation_checkpointing.{key}'" in m and ACTIVATION_CHECKPOINTING[key] in m]
    assert not [m for m in msgs if "number_checkpoints" in m]


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_unused_offload_keys_warn(section):
    _, msgs = _warnings_of(
        {
            "zero_optimization": {
                "stage": 3,
                section: {"device": "cpu", "buffer_size": 10, "max_in_cpu": 10, "fast_init": True},
            }
        }
    )
    for key in ("buffer_size", "max_in_cpu", "fast_init"):
        assert [m for m in msgs if f"'zero_optimization.{section}.{key}'" in m and OFFLOAD[key] in m]


def test_implemented_keys_parse_silently():
    doc = {
        "seed": 3,
        "steps_per_print": 5,
        "activation_checkpointing": {"number_checkpoints": 1, "cpu_checkpointing": True},
        "zero_optimization": {
            "stage": 1,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "cpu", "ratio": 0.4, "pin_memory": True},
        },
    }
    cfg, msgs = _warnings_of(doc)
    assert msgs == []
    assert cfg.seed == 3 and cfg.steps_per_print == 5
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.4


def test_every_top_level_key_warns_and_is_dropped():
    for key, instead in TOP_LEVEL.items():
        cfg, msgs = _warnings_of({"train_batch_size": 8, key: {"enabled": True}})
        assert cfg.train_batch_size == 8
        assert msgs == [f"config key '{key}' is a DeepSpeed setting with no effect in qcompress: {instead}"]


def test_a_reparsed_config_warns_once_per_call_site():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            load_config({"zero_optimization": {"overlap_comm": True}})
    assert len([w for w in seen if "overlap_comm" in str(w.message)]) == 1


def test_bad_values_name_the_key():
    from qcompress.errors import ConfigError

    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.ratio"):
        load_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})
    with pytest.raises(ConfigError, match="seed"):
        load_config({"seed": -1})
    with pytest.raises(ConfigError, match="activation_checkpointing.number_checkpoints"):
        load_config({"activation_checkpointing": {"number_checkpoints": -2}})


def test_the_keys_page_lists_every_key_and_warning():
    """docs/deepspeed-keys.md names every top-level key the schema reads and every warned key, with
    the warning's own text."""
    import dataclasses
    import os

    from qcompress.config.deepspeed_keys import FP16, NOT_HONOURED
    from qcompress.config.training import Config

    page = open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deepspeed-keys.md"), encoding="utf-8"
    ).read()
    for f in dataclasses.fields(Config):
        if not f.metadata.get("internal"):
            assert f"`{f.name}" in page, f.name
    tables = [
        (TOP_LEVEL, ""),
        (ZERO, "zero_optimization."),
        (OFFLOAD, "zero_optimization.offload_optimizer."),
        (ACTIVATION_CHECKPOINTING, "activation_checkpointing."),
        (FP16, "fp16."),
        (NOT_HONOURED, ""),
    ]
    for table, prefix in tables:
        for key, instead in table.items():
            assert f"| `{prefix}{key}`" in page and instead in page, prefix + key
