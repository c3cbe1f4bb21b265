"""Run-time tenants' keys (gateway/tenancy/accounts.py) over a records file in tmp_path, on a fake clock: the
limit on a tenant's live keys holds through rotations too."""

from __future__ import annotations

import asyncio

import pytest

from gateway.registry.records import FileRecords
from gateway.tenancy.accounts import MAX_KEYS_PER_TENANT, AccountError, AccountRecords, Accounts, keys_of


def live_keys(accounts: Accounts, now_s: float) -> int:
    _, records = asyncio.run(accounts.load())
    return sum(k.is_valid(now_s) for k in keys_of(records, "acme"))


@pytest.fixture
def accounts(tmp_path) -> Accounts:
    accounts = Accounts(FileRecords(tmp_path, name="tenants", record_type=AccountRecords), frozenset(), frozenset(),
                        clock=lambda: 1000.0)
    asyncio.run(accounts.create_tenant("acme", {}))
    return accounts


def test_rotating_with_a_grace_period_counts_the_old_key_toward_the_limit(accounts) -> None:
    _, newest, _ = asyncio.run(accounts.issue_key("acme"))
    for _ in range(MAX_KEYS_PER_TENANT - 1):  # each rotation leaves the old key live for an hour
        _, newest, _ = asyncio.run(accounts.issue_key("acme", replacing=newest.id, old_expires_s=4600.0))
    assert live_keys(accounts, 1000.0) == MAX_KEYS_PER_TENANT
    with pytest.raises(AccountError) as refused:
        asyncio.run(accounts.issue_key("acme", replacing=newest.id, old_expires_s=4600.0))
    assert refused.value.status == 403 and refused.value.code == "key_limit"
    assert live_keys(accounts, 1000.0) == MAX_KEYS_PER_TENANT  # the refused rotation changed nothing

    _, newest, _ = asyncio.run(accounts.issue_key("acme", replacing=newest.id))  # no grace: the old key ends now
    assert live_keys(accounts, 1000.0) == MAX_KEYS_PER_TENANT
    with pytest.raises(AccountError) as refused:
        asyncio.run(accounts.issue_key("acme"))
    assert refused.value.code == "key_limit"
