"""Loading a local Hugging Face model folder for a task, offline, and building fresh copies of it."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from .errors import JobError

AUTO_CLASSES = {"text-classification": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM"}


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    try:
        import transformers
    except ImportError:
        from ..errors import install_hint

        raise JobError(f"qcompress train needs transformers: {install_hint('hf')}", code=1) from None
    transformers.logging.set_verbosity_error()  # our report says what matters
    transformers.logging.disable_progress_bar()
    return transformers


def auto_class(task: str):
    return getattr(_transformers(), AUTO_CLASSES[task])


def check_model_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        raise JobError(
            f"--model {folder}: no such folder (a local Hugging Face model folder with "
            "config.json, safetensors weights and tokenizer files)"
        )
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise JobError(f"--model {folder}: no config.json there; is it a Hugging Face model folder?")


def load_tokenizer(folder: str):
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise JobError(f"--model {folder}: cannot load its tokenizer ({err})") from None
    if tok.pad_token_id is None:  # GPT-2 style tokenizers: pad with eos (masked out anyway)
        tok.pad_token = tok.eos_token or tok.sep_token
    if tok.pad_token_id is None:
        raise JobError(f"--model {folder}: the tokenizer has no pad, eos or sep token to pad batches with")
    return tok


def load_model(
    folder: str,
    task: str,
    labels: Optional[List[str]] = None,
    seed: int = 0,
    pad_token_id: Optional[int] = None,
    dtype: str = "float32",
) -> nn.Module:
    """The pretrained model with the task's head; a classification head with one class per label
    (a fresh head, seeded, unless the checkpoint's head already has that many classes).
    `pad_token_id`: the id batches are padded with, recorded in a config that has none."""
    check_model_folder(folder)
    cls = auto_class(task)
    kwargs, ckpt_labels = {}, None
    if task == "text-classification":
        kwargs = dict(
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)},
            ignore_mismatched_sizes=True,
        )
        ckpt_labels = _checkpoint_labels(folder)
    torch.manual_seed(seed)
    try:
        model, info = cls.from_pretrained(
            folder, local_files_only=True, dtype=getattr(torch, dtype), output_loading_info=True, **kwargs
        )
    except ValueError as err:
        msg = str(err).splitlines()[0]
        raise JobError(f"--model {folder} cannot do --task {task}: {msg}") from None
    except OSError as err:
        raise JobError(f"--model {folder}: cannot load the weights ({err})") from None
    # a head the checkpoint did not have (or had with another number of classes) starts random
    model.qc_fresh_head = bool(info.get("missing_keys") or info.get("mismatched_keys"))
    if (
        task == "text-classification"
        and not model.qc_fresh_head
        and ckpt_labels is not None
        and ckpt_labels != list(labels)
        and sorted(ckpt_labels) == sorted(labels)
    ):
        # from_pretrained keeps the head's rows in the checkpoint's class order while our id2label
        # is sorted: without this, a fine-tuned head would answer "tech" under the name "business"
        _reorder_head(model, folder, [ckpt_labels.index(name) for name in labels])
    if getattr(model.config, "pad_token_id", None) is None and pad_token_id is not None:
        # decoder classifiers (GPT2ForSequenceClassification, ...) find each text's last token by
        # the config's pad id and refuse batches without one; GPT-2 checkpoints have none
        model.config.pad_token_id = pad_token_id
    if task == "causal-lm" and getattr(model.config, "is_decoder", True) is False:
        model.config.is_decoder = True  # BERT-style configs used as a causal LM
    return model


def _checkpoint_labels(folder: str) -> Optional[List[str]]:
    """The class names of the checkpoint's own head in id order (None when it names none)."""
    try:
        cfg = _transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
        names = [str(cfg.id2label[i]) for i in range(len(cfg.id2label))]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return names if len(set(names)) == len(names) else None


@torch.no_grad()
def _reorder_head(model: nn.Module, folder: str, order: List[int]) -> None:
    """Put the output rows of the classification head (the last Linear with one output per class,
    as transformers' heads are) in `order`: new class i is the checkpoint's class order[i]."""
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == len(order)]
    if not heads:
        raise JobError(
            f"--model {folder}: cannot find the classification head to put its classes in the "
            "order of the data's labels"
        )
    head = heads[-1]
    index = torch.tensor(order, device=head.weight.device)
    head.weight.copy_(head.weight.index_select(0, index))
    if head.bias is not None:
        head.bias.copy_(head.bias.index_select(0, index))


def fresh_model(model: nn.Module, task: str) -> nn.Module:
    """An uncompressed instance of the same architecture, config and dtype (weights are overwritten later)."""
    torch.manual_seed(0)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return auto_class(task).from_config(model.config, dtype=dtype)


def position_limit(model: nn.Module) -> Optional[int]:
    """Tokens the model can take: the rows of its learned position table (`*position*` / GPT-2's
    `wpe`), less RoBERTa-style offsets (positions start after padding_idx); None without such a
    table (rotary / relative positions have no hard limit)."""
    limit = None
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Embedding) and ("position" in last or last == "wpe"):
            n = m.num_embeddings - (m.padding_idx + 1 if m.padding_idx is not None else 0)
            limit = n if limit is None else min(limit, n)
    return limit


def check_max_length(model: nn.Module, folder: str, max_length: int) -> None:
    limit = position_limit(model)
    if limit is not None and max_length > limit:
        raise JobError(
            f"--max-length {max_length} is more tokens than --model {folder} has positions for "
            f"({limit}); use --max-length {limit} or less"
        )


def fp32_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights and buffers stored as float32 (integers as they are)."""
    total = 0
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * (4 if t.is_floating_point() else t.element_size())
    return total


def describe(model: nn.Module) -> Tuple[str, int]:
    """(class name, parameter count)."""
    return type(model).__name__, sum(p.numel() for p in model.parameters())
