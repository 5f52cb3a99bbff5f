"""The Trainer callback and DeepSpeed's seed / activation_checkpointing: a config seed that is not
the Trainer's is refused by name (the Trainer seeds from its arguments); the section checkpoints
the model's layers as qcompress.initialize does."""

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)')

import qcompress  # noqa: E402
from qcompress.hf import CompressionCallback  # noqa: E402
from qcompress.hf.callback import check_training_args  # noqa: E402
from tests.helpers.tiny_models import make_gpt2  # noqa: E402

RECIPE = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"w8": {"params": {"start_bits": 8, "target_bits": 8}}},
        }
    }
}


def _args(**kw):
    base = dict(
        world_size=1,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=4,
        fp16=False,
        bf16=False,
        max_grad_norm=1.0,
        deepspeed=None,
        seed=42,
        should_save=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_a_config_seed_other_than_the_trainers_is_refused_by_name():
    with pytest.raises(qcompress.ConfigError, match=r"^seed: .*TrainingArguments.seed is 42"):
        check_training_args(qcompress.load_config(dict(RECIPE, seed=7)), _args())
    check_training_args(qcompress.load_config(dict(RECIPE, seed=42)), _args())


@pytest.mark.parametrize(
    "section,flags", [(None, [False, False]), ({}, [True, True]), ({"number_checkpoints": 1}, [True, False])]
)
def test_the_section_checkpoints_the_trainers_model(section, flags):
    doc = dict(RECIPE, **({"activation_checkpointing": section} if section is not None else {}))
    model = make_gpt2()
    CompressionCallback(doc).on_init_end(_args(), None, None, model=model)
    assert [layer.gradient_checkpointing for layer in model.transformer.h] == flags
