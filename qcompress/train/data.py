"""Data for `qcompress train`: read texts (and labels) from the user's files, split off an eval set,
map labels to ids, tokenize, and pad batches.

Formats: CSV, TSV, JSON lines (or a .json list of objects), a folder of class sub-folders of .txt
files (label = sub-folder name), and for causal-lm .txt files or a folder of them. Every problem with
the input is a `DataError` whose message names the file (and the row or column), so the CLI can print
one line and exit with status 2.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..config.loader import DuplicateKeyError, unique_pairs

TASKS = ("text-classification", "causal-lm")

# Tokenizer calls take this many texts at a time: fast tokenizers encode a batch in parallel, and
# the per-call overhead stays small, while memory holds only one batch of encodings.
_TOKENIZE_BATCH = 1000
_LABEL_PAD = -100  # ignored by the cross-entropy losses of transformers' models
_INT_LABEL = re.compile(r"[+-]?\d+")


class DataError(ValueError):
    """The data given to `qcompress train` cannot be used; the message names the file (and row / column)."""


@dataclass
class Examples:
    """Raw texts before tokenization."""

    texts: List[str]
    labels: Optional[List[str]]  # text-classification: each text's label as a string; causal-lm: None
    source: str  # the path they came from (for messages)

    def __len__(self) -> int:
        return len(self.texts)


class TokenizedDataset(torch.utils.data.Dataset):
    """Tokenized examples; each item is a dict of LongTensors (1-D, except a 0-d class label)."""

    def __init__(self, items: List[Dict[str, torch.Tensor]], source: str = ""):
        self.items = items
        self.source = source

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return dict(self.items[i])  # a fresh dict: callers may add or drop keys


@dataclass
class PreparedData:
    train: TokenizedDataset
    eval: TokenizedDataset
    labels: Optional[List[str]]  # classification label names (id = position); None for causal-lm
    summary: str  # one line for the log and the report


# --- reading ---------------------------------------------------------------------------------------


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; the tasks are: {', '.join(TASKS)}")


def _allow_large_csv_fields() -> None:
    # The csv module refuses fields over 128 KiB by default; whole articles in one cell are normal.
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:  # a C long narrower than Py_ssize_t (Windows)
            limit //= 2


def _read_text_file(path: str) -> str:
    # Plain-text corpora often hold a stray non-UTF-8 byte (one BBC article does); replacing it
    # loses one character, refusing the whole corpus would lose the run.
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _label_value(value, where: str) -> str:
    """A label cell as a string; integer labels (JSON numbers) become their decimal string."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}: the label is missing")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: the label {value!r} is not a string or an integer")


def _text_value(value, where: str) -> str:
    if value is None:
        raise DataError(f"{where}: the text is missing")
    if not isinstance(value, str):
        raise DataError(f"{where}: the text {value!r} is not a string")
    return value


def _missing_column(path: str, kind: str, column: str, present: Sequence[str], flag: str) -> DataError:
    shown = ", ".join(repr(c) for c in present) if present else "(none)"
    return DataError(f"{path}: no {kind} column {column!r} ({flag}); the columns are: {shown}")


def _rows_to_examples(
    path: str, rows: Iterable[Tuple[str, dict]], columns: List[str], task: str, text_column: str, label_column: str
) -> Examples:
    """Examples from (where, row-dict) pairs whose keys are `columns` (all keys seen in the file)."""
    want_labels = task == "text-classification"
    if text_column not in columns:
        raise _missing_column(path, "text", text_column, columns, "--text-column")
    if want_labels and label_column not in columns:
        raise _missing_column(path, "label", label_column, columns, "--label-column")
    texts: List[str] = []
    labels: Optional[List[str]] = [] if want_labels else None
    for where, row in rows:
        texts.append(_text_value(row.get(text_column), f"{where}, column {text_column!r}"))
        if labels is not None:
            labels.append(_label_value(row.get(label_column), f"{where}, column {label_column!r}"))
    return Examples(texts, labels, path)


