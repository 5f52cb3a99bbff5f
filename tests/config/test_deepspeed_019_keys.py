"""Every key of DeepSpeed 0.19's config schema loads: the keys qcompress's schema declares parse,
the others are dropped with one warning naming each. The key list is read from an installed
DeepSpeed package when there is one (its source, parsed without importing it) and from the
committed copy (qcompress/config/deepspeed_0_19_keys.json) otherwise; the reader itself is checked
on a small package written here, whose keys are known by construction."""

import dataclasses
import os
import textwrap
import typing
import warnings

import pytest

from qcompress.config import deepspeed_schema as dss
from qcompress.config import load_config
from qcompress.config.training import Config
from qcompress.errors import ConfigError


def _keys():
    folder = dss.installed_package_dir()
    if folder is not None:
        print(f"DeepSpeed {dss.version_of(folder)} is installed: its keys are read from {folder}")
        return dss.extract(folder)
    print(f"DeepSpeed is not installed: the committed key list (DeepSpeed {dss.committed()['deepspeed']}) is checked")
    return dss.committed()["keys"]


def _declared(path):
    """(declared by qcompress's schema, its default as a document value) for a dotted path."""
    from qcompress.config.deepspeed_keys import RENAMED
    from qcompress.config.schema import _layout

    if path in RENAMED:  # DeepSpeed's other name for a declared key
        path = path.rsplit(".", 1)[0] + "." + RENAMED[path]
    cls, value = Config, None
    for part in path.split("."):
        if cls is None:
            return False, None
        _, by_key = _layout(cls)
        f = by_key.get("bf16" if part == "bfloat16" else part)
        if f is None:
            return False, None
        hint = typing.get_type_hints(cls)[f.name]
        sub = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if sub is not None:
            cls, value = sub, {}
        else:
            cls = None
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return True, value


def _doc(path, value):
    doc = node = {}
    parts = path.split(".")
    for p in parts[:-1]:
        node[p] = {}
        node = node[p]
    node[parts[-1]] = value
    for section, kind in (("optimizer", "AdamW"), ("scheduler", "WarmupLR")):
        if section in doc and isinstance(doc[section], dict):
            if doc[section].get("type") is None:  # required: a value the schema takes
                doc[section]["type"] = kind
    return doc


