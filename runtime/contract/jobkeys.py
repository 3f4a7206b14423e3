"""The meta-store key prefix of one job. Every key of the job starts with it (colocated/keys.py, the step
event stream of events.py, the checkpoint records of checkpoint.py), so no two jobs share a key."""

from __future__ import annotations


def job_prefix(namespace: str, job: str) -> str:
    """`colocate:{namespace}:{job}`, from the values of COLOCATE_NAMESPACE and COLOCATE_JOB_NAME."""
    return f"colocate:{namespace}:{job}"