def _read_delimited(path: str, delimiter: str, task: str, text_column: str, label_column: str) -> Examples:
    _allow_large_csv_fields()
    rows: List[Tuple[str, dict]] = []
    try:
        # utf-8-sig: spreadsheet exports often start with a byte-order mark, which would otherwise
        # become part of the first column's name.
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: the file is empty (a header row naming the columns comes first)")
            header = [h.strip() for h in header]
            for column in (text_column,) + ((label_column,) if task == "text-classification" else ()):
                at = [i + 1 for i, h in enumerate(header) if h == column]
                if len(at) > 1:  # a dict per row would silently keep the last of them
                    raise DataError(
                        f"{path}: the header names column {column!r} {len(at)} times "
                        f"(columns {', '.join(map(str, at))}); rename all but one"
                    )
            for cells in reader:
                if not cells or all(not c.strip() for c in cells):
                    continue  # blank lines separate nothing
                where = f"{path}, line {reader.line_num}"
                if len(cells) > len(header):
                    raise DataError(f"{where}: {len(cells)} fields but the header names {len(header)} columns")
                # A short row lacks its last columns: those read as missing (None), not as "".
                rows.append((where, dict(zip(header, cells))))
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except csv.Error as e:
        raise DataError(f"{path}: not a readable {'TSV' if delimiter == chr(9) else 'CSV'} file: {e}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    return _rows_to_examples(path, rows, header, task, text_column, label_column)


def _read_json(path: str, task: str, text_column: str, label_column: str, allow_list: bool) -> Examples:
    try:
        with open(path, encoding="utf-8-sig") as f:
            content = f.read()
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    rows: List[Tuple[str, dict]] = []
    whole = None
    if allow_list and content.lstrip().startswith("["):
        # A .json file may hold one list of objects instead of one object per line.
        try:
            whole = json.loads(content, object_pairs_hook=unique_pairs)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        except DuplicateKeyError as e:  # json keeps the last copy: the row would be ambiguous
            raise DataError(f"{path}: an object has the key {e.key!r} twice") from None
        for i, obj in enumerate(whole, 1):
            if not isinstance(obj, dict):
                raise DataError(f"{path}, item {i}: expected a JSON object, got {type(obj).__name__}")
            rows.append((f"{path}, item {i}", obj))
    else:
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=unique_pairs)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}, line {n}: not valid JSON ({e.msg}); expected one JSON object per line"
                ) from None
            except DuplicateKeyError as e:
                raise DataError(f"{path}, line {n}: the key {e.key!r} is given twice") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}, line {n}: expected a JSON object, got {type(obj).__name__}")
            rows.append((f"{path}, line {n}", obj))
    if not rows:
        raise DataError(f"{path}: no examples in the data")
    columns: List[str] = []
    seen = set()
    for _, row in rows:
        for k in row:
            if k not in seen:
                seen.add(k)
                columns.append(k)
    return _rows_to_examples(path, rows, columns, task, text_column, label_column)


def _not_utf8(path: str, e: UnicodeDecodeError) -> DataError:
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
    except OSError:
        head = b""
    if head in (b"\xff\xfe", b"\xfe\xff"):  # spreadsheets' "Unicode text" export is UTF-16
        return DataError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    return DataError(f"{path}: not valid UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8")


def _visible(names: Iterable[str]) -> List[str]:
    return sorted(n for n in names if not n.startswith("."))


def _read_class_folders(path: str) -> Examples:
    classes = [d for d in _visible(os.listdir(path)) if os.path.isdir(os.path.join(path, d))]
    if not classes:
        raise DataError(
            f"{path}: no class sub-folders; text-classification reads a folder as one "
            f"sub-folder of .txt files per class (or give a CSV/TSV/JSONL file)"
        )
    texts: List[str] = []
    labels: List[str] = []
    for label in classes:
        folder = os.path.join(path, label)
        files = [
            f
            for f in _visible(os.listdir(folder))
            if f.lower().endswith(".txt") and os.path.isfile(os.path.join(folder, f))
        ]
        if not files:
            raise DataError(f"{folder}: the class folder {label!r} holds no .txt files")
        for name in files:
            texts.append(_read_text_file(os.path.join(folder, name)))
            labels.append(label)
    return Examples(texts, labels, path)


