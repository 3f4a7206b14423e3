"""Finding the control-plane binaries that scripts/build-tools.sh builds from Go modules."""

from __future__ import annotations

import os
from pathlib import Path

REQUIRED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
KWOK_STAGES = "kwok-stages.yaml"
CACHE_ROOT = Path(os.environ.get("COLOCATE_CACHE_DIR", Path.home() / ".cache" / "colocate-operator"))


class MissingBinaries(RuntimeError):
    pass


def _missing(directory: Path) -> list[str]:
    gone = [b for b in REQUIRED if not os.access(directory / b, os.X_OK)]
    if not (directory / KWOK_STAGES).is_file():
        gone.append(KWOK_STAGES)
    return gone


def find_bin_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The directory of control-plane binaries: explicit, else $COLOCATE_BIN_DIR, else the newest complete
    build in the cache. Raises MissingBinaries with the fix when none is usable."""
    chosen = explicit or os.environ.get("COLOCATE_BIN_DIR")
    if chosen:
        directory = Path(chosen)
        gone = _missing(directory)
        if gone:
            raise MissingBinaries(f"{directory} lacks {', '.join(gone)}; run `make setup` to build them")
        return directory
    candidates = sorted(CACHE_ROOT.glob("bin-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for directory in candidates:
        if not _missing(directory):
            return directory
    raise MissingBinaries(
        f"no complete set of control-plane binaries ({', '.join(REQUIRED)}) under {CACHE_ROOT}; "
        "run `make setup` to build them from Go modules, or point COLOCATE_BIN_DIR at prebuilt ones"
    )


KUEUE_FILES = ("kueue", "webhooks.yaml", "crds")


def find_kueue_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Kueue's directory (its binary, CRDs and webhook manifests): explicit, else $COLOCATE_KUEUE_DIR, else
    the newest complete one scripts/build-tools.sh left in the cache. Raises MissingBinaries with the fix."""
    chosen = explicit or os.environ.get("COLOCATE_KUEUE_DIR")
    candidates = (
        [Path(chosen)]
        if chosen
        else sorted(CACHE_ROOT.glob("kueue-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    )
    for directory in candidates:
        if directory.name.endswith(".tmp"):
            continue  # a build in progress
        if all((directory / f).exists() for f in KUEUE_FILES) and os.access(directory / "kueue", os.X_OK):
            return directory
    where = chosen or f"{CACHE_ROOT}/kueue-*"
    raise MissingBinaries(
        f"no complete Kueue build ({', '.join(KUEUE_FILES)}) in {where}; run `bash scripts/build-tools.sh` "
        "(it builds Kueue from tools/kueue) or point COLOCATE_KUEUE_DIR at one"
    )


FAKEGPU = "colocate-fakegpu"


def find_fakegpu(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The real node's fake GPU device plugin (devcluster/fakegpu): explicit, else $COLOCATE_FAKEGPU, else the
    newest one scripts/build-tools.sh left in the cache. Raises MissingBinaries with the fix."""
    chosen = explicit or os.environ.get("COLOCATE_FAKEGPU")
    candidates = (
        [Path(chosen)]
        if chosen
        else sorted(
            (d / FAKEGPU for d in CACHE_ROOT.glob("fakegpu-*") if not d.name.endswith(".tmp")),
            key=lambda p: p.stat().st_mtime if p.exists() else 0,
            reverse=True,
        )
    )
    for binary in candidates:
        if os.access(binary, os.X_OK):
            return binary
    where = chosen or f"{CACHE_ROOT}/fakegpu-*/{FAKEGPU}"
    raise MissingBinaries(
        f"no fake GPU device plugin at {where}; run `bash scripts/build-tools.sh` without COLOCATE_BIN_DIR "
        "(it builds devcluster/fakegpu) or point COLOCATE_FAKEGPU at one"
    )
