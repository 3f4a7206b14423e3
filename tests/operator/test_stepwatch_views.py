"""Which view of the job a step follower's status write starts from: the newer of what its own last write
left and what the job's newest watch event showed (the reconciler's writes arrive that way), so its first
write does not lose a 409 to them and read the job again."""

from __future__ import annotations

from colocate_operator.step_writes import JobView, newer_view


def view(rv: str) -> JobView:
    return JobView("uid", rv, 1, ())


def test_the_watched_view_wins_only_when_newer() -> None:
    assert newer_view(view("10"), view("12")) == view("12")
    assert newer_view(view("12"), view("10")) == view("12")
    assert newer_view(view("10"), None) == view("10")
    assert newer_view(view(""), view("5")) == view("5"), "our write echoed no version"


def test_no_view_of_our_own_still_reads_the_job() -> None:
    """None after a lost conflict means read first: a watched view may be the one that just lost."""
    assert newer_view(None, view("12")) is None