def _read_text_folder(path: str) -> Examples:
    files: List[str] = []
    for root, dirs, names in os.walk(path):
        dirs[:] = _visible(dirs)
        files.extend(os.path.join(root, n) for n in _visible(names) if n.lower().endswith(".txt"))
    # Sorted by the path below the folder, so the order does not depend on the file system.
    files.sort(key=lambda p: os.path.relpath(p, path).split(os.sep))
    if not files:
        raise DataError(f"{path}: no .txt files in the folder or its sub-folders")
    return Examples([_read_text_file(f) for f in files], None, path)


def read_examples(path, task: str, text_column: str = "text", label_column: str = "label") -> Examples:
    """Texts (and, for text-classification, string labels) from a file or folder; see the module doc."""
    _check_task(task)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        ex = _read_class_folders(path) if task == "text-classification" else _read_text_folder(path)
    else:
        ext = os.path.splitext(path)[1].lower()
        if ext == ".csv":
            ex = _read_delimited(path, ",", task, text_column, label_column)
        elif ext == ".tsv":
            ex = _read_delimited(path, "\t", task, text_column, label_column)
        elif ext in (".jsonl", ".json"):
            ex = _read_json(path, task, text_column, label_column, allow_list=ext == ".json")
        elif ext == ".txt":
            if task == "text-classification":
                raise DataError(
                    f"{path}: a .txt file holds no labels; text-classification reads a CSV, TSV "
                    f"or JSON-lines file, or a folder of class sub-folders of .txt files"
                )
            ex = Examples([_read_text_file(path)], None, path)
        else:
            raise DataError(
                f"{path}: unknown data file type {ext or '(no extension)'!r}; "
                f"use .csv, .tsv, .jsonl, .json, .txt or a folder"
            )
    if not ex.texts:
        raise DataError(f"{path}: no examples in the data")
    return ex


# --- labels, splits, subsets -----------------------------------------------------------------------


