"""The results pages say what is true of themselves: benchmarks/regenerate.sh runs a command for
every section on the pages (but the GPU page's) and no command whose section is not on its page;
no page's command names a file of the machine that ran it; parallel.md's prose quotes its own
table's ranges; RESULTS.md's table of what each section was run at is the one the headers give."""

import os
import re
import shlex


from benchmarks import common, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _normal(cmd: str) -> str:
    """A command without the python prefix and the --note annotations (text, not settings)."""
    words = [w for w in shlex.split(cmd.replace("$PY", ".venv/bin/python"))]
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--note":
            skip = True
            continue
        if w.endswith("python"):
            continue
        out.append(w)
    return " ".join(out)


def _regenerate_commands():
    text = open(os.path.join(ROOT, "benchmarks", "regenerate.sh"), encoding="utf-8").read()
    text = text.replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        line = line.strip()
        if "$PY benchmarks/" in line and not line.startswith("#"):
            line = line.split("|| ")[-1] if line.startswith("[") else line
            cmds.append(_normal(line))
    return cmds


def _writes(cmd: str) -> bool:
    """Whether the command writes a section: scripts with a --write-results option only with it."""
    script = re.search(r"benchmarks/(\w+\.py)", cmd).group(1)
    src = open(os.path.join(ROOT, "benchmarks", script), encoding="utf-8").read()
    if "write_section" not in src and "--write-results" not in src:
        return False
    return "--write-results" in cmd or '"--write-results"' not in src


def _header_commands():
    found = {}
    for path in provenance.pages():
        text = open(path, encoding="utf-8").read()
        for key, body in provenance._SECTION.findall(text):
            head = provenance._HEADER.search(body)
            if head:
                found[(os.path.basename(path), key)] = _normal(head.group("cmd"))
    return found


def test_regenerate_runs_exactly_the_sections_on_the_pages():
    cmds = _regenerate_commands()
    headers = _header_commands()
    assert cmds and headers
    written = {c for c in cmds if _writes(c)}
    missing = {k: c for k, c in headers.items() if c not in written}
    assert not missing, f"sections no regenerate.sh command writes: {missing}"
    # provenance.py writes RESULTS.md's table of the others (no header of its own: checked below)
    extra = {c for c in written if "provenance.py" not in c} - set(headers.values())
    assert not extra, f"regenerate.sh commands whose section is on no page: {extra}"


def test_no_page_command_names_a_machine_path():
    for (page, key), cmd in _header_commands().items():
        assert not re.search(r"(^|\s)/(tmp|work|home|root)/", cmd), (page, key, cmd)
    assert "--json" not in common.command(["benchmarks/compile_step.py", "--json", "/tmp/x.json", "--write-results"])


def test_parallel_prose_quotes_its_table():
    text = open(os.path.join(common.RESULTS_DIR, "parallel.md"), encoding="utf-8").read()
    ratios = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 4 and cells[4].endswith("x") and re.fullmatch(r"[\d.]+x", cells[4]):
            ratios[(cells[0], cells[1])] = float(cells[4][:-1])
    tp = [v for (s, m), v in ratios.items() if "TP2" in m]
    pp = [v for (s, m), v in ratios.items() if "PP2" in m and "TP2" not in m]
    assert tp and pp
    prose = " ".join(text.split("<!-- /generated: tiny-llama -->")[1].split())
    assert f"TP2 are {min(tp):.2f} to {max(tp):.2f} times slower" in prose, (min(tp), max(tp))
    assert f"run at {min(pp):.2f} to {max(pp):.2f} times DP's step time" in prose, (min(pp), max(pp))


def test_results_index_says_what_each_section_was_run_at():
    page = open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), encoding="utf-8").read()
    assert "re-run at the commit in its section's header" not in page
    table = common.read_section(os.path.join(ROOT, "benchmarks", "RESULTS.md"), provenance.KEY)
    assert table is not None and table.strip() == provenance.render().strip()
    # every section with a header is a row, with its header's commit
    rows = {(p, k): at for p, k, _, at, _ in provenance.rows()}
    for (page, key), _ in _header_commands().items():
        assert any(k == key and p.endswith(page) for p, k in rows), (page, key)


def test_docs_cite_no_gpu_timings_the_pages_lack():
    """docs/export.md may point at GPU timings of the packed reload only once a page holds them."""
    doc = open(os.path.join(ROOT, "docs", "export.md"), encoding="utf-8").read()
    held = (
        any("gpu_quick" in cmd for cmd in _header_commands().values())
        or "gpu_quick" in open(os.path.join(common.RESULTS_DIR, "gpu.md"), encoding="utf-8").read()
    )
    if not held:
        assert not re.search(r"GPU timings[^.]*are in", " ".join(doc.split())), "docs/export.md cites GPU timings"
        assert "no results page holds those timings" in " ".join(doc.split())
