"""External meta-stores (M9): the operator dials, and sends a job's password to, only the addresses its
administrator allowed; a job naming another one is refused with a condition that says why, and no pods."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from colocate_operator import metastore
from colocate_operator.addresses import AddressAllowList
from colocate_operator.config import ConfigError, OperatorConfig
from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decide import decide
from colocate_operator.observed import Observed
from colocate_operator.spec import ColocateJob
from tests.operator import factories

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
ALLOW = "redis.shared.example.com:6379, *.redis.example.com, 10.20.0.0/16, cache.example.com"


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("redis.shared.example.com:6379", True),
        ("REDIS.shared.example.com:6379", True),  # DNS names are case-insensitive
        ("redis.shared.example.com:6380", False),  # the entry names its port
        ("a.redis.example.com:1234", True),
        ("a.b.redis.example.com:6379", True),
        ("redis.example.com:6379", False),  # `*.domain` is what is under it, not the domain itself
        ("evilredis.example.com:6379", False),
        ("10.20.3.4:6379", True),
        ("10.21.0.1:6379", False),
        ("cache.example.com:1", True),  # no port in the entry: any port
        ("cache.example.com.evil.net:6379", False),
        ("169.254.169.254:80", False),
        ("127.0.0.1:6379", False),
        ("redis.default.svc.cluster.local:6379", False),
        ("no-port", False),
    ],
)
def test_allow_list_matches_addresses_as_written(address: str, allowed: bool) -> None:
    assert AddressAllowList.parse(ALLOW).allows(address) is allowed


def test_empty_allow_list_refuses_everything_and_star_allows_everything() -> None:
    assert not AddressAllowList().allows("redis:6379")
    assert not AddressAllowList.parse("").allows("redis:6379")
    assert AddressAllowList.parse("*").allows("anything.at.all:1")


@pytest.mark.parametrize(
    ("entry", "named"),
    [("10.0.0.0/33", "10.0.0.0/33"), ("redis:0", "redis:0"), ("redis:port", "redis:port"), ("a b", "a b")],
)
def test_bad_allow_list_entries_are_a_config_error_naming_them(entry: str, named: str) -> None:
    with pytest.raises(ConfigError, match="COLOCATE_EXTERNAL_METASTORE_ALLOW") as error:
        OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": f"ok.example.com,{entry}"})
    assert named in str(error.value)


def test_config_reads_the_allow_list() -> None:
    config = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": ALLOW})
    assert config.external_metastore_allow.allows("10.20.0.9:6379")
    assert not OperatorConfig.from_env({}).external_metastore_allow.allows("10.20.0.9:6379")


def external_job(address: str) -> ColocateJob:
    return factories.job(
        metaStore={
            "mode": "External",
            "external": {"address": address, "passwordSecretRef": {"name": "auth"}},
        }
    )


def test_a_job_naming_an_address_not_allowed_is_refused_with_a_condition_and_no_pods() -> None:
    config = OperatorConfig(external_metastore_allow=AddressAllowList.parse(ALLOW))
    job = external_job("evil.example.net:6379")
    assert metastore.endpoint(job, config).allowed is False
    # Even with its Secret present, nothing starts: the pods would send the password there too.
    observed = Observed(external_secret_found=True, device_class_found=True)
    plan = decide(job, {}, observed, NOW, config, "unused")
    assert not [m for m in plan.creates if m["kind"] == "Pod"]
    (meta,) = [c for c in plan.status["conditions"] if c["type"] == Cond.META_STORE_READY]
    assert (meta["status"], meta["reason"]) == ("False", Reason.EXTERNAL_ADDRESS_NOT_ALLOWED)
    assert "evil.example.net:6379" in meta["message"]
    assert "externalMetaStore.allowedAddresses" in meta["message"]
    assert plan.status["phase"] == Phase.PENDING

    allowed = decide(external_job("redis.shared.example.com:6379"), {}, observed, NOW, config, "x")
    assert [m for m in allowed.creates if m["kind"] == "Pod"], "an allowed address starts the pods"


def test_managed_meta_store_is_always_the_operators_own() -> None:
    assert metastore.endpoint(factories.job(), OperatorConfig()).allowed is True
