"""The reader's kept mappings (kept.py) on their own: which anchors `hold` opens, keeps and drops, with a
counting importer in place of CUDA IPC; no Redis."""

from __future__ import annotations

import logging

import pytest
import torch

from colocate_runtime.colocated.kept import KeptMappings, kept_key
from colocate_runtime.colocated.manifest import BucketRecord
from colocate_runtime.colocated.transport import TransportError


class Importer:
    """Opens a descriptor as a fresh CPU tensor; counts opens and synchronizes, fails where told."""

    kind = "Fake"

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.syncs = 0
        self.fail: set[bytes] = set()

    def device_uuid(self) -> str:
        return "GPU-x"

    def open(self, descriptor: dict, nbytes: int) -> torch.Tensor:
        handle = descriptor["handle"]
        if handle in self.fail:
            raise TransportError(f"cannot open {handle!r}")
        self.opened.append(handle)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        self.syncs += 1


def bucket(index: int, handle: bytes, *, offset: int = 0, nbytes: int = 64) -> BucketRecord:
    descriptor = {"uuid": "GPU-x", "handle": handle, "storage_offset": offset, "nbytes": nbytes}
    return BucketRecord(index, "bfloat16", nbytes, descriptor)


@pytest.fixture
def importer() -> Importer:
    return Importer()


@pytest.mark.parametrize(
    ("descriptor", "key"),
    [
        ({"uuid": "GPU-x", "handle": b"\x01\x02"}, b"GPU-x/\x01\x02"),
        ({"uuid": "GPU-x", "file": "/dev/shm/b0"}, b"GPU-x//dev/shm/b0"),
        ({"uuid": "GPU-x", "handle": b"h", "file": "f"}, b"GPU-x/h"),  # the handle names a CUDA allocation
        ({"handle": b"h"}, None),  # no device
        ({"uuid": "GPU-x"}, None),  # nothing names the allocation
        ({"uuid": "GPU-x", "handle": b""}, None),
        ({"uuid": 3, "handle": b"h"}, None),
    ],
)
def test_kept_key(descriptor: dict, key: bytes | None) -> None:
    assert kept_key(BucketRecord(0, "bfloat16", 8, descriptor)) == key


def test_the_first_step_opens_its_anchors_and_later_steps_read_through_them(importer: Importer) -> None:
    kept = KeptMappings(importer)
    first = kept.hold([bucket(0, b"a"), bucket(1, b"b")])
    assert first.opened == (0, 1) and first.indices == (0, 1) and len(kept) == 2
    # The next step's buckets: the same allocations at the same places, under any index.
    second = kept.hold([bucket(3, b"a"), bucket(4, b"b")])
    assert second.opened == () and second.indices == (3, 4) and importer.opened == [b"a", b"b"]
    assert second.tensors[3] is first.tensors[0] and second.tensors[4] is first.tensors[1]


def test_an_anchor_the_manifest_no_longer_keeps_is_dropped_first(importer: Importer) -> None:
    kept = KeptMappings(importer)
    kept.hold([bucket(0, b"a"), bucket(1, b"b")])
    moved = kept.hold([bucket(0, b"a"), bucket(1, b"c")])  # the trainer's storage of bucket 1 moved
    assert moved.opened == (1,) and len(kept) == 2 and importer.opened == [b"a", b"b", b"c"]
    assert importer.syncs == 1  # no copy still reads through the dropped anchor
    nothing = kept.hold([])  # the trainer stopped asking
    assert nothing.tensors == {} and len(kept) == 0


def test_another_place_in_the_same_allocation_is_another_anchor(importer: Importer) -> None:
    kept = KeptMappings(importer)
    held = kept.hold([bucket(0, b"a", offset=0), bucket(1, b"a", offset=64)])
    assert held.opened == (0, 1) and len(kept) == 2
    resized = kept.hold([bucket(0, b"a", offset=0, nbytes=32)])  # same handle, another storage size
    assert resized.opened == (0,) and len(kept) == 1


def test_buckets_without_a_key_are_not_kept(importer: Importer) -> None:
    kept = KeptMappings(importer)
    unnamed = BucketRecord(0, "bfloat16", 8, {"uuid": "GPU-x"})
    held = kept.hold([unnamed, bucket(1, b"a")])
    assert held.indices == (1,) and held.opened == (1,) and len(kept) == 1


def test_a_step_whose_open_fails_closes_the_anchors_it_opened(importer: Importer) -> None:
    kept = KeptMappings(importer)
    kept.hold([bucket(0, b"a")])
    importer.fail.add(b"c")
    with pytest.raises(TransportError):
        kept.hold([bucket(0, b"a"), bucket(1, b"b"), bucket(2, b"c")])
    # "b" was this step's: closed again so that its failed ACK need not name it; "a" was an earlier step's.
    assert len(kept) == 1
    assert kept.hold([bucket(0, b"a")]).opened == ()


def test_drop_all(importer: Importer, caplog: pytest.LogCaptureFixture) -> None:
    kept = KeptMappings(importer)
    kept.hold([bucket(0, b"a"), bucket(1, b"b")])
    with caplog.at_level(logging.INFO, logger="colocate_runtime.colocated.kept"):
        kept.drop_all("trainer generation 1 ended")
    assert len(kept) == 0 and importer.syncs == 2
    assert "kept mappings dropped (2): trainer generation 1 ended" in caplog.text
    assert "still referenced" not in caplog.text
    assert kept.hold([bucket(0, b"a")]).opened == (0,)  # opened afresh


def test_an_anchor_still_referenced_when_dropped_is_reported(
    importer: Importer, caplog: pytest.LogCaptureFixture
) -> None:
    kept = KeptMappings(importer)
    leak = kept.hold([bucket(0, b"a")]).tensors[0]
    with caplog.at_level(logging.WARNING, logger="colocate_runtime.colocated.kept"):
        kept.drop_all("reader closed")
    assert "still referenced after it was dropped" in caplog.text
    del leak
