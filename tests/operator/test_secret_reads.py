"""One read of an External meta-store's Secret per job: the reconciler's check and the step follower's first
connection share it (secret_reads.py), and a reconnect reads the Secret again, so a rotated password is
picked up."""

from __future__ import annotations

import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from colocate_operator import kube
from colocate_operator.config import OperatorConfig
from colocate_operator.metastore import endpoint
from colocate_operator.reconciler import Reconciler
from colocate_operator.secret_reads import SecretReads
from colocate_operator.store_credentials import password_of as _credentials
from tests.operator import factories
from tests.operator.test_reconciler import NOW, FakeKube

STORE = {"mode": "External", "external": {"address": "127.0.0.1:6379", "passwordSecretRef": {"name": "ms"}}}
CONFIG = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})


def put_secret(api: FakeKube, password: str) -> None:
    data = {"password": base64.b64encode(password.encode()).decode()}
    api.put(kube.SECRETS, {"metadata": {"name": "ms", "namespace": "ns"}, "data": data})


def secret_gets(api: FakeKube) -> int:
    return sum(1 for call in api.calls if call[:2] == ("get", "secrets"))


@pytest.fixture
def api() -> FakeKube:
    fake = FakeKube()
    fake.put(kube.COLOCATE_JOBS, factories.body(metaStore=STORE))
    fake.put(kube.DEVICE_CLASSES, {"metadata": {"name": "gpu.nvidia.com"}})
    put_secret(fake, "first")
    return fake


def test_the_follower_uses_the_reconcilers_read_and_a_reconnect_reads_the_rotated_password(
    api: FakeKube,
) -> None:
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    reconciler._schedule = lambda *args: None  # type: ignore[method-assign]
    reads = reconciler.secret_reads
    reconciler.reconcile("ns", "demo")
    assert secret_gets(api) == 1
    assert "first" not in repr(reads)

    store = endpoint(factories.job(metaStore=STORE), CONFIG)
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=False) == "first"
    assert secret_gets(api) == 1  # the first connection took the reconciler's read

    put_secret(api, "second")  # rotated
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=False) == "first"
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=True) == "second"
    assert secret_gets(api) == 2
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=False) == "second"


def test_a_read_older_than_max_age_or_a_missing_key_is_read_again(api: FakeKube) -> None:
    now = [0.0]
    reads = SecretReads(max_age=120, clock=lambda: now[0])
    store = endpoint(factories.job(metaStore=STORE), CONFIG)
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=False) == "first"
    put_secret(api, "second")
    now[0] += 121
    assert _credentials(api, store, "ns", "demo", None, reads, fresh=False) == "second"
    assert secret_gets(api) == 2
    api.objects.pop(("secrets", "ns", "ms"))
    with pytest.raises(LookupError, match="ns/ms"):
        _credentials(api, store, "ns", "demo", None, reads, fresh=True)
    assert reads.recent("ns", "ms") is None  # a deleted Secret is not answered from memory


def test_a_read_without_the_key_is_not_trusted_by_the_reconciler_or_the_follower(api: FakeKube) -> None:
    reconciler = Reconciler(api, CONFIG, clock=lambda: NOW)
    reconciler._schedule = lambda *args: None  # type: ignore[method-assign]
    api.put(kube.SECRETS, {"metadata": {"name": "ms", "namespace": "ns"}, "data": {}})
    reconciler.reconcile("ns", "demo")
    assert "not found" in str(api.job()["status"])
    put_secret(api, "added")  # the user fixes the Secret
    store = endpoint(factories.job(metaStore=STORE), CONFIG)
    assert _credentials(api, store, "ns", "demo", None, reconciler.secret_reads, fresh=False) == "added"


class _SlowSecrets:
    """An API whose Secret reads block until released, counting them."""

    def __init__(self) -> None:
        self.gets = 0
        self.release = threading.Event()

    def get(self, kind: kube.Kind, namespace: str, name: str, **_: object) -> dict:
        self.gets += 1
        assert self.release.wait(10)
        return {"metadata": {"resourceVersion": "7"}, "data": {"password": "cGFzcw=="}}


def test_passes_that_start_together_share_one_read_of_their_secret() -> None:
    reads, api = SecretReads(max_age=120), _SlowSecrets()
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(reads.read_shared, api, "ns", "ms") for _ in range(8)]  # type: ignore[arg-type]
        time.sleep(0.2)
        api.release.set()
        results = [a.result(10) for a in answers]
    assert api.gets == 1
    assert all(r is not None and r.data == {"password": "cGFzcw=="} for r in results)
    assert reads.read_shared(api, "ns", "ms") is not None and api.gets == 2, "no flight left behind"  # type: ignore[arg-type]
