"""Where `loraplex serve` runs (gateway/cluster/ray_nodes.py): the address it joins, and an address where
nothing answers refused at once instead of after Ray's minutes of retries."""

from __future__ import annotations

import socket
import time

import pytest

from gateway.cluster.ray_nodes import JoinError, check_reachable, ray_address
from tests.redis_server import free_port


def test_the_flag_wins_over_ray_address_and_nothing_means_a_local_ray() -> None:
    assert ray_address("10.0.0.1:6379", {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.1:6379"
    assert ray_address(None, {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.2:6379"
    assert ray_address(None, {"RAY_ADDRESS": ""}) is None
    assert ray_address(None, {}) is None


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_address_where_nothing_listens_is_refused_at_once(form) -> None:
    address = form.format(port=free_port())
    started = time.monotonic()
    with pytest.raises(JoinError, match=address.replace(".", r"\.")):
        check_reachable(address, timeout_s=2)
    assert time.monotonic() - started < 2


def test_an_address_that_answers_and_one_ray_resolves_itself_pass() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=2)
    check_reachable("auto")  # Ray looks for a local cluster itself
