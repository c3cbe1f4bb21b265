"""Fingerprints are content-addressed, stable across processes, and sensitive to every input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFValueType

from cache.hashing import TaggedHasher
from tests.tinymodels import invocation_metadata, random_lora, write_adapter
from worker.formats import fingerprint as fp_module
from worker.formats.adapter import load_adapter
from worker.formats.fingerprint import adapter_set_fingerprint, base_fingerprint, base_fingerprint_uncached
from worker.formats.gguf_file import GGUFFile

TARGETS = ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"]


@pytest.fixture(scope="module")
def pairs(tiny_llama) -> dict:
    return random_lora(tiny_llama, TARGETS, rank=4, seed=0)


def fp(path) -> str:
    return load_adapter(path).fingerprint


def test_same_content_other_path_and_name_same_fingerprint(tmp_path, pairs) -> None:
    first = write_adapter(tmp_path / "tenant-a.gguf", pairs, metadata={"adapter.lora.task_name": (GGUFValueType.STRING, "a", None)})
    second = write_adapter(tmp_path / "tenant-b.gguf", pairs, metadata={"adapter.lora.task_name": (GGUFValueType.STRING, "b", None)})
    (tmp_path / "sub").mkdir()
    third = shutil.copy(first, tmp_path / "sub" / "other.gguf")
    assert fp(first) == fp(second) == fp(third)


def test_fingerprint_changes_with_weights_alpha_and_invocation(tmp_path, pairs) -> None:
    reference = fp(write_adapter(tmp_path / "ref.gguf", pairs))
    a, b = pairs[TARGETS[0]]
    b2 = b.copy()
    b2[3, 1] = np.nextafter(b2[3, 1], np.float32(1))  # one weight, one ulp
    assert fp(write_adapter(tmp_path / "w.gguf", {**pairs, TARGETS[0]: (a, b2)})) != reference
    assert fp(write_adapter(tmp_path / "alpha.gguf", pairs, alpha=9.0)) != reference
    assert fp(write_adapter(tmp_path / "inv.gguf", pairs, metadata=invocation_metadata([1, 2]))) != reference
    assert fp(write_adapter(tmp_path / "inv2.gguf", pairs, metadata=invocation_metadata([1, 3]))) != fp(tmp_path / "inv.gguf")


def test_adapter_set_fingerprint() -> None:
    base = "b" * 64
    one = adapter_set_fingerprint(base, [("x", 1.0), ("y", 0.5)])
    assert one == adapter_set_fingerprint(base, [("y", 0.5), ("x", 1.0)])  # order-free
    assert one == adapter_set_fingerprint(base, [("y", 0.5), ("z", 0.0), ("x", 1)])  # scale 0 drops out
    assert one != adapter_set_fingerprint(base, [("x", 1.0), ("y", 0.25)])  # scale matters
    assert one != adapter_set_fingerprint("c" * 64, [("x", 1.0), ("y", 0.5)])  # base matters
    assert adapter_set_fingerprint(base, []) == adapter_set_fingerprint(base, [("x", 0.0)])
    assert adapter_set_fingerprint(base, [("x", -0.0)]) == adapter_set_fingerprint(base, [])


def test_fields_are_length_prefixed() -> None:
    def digest(*fields: str) -> str:
        h = TaggedHasher("t", 1)
        for f in fields:
            h.text("f", f)
        return h.hexdigest()

    assert digest("ab", "c") != digest("a", "bc")
    assert digest("abc") != digest("ab", "c")


def test_base_fingerprint_is_stable_across_processes(tiny_llama) -> None:
    ours = base_fingerprint_uncached(GGUFFile(tiny_llama.path))
    code = ("import sys; from worker.formats.gguf_file import GGUFFile; from worker.formats.fingerprint import base_fingerprint; "
            "print(base_fingerprint(GGUFFile(sys.argv[1])))")
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", code, str(tiny_llama.path)], capture_output=True, text=True, check=True, env=env)
    assert other.stdout.strip() == ours


def test_base_fingerprint_sees_one_tensor_byte(tmp_path, tiny_llama) -> None:
    w = tiny_llama.tensors["blk.1.ffn_up.weight"].copy()
    w[0, 0] += 1e-3
    changed = tiny_llama.with_tensors(tmp_path / "changed.gguf", {"blk.1.ffn_up.weight": w})
    same = tiny_llama.with_tensors(tmp_path / "same.gguf", {})
    original = base_fingerprint_uncached(GGUFFile(tiny_llama.path))
    assert base_fingerprint_uncached(GGUFFile(same)) == original
    assert base_fingerprint_uncached(GGUFFile(changed)) != original


def test_base_fingerprint_cache_by_path_size_mtime(tmp_path, tiny_llama, monkeypatch) -> None:
    path = shutil.copy(tiny_llama.path, tmp_path / "m.gguf")
    calls = []
    real = fp_module.base_fingerprint_uncached
    monkeypatch.setattr(fp_module, "base_fingerprint_uncached", lambda g: calls.append(g) or real(g))
    cache_dir = tmp_path / "cache"
    first = base_fingerprint(GGUFFile(path), cache_dir)
    assert base_fingerprint(GGUFFile(path), cache_dir) == first and len(calls) == 1
    fp_module._memo.clear()  # a new process: the disk cache answers
    assert base_fingerprint(GGUFFile(path), cache_dir) == first and len(calls) == 1
    os.utime(path, ns=(1, 1))  # touched: hash again
    assert base_fingerprint(GGUFFile(path), cache_dir) == first and len(calls) == 2


def test_the_base_fingerprint_persists_on_disk_and_a_bad_file_is_recomputed(tiny_llama, tmp_path, monkeypatch) -> None:
    gguf = GGUFFile(tiny_llama.path)
    expected = base_fingerprint_uncached(gguf)
    monkeypatch.setattr(fp_module, "_memo", {})
    assert base_fingerprint(gguf, tmp_path / "fp") == expected
    (stored,) = (tmp_path / "fp").iterdir()
    monkeypatch.setattr(fp_module, "_memo", {})  # another process: nothing in memory
    monkeypatch.setattr(fp_module, "base_fingerprint_uncached", lambda g: pytest.fail("re-hashed the base"))
    assert base_fingerprint(gguf, tmp_path / "fp") == expected
    stored.write_text("not a digest")
    monkeypatch.setattr(fp_module, "_memo", {})
    monkeypatch.setattr(fp_module, "base_fingerprint_uncached", lambda g: "f" * 64)
    assert base_fingerprint(gguf, tmp_path / "fp") == "f" * 64  # computed again, not trusted
    read_only = tmp_path / "ro"
    read_only.write_text("a file where the directory should be")
    monkeypatch.setattr(fp_module, "_memo", {})
    assert base_fingerprint(gguf, read_only) == "f" * 64  # cannot keep it: still answers
