"""The per-file caches (a GGUF file's config, tokenizer, weights): an entry is built by one
process at a time, the others waiting for it rather than converting the same file beside it."""

from __future__ import annotations

import fcntl

import pytest

from bulletserve.model.source import building_cache


def test_an_entry_is_built_under_a_lock_and_found_built_after(tmp_path):
    folder = tmp_path / "entry"
    with building_cache(folder, "done") as to_build:
        assert to_build
        # Another process asking now would wait: the lock is held while this one builds.
        with open(tmp_path / "entry.lock", "w") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        folder.mkdir()
        (folder / "done").write_text("built")
    with open(tmp_path / "entry.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    with building_cache(folder, "done") as to_build:
        assert not to_build
