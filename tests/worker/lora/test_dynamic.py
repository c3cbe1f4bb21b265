"""Adapters come and go between steps, and a pass computes only the adapters in its batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import invocation_metadata, random_lora, write_adapter
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.lora import batch as lora_batch
from worker.lora.backend import TorchLoRABackend
from worker.lora.mapping import token_scales
from worker.model.attention import Segment

ATTN = ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.attn_q.weight"]
MLP = ["blk.0.ffn_up.weight", "blk.1.ffn_down.weight"]


class CountingBackend(TorchLoRABackend):
    """Records the rank columns of every linear LoRA matmul, and the blocks of every grouped one."""

    def __init__(self) -> None:
        self.columns: list[int] = []
        self.groups: list[tuple[int, int]] = []  # (blocks, rows per block)

    def add_linear(self, out, x, a, b, scales) -> None:
        self.columns.append(a.shape[0])
        super().add_linear(out, x, a, b, scales)

    def add_linear_groups(self, out, x, a, b, rows, scales) -> None:
        self.groups.append(tuple(scales.shape[:2]))
        super().add_linear_groups(out, x, a, b, rows, scales)


MODES = {  # how a pass computes its adapters: (SEGMENTED_MIN_ROWS, SEGMENTED_MIN_RUN, GROUPED_MAX_SHARE, GROUPED_MIN_MACS)
    "segmented": (1, 1, lora_batch.GROUPED_MAX_SHARE, 0),
    "stacked": (10**9, 1, 0.0, 0),
    "grouped": (10**9, 1, 1.0, 0),
    # the defaults but for the floor on a grouped matmul's size (the tiny model's matmuls are all small)
    "grouped if worth it": (lora_batch.SEGMENTED_MIN_ROWS, lora_batch.SEGMENTED_MIN_RUN, lora_batch.GROUPED_MAX_SHARE, 0),
}


def compute_adapters(monkeypatch, mode: str) -> None:
    for name, value in zip(("SEGMENTED_MIN_ROWS", "SEGMENTED_MIN_RUN", "GROUPED_MAX_SHARE", "GROUPED_MIN_MACS"), MODES[mode]):
        monkeypatch.setattr(lora_batch, name, value)


def adapters(tiny, tmp_path, count: int, targets=ATTN, rank: int = 4, seed: int = 100):
    base = GGUFFile(tiny.path)
    return [load_adapter(write_adapter(tmp_path / f"a{seed + i}.gguf", random_lora(tiny, targets, rank=rank, seed=seed + i), alpha=8.0),
                         base)
            for i in range(count)]


def test_an_added_adapter_serves_as_if_loaded_at_start_and_a_removed_one_is_gone(tiny_llama, tmp_path) -> None:
    first, second, third = adapters(tiny_llama, tmp_path, 2) + adapters(tiny_llama, tmp_path, 1, MLP, seed=200)
    ids = list(range(5, 40))
    runner = ModelRunner(GGUFFile(tiny_llama.path), [first], TEST_DEVICE)
    before = prompt_logits(runner, ids, {0: 1.0})
    assert runner.add_adapter(second) == 1
    alone = ModelRunner(GGUFFile(tiny_llama.path), [second], TEST_DEVICE)
    torch.testing.assert_close(prompt_logits(runner, ids, {1: 0.8}), prompt_logits(alone, ids, {0: 0.8}), atol=1e-5, rtol=1e-5)
    runner.remove_adapter(0)
    assert runner.lora.nbytes(0) == 0 and 0 not in runner.adapters
    with pytest.raises(ValueError, match="adapter slot 0 does not exist"):
        runner.resolve_adapters(ids, {0: 1.0})
    assert runner.add_adapter(third) == 0  # the freed slot, with targets no adapter had: wrapped now
    mlp_alone = ModelRunner(GGUFFile(tiny_llama.path), [third], TEST_DEVICE)
    torch.testing.assert_close(prompt_logits(runner, ids, {0: 1.0}), prompt_logits(mlp_alone, ids, {0: 1.0}), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(prompt_logits(runner, ids, {0: 1.0}), before, atol=1e-3)
    torch.testing.assert_close(prompt_logits(runner, ids, {1: 0.8}), prompt_logits(alone, ids, {0: 0.8}), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("alora_rank", [4, 2])
def test_a_mixed_batch_equals_each_request_alone_every_way(tiny_llama, tmp_path, monkeypatch, mode, alora_rank) -> None:
    """Segmented (each adapter over its rows), stacked (one stack of the active adapters) and grouped
    (the stack's blocks, each over its own rows) passes give each request what it gets alone, with
    stacked adapters and an aLoRA in the batch; a stack of mixed ranks is never grouped."""
    held = adapters(tiny_llama, tmp_path, 3)
    invocation = [150, 151]
    alora = load_adapter(write_adapter(tmp_path / "alora.gguf", random_lora(tiny_llama, ATTN + MLP, rank=alora_rank, seed=9),
                                       metadata=invocation_metadata(invocation)), GGUFFile(tiny_llama.path))
    backend = CountingBackend()
    runner = ModelRunner(GGUFFile(tiny_llama.path), [*held, alora], TEST_DEVICE, backend)
    seqs = [(list(range(10, 40)), {0: 1.0}), (list(range(50, 70)) + invocation + [7, 8], {1: 0.5, 3: 1.0}),
            (list(range(80, 105)), {0: -0.5, 2: 1.0}), (list(range(110, 120)), {})]
    # alone: under 64 tokens, and one adapter's rows are the whole pass: stacked
    expected = [prompt_logits(runner, ids, s) for ids, s in seqs]
    assert not backend.groups
    compute_adapters(monkeypatch, mode)
    kv = runner.allocate_kv(len(seqs), 64)
    mapped = [runner.resolve_adapters(ids, s) for ids, s in seqs]
    tokens, segments = [], []
    for slot, (ids, _) in enumerate(seqs):
        segments.append(Segment(slot, len(tokens), len(ids), 0))
        tokens += ids
    rows, active = token_scales([(m, 0, len(ids)) for m, (ids, _) in zip(mapped, seqs)])
    out = runner.logits(tokens, segments, kv, torch.from_numpy(rows), active, range(len(tokens))).cpu()
    offset = 0
    for (ids, _), want in zip(seqs, expected):
        torch.testing.assert_close(out[offset : offset + len(ids)], want, atol=1e-4, rtol=1e-4)  # batch shape changes GEMM blocking
        offset += len(ids)
    # asking for a few rows, the last layer computes only those, each with its own adapters' scales
    # each sequence's last row, and one after the aLoRA's activation
    wanted = [seg.row + seg.length - 1 for seg in segments] + [segments[1].row + 21]
    few = runner.logits(tokens, segments, runner.allocate_kv(len(seqs), 64), torch.from_numpy(rows), active, wanted).cpu()
    torch.testing.assert_close(few, out[wanted], atol=1e-4, rtol=1e-4)
    if mode == "grouped":  # the MLP targets hold the aLoRA alone; the attention ones all four, grouped only at one rank
        blocks = {count for count, _ in backend.groups}
        assert blocks == ({1, 4} if alora_rank == 4 else {1})


def test_a_pass_computes_only_the_adapters_in_its_batch(tiny_llama, tmp_path) -> None:
    """A worker holding 40 adapters, decoding 2 of them: every LoRA matmul spans the 2 adapters'
    rank columns, not 40's; a big (segmented) pass spans one adapter's at a time."""
    backend = CountingBackend()
    runner = ModelRunner(GGUFFile(tiny_llama.path), adapters(tiny_llama, tmp_path, 40), TEST_DEVICE, backend)
    kv = runner.allocate_kv(2, 128)
    mapped = [runner.resolve_adapters([], {7: 1.0}), runner.resolve_adapters([], {31: 1.0})]
    rows, active = token_scales([(mapped[0], 0, 1), (mapped[1], 0, 1)])
    runner.logits([5, 6], [Segment(0, 0, 1, 0), Segment(1, 1, 1, 0)], kv, torch.from_numpy(rows), active, [0, 1])
    assert backend.columns and set(backend.columns) == {8}  # rank 4 + rank 4, stacked
    for first in range(0, 40, 2):  # other pairs come and go: the working set takes them in, and stays bounded
        backend.columns.clear()
        pair = [runner.resolve_adapters([], {first: 1.0}), runner.resolve_adapters([], {first + 1: 1.0})]
        rows, active = token_scales([(pair[0], 0, 1), (pair[1], 0, 1)])
        runner.logits([5, 6], [Segment(0, 0, 1, 0), Segment(1, 1, 1, 0)], kv, torch.from_numpy(rows), active, [0, 1])
        assert 8 <= max(backend.columns) <= 2 * 8 + 64 + 8  # its two, plus idle ones at most twice theirs and the spare room
    backend.columns.clear()
    rows, active = token_scales([(mapped[0], 0, 60), (mapped[1], 0, 60)])
    runner.logits(list(range(120)), [Segment(0, 0, 60, 0), Segment(1, 60, 60, 0)], kv, torch.from_numpy(rows), active, [59, 119])
    assert backend.columns and set(backend.columns) == {4}  # one adapter over its own rows


def test_a_decode_step_of_many_adapters_computes_each_over_its_own_rows(tiny_llama, tmp_path, monkeypatch) -> None:
    """16 sequences on 16 adapters of one rank: one batched matmul of 16 blocks of one row each;
    16 sequences on one adapter: one matmul over the stack; and the same tokens either way."""
    compute_adapters(monkeypatch, "grouped if worth it")
    backend = CountingBackend()
    runner = ModelRunner(GGUFFile(tiny_llama.path), adapters(tiny_llama, tmp_path, 16), TEST_DEVICE, backend)
    segments = [Segment(i, i, 1, 0) for i in range(16)]

    def step(slots: list[int]) -> torch.Tensor:
        backend.columns.clear()
        backend.groups.clear()
        rows, active = token_scales([(runner.resolve_adapters([], {slot: 1.0}), 0, 1) for slot in slots])
        return runner.logits(list(range(5, 21)), segments, runner.allocate_kv(16, 8), torch.from_numpy(rows), active, range(16)).cpu()

    mixed = step(list(range(16)))
    assert backend.groups and set(backend.groups) == {(16, 1)} and not backend.columns
    for slot in (0, 9):
        same = step([slot] * 16)
        assert backend.columns and not backend.groups
        torch.testing.assert_close(same[slot], mixed[slot], atol=1e-5, rtol=1e-5)


def test_a_stack_is_grouped_only_where_that_is_cheaper() -> None:
    """The defaults: 16 rows on 16 rank-16 adapters of a 576 x 576 linear are grouped; the same at
    rank 8, or on 8 adapters of two rows each, or on a 64 x 64 linear, are not (the stack's one
    matmul is as fast there); nor is a stack of mixed ranks, or one adapter on most rows."""
    import numpy as np

    from worker.lora.batch import LoRABatch

    def groups(slot_of_row: list[int], ranks: list[int], features: int):
        scales = np.zeros((len(slot_of_row), len(ranks)), dtype=np.float32)
        scales[np.arange(len(slot_of_row)), slot_of_row] = 0.5
        batch = LoRABatch()
        batch.set(torch.from_numpy(scales), tuple(range(len(ranks))), scales)
        return batch.groups(tuple(enumerate(ranks)), torch.float32, sum(ranks) * features)

    rows, scales = groups(list(range(16)), [16] * 16, 1152)
    assert rows.tolist() == list(range(16)) and scales.shape == (16, 1, 1) and set(scales.flatten().tolist()) == {0.5}
    assert groups(list(range(16)), [8] * 16, 1152) is None
    assert groups([i % 8 for i in range(16)], [16] * 8, 1152) is None
    assert groups(list(range(16)), [16] * 16, 128) is None
    assert groups(list(range(16)), [16] * 15 + [8], 1152) is None
    assert groups([0] * 8 + list(range(8, 16)), [64] * 16, 4096) is None
    rows, scales = groups([i % 16 for i in range(64)], [16] * 16, 1152)  # 64 rows of 16 adapters: blocks of 4 rows
    assert rows.view(16, 4)[3].tolist() == [3, 19, 35, 51]


def test_a_decode_step_of_many_sequences_is_not_computed_run_by_run(tiny_llama, tmp_path, monkeypatch) -> None:
    """64 sequences of one new token each on 32 adapters: a big pass, but of 64 runs of one row:
    one batched matmul of 32 blocks of two rows per target, as the stack computes it."""
    compute_adapters(monkeypatch, "grouped if worth it")
    backend = CountingBackend()
    runner = ModelRunner(GGUFFile(tiny_llama.path), adapters(tiny_llama, tmp_path, 32), TEST_DEVICE, backend)
    segments = [Segment(i, i, 1, 0) for i in range(64)]
    rows, active = token_scales([(runner.resolve_adapters([], {i % 32: 1.0}), 0, 1) for i in range(64)])

    def step() -> torch.Tensor:
        return runner.logits(
            [5 + i for i in range(64)], segments, runner.allocate_kv(64, 4), torch.from_numpy(rows), active, range(64)
        ).cpu()

    grouped = step()
    assert backend.groups and set(backend.groups) == {(32, 2)} and not backend.columns
    compute_adapters(monkeypatch, "stacked")
    torch.testing.assert_close(step(), grouped, atol=1e-5, rtol=1e-5)
    assert backend.columns and set(backend.columns) == {32 * 4}


@pytest.mark.parametrize("mode", list(MODES))
def test_an_adapter_with_infinite_weights_poisons_only_its_own_rows(tiny_llama, tmp_path, monkeypatch, mode) -> None:
    """0 * inf is NaN: an inf adapter idle in a batch (or in the working set) must not touch others' rows."""
    import numpy as np

    good = adapters(tiny_llama, tmp_path, 1)[0]
    pairs = {t: (a, np.full_like(b, np.inf)) for t, (a, b) in random_lora(tiny_llama, ATTN, 4, seed=7).items()}
    hot = load_adapter(write_adapter(tmp_path / "hot.gguf", pairs), GGUFFile(tiny_llama.path))
    embedding = {"token_embd.weight": random_lora(tiny_llama, ["token_embd.weight"], 4, seed=8)["token_embd.weight"]}
    hot_embedding = load_adapter(
        write_adapter(tmp_path / "hot-e.gguf", {t: (a, np.full_like(b, np.inf)) for t, (a, b) in embedding.items()}),
        GGUFFile(tiny_llama.path),
    )
    runner = ModelRunner(GGUFFile(tiny_llama.path), [good, hot, hot_embedding], TEST_DEVICE)
    ids = list(range(10, 45))
    want = prompt_logits(runner, ids, {0: 1.0})
    compute_adapters(monkeypatch, mode)
    for bad in (1, 2):
        kv = runner.allocate_kv(2, 64)
        mapped = [runner.resolve_adapters(ids, {bad: 1.0}), runner.resolve_adapters(ids, {0: 1.0})]
        rows, active = token_scales([(m, 0, len(ids)) for m in mapped])
        out = runner.logits(ids + ids, [Segment(0, 0, len(ids), 0), Segment(1, len(ids), len(ids), 0)], kv, torch.from_numpy(rows), active,
                            range(2 * len(ids))).cpu()
        assert not torch.isfinite(out[: len(ids)]).all()
        torch.testing.assert_close(out[len(ids):], want, atol=1e-5, rtol=1e-5)


def test_what_a_target_keeps_between_steps_follows_every_change_of_its_adapters() -> None:
    """The split of a batch's slots and the working set are kept while the batch's adapters stay
    the same: a slot's weights replaced, made non-finite or removed under the same active slots
    must show at once."""
    from worker.lora.weights import TargetWeights

    def pair(value: float, a_value: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2, 3), value if a_value is None else a_value), torch.full((4, 2), value)

    weights = TargetWeights("linear")
    weights.add(0, *pair(1.0))
    weights.add(1, *pair(2.0))
    used, shared, alone = weights.split((0, 1))
    assert (used, shared, alone) == ((0, 1), (0, 1), ())
    a, b = weights.working_set(shared)
    assert a[:, 0].tolist() == [1, 1, 2, 2] and b[0].tolist() == [1, 1, 2, 2]
    weights.add(1, *pair(5.0))  # replaced in its slot
    a, b = weights.working_set(weights.split((0, 1))[1])
    assert sorted(a[:, 0].tolist()) == [1, 1, 5, 5] and sorted(b[0].tolist()) == [1, 1, 5, 5]
    weights.add(0, *pair(1.0, float("inf")))  # non-finite now: computed alone
    assert weights.split((0, 1)) == ((0, 1), (1,), (0,))
    weights.remove(1)
    assert weights.split((0, 1)) == ((0,), (), (0,))
