"""Every HTTP answer in `loraplex_gateway_requests_total`, once (gateway/http/observed.py): those
refused before they reached a worker (a bad key, a bad body, a limit, no such route) as well as
those respond() answered, each under the labels known by then."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.gateway_setup import PROMPT, auth

Labels = tuple[str, str, str, str]  # tenant, adapter, endpoint, status


def answers(client) -> dict[Labels, float]:
    """The request counts /metrics shows, its own scrapes left out."""
    text = client.get("/metrics", headers=auth("operator")).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "loraplex_gateway_requests")
    return {(s.labels["tenant"], s.labels["adapter"], s.labels["endpoint"], s.labels["status"]): s.value
            for s in family.samples if s.name.endswith("_total") and s.labels["endpoint"] != "/metrics"}


def counted(client, send) -> dict[Labels, float]:
    """What `send()` added to the counts."""
    before = answers(client)
    send()
    after = answers(client)
    return {labels: n - before.get(labels, 0.0) for labels, n in after.items() if n != before.get(labels, 0.0)}


def test_each_refusal_before_a_worker_is_counted_once_with_its_status(client) -> None:
    def post(key: str | None, body: dict) -> None:
        headers = auth(key) if key else {"Authorization": "Bearer not-a-key"}
        client.post("/v1/completions", headers=headers, json=body)

    assert counted(client, lambda: post("t1", {"model": "a", "prompt": PROMPT, "max_tokens": -5})) == {
        ("t1", "", "completions", "400"): 1}
    assert counted(client, lambda: post(None, {"model": "a", "prompt": "hi"})) == {("", "", "completions", "401"): 1}
    assert counted(client, lambda: client.get("/no/such/route", headers=auth())) == {("t1", "", "", "404"): 1}
    assert counted(client, lambda: post("t2", {"model": "a", "prompt": "hi", "max_tokens": 2})) == {
        ("t2", "", "completions", "404"): 1}  # an adapter it may not use answers as an unknown one
    assert counted(client, lambda: post("t1", {"model": "a", "prompt": "x" * 5000})) == {("t1", "", "completions", "413"): 1}
    for _ in range(2):  # requests_per_min: 2, counted before the body is read
        post("limited", {})
    assert counted(client, lambda: post("limited", {})) == {("limited", "", "completions", "429"): 1}


def test_an_answered_request_is_counted_once_by_respond_whole_or_streamed(client) -> None:
    body = {"model": "b", "prompt": PROMPT, "max_tokens": 2}
    assert counted(client, lambda: client.post("/v1/completions", headers=auth(), json=body)) == {
        ("t1", "b", "completions", "200"): 1}
    assert counted(client, lambda: client.post("/v1/completions", headers=auth(), json={**body, "stream": True})) == {
        ("t1", "b", "completions", "200"): 1}
    assert counted(client, lambda: client.get("/v1/models", headers=auth("t2"))) == {("t2", "", "/v1/models", "200"): 1}


def test_the_inter_token_latency_of_a_finished_choice_is_observed(client) -> None:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    client.post("/v1/completions", headers=auth("shared"), json=body)
    text = client.get("/metrics", headers=auth("operator")).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "loraplex_gateway_itl_seconds")
    count = next(s for s in family.samples if s.name.endswith("_count") and s.labels == {"tenant": "shared", "adapter": "a"})
    assert count.value == 1
