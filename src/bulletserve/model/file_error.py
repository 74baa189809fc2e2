"""The error a model file's bad value or tensor raises (`ModelFileError`, one line naming the
file, the key or tensor, the value expected and the value found) and the checks of single
values that config.py and checks.py share."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

# A bound on any one dimension (width, MLP width, vocabulary, head size, positions): the
# largest served models use under 2^18; past this a value is a corrupt field, not a model.
MAX_DIMENSION = 1 << 24
MAX_LAYERS = 1 << 12


class ModelFileError(ValueError):
    """A model file disagrees with itself or holds values we cannot compute with."""

    def __init__(self, what: str, expected: str, found: object, file: Path | str | None = None):
        self.what, self.expected, self.found, self.file = what, expected, found, file
        where = f"{file}: " if file is not None else ""
        super().__init__(f"{where}{what}: expected {expected}, found {found}")

    def __reduce__(self) -> tuple:  # pickled whole (the engine core sends its start failure)
        return ModelFileError, (self.what, self.expected, self.found, self.file)

    def in_file(self, file: Path | str, names: Mapping[str, str] | None = None) -> ModelFileError:
        """The same problem, naming the file and (where `names` maps it) the file's own name
        for the key or tensor."""
        what = (names or {}).get(self.what, self.what)
        return ModelFileError(what, self.expected, self.found, file)


def check_int(values: Mapping[str, object], key: str, low: int, high: int = MAX_DIMENSION) -> int:
    """`values[key]`, an integer in [low, high]."""
    value = values.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ModelFileError(key, f"an integer in [{low}, {high}]", shown(value))
    return value


def check_positive_finite(key: str, value: object) -> None:
    """`value` a finite number > 0."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelFileError(key, "a finite number > 0", shown(value))


def is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def shown(value: object) -> str:
    """A found value as a message shows it (cut short)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
