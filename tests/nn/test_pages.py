"""Dropping a weight mapped from its checkpoint file gives its pages back (qcompress/nn/pages.py), and
mode qlora does so for the float bases it replaces by codes."""

from __future__ import annotations

import sys

import pytest
import torch

from qcompress.nn import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _resident(path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                inside = line.rstrip().endswith(str(path))
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.fixture
def mapped(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    want = {"a": torch.randn(256, 1024, generator=g), "b": torch.randn(256, 1024, generator=g)}
    path = tmp_path / "w.safetensors"
    save_file(want, str(path))
    got = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in load_file(str(path)).items()}
    if pages._file_mapping(got["a"].data_ptr(), got["a"].data_ptr() + 1) is None:
        pytest.skip("safetensors did not map the file")
    for t in got.values():
        float(t.sum())  # every page read: resident
    return path, got, want


def test_an_unreferenced_mapped_tensor_gives_its_pages_back(mapped):
    path, got, want = mapped
    before = _resident(path)
    n = got["a"].numel() * 4
    back = pages.drop(got, "a")
    assert "a" not in got
    assert n - 2 * pages._PAGE <= back <= n
    assert _resident(path) <= before - back
    assert torch.equal(got["b"], want["b"])  # the neighbour keeps its bytes


def test_a_tensor_used_elsewhere_keeps_its_pages(mapped):
    path, got, want = mapped
    held = got["a"]
    view = got["b"][1:]
    before = _resident(path)
    assert pages.drop(got, "a") == 0 and pages.drop(got, "b") == 0
    assert _resident(path) == before
    assert torch.equal(held, want["a"]) and torch.equal(view, want["b"][1:])


def test_anonymous_memory_is_only_let_go():
    holder = {"w": torch.randn(512, 512)}
    assert pages.drop(holder, "w") == 0 and not holder


def test_qlora_gives_back_the_mapped_float_base(tmp_path):
    """A model loaded by transformers from safetensors (its Parameters views of the mapped file):
    after init_compression in mode qlora the adapted layers' float weights are no longer resident."""
    import transformers

    import qcompress as qc
    from tests.helpers.lora_fixtures import lora_cfg

    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    ptr = model.model.layers[0].mlp.down_proj.weight.data_ptr()
    if pages._file_mapping(ptr, ptr + 1) is None:
        pytest.skip("transformers did not map the checkpoint")
    with torch.no_grad():
        for p in model.parameters():
            float(p.sum())
    before = _resident(path)
    targets = ["q_proj", "v_proj", "down_proj"]
    dropped = sum(m.weight.numel() * 4 for n, m in model.named_modules() if n.endswith(tuple(targets)))
    qc.init_compression(model, lora_cfg("qlora", targets=targets, wq_modules=targets, group_size=32))
    assert all("weight" not in m._parameters for n, m in model.named_modules() if n.endswith(tuple(targets)))
    assert _resident(path) <= before - dropped * 0.9
    x = torch.randint(0, 64, (1, 8))
    model(input_ids=x, labels=x).loss.backward()  # what stayed mapped still computes
