"""Errors raised while describing or converting weights; each message names the tensor and the fix.

A converter that guesses turns a wrong layout into silently corrupted weights, so every doubt is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class ConvertError(ValueError):
    """Base class: the weights or the layout cannot be converted as described."""


class UnknownArchitectureError(ConvertError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        super().__init__(f"unknown architecture {name!r}; registered: {sorted(known)}")


class UnsupportedLayoutError(ConvertError):
    """A parallel layout that the model's shapes cannot be split into (or that we chose not to support)."""


class MissingTensorError(ConvertError):
    def __init__(self, where: str, missing: Sequence[str], unclaimed: Sequence[str] = ()) -> None:
        """`unclaimed`: what the rank holds that no rule took (name and shape), so an unsupported layout is
        named by what the rank actually holds."""
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        held = ""
        if unclaimed:
            more = f" and {len(unclaimed) - 8} more" if len(unclaimed) > 8 else ""
            held = f"; the rank holds instead: {', '.join(unclaimed[:8])}{more}"
        super().__init__(f"{where}: {len(missing)} expected tensor(s) missing: {shown}{held}")


class UnexpectedTensorError(ConvertError):
    def __init__(self, where: str, unexpected: Sequence[str]) -> None:
        shown = ", ".join(unexpected[:8]) + (
            f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        )
        super().__init__(
            f"{where}: {len(unexpected)} tensor(s) no rule knows (wrong architecture, or a layout such as "
            f"legacy GroupedMLP that is not supported): {shown}"
        )


class ShapeMismatchError(ConvertError):
    def __init__(self, name: str, expected: Sequence[int], got: Sequence[int], why: str = "") -> None:
        hint = f" ({why})" if why else ""
        super().__init__(f"{name}: expected local shape {tuple(expected)}, got {tuple(got)}{hint}")
