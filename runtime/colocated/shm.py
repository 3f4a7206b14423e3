"""Shared-memory transport (CPU path): each bucket is a file under a shared directory, mapped by both sides.

It mirrors CUDA IPC where the protocol cares: a mapping held by the reader outlives the producer's free of
the file name, and a mapping is released only when every view of it is gone, which the forced close verifies
the same way. Descriptors carry a file name only; the importer refuses anything outside its directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import torch

from colocate_runtime.colocated.manifest import Descriptor
from colocate_runtime.colocated.transport import BucketGone, LocalBucket, TransportError

KIND = "SharedMemory"


class SharedMemoryExporter:
    kind = KIND

    def __init__(self, directory: str | os.PathLike[str], uuid: str, *, prefix: str = "colocate") -> None:
        self.directory = Path(directory)
        self.uuid = uuid
        self.prefix = prefix
        self.directory.mkdir(parents=True, exist_ok=True)

    def device_uuid(self) -> str:
        return self.uuid

    def allocate(self, index: int, nbytes: int, tag: str) -> LocalBucket:
        name = f"{self.prefix}-{tag}-b{index}-{os.getpid()}-{secrets.token_hex(4)}"
        path = self.directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return LocalBucket(index, tensor, {"kind": KIND, "file": name, "nbytes": nbytes, "uuid": self.uuid})

    def export(self, bucket: LocalBucket) -> None:
        if bucket.descriptor is None:
            raise TransportError(f"bucket {bucket.index} was not allocated by this exporter")

    def synchronize(self) -> None:
        pass

    def release(self, buckets: list[LocalBucket]) -> None:
        pass  # no share count: a mapping keeps its file's pages by itself, and `free` unlinks the name

    def free(self, buckets: list[LocalBucket]) -> None:
        for b in buckets:
            b.tensor = None
            if b.descriptor is not None:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / str(b.descriptor["file"])).unlink()


class SharedMemoryImporter:
    kind = KIND

    def __init__(self, directory: str | os.PathLike[str], uuid: str, *, prefix: str = "colocate") -> None:
        self.directory = Path(directory).resolve()
        self.uuid = uuid
        self.prefix = prefix

    def device_uuid(self) -> str:
        return self.uuid

    def open(self, descriptor: Descriptor, nbytes: int) -> torch.Tensor:
        if descriptor.get("kind") != KIND:
            raise TransportError(f"descriptor of kind {descriptor.get('kind')!r}, this importer opens {KIND}")
        if descriptor.get("uuid") != self.uuid:
            raise TransportError(
                f"bucket exported on {descriptor.get('uuid')!r}, this reader is on {self.uuid!r}"
            )
        name = descriptor.get("file")
        if not isinstance(name, str) or "/" in name or not name.startswith(self.prefix + "-"):
            raise TransportError(f"bucket file name {name!r} is not one this transport creates")
        path = self.directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise BucketGone(
                f"bucket file {path} is gone (the producer freed it or died, or its shared-memory "
                "directory is not this one)"
            ) from None
        if size < nbytes or descriptor.get("nbytes") != nbytes:
            raise TransportError(f"bucket file {path} holds {size} bytes, the manifest says {nbytes}")
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        pass
