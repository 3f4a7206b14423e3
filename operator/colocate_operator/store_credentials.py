"""The meta-store password (and Redis user) the operator dials a job's store with, read from Kubernetes.

Shared by the step follower, which reads the job's step stream, and the checkpoint reads (checkpoints.py).
A Managed store's Service and Secret must be the job's own before its password is sent anywhere; an External
store's Secret is read through the operator's recent Secret reads, so that a reconcile and a follower that
both need it moments apart cost one read.
"""

from __future__ import annotations

import base64

from colocate_operator import kube, names
from colocate_operator.metastore import MetaStoreEndpoint
from colocate_operator.secret_reads import SecretReads


def check_managed_store_owned(api: kube.Kube, namespace: str, job: str, uid: str | None) -> None:
    """The Managed Redis Service and Secret must be the job's own (LookupError otherwise): an object of
    that name held by someone else would receive the job's password, or hand it theirs."""
    for kind, child in ((kube.SERVICES, names.metastore(job)), (kube.SECRETS, names.metastore_secret(job))):
        meta = api.get(kind, namespace, child, metadata_only=True)
        owners = [ref.get("uid") for ref in ((meta or {}).get("metadata") or {}).get("ownerReferences") or []]
        if meta is not None and uid not in owners:
            raise LookupError(f"{kind.plural} {namespace}/{child} is not owned by the job: not dialing it")


def password_from_secret(api: kube.Kube, namespace: str, name: str, key: str) -> str:
    secret = api.get(kube.SECRETS, namespace, name)
    if secret is None or key not in (secret.get("data") or {}):
        raise LookupError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(secret["data"][key]).decode()


def password_of(
    api: kube.Kube,
    store: MetaStoreEndpoint,
    namespace: str,
    name: str,
    uid: str | None,
    secret_reads: SecretReads | None = None,
    fresh: bool = True,
) -> str:
    """The store's password. An External store's Secret as the reconciler (or another follower) read it
    moments ago unless `fresh` (a reconnect after a failure reads it again: the password may have rotated)."""
    if store.mode == "Managed":  # never our password to a Service someone else holds (M2)
        check_managed_store_owned(api, namespace, name, uid)
    elif secret_reads is not None:
        seen = None if fresh else secret_reads.recent(namespace, store.secret_name)
        if seen is None and not fresh:  # nothing remembered: share a read in flight
            seen = secret_reads.read_shared(api, namespace, store.secret_name)
        elif seen is None or store.secret_key not in seen.data:  # a missing key is never taken from memory
            seen = secret_reads.read(api, namespace, store.secret_name)
        if seen is None or store.secret_key not in seen.data:
            raise LookupError(f"Secret {namespace}/{store.secret_name} has no key {store.secret_key!r}")
        return base64.b64decode(seen.data[store.secret_key]).decode()
    return password_from_secret(api, namespace, store.secret_name, store.secret_key)


def username_of(
    api: kube.Kube, store: MetaStoreEndpoint, namespace: str, secret_reads: SecretReads | None = None
) -> str | None:
    """The Redis user of the operator's password: None (`default`) for its Managed store; for an External one
    the Secret's `username` key where present (a shared store's per-job ACL user, operator/README.md)."""
    if store.mode == "Managed" or store.username_key is None:
        return None
    seen = secret_reads.recent(namespace, store.secret_name) if secret_reads is not None else None
    data = (
        seen.data
        if seen is not None
        else (api.get(kube.SECRETS, namespace, store.secret_name) or {}).get("data")
    )
    raw = (data or {}).get(store.username_key)
    if not raw:
        return None
    return base64.b64decode(raw).decode().strip() or None