def test_every_deepspeed_key_loads_and_the_unhonoured_ones_warn_by_name():
    keys = _keys()
    assert len(keys) > 300 and "zero_optimization.stage" in keys and "train_batch_size" in keys
    refused, silent = [], []
    for path in keys:
        declared, value = _declared(path)
        doc = _doc(path, value if declared else True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                load_config(doc)
            except ConfigError as err:
                refused.append(f"{path}: {err}")
                continue
        # the key, or the section it is in when that whole section is dropped (aio, wandb, ...)
        parts = path.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        named = [
            str(w.message)
            for w in seen
            if any(f"'{p}'" in str(w.message) for p in prefixes)
            and "no effect" in str(w.message)
            or any(f"'{p}'" in str(w.message) for p in prefixes)
            and "does not honour" in str(w.message)
        ]
        if not declared and len(named) != 1:
            silent.append((path, named))
    assert not refused, refused[:10]
    assert not silent, silent[:10]


def test_the_keys_an_outside_user_hit_load_with_one_warning_each():
    doc = {
        "train_batch_size": 8,
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "torch_autocast": {"enabled": False},
        "zero_optimization": {
            "stage": 2,
            "ignore_unused_parameters": True,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 2,
            "zero_quantized_gradients": True,
            "overlap_comm": True,
        },
    }
    named = [
        "bf16.immediate_grad_update",
        "torch_autocast",
        "zero_optimization.ignore_unused_parameters",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_gradients",
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own filter: once per key
        for _ in range(3):
            cfg = load_config(doc)
    msgs = [str(w.message) for w in seen]
    for key in named:
        assert len([m for m in msgs if f"'{key}'" in m and "does not honour" in m]) == 1, (key, msgs)
    assert cfg.zero_optimization.stage == 2 and cfg.bf16.enabled and cfg.train_batch_size == 8
    # a key DeepSpeed does not have either is still refused, by name
    with pytest.raises(ConfigError, match=r"zero_optimization\.zero_quantised_weights.*zero_quantized_weights"):
        load_config({"zero_optimization": {"zero_quantised_weights": True}})


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(textwrap.dedent(text))


def test_the_reader_finds_exactly_the_keys_a_small_package_reads(tmp_path):
    """A package shaped like DeepSpeed's config code: constants behind a star import, a key passed
    as a parameter default, a section unpacked into a pydantic model with an alias and a nested
    model, a section handed to a class, keys read only under a section, a pipeline defaults dict."""
    root = str(tmp_path / "deepspeed")
    _write(root, "__init__.py", "")
    _write(root, "runtime/__init__.py", "")
    _write(
        root,
        "runtime/constants.py",
        """
        TRAIN_BATCH_SIZE = "train_batch_size"
        ZERO = "zero_optimization"
        COMM = "communication_data_type"
        ACT = "activation_checkpointing"
        ACT_PART = "partition_activations"
        UNUSED_CONSTANT = "never_read"
    """,
    )
    _write(
        root,
        "runtime/config_utils.py",
        """
        from pydantic import BaseModel
        class DeepSpeedConfigModel(BaseModel):
            pass
        def get_scalar_param(d, key, default):
            return d.get(key, default)
    """,
    )
    _write(root, "runtime/zero/__init__.py", "from .config import *\n")
    _write(
        root,
        "runtime/zero/config.py",
        """
        from typing import Optional
        from pydantic import Field
        from ..config_utils import DeepSpeedConfigModel
        from ..constants import ZERO
        class Offload(DeepSpeedConfigModel):
            device: str = "none"
        class ZeroConfig(DeepSpeedConfigModel):
            stage: int = 0
            prefetch: int = Field(5, alias="stage3_prefetch_bucket_size")
            offload_param: Optional[Offload] = None
            _private: int = 0
        def get_zero_config(param_dict):
            if ZERO in param_dict:
                section = param_dict[ZERO]
            else:
                section = {}
            return ZeroConfig(**section)
    """,
    )
    _write(
        root,
        "runtime/act.py",
        """
        from .constants import *
        from .config_utils import get_scalar_param
        class ActConfig:
            def __init__(self, param_dict):
                if ACT in param_dict.keys():
                    self._init(param_dict[ACT])
            def _init(self, section):
                self.part = get_scalar_param(section, ACT_PART, False)
    """,
    )
    _write(
        root,
        "runtime/config.py",
        """
        from .constants import *
        from .config_utils import get_scalar_param
        from .zero import get_zero_config
        from .act import ActConfig
        def get_comm(param_dict, comm_type=COMM):
            return get_scalar_param(param_dict, comm_type, None)
        def get_pipeline_config(param_dict):
            default_pipeline = {"stages": 1, "partition": "best"}
            return default_pipeline
        class DeepSpeedConfig:
            def __init__(self, config):
                self._param_dict = config
                self._initialize_params(dict(self._param_dict))
            def _initialize_params(self, param_dict):
                self.batch = param_dict.get(TRAIN_BATCH_SIZE)
                self.zero = get_zero_config(param_dict)
                self.comm = get_comm(param_dict)
                self.act = ActConfig(param_dict)
                self.opt = param_dict["optimizer"]["type"] if "optimizer" in param_dict else None
            def vocab(self):
                return self._param_dict.get("vocabulary_size", 0)
    """,
    )
    _write(
        root,
        "runtime/progressive_layer_drop.py",
        """
        class ProgressiveLayerDrop:
            def __init__(self, theta=0.5, gamma=0.001):
                pass
    """,
    )
    assert dss.extract(root) == sorted(
        [
            "train_batch_size",
            "zero_optimization",
            "zero_optimization.stage",
            "zero_optimization.prefetch",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.offload_param",
            "zero_optimization.offload_param.device",
            "communication_data_type",
            "activation_checkpointing",
            "activation_checkpointing.partition_activations",
            "optimizer",
            "optimizer.type",
            "vocabulary_size",
            "pipeline.stages",
            "pipeline.partition",
            "progressive_layer_drop.theta",
            "progressive_layer_drop.gamma",
        ]
    )


def test_zero1_under_a_split_says_it_runs_as_stage_2():
    def said(doc):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            load_config(doc)
        return [str(w.message) for w in seen if "'zero_optimization.stage'" in str(w.message)]

    tp = said({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}})
    assert len(tp) == 1 and "stage 2" in tp[0] and "autotp_size 2" in tp[0], tp
    assert len(said({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}})) == 1
    assert said({"zero_optimization": {"stage": 1}}) == []  # no split: stage 1 as asked
    assert said({"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}) == []
    assert (
        said(
            {
                "zero_optimization": {"stage": 1},
                "tensor_parallel": {"autotp_size": 2},
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
            }
        )
        == []
    )  # 1-bit: its own shards


def test_deepspeeds_field_names_behind_its_aliases_mean_the_declared_keys():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config({"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert not [w for w in seen if "gather_16bit" in str(w.message)]
