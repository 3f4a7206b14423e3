"""The messages of one step: the trainer's manifest (msgpack) and the reader's ACK (JSON). Never pickle.

A manifest names, for one GPU and one step, the buckets (dtype, size and a transport descriptor made of plain
fields: bytes, ints, strings) and the entries packed in them (canonical name, dtype, shape, byte offset and an
optional shard box). A decoded manifest is checked before any of it is used: a reader never maps or indexes
memory on the strength of an unchecked message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from colocate_runtime.colocated.buckets import (
    BucketPlan,
    BucketPlanError,
    BucketSpec,
    PlacedEntry,
    check_plan,
)
from colocate_runtime.shards import ShardError, TensorShard

SCHEMA_VERSION = 1
Descriptor = dict[str, str | int | bytes | bool | None]


class ManifestError(ValueError):
    """A manifest or ACK that cannot be trusted (wrong schema, step, GPU, or inconsistent layout)."""


@dataclass(frozen=True, slots=True)
class Producer:
    rank: int
    replica: int
    pid: int
    host: str


@dataclass(frozen=True, slots=True)
class BucketRecord:
    index: int
    dtype: str
    nbytes: int
    descriptor: Descriptor


@dataclass(frozen=True, slots=True)
class WeightDigest:
    """The trainer's weights check of one step (digest.py): every `period` steps cover every byte; `sums`
    holds one little-endian uint16 per entry, in entry order."""

    period: int
    chunk: int
    sums: bytes


@dataclass(frozen=True, slots=True)
class Manifest:
    job: str
    namespace: str
    gen: int
    step: int
    gpu: str
    weight_version: str
    transport: str
    producer: Producer
    buckets: tuple[BucketRecord, ...]
    entries: tuple[PlacedEntry, ...]
    checksums: dict[str, str] = field(default_factory=dict)
    # Buckets the producer lets the reader keep mapped across steps: its own storage, which stays where it
    # is (the reader's KeptMappings). A reader that does not know the field maps and closes them per step.
    kept: tuple[int, ...] = ()
    digest: WeightDigest | None = None  # None: the trainer runs no weights check (or an older trainer)

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def plan(self) -> BucketPlan:
        return BucketPlan(tuple(BucketSpec(b.index, b.dtype, b.nbytes) for b in self.buckets), self.entries)


def _entry_columns(entries: tuple[PlacedEntry, ...]) -> dict[str, list]:
    # Entries as parallel columns: a 400-entry manifest encodes and decodes in well under a millisecond.
    cols: dict[str, list] = {
        "name": [e.name for e in entries],
        "dtype": [e.dtype for e in entries],
        "shape": [list(e.shape) for e in entries],
        "bucket": [e.bucket for e in entries],
        "offset": [e.offset for e in entries],
        "nbytes": [e.nbytes for e in entries],
        "shard": [None if e.shard is None else e.shard.to_json() for e in entries],
    }
    if any(e.view is not None for e in entries):  # in-place steps only: packed manifests keep their bytes
        cols["view"] = [None if e.view is None else [list(e.view[0]), list(e.view[1])] for e in entries]
    return cols


# Layouts at least this large travel by reference: written once under their hash, named by each manifest
# (a whole Qwen3-30B-A3B rank has 18,867 entries, 5 MB packed: 26 ms a step to write and read again). Even
# a dense 8B model's 400 entries (42 KB) cost about 0.3 ms a step embedded (the publish and fetch scripts
# carry them, the reader unpacks them to compare); only a layout of a few dozen entries stays embedded.
LAYOUT_BY_REFERENCE_BYTES = 4 << 10


def layout_ref(packed: bytes) -> str:
    return hashlib.sha256(packed).hexdigest()[:32]


class LayoutEncoder:
    """The writer's cache of its last layout's encoded entry columns: layouts repeat from step to step, so a
    step's manifest is its small parts packed around bytes packed once (the same bytes as without it)."""

    def __init__(self) -> None:
        self._entries: tuple[PlacedEntry, ...] | None = None
        self._packed = b""
        self.ref = ""

    def entries_bytes(self, entries: tuple[PlacedEntry, ...]) -> bytes:
        if entries is not self._entries and entries != self._entries:
            self._packed = msgpack.packb(_entry_columns(entries), use_bin_type=True)
            self.ref = layout_ref(self._packed)
        self._entries = entries
        return self._packed


