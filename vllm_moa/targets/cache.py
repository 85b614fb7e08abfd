"""Cache folders that are either complete or absent.

A folder is built in a temporary sibling (`.NAME.partial-XXXX/`), every file fsynced, a manifest
(the folder's identity, its files and sizes, build timings) written last, and then renamed into
place: a reader that finds `NAME/` with a manifest matching what it expects uses it; anything else
(no manifest, another identity, a missing or truncated file) is rebuilt. Builders take a file lock,
so that concurrent processes build once, and remove what an interrupted build left behind.

The cache root is `$VLLM_MOA_CACHE`, else `$XDG_CACHE_HOME/vllm-moa`, else `~/.cache/vllm-moa`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from vllm_moa import envs
from vllm_moa.targets.errors import CacheWriteError

CACHE_ENV = "VLLM_MOA_CACHE"
MANIFEST_FILE = "vllm-moa-manifest.json"
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

# build(scratch_dir, out_dir) fills out_dir (scratch_dir is for downloads, removed afterwards) and
# returns what else the manifest should record (timings, versions)
Builder = Callable[[Path, Path], Mapping[str, Any]]


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $VLLM_MOA_CACHE, else the user cache dir."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return envs.VLLM_MOA_CACHE


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest if it is complete: the manifest parses and every file it lists is
    there with its recorded size; None otherwise."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
        if all((folder / name).stat().st_size == size for name, size in files.items()):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def is_complete(folder: Path, identity: Mapping[str, Any]) -> bool:
    """Whether `folder` is a finished build of `identity`."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("identity") == dict(identity)


def cached_folder(root: Path, name: str, identity: Mapping[str, Any], build: Builder, *, force: bool = False) -> Path:
    """`root/name`, built by `build` unless a complete build of `identity` is already there (or
    `force`). Raises CacheWriteError when it cannot be written; then nothing new is left behind."""
    folder = root / name
    if not force and is_complete(folder, identity):
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / f".{name}.lock")):
            if not force and is_complete(folder, identity):  # another process built it meanwhile
                return folder
            _remove_leftovers(root, name)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
            try:
                _build_and_publish(staging, folder, identity, build)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        raise _write_error(err, root) from err
    return folder


def _build_and_publish(staging: Path, folder: Path, identity: Mapping[str, Any], build: Builder) -> None:
    scratch, out_dir = staging / "scratch", staging / folder.name
    scratch.mkdir()
    out_dir.mkdir()
    started = time.time()
    extra = dict(build(scratch, out_dir))
    shutil.rmtree(scratch)
    files = {path.name: path.stat().st_size for path in sorted(out_dir.iterdir()) if path.is_file()}
    for file_name in files:
        _fsync_file(out_dir / file_name)
    manifest = {"identity": dict(identity), "files": files, "built_at": started,
                "build_seconds": round(time.time() - started, 3), **extra}
    _write_manifest(out_dir / MANIFEST_FILE, manifest)
    _fsync_dir(out_dir)
    set_aside = None
    if folder.exists():  # incomplete, of another identity, or forced: moved aside, then removed
        set_aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        folder.rename(set_aside / folder.name)
    os.replace(out_dir, folder)
    _fsync_dir(folder.parent)
    if set_aside is not None:
        shutil.rmtree(set_aside, ignore_errors=True)


def _write_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=2)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def _remove_leftovers(root: Path, name: str) -> None:
    """Staging and set-aside folders of earlier builds that were killed or failed to clean up
    (only called under the build lock, so no live build owns them)."""
    for pattern in (f".{name}.partial-*", f".{name}.old-*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync elsewhere
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(err: OSError, root: Path) -> CacheWriteError:
    if err.errno in _NO_SPACE:
        return CacheWriteError(
            f"not enough space to write the model under {root} ({err.strerror or err}); "
            f"free some space or set {CACHE_ENV} to a folder on another disk, then run again"
        )
    return CacheWriteError(f"could not write the model under {root} ({err}); nothing half-written was kept")
