"""Progress written to a file or a CI log is one plain line every N steps and at the end; on a
terminal it is tqdm's bar. Oracle: the lines expected from the step count, and tqdm's own
carriage returns."""

import io

from qcompress.train.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_not_a_terminal_gets_one_line_every_n_steps_and_at_the_end():
    out = io.StringIO()
    p = StepProgress("qat", total=23, every=10, stream=out)
    for i in range(23):
        p.update(1.0 / (i + 1), 8.0)
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split()[2] for line in lines] == ["10/23", "20/23", "23/23"]
    assert lines[0].startswith("[qat] step 10/23 loss 0.1000 8.0 samples/s")


def test_a_resumed_phase_counts_from_its_start():
    out = io.StringIO()
    p = StepProgress("fp32_finetuned", total=12, initial=5, every=5, stream=out)
    for _ in range(7):
        p.update(0.5, 1.0)
    assert [line.split()[2] for line in out.getvalue().splitlines()] == ["10/12", "12/12"]


def test_a_terminal_gets_the_bar():
    out = Terminal()
    p = StepProgress("qat", total=3, every=10, stream=out)
    for _ in range(3):
        p.update(0.5, 1.0)
    p.close()
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()


def test_the_training_loop_logs_through_it(monkeypatch, tmp_path):
    """loop.run with a non-terminal stderr writes plain lines at the engine's steps_per_print."""
    import sys

    import torch

    import qcompress
    from qcompress.train import loop
    from tests.helpers.tiny_models import make_gpt2

    model = make_gpt2()
    doc = {"train_batch_size": 4, "steps_per_print": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = qcompress.initialize(model, doc)
    data = [{"input_ids": torch.randint(0, 96, (8,)), "labels": torch.randint(0, 96, (8,))} for _ in range(8)]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    phase = loop.Phase(
        name="qat",
        engine=engine,
        dataset=data,
        task="causal-lm",
        steps=5,
        seed=0,
        pad_id=0,
        ckpt_dir=str(tmp_path / "ckpt"),
        save_steps=0,
        metrics=None,
    )
    loop.run(phase)
    lines = err.getvalue().splitlines()
    assert [line.split()[2] for line in lines if line.startswith("[qat] step")] == ["2/5", "4/5", "5/5"]
    assert "\r" not in err.getvalue()