def encode_manifest(m: Manifest, layout: LayoutEncoder | None = None, *, by_reference: bool = False) -> bytes:
    """`by_reference`: name the layout (`layout.ref`) instead of embedding it; the writer stores its bytes
    under that name (`MetaStore.publish_manifest(..., layout=)`)."""
    doc = _manifest_doc(m)
    if layout is None:
        doc["entries"] = _entry_columns(m.entries)
        return msgpack.packb(doc, use_bin_type=True)
    if by_reference:
        layout.entries_bytes(m.entries)
        doc["layout"] = layout.ref
        return msgpack.packb(doc, use_bin_type=True)
    # The same bytes as msgpack.packb(doc): a map header, then each key and value, in insertion order.
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(doc) + 1)]
    for key, value in doc.items():
        parts.append(packer.pack(key))
        parts.append(packer.pack(value))
    parts.append(packer.pack("entries"))
    parts.append(layout.entries_bytes(m.entries))
    return b"".join(parts)


def _manifest_doc(m: Manifest) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "job": m.job,
        "namespace": m.namespace,
        "gen": m.gen,
        "step": m.step,
        "gpu": m.gpu,
        "weight_version": m.weight_version,
        "transport": m.transport,
        "producer": {
            "rank": m.producer.rank,
            "replica": m.producer.replica,
            "pid": m.producer.pid,
            "host": m.producer.host,
        },
        "buckets": [
            {"index": b.index, "dtype": b.dtype, "nbytes": b.nbytes, "descriptor": b.descriptor}
            for b in m.buckets
        ],
        "checksums": dict(m.checksums),
        **({"kept": list(m.kept)} if m.kept else {}),
        **(
            {"digest": {"period": m.digest.period, "chunk": m.digest.chunk, "sums": m.digest.sums}}
            if m.digest is not None
            else {}
        ),
    }


class LayoutCache:
    """The reader's last decoded and checked layout. When a step's packed entry columns and bucket sizes equal
    it (the bytes compared in full, not a hash the sender supplies), its checked entries are reused as they
    are: building and checking 400 entries costs a millisecond a step, skipping and comparing their bytes a
    few hundredths. Everything else (descriptors, gen, step, GPU) is decoded and checked on every step."""

    def __init__(self) -> None:
        self.packed = b""
        self.ref = ""  # layout_ref(packed)
        self.bucket_sizes: tuple[tuple[int, str, int], ...] = ()
        self.entries: tuple[PlacedEntry, ...] | None = None
        self.hits = 0

    def lookup(
        self, packed: bytes, bucket_sizes: tuple[tuple[int, str, int], ...]
    ) -> tuple[PlacedEntry, ...] | None:
        if self.entries is not None and bucket_sizes == self.bucket_sizes and packed == self.packed:
            self.hits += 1
            return self.entries
        return None

    def store(
        self, packed: bytes, bucket_sizes: tuple[tuple[int, str, int], ...], entries: tuple[PlacedEntry, ...]
    ) -> None:
        self.packed, self.bucket_sizes, self.entries = packed, bucket_sizes, entries
        self.ref = layout_ref(packed)


