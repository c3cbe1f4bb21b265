"""Speculative decoding's counts per adapter set in `/metrics`: each choice's drafts, as its
`/completion` timings report them (`draft_n`, `draft_n_accepted`), are counted under its tenant
and adapters (`loraplex_gateway_*draft*_total`), and those add up to the replicas' own totals
(`loraplex_engine_*draft*_total`); usage counts generated tokens, drafts or not."""

from __future__ import annotations

import uuid
from collections import defaultdict

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.gateway_setup import auth, local_serving, tiny_config

PROMPT = list(range(4, 40)) * 2  # a prompt that repeats itself
PREDICTED = 16
REPEAT = {"logit_bias": [[7, 50]]}  # decoding says 7, 7, 7, ...: drafted and accepted


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("gw"), prefix,
                         speculative={"method": "ngram", "max_draft": 3, "is_adaptive": False})
    with local_serving(config) as (app, _), TestClient(app) as client:
        yield client


def totals(text: str, family: str, by: str | None) -> dict[str, float]:
    """The `family`'s counter samples in `text`, summed by the label `by` (None: all in one)."""
    sums: dict[str, float] = defaultdict(float)
    for parsed in text_string_to_metric_families(text):
        if parsed.name == family:
            for sample in parsed.samples:
                if sample.name == f"{family}_total":
                    sums[sample.labels[by] if by else ""] += sample.value
    return dict(sums)


def test_drafts_are_counted_per_adapter_set_and_add_up_to_the_replicas_totals(client) -> None:
    reported: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # adapter label -> draft_n, draft_n_accepted
    for names, label in ((["a"], "a"), (["b", "a"], "a+b"), ([], "base")):  # stacked: one set, its names sorted
        for extra in ({}, REPEAT):
            body = {"prompt": PROMPT, "n_predict": PREDICTED, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "lora": [{"name": name, "scale": 0.5} for name in names], **extra}
            answer = client.post("/completion", headers=auth(), json=body)
            assert answer.status_code == 200, answer.text
            answer = answer.json()
            assert answer["tokens_predicted"] == answer["timings"]["predicted_n"] == PREDICTED  # drafts are never billed
            reported[label][0] += answer["timings"].get("draft_n", 0)
            reported[label][1] += answer["timings"].get("draft_n_accepted", 0)
    assert all(0 < accepted <= drafted for drafted, accepted in reported.values()), reported
    text = client.get("/metrics", headers=auth("operator")).text
    drafted = totals(text, "loraplex_gateway_drafted_tokens", "adapter")
    accepted = totals(text, "loraplex_gateway_accepted_draft_tokens", "adapter")
    assert drafted == {label: n for label, (n, _) in reported.items()}
    assert accepted == {label: n for label, (_, n) in reported.items()}
    assert set(totals(text, "loraplex_gateway_drafted_tokens", "tenant")) == {"t1"}
    assert sum(drafted.values()) == totals(text, "loraplex_engine_drafted_tokens", None)[""]  # every replica's
    assert sum(accepted.values()) == totals(text, "loraplex_engine_accepted_draft_tokens", None)[""]
    completion = totals(text, "loraplex_gateway_completion_tokens", "adapter")
    assert completion == {label: 2 * PREDICTED for label in reported}
