"""CUDA IPC transport: buckets in plain cudaMalloc memory, exported as explicit descriptor fields.

The descriptor holds the fields torch's storage sharing produces (`UntypedStorage._share_cuda_`: memory
handle, sizes, offsets, the producer's reference-counter file and its event) as bytes and ints, so the reader
rebuilds the storage with `UntypedStorage._new_shared_cuda` and nothing is unpickled. These are private torch
APIs: `tests/runtime/test_colocated_gpu.py` covers them on every torch the project uses.

Memory from VMM allocators (expandable segments, torch_memory_saver) cannot be exported with
`cudaIpcGetMemHandle`; the exporter refuses to start when the caching allocator is configured that way.
GPUs are named by UUID: the two containers of a pod may number them differently.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from colocate_runtime.colocated.manifest import Descriptor
from colocate_runtime.colocated.transport import DeviceNotVisible, LocalBucket, TransportError

log = logging.getLogger(__name__)

KIND = "CudaIPC"
_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# torch's limits (c10/cuda CUDACachingAllocator, torch/csrc/CudaIPCTypes.h): blocks start at multiples of
# 512 bytes within their segment, a reference-counter file holds 10000 counters, IPC handles are 64 bytes.
_BLOCK_ALIGN = 512
_REF_COUNTERS_PER_FILE = 10_000
_EVENT_HANDLE_BYTES = 64
_MAX_OFFSET = 1 << 40  # no GPU has a terabyte segment
# A reference-counter file as torch's RefcountedMapAllocator lays it out in /dev/shm: its own 64-byte header,
# then the int64 counters. A file of another size is not read (release then decrements once, blind).
_REF_FILE_HEADER = 64
_REF_FILE_BYTES = _REF_FILE_HEADER + 8 * _REF_COUNTERS_PER_FILE
_SHM_DIR = Path("/dev/shm")


def gpu_uuid(device: torch.device | int) -> str:
    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        index = torch.cuda.current_device()
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid)


def device_index_of(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    raise DeviceNotVisible(
        f"no visible GPU has UUID {uuid} (visible: {visible}); "
        "the trainer and SGLang containers must share the same GPUs"
    )


def visible_uuids() -> frozenset[str]:
    """UUIDs of every GPU this process can see (no CUDA context is created for them)."""
    return frozenset(gpu_uuid(i) for i in range(torch.cuda.device_count()))


def allocator_settings() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    runtime = getter() if getter is not None else ""
    env = ",".join(os.environ.get(name, "") for name in _ALLOC_ENV)
    return f"{env},{runtime}"


def check_exportable() -> None:
    """Refuse allocator settings whose memory cudaIpcGetMemHandle cannot export."""
    settings = allocator_settings().replace(" ", "").lower()
    if "expandable_segments:true" in settings:
        raise TransportError(
            "CUDA IPC buckets need plain cudaMalloc memory, but the caching allocator uses expandable "
            "segments "
            "(expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF/PYTORCH_ALLOC_CONF or set at run time); "
            "such virtual-memory allocations cannot be exported with cudaIpcGetMemHandle. Turn expandable "
            "segments off in the trainer for the weight sync."
        )
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise TransportError(
            f"CUDA IPC buckets need PyTorch's native caching allocator (plain cudaMalloc), not {backend!r}"
        )


class CudaIpcExporter:
    kind = KIND

    def __init__(self, device: torch.device | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise TransportError("CUDA IPC transport needs a GPU; use the SharedMemory transport on CPU")
        check_exportable()
        self.device = torch.device(
            "cuda",
            torch.cuda.current_device()
            if device is None
            else (device.index if isinstance(device, torch.device) else device),
        )
        self._uuid = gpu_uuid(self.device)

    def device_uuid(self) -> str:
        return self._uuid

    def allocate(self, index: int, nbytes: int, tag: str) -> LocalBucket:
        return LocalBucket(index, torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def export(self, bucket: LocalBucket) -> None:
        if bucket.tensor is None:
            raise TransportError(f"bucket {bucket.index} was already freed")
        storage = bucket.tensor.untyped_storage()
        (_device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        bucket.descriptor = {
            "kind": KIND,
            "uuid": self._uuid,
            "handle": bytes(handle),
            "storage_nbytes": int(size),
            "storage_offset": int(offset),
            "ref_counter_handle": bytes(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": None if event_handle is None else bytes(event_handle),
            "event_sync_required": bool(event_sync),
        }

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self, buckets: list[LocalBucket]) -> None:
        """Bring torch's share count of each bucket to zero, as the reader's close would have. `_share_cuda_`
        sets a bucket's counter to 1 and only the consumer's storage deleter decrements it; a bucket no reader
        mapped (or whose reader died holding it) would otherwise sit in torch's IPC limbo, allocated, until
        this process exits. Only for buckets no reader maps or ever will: the caller's protocol says which.

        The counter is read first, so a bucket whose reader closed it before dying is not decremented twice
        (a negative counter reads as a huge unsigned one to torch: limbo for good)."""
        for b in buckets:
            d = b.descriptor
            if not d or d.get("kind") != KIND:
                continue
            handle, offset = d["ref_counter_handle"], d["ref_counter_offset"]
            assert isinstance(handle, bytes) and isinstance(offset, int)
            count = share_count(handle, offset)
            if count is None:
                log.debug("IPC counter of bucket %d not readable: one decrement", b.index)
                count = 1
            for _ in range(min(count, 64)):
                torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)

    def free(self, buckets: list[LocalBucket]) -> None:
        for b in buckets:
            b.tensor = None
        # Blocks shared with a consumer sit in torch's IPC limbo until the consumer's reference counter drops;
        # collect them now that the consumer said its mappings are closed.
        torch.cuda.ipc_collect()


def share_count(ref_counter_handle: bytes, ref_counter_offset: int) -> int | None:
    """The value of one of torch's CUDA IPC reference counters (how many consumers still hold the storage),
    read from its shared-memory file; None when the file is gone or not laid out as expected."""
    name = ref_counter_handle.decode("ascii", errors="replace").lstrip("/")
    if not name or "/" in name or not 0 <= ref_counter_offset < _REF_COUNTERS_PER_FILE:
        return None
    try:
        with open(_SHM_DIR / name, "rb") as f:
            if os.fstat(f.fileno()).st_size != _REF_FILE_BYTES:
                return None
            f.seek(_REF_FILE_HEADER + 8 * ref_counter_offset)
            raw = f.read(8)
    except OSError:
        return None
    return int.from_bytes(raw, sys.byteorder, signed=True) if len(raw) == 8 else None


def check_descriptor(descriptor: Descriptor, nbytes: int) -> None:
    """Refuse, before anything is mapped, a descriptor whose fields torch would turn into pointer arithmetic
    out of range (descriptors come from the meta-store, which every container of the job can write):
    storage offset and size, the reference counter's file name and slot (torch decrements that int64 when
    the mapping closes), the event handle. What cannot be checked without mapping: that the offset lies
    inside the exporter's segment (the handle does not say how large it is)."""

    def bad(field: str, why: str) -> TransportError:
        return TransportError(f"CUDA IPC descriptor refused: {field} {why}")

    def integer(field: str, low: int, high: int) -> int:
        value = descriptor.get(field)
        if type(value) is not int or not low <= value < high:
            raise bad(field, f"= {value!r}, expected an integer in [{low}, {high})")
        return value

    if descriptor.get("kind") != KIND:
        raise TransportError(f"descriptor of kind {descriptor.get('kind')!r}, this importer opens {KIND}")
    uuid = descriptor.get("uuid")
    if not isinstance(uuid, str) or not uuid.startswith("GPU-") or len(uuid) > 64:
        raise bad("uuid", f"= {uuid!r}, expected a GPU UUID")
    handle = descriptor.get("handle")
    if not isinstance(handle, bytes) or not 0 < len(handle) <= 256:
        raise bad("handle", "is not a memory handle (bytes)")
    if integer("storage_nbytes", 1, _MAX_OFFSET) != nbytes:
        raise bad("storage_nbytes", f"= {descriptor['storage_nbytes']}, the manifest says {nbytes}")
    if integer("storage_offset", 0, _MAX_OFFSET) % _BLOCK_ALIGN:
        raise bad("storage_offset", f"= {descriptor['storage_offset']} is not a block start")
    ref = descriptor.get("ref_counter_handle")
    if (
        not isinstance(ref, bytes)
        or not 1 < len(ref) <= 255
        or not ref.startswith(b"/")
        or b"/" in ref[1:]
        or not ref.isascii()
        or not ref[1:].replace(b"_", b"").replace(b"-", b"").replace(b".", b"").isalnum()
    ):
        raise bad("ref_counter_handle", f"= {ref!r}, expected a shared-memory name such as /torch_1_2_3")
    integer("ref_counter_offset", 0, _REF_COUNTERS_PER_FILE)
    event = descriptor.get("event_handle")
    if event is not None and (not isinstance(event, bytes) or len(event) != _EVENT_HANDLE_BYTES):
        raise bad("event_handle", f"is not None or {_EVENT_HANDLE_BYTES} bytes")
    if type(descriptor.get("event_sync_required")) is not bool:
        raise bad("event_sync_required", "is not a boolean")