def _unpack_top(blob: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The manifest's top-level map, with the entry columns left packed (their bytes, skipped unparsed)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)
    unpacker.feed(blob)
    doc: dict[str, Any] = {}
    packed = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if not isinstance(key, str):
            raise ManifestError("manifest keys must be strings")
        if key == "entries":
            start = unpacker.tell()
            unpacker.skip()
            packed = blob[start : unpacker.tell()]
        else:
            doc[key] = unpacker.unpack()
    if unpacker.tell() != len(blob):
        raise ManifestError("manifest is not valid msgpack: extra data after its map")
    return doc, packed


def decode_manifest(
    blob: bytes,
    *,
    expect_gen: int | None = None,
    expect_step: int | None = None,
    expect_gpu: str | None = None,
    cache: LayoutCache | None = None,
    layouts: Callable[[str], bytes | None] | None = None,
) -> Manifest:
    """Decode and check a manifest; `expect_*` pin it to the key it was read from. With a `cache`, a layout
    equal to the last one checked is not decoded and checked again. `layouts` reads a layout the manifest
    names by reference (only when the cache does not hold it); its bytes must hash to the name."""
    try:
        doc, packed = _unpack_top(blob)
    except ManifestError:
        raise
    except (ValueError, msgpack.UnpackException) as err:
        raise ManifestError(f"manifest is not valid msgpack: {err}") from None
    if doc.get("schema") != SCHEMA_VERSION:
        raise ManifestError(f"manifest schema {doc.get('schema')!r}, this reader knows {SCHEMA_VERSION}")
    if packed is None and "layout" in doc:
        packed = _referenced_layout(doc.pop("layout"), cache, layouts)
    if packed is None:
        raise ManifestError("manifest has no entries")
    try:
        buckets = tuple(
            BucketRecord(int(b["index"]), str(b["dtype"]), int(b["nbytes"]), _descriptor(b["descriptor"]))
            for b in doc["buckets"]
        )
        bucket_sizes = tuple((b.index, b.dtype, b.nbytes) for b in buckets)
        cached = None if cache is None else cache.lookup(packed, bucket_sizes)
        entries = cached if cached is not None else _decode_entries(_unpack_entries(packed))
        p = doc["producer"]
        m = Manifest(
            job=str(doc["job"]),
            namespace=str(doc["namespace"]),
            gen=int(doc["gen"]),
            step=int(doc["step"]),
            gpu=str(doc["gpu"]),
            weight_version=str(doc["weight_version"]),
            transport=str(doc["transport"]),
            producer=Producer(int(p["rank"]), int(p["replica"]), int(p["pid"]), str(p["host"])),
            buckets=buckets,
            entries=entries,
            checksums={str(k): str(v) for k, v in dict(doc.get("checksums") or {}).items()},
            kept=tuple(int(i) for i in doc.get("kept") or ()),
            digest=_digest(doc.get("digest"), len(entries)),
        )
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError, ShardError) as err:
        raise ManifestError(f"malformed manifest: {err!r}") from None
    for what, got, want in (
        ("gen", m.gen, expect_gen),
        ("step", m.step, expect_step),
        ("gpu", m.gpu, expect_gpu),
    ):
        if want is not None and got != want:
            raise ManifestError(f"manifest for {what} {got!r} found under the key of {what} {want!r}")
    stray = set(m.kept) - {b.index for b in m.buckets}
    if stray:
        raise ManifestError(f"manifest keeps buckets {sorted(stray)} mapped, which it does not have")
    if cached is not None:
        return m
    try:
        check_plan(m.plan())
    except BucketPlanError as err:
        raise ManifestError(f"manifest layout is inconsistent: {err}") from None
    for e in m.entries:
        if e.shard is not None and (e.shard.name != e.name or e.shard.box.lengths != e.shape):
            raise ManifestError(f"{e.name}: shard {e.shard} does not describe the entry")
    if cache is not None:
        cache.store(packed, bucket_sizes, entries)
    return m


def _referenced_layout(
    ref: Any, cache: LayoutCache | None, layouts: Callable[[str], bytes | None] | None
) -> bytes:
    if not isinstance(ref, str) or len(ref) != 32:
        raise ManifestError(f"manifest names layout {ref!r}, not a layout reference")
    if cache is not None and cache.entries is not None and cache.ref == ref:
        return cache.packed
    packed = None if layouts is None else layouts(ref)
    if packed is None:
        raise ManifestError(f"manifest names layout {ref}, which the meta-store does not hold (expired?)")
    if layout_ref(packed) != ref:
        raise ManifestError(f"layout {ref} in the meta-store does not hash to its name")
    return packed


