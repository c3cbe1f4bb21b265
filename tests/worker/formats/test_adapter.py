"""Every rule of docs/architecture.md#adapters-we-read, in order, with its exact message; metadata; what loads."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from tests.tinymodels import invocation_metadata, random_lora, write_adapter
from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.gguf_file import GGUFFile, GGUFFormatError

Q = "blk.0.attn_q.weight"


@pytest.fixture(scope="module")
def base(tiny_llama) -> GGUFFile:
    return GGUFFile(tiny_llama.path)


@pytest.fixture(scope="module")
def good_pairs(tiny_llama) -> dict:
    return random_lora(tiny_llama, [Q, "blk.1.ffn_down.weight", "token_embd.weight"], rank=4, seed=0)


def rejected(path, base) -> str:
    with pytest.raises(AdapterError) as info:
        load_adapter(path, base)
    assert str(info.value) == info.value.message
    return info.value.message


def test_valid_adapter_loads_with_metadata(tmp_path, base, good_pairs) -> None:
    meta = {
        "adapter.lora.task_name": (GGUFValueType.STRING, "summarize", None),
        "adapter.lora.prompt_prefix": (GGUFValueType.STRING, "Summarize: ", None),
        **invocation_metadata([150, 151]),
    }
    adapter = load_adapter(write_adapter(tmp_path / "ok.gguf", good_pairs, alpha=16.0, metadata=meta), base)
    assert adapter.alpha == 16.0
    assert (adapter.task_name, adapter.prompt_prefix) == ("summarize", "Summarize: ")
    assert adapter.invocation_tokens == (150, 151) and adapter.is_alora
    assert list(adapter.pairs) == sorted(good_pairs)
    pair = adapter.pairs[Q]
    assert pair.rank == 4 and adapter.scale(pair, 0.5) == pytest.approx(0.5 * 16 / 4)
    a, b = adapter.load_pair("token_embd.weight")
    np.testing.assert_array_equal(a, good_pairs["token_embd.weight"][0])  # (V, r)
    np.testing.assert_array_equal(b, good_pairs["token_embd.weight"][1])  # (d, r)


def test_alpha_missing_means_zero_and_scale_is_the_runtime_scale(tmp_path, base, good_pairs) -> None:
    adapter = load_adapter(write_adapter(tmp_path / "noalpha.gguf", good_pairs, alpha=None), base)
    assert adapter.alpha == 0.0
    assert adapter.scale(adapter.pairs[Q], 0.25) == 0.25


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"general_type": "model"}, "expect general.type to be 'adapter', but got: model"),
        ({"general_type": None}, "expect general.type to be 'adapter', but got: "),
        ({"arch": "qwen2"}, "model arch and LoRA arch mismatch"),
        ({"adapter_type": "ia3"}, "expect adapter.type to be 'lora', but got: ia3"),
        ({"adapter_type": None}, "expect adapter.type to be 'lora', but got: "),
        (
            {"metadata": {"adapter.alora.invocation_tokens": (GGUFValueType.UINT32, 5, None)}},
            "invalid gguf type for adapter.alora.invocation_tokens",
        ),
        (
            {"metadata": {"adapter.alora.invocation_tokens": (GGUFValueType.ARRAY, [1, 2], GGUFValueType.INT32)}},
            "invalid gguf element type for adapter.alora.invocation_tokens",
        ),
        # several faults: the first rule in order wins
        ({"general_type": "model", "arch": "qwen2", "adapter_type": "ia3"}, "expect general.type to be 'adapter', but got: model"),
        ({"arch": "qwen2", "adapter_type": "ia3"}, "model arch and LoRA arch mismatch"),
    ],
)
def test_metadata_rules(tmp_path, base, good_pairs, kwargs, message) -> None:
    assert rejected(write_adapter(tmp_path / "bad.gguf", good_pairs, **kwargs), base) == message


def test_unexpected_suffix(tmp_path, base, good_pairs) -> None:
    path = write_adapter(tmp_path / "s.gguf", good_pairs, extra_tensors={"blk.0.attn_q.weight.lora_c": np.zeros((2, 2), np.float32)})
    assert rejected(path, base) == "LoRA tensor 'blk.0.attn_q.weight.lora_c' has unexpected suffix"


def test_norm_tensors_are_skipped(tmp_path, base, good_pairs) -> None:
    path = write_adapter(tmp_path / "n.gguf", good_pairs, extra_tensors={"blk.0.attn_norm.weight": np.ones(64, np.float32)})
    adapter = load_adapter(path, base)
    assert adapter.skipped_tensors == ("blk.0.attn_norm.weight",)
    assert "blk.0.attn_norm.weight" not in adapter.pairs


@pytest.mark.parametrize("missing", ["a", "b"])
def test_pair_missing_one_component(tmp_path, base, good_pairs, missing) -> None:
    a, b = good_pairs[Q]
    pairs = {**good_pairs, Q: (None, b) if missing == "a" else (a, None)}
    assert rejected(write_adapter(tmp_path / "m.gguf", pairs), base) == f"LoRA tensor pair for '{Q}' is missing one component"


def test_target_not_in_base(tmp_path, base, good_pairs) -> None:
    pairs = {**good_pairs, "blk.7.attn_q.weight": good_pairs[Q]}
    assert rejected(write_adapter(tmp_path / "x.gguf", pairs), base) == "LoRA tensor 'blk.7.attn_q.weight' does not exist in base model"


def test_incorrect_shape(tmp_path, base, good_pairs) -> None:
    a, b = good_pairs[Q]
    wrong_k = np.zeros((4, a.shape[1] + 1), np.float32)
    assert rejected(write_adapter(tmp_path / "k.gguf", {Q: (wrong_k, b)}), base) == f"tensor '{Q}' has incorrect shape"
    wrong_d = np.zeros((b.shape[0] + 2, 4), np.float32)
    assert rejected(write_adapter(tmp_path / "d.gguf", {Q: (a, wrong_d)}), base) == f"tensor '{Q}' has incorrect shape"


def test_lora_a_not_transposed(tmp_path, base, good_pairs) -> None:
    a, b = good_pairs[Q]
    b_rank_5 = np.zeros((b.shape[0], 5), np.float32)
    assert rejected(write_adapter(tmp_path / "t.gguf", {Q: (a, b_rank_5)}), base) == "lora_a tensor is not transposed"


def test_token_embedding_shape_rule(tmp_path, base, good_pairs) -> None:
    a, b = good_pairs["token_embd.weight"]  # A (V, r), B (d, r)
    wrong_vocab = np.zeros((a.shape[0] - 1, 4), np.float32)
    message = rejected(write_adapter(tmp_path / "e.gguf", {"token_embd.weight": (wrong_vocab, b)}), base)
    assert message == "tensor 'token_embd.weight' has incorrect shape"
    # the linear layout (A transposed) is wrong for the embedding
    linear_layout = {"token_embd.weight": (a.T.copy(), b)}
    assert rejected(write_adapter(tmp_path / "e2.gguf", linear_layout), base) == "tensor 'token_embd.weight' has incorrect shape"


@pytest.mark.parametrize("with_base", [True, False])
def test_token_embedding_ranks_must_agree(tmp_path, base, good_pairs, with_base) -> None:
    a, b = good_pairs["token_embd.weight"]  # rank 4
    path = write_adapter(tmp_path / "r.gguf", {"token_embd.weight": (a, b[:, :3].copy())})
    assert rejected(path, base if with_base else None) == "tensor 'token_embd.weight' has incorrect shape"


def test_bad_alignment_is_a_format_error(tmp_path, good_pairs) -> None:
    path = write_adapter(tmp_path / "al.gguf", good_pairs, metadata={"general.alignment": (GGUFValueType.UINT32, 0, None)})
    with pytest.raises(GGUFFormatError, match="alignment must be a power of two"):
        load_adapter(path)


def test_pairs_are_checked_in_name_order(tmp_path, base, good_pairs) -> None:
    a, b = good_pairs[Q]
    pairs = {"blk.1.ffn_down.weight": (None, good_pairs["blk.1.ffn_down.weight"][1]), Q: (a, np.zeros((b.shape[0], 5), np.float32))}
    assert rejected(write_adapter(tmp_path / "o.gguf", pairs), base) == "lora_a tensor is not transposed"


def test_data_outside_the_file(tmp_path, base, good_pairs) -> None:
    path = write_adapter(tmp_path / "trunc.gguf", {Q: good_pairs[Q]})
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    assert rejected(path, base) == f"LoRA tensor '{Q}.lora_b' data is not within the file bounds"


def test_quantized_adapter_tensors_load(tmp_path, base, tiny_llama) -> None:
    pairs = random_lora(tiny_llama, ["blk.0.ffn_up.weight"], rank=32, seed=1)  # Q8_0 rows need 32 columns
    adapter = load_adapter(write_adapter(tmp_path / "q8.gguf", pairs, tensor_type=GGMLQuantizationType.Q8_0), base)
    a, _ = adapter.load_pair("blk.0.ffn_up.weight")
    np.testing.assert_allclose(a, pairs["blk.0.ffn_up.weight"][0], atol=0.02)


def test_not_a_gguf_file(tmp_path, base) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFFormatError, match="not a valid GGUF file: bad magic"):
        load_adapter(path, base)


def test_truncated_header(tmp_path, base, good_pairs) -> None:
    path = write_adapter(tmp_path / "h.gguf", good_pairs)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(GGUFFormatError, match="file ends inside the header"):
        load_adapter(path, base)


def test_standalone_checks_without_base(tmp_path, good_pairs, small_adapter_path) -> None:
    copy = shutil.copy(small_adapter_path, tmp_path / "renamed.gguf")
    adapter = load_adapter(copy)
    assert adapter.arch == "llama" and adapter.alpha == 8.0 and adapter.task_name == "small"
    assert len(adapter.pairs) == 90
    assert rejected(
        write_adapter(tmp_path / "bad.gguf", good_pairs, adapter_type="ia3"), None
    ) == "expect adapter.type to be 'lora', but got: ia3"
