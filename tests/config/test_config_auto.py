"""'auto' values of transformers-style ds_config.json files (HF's DeepSpeed integration fills them
from TrainingArguments): loaded, filled by the Trainer callback and by `qcompress train`, refused
by the engine with the key named."""

import json

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.errors import ConfigError

# the shape of transformers' documented ZeRO-3 example config, plus a compression section
HF_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 0,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "sub_group_size": 1e9,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantization_type": "symmetric"},
            "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["0"]}},
        }
    },
}


def test_auto_values_load_with_defaults_and_are_listed():
    cfg = qcompress.load_config(HF_STYLE)
    assert set(cfg.auto_keys) == {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
    }
    plain = qcompress.load_config({"compression_training": HF_STYLE["compression_training"]})
    assert cfg.train_batch_size is None and cfg.gradient_clipping == plain.gradient_clipping
    assert cfg.precision == "fp32" and cfg.fp16.initial_scale_power == 16
    assert cfg.zero_optimization.reduce_bucket_size == plain.zero_optimization.reduce_bucket_size
    assert cfg.optimizer.params == {} and cfg.scheduler.params == {}
    assert cfg.raw["train_batch_size"] == "auto"  # the document itself is kept as written


@pytest.mark.parametrize(
    "path,doc",
    [
        ("zero_optimization.stage", {"zero_optimization": {"stage": "auto"}}),
        (
            "compression_training.weight_quantization.different_groups.wq1.params.start_bits",
            {
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"enabled": True},
                        "different_groups": {
                            "wq1": {"params": {"start_bits": "auto", "target_bits": 8}, "modules": ["0"]}
                        },
                    }
                }
            },
        ),
    ],
)
def test_auto_elsewhere_is_a_config_error_naming_the_key(path, doc):
    with pytest.raises(ConfigError) as err:
        qcompress.load_config(doc)
    assert path in str(err.value)


def test_engine_refuses_auto_it_cannot_fill_and_takes_zero_defaults():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ConfigError) as err:
        qcompress.initialize(model, HF_STYLE)
    assert "train_batch_size" in str(err.value) and "TrainingArguments" in str(err.value)
    doc = dict(
        HF_STYLE,
        train_batch_size=4,
        gradient_accumulation_steps=1,
        fp16={"enabled": False},
        bf16={"enabled": False},
        gradient_clipping=1.0,
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2}},
    )
    del doc["train_micro_batch_size_per_gpu"]
    qcompress.init_compression(model, doc)
    engine = qcompress.initialize(model, doc)  # only the ZeRO sizes are still "auto": defaults
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    assert engine.train_batch_size == 4 and engine.gradient_clipping == 1.0


def test_trainer_callback_takes_auto_from_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    from qcompress.hf.callback import check_training_args

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        report_to=[],
    )
    with pytest.warns(UserWarning, match="not used"):  # optimizer / scheduler: the Trainer's own
        check_training_args(qcompress.load_config(HF_STYLE), args)
    # numbers are still compared: a real disagreement stays an error
    with pytest.raises(ConfigError, match="gradient_clipping"):
        check_training_args(qcompress.load_config(dict(HF_STYLE, gradient_clipping=1.0)), args)


def _job_opts(tmp_path, doc, **kw):
    from qcompress.train.job import JobOptions

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(doc))
    return JobOptions(
        configs=[str(path)], model="m", data="d", task="text-classification", out=str(tmp_path / "out"), **kw
    )


def test_job_fills_auto_from_its_options(tmp_path):
    from qcompress.train.job import job_config

    opts = _job_opts(tmp_path, HF_STYLE, lr=3e-4, batch_size=8)
    doc = job_config(opts)
    cfg = qcompress.load_config(doc)
    assert cfg.auto_keys == ()
    assert doc["train_batch_size"] == 8 and "gradient_accumulation_steps" not in doc
    assert doc["optimizer"]["params"] == {"lr": 3e-4}
    assert doc["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 0}


def test_job_refuses_auto_step_counts(tmp_path):
    from qcompress.train.job import job_config, JobError

    doc = json.loads(json.dumps(HF_STYLE))
    doc["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}
    with pytest.raises(JobError, match="scheduler.params.total_num_steps"):
        job_config(_job_opts(tmp_path, doc))