def _unpack_entries(packed: bytes) -> Any:
    try:
        return msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise ManifestError(f"manifest entries are not valid msgpack: {err}") from None


def _decode_entries(cols: Any) -> tuple[PlacedEntry, ...]:
    n = len(cols["name"])
    if any(len(cols[k]) != n for k in ("dtype", "shape", "bucket", "offset", "nbytes", "shard")):
        raise ManifestError("manifest entry columns have different lengths")
    views = cols.get("view") or [None] * n
    if len(views) != n:
        raise ManifestError("manifest entry columns have different lengths")
    entries = tuple(
        PlacedEntry(
            name,
            dtype,
            _shape(shape),
            _int(bucket),
            _int(offset),
            _int(nbytes),
            None if shard is None else TensorShard.from_json(shard),
            None if view is None else _view(view),
        )
        for name, dtype, shape, bucket, offset, nbytes, shard, view in zip(
            cols["name"],
            cols["dtype"],
            cols["shape"],
            cols["bucket"],
            cols["offset"],
            cols["nbytes"],
            cols["shard"],
            views,
            strict=True,
        )
    )
    if not all(type(e.name) is str and type(e.dtype) is str for e in entries):
        raise ManifestError("manifest entry names and dtypes must be strings")
    return entries


def _digest(raw: Any, entries: int) -> WeightDigest | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ManifestError("manifest digest is not a map")
    period, chunk, sums = raw.get("period"), raw.get("chunk"), raw.get("sums")
    if type(period) is not int or type(chunk) is not int or not isinstance(sums, bytes):
        raise ManifestError("manifest digest needs integers period and chunk and bytes sums")
    # chunk: a power of two the digest kernel can read (digest.chunk_supported)
    if not 1 <= period <= 1 << 20 or not 0 < chunk <= 4096 or chunk & (chunk - 1) or len(sums) != 2 * entries:
        raise ManifestError(
            f"manifest digest (period {period}, chunk {chunk}, {len(sums)} bytes) does not fit its "
            f"{entries} entries"
        )
    return WeightDigest(period, chunk, sums)


def _view(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(value, list) or len(value) != 2:
        raise ManifestError(f"entry view {value!r} is not [shape, strides]")
    return _shape(value[0]), _shape(value[1])


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ManifestError(f"expected an integer, got {type(value).__name__}")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    shape = tuple(value)
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ManifestError(f"shape {value!r} is not a list of non-negative integers")
    return shape


def _descriptor(raw: Any) -> Descriptor:
    if not isinstance(raw, dict):
        raise ManifestError("bucket descriptor is not a map")
    out: Descriptor = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, str | int | bytes | bool)):
            raise ManifestError(f"bucket descriptor field {k!r} has a value of type {type(v).__name__}")
        out[k] = v
    return out