class CudaIpcImporter:
    kind = KIND

    def __init__(self, device: torch.device | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise TransportError("CUDA IPC transport needs a GPU")
        index = (
            torch.cuda.current_device()
            if device is None
            else (device.index if isinstance(device, torch.device) else device)
        )
        self.device = torch.device("cuda", index)
        self._uuid = gpu_uuid(self.device)

    def device_uuid(self) -> str:
        return self._uuid

    def open(self, descriptor: Descriptor, nbytes: int) -> torch.Tensor:
        check_descriptor(descriptor, nbytes)
        uuid = str(descriptor["uuid"])
        index = device_index_of(uuid)
        if index != self.device.index:
            raise TransportError(f"bucket lives on {uuid}, this reader serves {self._uuid}")
        size = int(descriptor["storage_nbytes"])  # type: ignore[arg-type]
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                descriptor["handle"],
                size,
                descriptor["storage_offset"],
                descriptor["ref_counter_handle"],
                descriptor["ref_counter_offset"],
                descriptor["event_handle"],
                descriptor["event_sync_required"],
            )
        except (KeyError, TypeError, RuntimeError) as err:
            raise TransportError(f"cannot open the CUDA IPC handle of a bucket on {uuid}: {err}") from err
        flat = torch.empty(0, dtype=torch.uint8, device=self.device)
        flat.set_(storage, 0, (nbytes,), (1,))
        return flat

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
