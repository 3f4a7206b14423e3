"""The chart's image reference: by tag (the chart's appVersion by default) or by digest (`image.digest`, what
a user pins after pushing the image to their own registry: README.md, "A real node and images built here")."""

from __future__ import annotations

import pytest

from colocate_devcluster import Cluster
from tests.kube import CHART, helm, render_chart

pytestmark = pytest.mark.integration

DIGEST = "sha256:" + "0123456789abcdef" * 4


def images(cluster: Cluster, *values: str) -> list[str]:
    """The image of every container the chart renders (the operator's Deployment and its helm test pod)."""
    found = []
    for doc in render_chart(cluster, *values):
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc.get("spec", {})
        found += [c["image"] for c in spec.get("containers", []) if isinstance(c, dict) and "image" in c]
    return found


def test_image_by_tag_by_default(cluster: Cluster) -> None:
    assert set(images(cluster)) == {"colocate/colocate-operator:0.1.0"}
    assert set(images(cluster, "--set", "image.tag=0.2.0")) == {"colocate/colocate-operator:0.2.0"}


def test_image_by_digest(cluster: Cluster) -> None:
    repository = ("--set", "image.repository=registry.example/op")
    by_digest = images(cluster, *repository, "--set", f"image.digest={DIGEST}")
    assert len(by_digest) == 2 and set(by_digest) == {f"registry.example/op@{DIGEST}"}
    # A tag beside the digest is kept for people reading the spec; the runtime pulls by the digest.
    both = images(cluster, "--set", "image.tag=0.1.0", "--set", f"image.digest={DIGEST}")
    assert set(both) == {f"colocate/colocate-operator:0.1.0@{DIGEST}"}


@pytest.mark.parametrize("bad", ["latest", "sha256:abc", "sha512:" + "0" * 128, DIGEST.upper()])
def test_schema_refuses_a_digest_that_is_not_sha256(cluster: Cluster, bad: str) -> None:
    result = helm(cluster, "template", "rel", str(CHART), "--set", f"image.digest={bad}", check=False)
    assert result.returncode != 0 and "digest" in result.stderr, result.stderr
