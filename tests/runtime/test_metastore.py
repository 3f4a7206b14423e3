"""Meta-store protocol operations against a real, password-protected redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_runtime.colocated.config import ColocateConfig, ConfigError, MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.liveness import Heartbeat, PeerWatch
from colocate_runtime.colocated.manifest import Ack
from colocate_runtime.colocated.metastore import (
    CLAIM_READER,
    CLAIM_REVOKED,
    MalformedAck,
    MetaStore,
    MetaStoreAuthError,
    MetaStoreConflict,
    MetaStoreUnavailable,
    NotClaimant,
    parse_claim,
    proves,
    reader_identity,
    step_claim,
)
from colocate_runtime.contract import events as ev
from tests.runtime.colocated_env import open_store

pytestmark = pytest.mark.timeout(60)
KEYS = KeySchema("ns1", "job1")
UUID = "GPU-test-0"
ME = step_claim(reader_identity("host-a", 4242, "t0k3n"), "proof-1")


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[MetaStore]:
    yield from open_store(redis_server, KEYS)


def test_wrong_password_is_refused_without_leaking_it(redis_server: RedisServer) -> None:
    bad = MetaStoreAddress("127.0.0.1", redis_server.port, "not-the-password-xyz")
    with pytest.raises(MetaStoreAuthError) as err:
        MetaStore.connect(bad, KEYS)
    assert "not-the-password-xyz" not in str(err.value)
    assert "not-the-password-xyz" not in repr(bad)
    with pytest.raises(MetaStoreAuthError):
        MetaStore.connect(MetaStoreAddress("127.0.0.1", redis_server.port, ""), KEYS)


def test_unreachable_redis_is_a_clear_error() -> None:
    with pytest.raises(MetaStoreUnavailable, match="unreachable"):
        MetaStore.connect(MetaStoreAddress("127.0.0.1", free_port(), "x"), KEYS)


def test_manifest_publish_is_nx_idempotent_and_notifies_once(
    store: MetaStore,
    redis_server: RedisServer,
) -> None:
    gen = store.start_incarnation(UUID)
    assert store.publish_manifest(gen, 1, UUID, b"m1") is True
    assert store.publish_manifest(gen, 1, UUID, b"m1") is False  # a retry of the same write
    with pytest.raises(MetaStoreConflict):
        store.publish_manifest(gen, 1, UUID, b"other")
    assert store.pop_ready(gen, UUID, 0.1) == 1
    assert store.pop_ready(gen, UUID, 0.1) is None  # exactly one notification
    assert store.read_manifest(gen, 1, UUID) == b"m1"
    client = redis_server.client()
    for key in (KEYS.manifest(gen, 1, UUID),):
        ttl = client.pttl(key)
        assert 0 < ttl <= 30_000, key


def test_every_step_key_has_a_ttl(store: MetaStore, redis_server: RedisServer) -> None:
    gen = store.start_incarnation(UUID)
    store.publish_manifest(gen, 1, UUID, b"m")
    store.publish_manifest(gen, 2, UUID, b"m")
    store.claim(gen, 1, UUID, ME)
    store.write_ack(gen, 1, UUID, Ack(status="ok", ipc_closed=True, reader=ME, proof="proof-1"))
    store.abort(gen, 1, "test", "tester")
    store.abort(gen, None, "test", "tester")
    store.heartbeat("reader", UUID, {"x": 1}, ttl_s=5)
    client = redis_server.client()
    keys = [k.decode() for k in client.keys(f"{KEYS.prefix}:*")]
    assert keys
    no_ttl = [k for k in keys if client.pttl(k) < 0 and k != KEYS.gen(UUID)]
    assert no_ttl == []  # only the incarnation counter lives as long as the job's Redis


def test_claim_first_wins(store: MetaStore) -> None:
    gen = store.start_incarnation(UUID)
    assert store.claim(gen, 5, UUID, CLAIM_READER) == CLAIM_READER
    assert store.claim(gen, 5, UUID, CLAIM_REVOKED) == CLAIM_READER
    assert store.claim(gen, 6, UUID, CLAIM_REVOKED) == CLAIM_REVOKED
    assert store.claim(gen, 6, UUID, CLAIM_READER) == CLAIM_REVOKED


def test_ack_wakes_the_waiter_and_states_ipc_closed(store: MetaStore) -> None:
    gen = store.start_incarnation(UUID)
    assert store.wait_ack(gen, 1, UUID, 0.05) is None
    store.claim(gen, 1, UUID, ME)
    ack = Ack(
        status="ok",
        ipc_closed=True,
        bytes_copied=10,
        seconds={"copy": 0.1},
        reader=ME,
        proof="proof-1",
        opened=(0, 1),
    )
    assert store.write_ack(gen, 1, UUID, ack) is True
    assert store.write_ack(gen, 1, UUID, ack) is False
    got = store.wait_ack(gen, 1, UUID, 1.0)
    assert got == ack
    with pytest.raises(Exception, match="ipc_closed"):
        Ack(status="ok", ipc_closed=False)


def test_abort_keys_step_and_incarnation(store: MetaStore) -> None:
    gen = store.start_incarnation(UUID)
    assert store.abort_reason(gen, 3) is None
    store.abort(gen, 3, "operator asked", "operator")
    store.abort(gen, 3, "second reason", "someone")
    assert "operator asked" in store.abort_reason(gen, 3)
    assert store.abort_reason(gen, 4) is None
    store.abort(gen, None, "job suspended", "operator")
    assert "job suspended" in store.abort_reason(gen, 4)


def test_incarnations_separate_keys(store: MetaStore) -> None:
    g1 = store.start_incarnation(UUID)
    store.publish_manifest(g1, 1, UUID, b"old")
    g2 = store.start_incarnation(UUID)
    assert g2 > g1 and store.current_gen(UUID) == g2
    assert store.pop_ready(g2, UUID, 0.05) is None  # the old incarnation's notification is not seen
    assert store.read_manifest(g2, 1, UUID) is None


def test_incarnations_count_per_gpu(store: MetaStore) -> None:
    """Two trainer processes of one job: each GPU keeps its own generation (a job-wide counter let one
    trainer's start hide the other's keys from its reader)."""
    other = "GPU-other"
    mine = store.start_incarnation(UUID)
    theirs = store.start_incarnation(other)
    assert store.current_gen(UUID) == mine and store.current_gen(other) == theirs
    store.restore_gen(UUID, mine + 5)  # NX: an existing counter is never overwritten
    assert store.current_gen(UUID) == mine


def test_heartbeat_expires_and_watch_declares_death(store: MetaStore) -> None:
    hb = Heartbeat(store, "reader", UUID, ttl_s=0.4, info=lambda: {"state": "idle"}).start()
    watch = PeerWatch(store, "reader", UUID, ttl_s=0.4)
    watch.check()
    assert watch.ever_seen and not watch.dead()
    time.sleep(0.6)
    watch.check()
    assert not watch.dead()  # still refreshed
    hb.stop(drop=False)
    deadline = time.monotonic() + 3
    while store.read_heartbeat("reader", UUID) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.read_heartbeat("reader", UUID) is None
    # A heartbeat from this host names a live pid (ours): a silent but live process is not dead.
    time.sleep(0.5)
    watch.check()
    assert watch.silent_for() >= 0.4
    assert not watch.dead()
    watch.last_info = {"host": "elsewhere", "pid": 1}
    assert watch.dead()


def test_redis_restart_is_detected_and_gen_restored(store: MetaStore, redis_server: RedisServer) -> None:
    gen = store.start_incarnation(UUID)
    run_id = store.server_run_id()
    redis_server.restart()
    for _ in range(3):  # the client reconnects (the first call may see the dropped connection)
        try:
            store.ping()
            break
        except MetaStoreUnavailable:
            time.sleep(0.1)
    assert store.server_run_id() != run_id
    assert store.current_gen(UUID) is None
    store.restore_gen(UUID, gen)
    assert store.current_gen(UUID) == gen


def test_step_events_round_trip_through_the_stream(store: MetaStore) -> None:
    e1 = ev.StepEvent(
        role="trainer",
        gen=2,
        step=7,
        phase="finished",
        result="ok",
        seconds=0.0123,
        phase_seconds={"publish": 0.001, "wait_ack": 0.01},
        bytes=1 << 30,
        handles=2,
        replica=1,
        rank=3,
        gpu=UUID,
        weight_version="7",
    )
    e2 = ev.StepEvent(role="trainer", gen=2, step=7, phase="final", result="ok", final=True)
    store.emit(e1, e2)
    got = [e for _, e in store.read_events()]
    assert [e.phase for e in got] == ["finished", "final"]
    assert got[0].phase_seconds == {"publish": 0.001, "wait_ack": 0.01}
    assert got[0].bytes == 1 << 30 and got[0].gpu == UUID and got[0].handles == 2 and not got[0].final
    assert got[1].final and got[1].result == "ok"
    assert ev.stream_key("ns1", "job1") == KEYS.events() == "colocate:ns1:job1:events"


def test_event_codec_rejects_garbage() -> None:
    fields = ev.encode(ev.StepEvent(role="reader", gen=1, step=1, phase="closed", seconds=0.5), now=123.0)
    assert all(isinstance(v, str) for v in fields.values())
    assert ev.decode({k.encode(): v.encode() for k, v in fields.items()}).seconds == 0.5
    with pytest.raises(ev.EventError):
        ev.decode({**fields, "phase": "exploded"})
    with pytest.raises(ev.EventError):
        ev.decode({**fields, "step": "x"})
    with pytest.raises(ev.EventError):
        ev.decode({**fields, "v": "2"})


def test_config_from_env_validates_and_hides_the_password() -> None:
    env = {
        "COLOCATE_JOB_NAME": "job1",
        "COLOCATE_NAMESPACE": "team-a",
        "COLOCATE_METASTORE_ADDR": "job1-redis.team-a.svc:6379",
        "COLOCATE_METASTORE_PASSWORD": "s3cr3t-value",
        "COLOCATE_REPLICA_INDEX": "2",
        "COLOCATE_BUCKET_MB": "512",
        "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
    }
    cfg = ColocateConfig.from_env(env)
    assert cfg.metastore.host == "job1-redis.team-a.svc" and cfg.metastore.port == 6379
    assert cfg.bucket_bytes == 512 << 20 and cfg.replica_index == 2 and cfg.step_timeout_s == 120
    assert "s3cr3t-value" not in repr(cfg) and "s3cr3t-value" not in str(cfg.metastore)
    for key, value, match in (
        ("COLOCATE_METASTORE_ADDR", "no-port", "host:port"),
        ("COLOCATE_BUCKET_MB", "lots", "COLOCATE_BUCKET_MB"),
        ("COLOCATE_TRANSPORT", "Carrier-Pigeon", "COLOCATE_TRANSPORT"),
        ("COLOCATE_JOB_NAME", "a:b", "COLOCATE_JOB_NAME"),
    ):
        with pytest.raises(ConfigError, match=match):
            ColocateConfig.from_env({**env, key: value})
    missing = dict(env)
    del missing["COLOCATE_METASTORE_PASSWORD"]
    with pytest.raises(ConfigError, match="COLOCATE_METASTORE_PASSWORD"):
        ColocateConfig.from_env(missing)


def test_only_the_claimant_can_ack_and_a_stray_value_cannot_lock_it_out(
    store: MetaStore,
    redis_server: RedisServer,
) -> None:
    gen = store.start_incarnation(UUID)
    other = step_claim(reader_identity("host-a", 4243, "0th3r"), "proof-x")
    who = parse_claim(ME)
    assert who is not None and (who.host, who.pid, who.identity) == (
        "host-a",
        4242,
        "reader:host-a:4242:t0k3n",
    )
    assert parse_claim(CLAIM_REVOKED) is None and parse_claim("reader:x:notapid:t:" + "0" * 40) is None
    assert proves(ME, "proof-1") and not proves(ME, "proof-2") and not proves(ME, "")
    mine = Ack(status="ok", ipc_closed=True, reader=ME, proof="proof-1", opened=(0,))
    with pytest.raises(NotClaimant, match="claimed by nobody"):
        store.write_ack(gen, 1, UUID, mine)  # nothing claimed yet
    assert store.claim(gen, 1, UUID, ME) == ME
    with pytest.raises(NotClaimant, match=f"claimed by {ME}, not by {other}"):
        store.write_ack(gen, 1, UUID, Ack(status="ok", ipc_closed=True, reader=other, proof="proof-x"))
    with pytest.raises(NotClaimant):  # the claim's value is public; its proof is not
        store.write_ack(gen, 1, UUID, Ack(status="ok", ipc_closed=True, reader=ME, proof="guess"))
    assert store.read_ack(gen, 1, UUID) is None  # the refused ACKs wrote nothing
    # A stray process writes the ACK key and its token directly (even naming the claim): the claimant's own
    # ACK still gets through.
    client = redis_server.client()
    for forged in (
        Ack(status="ok", ipc_closed=True, reader=other, proof="proof-x").to_json(),
        Ack(status="ok", ipc_closed=True, reader=ME, proof="guess").to_json(),
    ):
        client.set(KEYS.ack(gen, 1, UUID), forged)
        client.rpush(KEYS.ack_queue(gen, 1, UUID), forged)
        assert store.wait_ack(gen, 1, UUID, 1.0).to_json() == forged  # the writer sees it (and refuses it)
    assert store.write_ack(gen, 1, UUID, mine) is True
    assert store.wait_ack(gen, 1, UUID, 1.0) == mine
    assert store.write_ack(gen, 1, UUID, mine) is False  # a retry of the same ACK
    with pytest.raises(MetaStoreConflict):
        store.write_ack(gen, 1, UUID, Ack(status="error", ipc_closed=True, reader=ME, proof="proof-1"))


def test_a_malformed_ack_is_a_clear_error_not_a_crash(store: MetaStore, redis_server: RedisServer) -> None:
    gen = store.start_incarnation(UUID)
    client = redis_server.client()
    for junk in (
        b"{not json",
        b'{"schema": 1}',
        b'{"schema": 1, "status": "ok", "ipc_closed": true, "opened": "x"}',
    ):
        client.set(KEYS.ack(gen, 1, UUID), junk)
        client.rpush(KEYS.ack_queue(gen, 1, UUID), junk)
        with pytest.raises(MalformedAck, match="step 1"):
            store.wait_ack(gen, 1, UUID, 1.0)
        with pytest.raises(MalformedAck):
            store.read_ack(gen, 1, UUID)
