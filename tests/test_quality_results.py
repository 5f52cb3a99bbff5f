"""benchmarks/quality.py --write-results: rewriting the RESULTS section keeps what it does not
measure. Oracle: the section text written by hand in the test."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("qc_quality", os.path.join(ROOT, "benchmarks", "quality.py"))
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)

OLD = (quality.INTRO
       + "\n### Classifier (accuracy)\n\nold setup\n\n| old table |\n\n- Target: old target line.\n"
         "- A hand note.\n- A second note\n  with a continuation\n\n  | nested | table |\n- A hand note.\n"
       + "\n### LM (perplexity)\n\nlm setup\n\n| lm table |\n\n- An LM note.\n")


def summary(notes=None):
    s = {"metric": "accuracy", "title": "Classifier (accuracy)", "setup": "new setup",
         "recipes": {"w8a8": {"label": "W8A8", "fp32": 0.9, "ptq_minmax": 0.8, "ptq_mse": 0.85,
                              "qat": 0.88, "qat_rl": 0.89, "qad_rl": 0.9}}}
    if notes:
        s["notes"] = notes
    return s


def test_bullets_keep_continuations():
    sub = quality.subsections(OLD)["Classifier (accuracy)"]
    assert quality.bullets(sub) == ["Target: old target line.", "A hand note.",
                                    "A second note\n  with a continuation\n\n  | nested | table |", "A hand note."]


def test_rewrite_keeps_other_task_and_inherits_notes_once():
    new = quality.section({"classifier": summary()}, OLD)
    assert new.startswith(quality.INTRO)
    assert "### LM (perplexity)\n\nlm setup\n\n| lm table |\n\n- An LM note.\n" in new   # untouched
    cls = quality.subsections(new)["Classifier (accuracy)"]
    assert "new setup" in cls and "old setup" not in cls and "| W8A8 |" in cls
    assert quality.bullets(cls) == ["A hand note.", "A second note\n  with a continuation\n\n  | nested | table |"]
    # idempotent: writing the written section again changes nothing
    assert quality.section({"classifier": summary()}, new) == new


def test_notes_from_summary_replace_old_ones():
    new = quality.section({"classifier": summary(["Fresh note.", "Fresh note."])}, OLD)
    assert quality.bullets(quality.subsections(new)["Classifier (accuracy)"]) == ["Fresh note."]


def test_write_results_replaces_only_the_section(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "HERE", str(tmp_path))
    (tmp_path / "RESULTS.md").write_text("# Results\n\n## Before\n\nx\n\n" + OLD + "\n## After\n\ny\n")
    quality.write_results(quality.section({"classifier": summary()}, quality.current_section()))
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Results\n\n## Before\n\nx\n\n## Compression quality")
    assert text.endswith("## After\n\ny\n") and "- An LM note." in text and "new setup" in text
    assert not os.path.exists(tmp_path / "RESULTS.md.tmp")
