"""What the CUDA driver charges to give a released range its memory back: the floor under SGLang's
`resume_memory_occupation(["weights"])` with `--enable-memory-saver`.

torch_memory_saver keeps each weight's virtual range and, on release, unmaps and frees its physical memory
(cuMemUnmap + cuMemRelease); on resume it creates new physical memory and maps it again (cuMemCreate +
cuMemMap + cuMemSetAccess), once per allocation. This times those driver calls alone, through ctypes on
libcuda, for the same bytes cut three ways: one allocation, the model's own tensors (SGLang allocates one
per parameter), and 2 MiB granules; and, beside them, cudaMalloc/cudaFree of the same bytes and one device-
to-device copy of them (what our update itself costs). No SGLang, no torch_memory_saver: if the driver alone
takes about what the resume takes, the resume is the driver's and no loader can make it faster. (One
physical allocation mapped piecewise into the ranges would need a nonzero cuMemMap offset, which the driver
refuses: CUDA_ERROR_NOT_SUPPORTED, 801, on the H200.)

    python3 bench/vmm_bench.py --gib 61 --tensors 435 [--repeats 3]

Prints one JSON line and appends it to bench/results/vmm.jsonl.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "vmm.jsonl"
_GRANULE = 2 << 20
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The six VMM calls torch_memory_saver makes, on the current device's primary context."""

    def __init__(self, device: int) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        u64, size, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        for name, types in {
            "cuMemAddressReserve": [ptr, size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [ptr, size, ptr, u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemSetAccess": [u64, size, ptr, size],
            "cuMemUnmap": [u64, size],
            "cuMemRelease": [u64],
        }.items():
            getattr(self.cu, name).argtypes = types
        torch.cuda.init()  # the primary context torch made current
        self.prop = _AllocProp()
        self.prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
        self.access = _AccessDesc(
            _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), 0, 0, 0), "reserve")
        return ptr.value

    def free_address(self, ptr: int, size: int) -> None:
        self._check(self.cu.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "address free")

    def create(self, size: int) -> int:
        handle = ctypes.c_uint64()
        self._check(
            self.cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop), 0),
            "create",
        )
        return handle.value

    def map(self, ptr: int, size: int, handle: int, offset: int = 0) -> None:
        self._check(self.cu.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), offset, handle, 0), "map")

    def allow(self, ptr: int, size: int) -> None:
        self._check(
            self.cu.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self.access), 1),
            "access",
        )

    def map_new(self, ptr: int, size: int) -> int:
        handle = self.create(size)
        self.map(ptr, size, handle)
        self.allow(ptr, size)
        return handle

    def unmap_release(self, ptr: int, size: int, handle: int) -> None:
        self._check(self.cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "unmap")
        self._check(self.cu.cuMemRelease(ctypes.c_uint64(handle)), "release")


def _round(n: int) -> int:
    return (n + _GRANULE - 1) // _GRANULE * _GRANULE


def split(total: int, parts: int) -> list[int]:
    """`parts` sizes summing to about `total`, granule-rounded, uneven like a model's (a few large, many
    small): sizes proportional to 1..parts."""
    weights = list(range(1, parts + 1))
    scale = total / sum(weights)
    return [_round(max(_GRANULE, int(w * scale))) for w in weights]


def time_cycle(driver: Driver, sizes: list[int]) -> dict[str, float]:
    """Release then resume every range, as torch_memory_saver does: returns ms for each half."""
    ranges = [(driver.reserve(s), s) for s in sizes]
    handles = [driver.map_new(p, s) for p, s in ranges]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for (p, s), h in zip(ranges, handles, strict=True):
        driver.unmap_release(p, s, h)
    t1 = time.perf_counter()
    handles = [driver.map_new(p, s) for p, s in ranges]
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for (p, s), h in zip(ranges, handles, strict=True):
        driver.unmap_release(p, s, h)
        driver.free_address(p, s)
    return {"release_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3}


def time_phases(driver: Driver, sizes: list[int]) -> dict[str, float]:
    """Resume split by call: cuMemCreate, cuMemMap, cuMemSetAccess, each over every range (ms)."""
    ranges = [(driver.reserve(s), s) for s in sizes]
    t0 = time.perf_counter()
    handles = [driver.create(s) for _, s in ranges]
    t1 = time.perf_counter()
    for (p, s), h in zip(ranges, handles, strict=True):
        driver.map(p, s, h)
    t2 = time.perf_counter()
    for p, s in ranges:
        driver.allow(p, s)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    for (p, s), h in zip(ranges, handles, strict=True):
        driver.unmap_release(p, s, h)
        driver.free_address(p, s)
    return {"create_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "access_ms": (t3 - t2) * 1e3}


def time_cudamalloc(total: int) -> dict[str, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    buf = torch.empty(total, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    del buf
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return {"malloc_ms": (t1 - t0) * 1e3, "free_ms": (time.perf_counter() - t1) * 1e3}


def time_copy(total: int) -> float:
    src = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return best * 2e3  # the whole size: twice the half we copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=61.0, help="bytes to release and resume (GiB)")
    ap.add_argument("--tensors", type=int, default=435, help="allocations of the model-like cut")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--granules", action="store_true", help="also 2 MiB allocations (about 10 s on an H200)")
    args = ap.parse_args(argv)
    total = _round(int(args.gib * 2**30))
    driver = Driver(torch.cuda.current_device())
    cuts = {"one": [total], "tensors": split(total, args.tensors)}
    if args.granules:
        cuts["granules"] = [_GRANULE] * (total // _GRANULE)
    line: dict[str, Any] = {"gib": args.gib, "device": torch.cuda.get_device_name(0)}
    for name, sizes in cuts.items():
        runs = [time_cycle(driver, sizes) for _ in range(args.repeats)]
        line[name] = {
            "allocations": len(sizes),
            "release_ms": round(min(r["release_ms"] for r in runs), 2),
            "resume_ms": round(min(r["resume_ms"] for r in runs), 2),
        }
        print(name, line[name], flush=True)
    tensors = cuts["tensors"]
    phases = [time_phases(driver, tensors) for _ in range(args.repeats)]
    line["tensors_phases_ms"] = {k: round(min(r[k] for r in phases), 2) for k in phases[0]}
    print("phases", line["tensors_phases_ms"], flush=True)
    line["cudamalloc"] = {k: round(v, 2) for k, v in time_cudamalloc(total).items()}
    line["copy_ms"] = round(time_copy(total), 2)
    line["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(line))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
