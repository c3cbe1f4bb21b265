"""DoRA in the GGUF adapter format: the converter's round trip, the load errors, fingerprints,
and the row norms DoRA is computed from."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFValueType

from gateway.cli import main as cli_main
from tests.tinymodels import random_lora, write_adapter
from tests.worker.lora.test_dora import ATTN, MLP, make_dora
from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.dora import DORA_KEY, merged_weight, row_norm_terms, row_norms
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf, permute_rows_for_adjacent_rope

TARGETS = ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"]
DORA = {DORA_KEY: (GGUFValueType.BOOL, True, None)}


def magnitudes(tiny, targets=TARGETS, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"{t}.lora_m": rng.uniform(0.5, 2.0, tiny.tensors[t].shape[0]).astype(np.float32) for t in targets}


def dora_file(tiny, path, pairs=None, m=None, metadata=DORA):
    pairs = random_lora(tiny, TARGETS, rank=4, seed=0) if pairs is None else pairs
    return write_adapter(path, pairs, metadata=metadata, extra_tensors=magnitudes(tiny) if m is None else m)


def test_converter_writes_the_magnitudes_and_the_key_and_they_load(tiny_llama, tmp_path, capsys) -> None:
    model = make_dora(tiny_llama, tmp_path / "peft", 0, ATTN + MLP)
    out = tmp_path / "dora.gguf"
    written = convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, out, ConvertOptions())
    adapter = load_adapter(out, GGUFFile(tiny_llama.path))
    assert adapter.is_dora and adapter.gguf.get(DORA_KEY) is True
    assert sorted(adapter.pairs) == sorted(written) and all(pair.m is not None for pair in adapter.pairs.values())
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if "lora_magnitude_vector" in k}
    for layer in range(tiny_llama.spec.num_layers):
        q = state[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_magnitude_vector.default.weight"]
        down = state[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_magnitude_vector.default.weight"]
        info = adapter.pairs[f"blk.{layer}.attn_q.weight"].m
        assert info.shape == (tiny_llama.spec.embed_dim,) and info.type.name == "F32"
        # q's rows are permuted for ggml's rope: its magnitudes with them
        np.testing.assert_array_equal(adapter.load_magnitude(f"blk.{layer}.attn_q.weight"),
                                      permute_rows_for_adjacent_rope(q, tiny_llama.spec.num_heads))
        assert not np.array_equal(adapter.load_magnitude(f"blk.{layer}.attn_q.weight"), q)
        np.testing.assert_array_equal(adapter.load_magnitude(f"blk.{layer}.ffn_down.weight"), down)
    assert cli_main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter"]["dora"] is True
    plain = tmp_path / "plain.gguf"
    write_adapter(plain, {t: adapter.load_pair(t) for t in adapter.pairs}, alpha=adapter.alpha)
    assert not load_adapter(plain).is_dora and load_adapter(plain).fingerprint != adapter.fingerprint


def test_converter_refuses_what_dora_cannot_be(tiny_llama, tmp_path) -> None:
    make_dora(tiny_llama, tmp_path / "peft", 0, ["q_proj"])
    config_path = tmp_path / "peft" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(ConversionError, match="has a lora_magnitude_vector but adapter_config.json does not set use_dora"):
        convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, tmp_path / "x.gguf", ConvertOptions())
    make_dora(tiny_llama, tmp_path / "emb", 0, ["q_proj", "embed_tokens"])
    with pytest.raises(ConversionError, match=r"DoRA on model\.embed_tokens is not supported"):
        convert_peft_to_gguf(tmp_path / "emb", tiny_llama.path, tmp_path / "x.gguf", ConvertOptions())


def test_a_dora_file_loads_with_its_magnitudes(tiny_llama, tmp_path) -> None:
    adapter = load_adapter(dora_file(tiny_llama, tmp_path / "ok.gguf"), GGUFFile(tiny_llama.path))
    assert adapter.is_dora
    np.testing.assert_array_equal(adapter.load_magnitude(TARGETS[0]), magnitudes(tiny_llama)[f"{TARGETS[0]}.lora_m"])
    assert adapter.num_bytes == sum(p.a.num_bytes + p.b.num_bytes + p.m.num_bytes for p in adapter.pairs.values())
    w, bias = adapter.load_base(TARGETS[0])
    np.testing.assert_array_equal(w, tiny_llama.tensors[TARGETS[0]])
    assert bias is None
    with pytest.raises(ValueError, match="load it against the base model"):
        load_adapter(adapter.path).load_base(TARGETS[0])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no key", r"LoRA tensor 'blk\.0\.attn_q\.weight\.lora_m' has unexpected suffix"),
        ("key not bool", r"invalid gguf type for adapter\.lora\.dora"),
        ("magnitude alone", r"DoRA magnitude 'blk\.1\.attn_k\.weight\.lora_m' has no lora_a/lora_b pair"),
        ("pair alone", r"DoRA tensor pair for 'blk\.1\.ffn_down\.weight' is missing its magnitude \(lora_m\)"),
        ("wrong length", r"tensor 'blk\.0\.attn_q\.weight\.lora_m' has incorrect shape"),
        ("2-D", r"tensor 'blk\.0\.attn_q\.weight\.lora_m' has incorrect shape"),
        ("embedding", r"DoRA is not supported on tensor 'token_embd\.weight'"),
    ],
)
def test_load_errors(tiny_llama, tmp_path, case, message) -> None:
    m = magnitudes(tiny_llama)
    pairs = random_lora(tiny_llama, TARGETS, rank=4, seed=0)
    metadata = DORA
    if case == "no key":
        metadata = {}
    elif case == "key not bool":
        metadata = {DORA_KEY: (GGUFValueType.UINT32, 1, None)}
    elif case == "magnitude alone":
        m["blk.1.attn_k.weight.lora_m"] = np.ones(32, np.float32)
    elif case == "pair alone":
        del m["blk.1.ffn_down.weight.lora_m"]
    elif case == "wrong length":
        m["blk.0.attn_q.weight.lora_m"] = np.ones(63, np.float32)
    elif case == "2-D":
        m["blk.0.attn_q.weight.lora_m"] = np.ones((2, 32), np.float32)
    elif case == "embedding":
        pairs.update(random_lora(tiny_llama, ["token_embd.weight"], rank=4, seed=1))
        m["token_embd.weight.lora_m"] = np.ones(64, np.float32)
    path = dora_file(tiny_llama, tmp_path / "bad.gguf", pairs, m, metadata)
    with pytest.raises(AdapterError, match=f"^{message}$"):
        load_adapter(path, GGUFFile(tiny_llama.path))


def test_fingerprint_covers_the_magnitudes_and_leaves_plain_loras_alone(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, TARGETS, rank=4, seed=0)
    first = load_adapter(dora_file(tiny_llama, tmp_path / "a.gguf", pairs)).fingerprint
    assert load_adapter(dora_file(tiny_llama, tmp_path / "b.gguf", pairs)).fingerprint == first
    changed = magnitudes(tiny_llama)
    changed[f"{TARGETS[1]}.lora_m"][3] += 0.5
    assert load_adapter(dora_file(tiny_llama, tmp_path / "c.gguf", pairs, changed)).fingerprint != first
    # a plain LoRA hashes as before DoRA existed: the digest of its pairs alone
    from cache.hashing import TaggedHasher
    from worker.formats.fingerprint import FINGERPRINT_VERSION, _hash_tensors

    plain = load_adapter(write_adapter(tmp_path / "p.gguf", pairs))
    h = TaggedHasher("loraplex.adapter", FINGERPRINT_VERSION)
    h.text("arch", "llama")
    h.real("alpha", 8.0)
    h.text("invocation", "none")
    _hash_tensors(h, plain.gguf, sorted(plain.gguf.tensors))
    assert plain.fingerprint == h.hexdigest() != first


def test_row_norms_from_their_terms_equal_the_direct_norm_at_any_scale() -> None:
    rng = np.random.default_rng(0)
    w, a, b = rng.normal(size=(40, 24)), rng.normal(size=(3, 24)), rng.normal(size=(40, 3))
    terms = row_norm_terms(w.astype(np.float32), a.astype(np.float32), b.astype(np.float32))
    w, a, b = (x.astype(np.float32).astype(np.float64) for x in (w, a, b))
    for scale in (0.0, 1.0, -0.3, 2.5):
        np.testing.assert_allclose(row_norms(terms, scale), np.linalg.norm(w + scale * b @ a, axis=1), rtol=1e-12)
    m = rng.uniform(0.5, 2, 40)
    merged = merged_weight(w, a, b, m, 0.7)
    assert merged.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(merged.astype(np.float64), axis=1), m, rtol=1e-6)