def label_names(*label_lists: Optional[Sequence[str]]) -> List[str]:
    """Sorted unique labels of all the lists (None lists are skipped); numeric order when every label
    is an integer ("2" before "10"). Positions are the class ids."""
    names = {label for labels in label_lists if labels is not None for label in labels}
    if names and all(_INT_LABEL.fullmatch(n) for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def _split_indices(n: int, eval_fraction: float, seed: int, source: str, what: str) -> Tuple[List[int], List[int]]:
    """(train, eval) positions: a seeded shuffle, eval = the first round(f * n), train = the rest."""
    if (
        isinstance(eval_fraction, bool)
        or not isinstance(eval_fraction, (int, float))
        or not math.isfinite(eval_fraction)
        or not 0 < eval_fraction < 1
    ):
        raise DataError(f"eval fraction {eval_fraction!r} is not between 0 and 1 (exclusive)")
    n_eval = round(eval_fraction * n)
    if n_eval == 0 or n_eval == n:
        side = "eval" if n_eval == 0 else "training"
        raise DataError(
            f"{source}: {n} {what} are too few to hold out {eval_fraction:g} for eval "
            f"(the {side} set would be empty); add data or give --eval-data"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order[n_eval:], order[:n_eval]


def _take(ex: Examples, idx: Sequence[int]) -> Examples:
    return Examples([ex.texts[i] for i in idx], None if ex.labels is None else [ex.labels[i] for i in idx], ex.source)


def split_examples(ex: Examples, eval_fraction: float, seed: int) -> Tuple[Examples, Examples]:
    """(train, eval): a held-out fraction, chosen by a seeded shuffle (reproducible for a seed)."""
    train_idx, eval_idx = _split_indices(len(ex.texts), eval_fraction, seed, ex.source, "examples")
    return _take(ex, train_idx), _take(ex, eval_idx)


def split_blocks(ds: TokenizedDataset, eval_fraction: float, seed: int) -> Tuple[TokenizedDataset, TokenizedDataset]:
    """The causal-lm held-out split: over token blocks, by the same rule as `split_examples`."""
    train_idx, eval_idx = _split_indices(len(ds), eval_fraction, seed, ds.source, "token blocks")
    return (
        TokenizedDataset([ds.items[i] for i in train_idx], ds.source),
        TokenizedDataset([ds.items[i] for i in eval_idx], ds.source),
    )


def subset(ex: Union[Examples, TokenizedDataset], n: Optional[int]):
    """The first n examples (or items of a TokenizedDataset); None keeps all."""
    if n is None:
        return ex
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DataError(f"the number of samples to keep must be a positive integer, got {n!r}")
    if isinstance(ex, TokenizedDataset):
        return TokenizedDataset(ex.items[:n], ex.source)
    return _take(ex, range(min(n, len(ex.texts))))


# --- tokenization ----------------------------------------------------------------------------------


def _check_max_length(max_length) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max_length must be a positive integer, got {max_length!r}")


def _unknown_labels(ex: Examples, label2id: Dict[str, int]) -> Optional[DataError]:
    for i, label in enumerate(ex.labels or ()):
        if label not in label2id:
            known = ", ".join(repr(k) for k in label2id)
            return DataError(
                f"{ex.source}: label {label!r} (example {i + 1}) is not among the training labels: {known}"
            )
    return None


def tokenize_classification(tokenizer, ex: Examples, label2id: Dict[str, int], max_length: int) -> TokenizedDataset:
    """Each text truncated to max_length tokens (no padding: `collate` pads per batch) with its label id."""
    _check_max_length(max_length)
    if ex.labels is None:
        raise DataError(f"{ex.source}: the examples have no labels; text-classification needs them")
    err = _unknown_labels(ex, label2id)
    if err is not None:
        raise err
    items: List[Dict[str, torch.Tensor]] = []
    for start in range(0, len(ex.texts), _TOKENIZE_BATCH):
        batch = ex.texts[start : start + _TOKENIZE_BATCH]
        enc = tokenizer(batch, truncation=True, max_length=max_length, padding=False)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        for j in range(len(batch)):
            item = {k: torch.tensor(enc[k][j], dtype=torch.long) for k in keys}
            item["labels"] = torch.tensor(label2id[ex.labels[start + j]], dtype=torch.long)
            items.append(item)
    return TokenizedDataset(items, ex.source)


def _end_of_text_id(tokenizer) -> int:
    for name in ("eos_token_id", "sep_token_id"):
        tid = getattr(tokenizer, name, None)
        if tid is not None:
            return tid
    raise DataError("the tokenizer has neither an eos nor a sep token to mark where a text ends")


def tokenize_causal_lm(tokenizer, ex: Examples, max_length: int) -> TokenizedDataset:
    """All texts as one token stream (eos after each text), cut into blocks of max_length tokens."""
    _check_max_length(max_length)
    eos = _end_of_text_id(tokenizer)
    stream: List[int] = []
    for start in range(0, len(ex.texts), _TOKENIZE_BATCH):
        batch = ex.texts[start : start + _TOKENIZE_BATCH]
        # verbose=False: a whole book is longer than the model's window on purpose; no warning.
        enc = tokenizer(batch, add_special_tokens=False, truncation=False, verbose=False)
        for ids in enc["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
    n_blocks = len(stream) // max_length
    if n_blocks == 0:
        raise DataError(
            f"{ex.source}: {len(stream)} tokens, fewer than max_length ({max_length}) tokens "
            f"make no training block; add text or lower --max-length"
        )
    # The last partial block is dropped: every block is full, so no padding and no masking.
    blocks = torch.tensor(stream[: n_blocks * max_length], dtype=torch.long).view(n_blocks, max_length)
    ones = torch.ones(max_length, dtype=torch.long)
    items = [{"input_ids": row, "attention_mask": ones, "labels": row} for row in blocks]
    return TokenizedDataset(items, ex.source)


def collate(items: List[dict], pad_id: Optional[int]) -> Dict[str, torch.Tensor]:
    """A batch: 1-D tensors right-padded to the longest item (input_ids with pad_id, labels with -100,
    the rest with 0), 0-d labels stacked. pad_id None pads with 0: padded positions are masked anyway."""
    if not items:
        raise ValueError("collate: no items")
    keys = list(items[0])
    for i, item in enumerate(items):
        if list(item) != keys:
            raise ValueError(f"collate: item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    out: Dict[str, torch.Tensor] = {}
    for key in keys:
        values = [item[key] for item in items]
        if values[0].dim() == 0:
            out[key] = torch.stack(values)
            continue
        fill = {"input_ids": 0 if pad_id is None else pad_id, "labels": _LABEL_PAD}.get(key, 0)
        longest = max(v.shape[0] for v in values)
        batch = torch.full((len(values), longest), fill, dtype=values[0].dtype)
        for row, v in zip(batch, values):
            row[: v.shape[0]] = v
        out[key] = batch
    return out


# --- the whole pipeline ----------------------------------------------------------------------------


def prepare_data(
    task: str,
    data,
    tokenizer,
    *,
    eval_data=None,
    eval_fraction: float = 0.2,
    seed: int = 0,
    max_length: int = 128,
    text_column: str = "text",
    label_column: str = "label",
    max_train_samples: Optional[int] = None,
    max_eval_samples: Optional[int] = None,
) -> PreparedData:
    """Read, split (or read eval_data), map labels to ids, subset and tokenize: what the job trains on."""
    _check_task(task)
    _check_max_length(max_length)
    data = os.fspath(data)
    eval_data = None if eval_data is None else os.fspath(eval_data)
    if task == "causal-lm":
        return _prepare_causal_lm(
            data,
            tokenizer,
            eval_data,
            eval_fraction,
            seed,
            max_length,
            text_column,
            max_train_samples,
            max_eval_samples,
        )
    train_ex = read_examples(data, task, text_column, label_column)
    if eval_data is None:
        train_ex, eval_ex = split_examples(train_ex, eval_fraction, seed)
        origin = f"from {data}"
    else:
        eval_ex = read_examples(eval_data, task, text_column, label_column)
        origin = f"from {data} / eval from {eval_data}"
    labels = label_names(train_ex.labels)
    if len(labels) < 2:
        raise DataError(
            f"{data}: only one class ({labels[0]!r}) in the training data; text-classification needs at least two"
        )
    label2id = {name: i for i, name in enumerate(labels)}
    err = _unknown_labels(eval_ex, label2id)
    if err is not None:
        if eval_data is None:  # both sides come from one file: a rare class fell wholly into eval
            raise DataError(
                f"{err} (it fell wholly into the held-out eval split; add examples of it, "
                f"change --seed or give --eval-data)"
            )
        raise err
    n_train, n_eval = len(train_ex), len(eval_ex)
    train_ex = subset(train_ex, max_train_samples)
    eval_ex = subset(eval_ex, max_eval_samples)
    train = tokenize_classification(tokenizer, train_ex, label2id, max_length)
    ev = tokenize_classification(tokenizer, eval_ex, label2id, max_length)
    summary = (
        f"{_count(len(train), n_train)} train / {_count(len(ev), n_eval)} eval texts {origin} ({len(labels)} labels)"
    )
    return PreparedData(train, ev, labels, summary)


def _count(kept: int, total: int) -> str:
    return str(kept) if kept == total else f"{kept} of {total}"


def _prepare_causal_lm(
    data, tokenizer, eval_data, eval_fraction, seed, max_length, text_column, max_train_samples, max_eval_samples
) -> PreparedData:
    train_ex = read_examples(data, "causal-lm", text_column)
    train = tokenize_causal_lm(tokenizer, train_ex, max_length)
    if eval_data is None:
        train, ev = split_blocks(train, eval_fraction, seed)
        origin = f"from {data}"
    else:
        ev = tokenize_causal_lm(tokenizer, read_examples(eval_data, "causal-lm", text_column), max_length)
        origin = f"from {data} / eval from {eval_data}"
    n_train, n_eval = len(train), len(ev)
    train = subset(train, max_train_samples)
    ev = subset(ev, max_eval_samples)
    summary = (
        f"{_count(len(train), n_train)} train / {_count(len(ev), n_eval)} eval blocks of "
        f"{max_length} tokens {origin} ({len(train_ex)} texts)"
    )
    return PreparedData(train, ev, None, summary)
