"""benchmarks/common.py: interleaved timing, per-round ratios and generated sections of results pages.
Oracles: a fake clock whose readings are chosen by hand, and pages written out by hand."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("qc_bench_common", os.path.join(ROOT, "benchmarks", "common.py"))
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)


def test_interleaved_takes_turns_and_reports_median_and_range(monkeypatch):
    calls, clock = [], iter([0, 1, 1, 4, 4, 6, 6, 12, 12, 15, 15, 17])  # a: 1, 2, 3 s; b: 3, 6, 2 s
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    t = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then round by round
    assert t["a"] == common.Timing(2, 1, 3, (1, 2, 3)) and t["b"] == common.Timing(3, 2, 6, (3, 6, 2))
    # per-round ratios b / a: 3, 3, 0.667 -> median 3, range 0.67-3
    assert common.ratio(t, "b", "a") == "3.00x [0.67-3.00]" and common.ratio_value(t, "b", "a") == 3


def test_replace_section_appends_then_replaces_keeping_the_rest():
    page = "# Title\n\nhand note\n"
    once = common.replace_section(page, "one", "first\n")
    assert once == "# Title\n\nhand note\n\n<!-- generated: one -->\nfirst\n<!-- /generated: one -->\n"
    two = common.replace_section(once + "\nafter\n", "one", "second")
    assert two == "# Title\n\nhand note\n\n<!-- generated: one -->\nsecond\n<!-- /generated: one -->\n\nafter\n"
    with pytest.raises(ValueError, match="section key 'a b'"):
        common.replace_section(page, "a b", "x")


def test_write_section_starts_a_page_with_the_machine_header(tmp_path):
    path = common.write_section(str(tmp_path / "p.md"), "k", "body\n", title="A page", cmd="python x.py --y")
    text = open(path).read()
    assert text.startswith("# A page\n\n<!-- generated: k -->\n> `python x.py --y` at commit ")
    assert common.cpu_model() in text and "torch threads" in text and text.endswith("body\n<!-- /generated: k -->\n")
    assert common.read_section(path, "k").endswith("\nbody\n") and common.read_section(path, "other") is None
    assert os.listdir(tmp_path) == ["p.md"]
