"""Where the operator's API credentials come from, and whether the kubernetes client library loads at all.

The operator talks to the API server through two clients: kopf's (aiohttp) and kube.py's (urllib3). Both
take their credentials from kopf's login functions: the pod's service account in the cluster, else the
current context of KUBECONFIG (or ~/.kube/config) with a token, a client certificate or basic auth. Only a
kubeconfig whose user runs an `exec` plugin or an `auth-provider` needs the kubernetes client library to get
a token (`kopf.login_via_client`).

The library costs the operator process about 32 MiB of memory just by being imported (its typed models),
and kopf imports it whenever it is installed. So `python -m colocate_operator` keeps it out of the process
(`keep_client_library_out`, before kopf is imported) unless the kubeconfig needs it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import kopf

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_CLIENT_PLUGINS = ("exec", "auth-provider")
log = logging.getLogger(__name__)


def _kubeconfig_paths() -> list[Path]:
    listed = os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in listed.split(os.pathsep) if p.strip()]
    return paths or [Path("~/.kube/config").expanduser()]


def kubeconfig_needs_client_library(documents: list[dict[str, Any]]) -> bool:
    """Whether the current context's user gets its token from a plugin (the first value wins, as kubectl
    merges files)."""
    current = next((d.get("current-context") for d in documents if d.get("current-context")), None)
    contexts = {c.get("name"): c.get("context") or {} for d in documents for c in d.get("contexts") or []}
    users: dict[Any, dict[str, Any]] = {}
    for d in documents:
        for u in d.get("users") or []:
            users.setdefault(u.get("name"), u.get("user") or {})
    user = users.get(contexts.get(current, {}).get("user"), {})
    return any(user.get(key) for key in _CLIENT_PLUGINS)


def needs_client_library() -> bool:
    """In a pod: no. Else whether the kubeconfig's current user needs a plugin (unreadable: say yes and let
    the library report it, as before)."""
    if SERVICE_ACCOUNT_TOKEN.exists():
        return False
    documents = []
    try:
        for path in _kubeconfig_paths():
            if path.exists():
                documents.append(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError):
        return True
    return kubeconfig_needs_client_library(documents)


def keep_client_library_out() -> bool:
    """Make `import kubernetes` fail in this process unless the credentials need it (kopf then uses its own
    login functions). Call before kopf is imported; True if the library was kept out."""
    if "kubernetes" in sys.modules or needs_client_library():
        return False
    sys.modules["kubernetes"] = None  # type: ignore[assignment]  # Python's own "import blocked" marker
    return True


def login() -> kopf.ConnectionInfo:
    """The operator's credentials, as kopf resolves them: service account, kubeconfig, then (for plugin
    users, when the library is installed) the kubernetes client library."""
    import kopf

    settings = kopf.OperatorSettings()
    for attempt in (kopf.login_with_service_account, kopf.login_with_kubeconfig):
        info = attempt(settings=settings)
        if info is not None and (
            info.token or info.certificate_path or info.certificate_data or info.password
        ):
            return info
    via_library = kopf.login_via_client(settings=settings, logger=log)
    if via_library is not None:
        return via_library
    raise kopf.LoginError(
        "no Kubernetes credentials: not in a pod with a service account, and KUBECONFIG (or ~/.kube/config) "
        "has no usable user in its current context"
    )
