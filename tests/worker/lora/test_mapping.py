"""Request scales -> per-token adapter scales (pure, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.formats.alora import MultipleALoRAError
from worker.lora.mapping import RequestAdapters, resolve, token_scales

INVOCATIONS = [None, None, (7, 8), (9,)]  # adapter slots 2 and 3 are aLoRAs


def test_plain_adapters_apply_from_the_first_token_and_scale_zero_is_off() -> None:
    mapped = resolve(INVOCATIONS, [1, 2, 3], {0: 0.5, 1: 0.0})
    assert mapped == RequestAdapters({0: 0.5}) and mapped.active_slots == {0}
    rows, active = token_scales([(mapped, 0, 3)])
    np.testing.assert_array_equal(rows, [[0.5]] * 3)  # one column per active slot, never one per slot held
    assert active == (0,)


def test_an_alora_applies_from_its_activation_index_even_across_spans() -> None:
    prompt = [1, 2, 3, 7, 8, 4]  # invocation at 3 -> active from 2
    mapped = resolve(INVOCATIONS, prompt, {1: 1.0, 2: 2.0})
    assert (mapped.alora_slot, mapped.activation, mapped.alora_scale) == (2, 2, 2.0)
    rows, active = token_scales([(mapped, 0, 2), (RequestAdapters(), 0, 1), (mapped, 2, 4)])
    assert active == (1, 2)
    np.testing.assert_array_equal(rows[:, 1], [0, 0, 0, 2, 2, 2, 2])  # first span ends before the activation
    np.testing.assert_array_equal(rows[:, 0], [1, 1, 0, 1, 1, 1, 1])
    first_only, active = token_scales([(mapped, 0, 2)])
    assert active == (1,) and first_only.shape == (2, 1)


def test_an_alora_without_its_invocation_is_off_and_two_are_refused() -> None:
    assert resolve(INVOCATIONS, [1, 2, 3], {2: 1.0}) == RequestAdapters()
    with pytest.raises(MultipleALoRAError):
        resolve(INVOCATIONS, [7, 8, 9], {2: 1.0, 3: 1.0})
    assert resolve(INVOCATIONS, [7, 8, 9], {2: 1.0, 3: 0.0}).alora_slot == 2
    with pytest.raises(ValueError, match="adapter slot 4 does not exist"):
        resolve(INVOCATIONS, [1], {4: 1.0})