@dataclass(frozen=True, slots=True)
class Ack:
    """The reader's answer for one step and GPU. `ipc_closed` is the producer's licence to free buckets."""

    status: str  # "ok" or "error"
    ipc_closed: bool
    result: str = "ok"  # on errors, the reader's StepFailed result: error, aborted, ...
    bytes_copied: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    gc_fallback: bool = False
    checksum_mismatches: tuple[str, ...] = ()
    error: str = ""
    reader_pid: int = 0
    reader_host: str = ""
    # The claim this ACK answers (metastore.step_claim: the reader's identity and the digest of `proof`) and
    # the proof itself: an ACK that does not prove the step's claim frees nothing.
    reader: str = ""
    proof: str = ""
    # Bucket indices this reader mapped in this step: the trainer releases the others' IPC share itself.
    # None: not said (an older reader), so the trainer assumes every bucket was mapped.
    opened: tuple[int, ...] | None = None
    # Earlier steps of this reader whose close failed and whose mappings are still alive (generation, step):
    # their parked buckets stay parked. None: not said (assume every earlier failed close is still mapped).
    held: tuple[tuple[int, int], ...] | None = None
    # Buckets of this step the reader still maps through its kept mappings, as the manifest allowed
    # (Manifest.kept): the step's own share of them is closed; the trainer's storage stays mapped.
    kept: tuple[int, ...] = ()
    # The weights check (digest.py): entries compared (0: none, the manifest had no digest or the reader
    # does not know it), and the parameters whose installed sample differs from the trainer's.
    digest_checked: int = 0
    digest_mismatches: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in ("ok", "error"):
            raise ManifestError(f"ACK status {self.status!r} is not ok or error")
        if self.status == "ok" and not self.ipc_closed:
            raise ManifestError("an ok ACK must state ipc_closed=true")

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": SCHEMA_VERSION,
                "status": self.status,
                "ipc_closed": self.ipc_closed,
                "result": self.result,
                "bytes_copied": self.bytes_copied,
                "seconds": self.seconds,
                "gc_fallback": self.gc_fallback,
                "checksum_mismatches": list(self.checksum_mismatches),
                "error": self.error[:2000],
                "reader_pid": self.reader_pid,
                "reader_host": self.reader_host,
                "reader": self.reader,
                "proof": self.proof,
                "opened": None if self.opened is None else list(self.opened),
                "held": None if self.held is None else [list(h) for h in self.held],
                **({"kept": list(self.kept)} if self.kept else {}),
                **({"digest_checked": self.digest_checked} if self.digest_checked else {}),
                **(
                    {"digest_mismatches": list(self.digest_mismatches[:DIGEST_NAMES_MAX])}
                    if self.digest_mismatches
                    else {}
                ),
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str | bytes) -> Ack:
        try:
            d = json.loads(text)
            if d.get("schema") != SCHEMA_VERSION:
                raise ManifestError(f"ACK schema {d.get('schema')!r}, this writer knows {SCHEMA_VERSION}")
            return Ack(
                status=str(d["status"]),
                ipc_closed=d["ipc_closed"] is True,
                result=str(d.get("result", "ok")),
                bytes_copied=int(d.get("bytes_copied", 0)),
                seconds={str(k): float(v) for k, v in dict(d.get("seconds") or {}).items()},
                gc_fallback=bool(d.get("gc_fallback", False)),
                checksum_mismatches=tuple(str(x) for x in d.get("checksum_mismatches") or ()),
                error=str(d.get("error", "")),
                reader_pid=int(d.get("reader_pid", 0)),
                reader_host=str(d.get("reader_host", "")),
                reader=str(d.get("reader", "")),
                proof=str(d.get("proof", "")),
                opened=_ack_ints(d.get("opened"), "opened"),
                held=_ack_held(d.get("held")),
                kept=_ack_ints(d.get("kept"), "kept") or (),
                digest_checked=int(d.get("digest_checked", 0)),
                digest_mismatches=_ack_names(d.get("digest_mismatches")),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ManifestError(f"malformed ACK: {err!r}") from None


_ACK_LIST_MAX = 4096  # more buckets or held steps than any real step has: a hostile ACK, refused
DIGEST_NAMES_MAX = 64  # parameters an ACK names at most (its error says how many differ in all)


def _ack_names(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > DIGEST_NAMES_MAX or not all(isinstance(x, str) for x in raw):
        raise ManifestError("ACK field digest_mismatches is not a list of parameter names")
    return tuple(raw)


def _ack_ints(raw: Any, name: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if (
        not isinstance(raw, list)
        or len(raw) > _ACK_LIST_MAX
        or not all(type(x) is int and 0 <= x < 1 << 31 for x in raw)
    ):
        raise ManifestError(f"ACK field {name} is not a list of bucket indices")
    return tuple(raw)


def _ack_held(raw: Any) -> tuple[tuple[int, int], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > _ACK_LIST_MAX:
        raise ManifestError("ACK field held is not a list of [generation, step]")
    held = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2 or not all(type(x) is int and x >= 0 for x in item):
            raise ManifestError("ACK field held is not a list of [generation, step]")
        held.append((item[0], item[1]))
    return tuple(held)
