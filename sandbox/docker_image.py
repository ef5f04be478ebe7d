"""The Docker sandbox's image, built offline from this host's own files.

No registry is needed: the image holds only what the host's Python needs that is not mounted
into the container at run time, namely static busybox (a shell for debugging), the system shared
libraries that the interpreter, its extension modules and the venv's extension modules link
against, the dynamic loader, and a minimal /etc. The Python prefix, the venv and the repository
are bind-mounted read-only at their host paths (`mounted_roots`), so the venv's `pyvenv.cfg`,
its editable install and `-m sandbox.runner` all resolve inside the container as they do here.

The tag is a hash of what the image is made from (the Python version and paths, the extension
modules scanned, the host's library cache, the user), so it changes when any of them does and
an existing image is reused without scanning anything with `ldd`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

REPO_ROOT = Path(__file__).resolve().parents[1]
# What of the repository a runner reads, wherever it runs: its own code, and the kit that
# candidates may import (kernels/kit; without kernels/__init__.py in view, `kernels` is a
# namespace package there and nothing else of the library is importable).
RUNNER_CODE = (REPO_ROOT / "sandbox", REPO_ROOT / "kernels" / "kit")
IMAGE_REPOSITORY = "recforge/sandbox"
# Bumped when the image's layout changes, so old tags are not reused.
IMAGE_FORMAT = 1
BUSYBOX = Path("/bin/busybox")
LOADER = Path("/lib64/ld-linux-x86-64.so.2")
# Rewritten by ldconfig whenever the host's packages add or replace a shared library.
HOST_LIBRARY_CACHE = Path("/etc/ld.so.cache")
# Applets linked to busybox in the image; `busybox APPLET` reaches all the others.
APPLETS = ("sh", "ls", "cat", "env", "id", "ps")


class DockerUnavailable(RuntimeError):
    """The Docker daemon cannot be reached (not installed, not running, or no permission)."""


def docker_client() -> docker.DockerClient:
    """A client of the daemon named by the environment (DOCKER_HOST, default socket), checked
    with a ping."""
    import docker
    import requests

    try:
        client = docker.from_env()
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise DockerUnavailable(
            f"cannot reach the Docker daemon ({exc}); start it with `make engine` (as root on Debian), "
            "`sudo systemctl start docker`, or point DOCKER_HOST at a running daemon on this machine"
        ) from exc
    return client


def mounted_roots() -> tuple[Path, ...]:
    """Host directories the container sees read-only at the same paths: the Python prefix (the
    venv's `pyvenv.cfg` points there), the venv and, of the repository, RUNNER_CODE (campaign
    state and the judge's files stay out). Nested ones are dropped."""
    roots = sorted({Path(p).absolute() for p in (sys.base_prefix, sys.prefix, *RUNNER_CODE)})
    kept: list[Path] = []
    for root in roots:
        if not any(root.is_relative_to(k) for k in kept):
            kept.append(root)
    return tuple(kept)


def _interpreter() -> Path:
    return Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"


_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


def _extension_modules() -> list[Path]:
    """The ELF files whose shared-library dependencies the image must provide."""
    dynload = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [_interpreter(), *sorted((dynload / "lib-dynload").glob("*.so"))]
    for dirpath, _, filenames in os.walk(sys.prefix):
        found.extend(Path(dirpath) / f for f in sorted(filenames) if _SHARED_OBJECT.search(f))
    return [p for p in found if p.is_file()]


def _stat_key(paths: Iterable[Path]) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p), st.st_size, st.st_mtime_ns))
    return out


def image_tag() -> str:
    """`recforge/sandbox:<hash>` of everything the image is built from."""
    key = repr(
        (
            IMAGE_FORMAT,
            sys.version,
            sys.base_prefix,
            sys.prefix,
            os.getuid(),
            os.getgid(),
            _stat_key([*_extension_modules(), BUSYBOX, LOADER]),
            _stat_key([HOST_LIBRARY_CACHE] if HOST_LIBRARY_CACHE.exists() else []),
        )
    )
    return f"{IMAGE_REPOSITORY}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


_LDD_LINE = re.compile(r"(?:=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)")


def shared_libraries(elf_files: list[Path]) -> list[Path]:
    """System libraries the files link against (as `ldd` resolves them on this host), minus
    those under a mounted root. Unresolved ones (`libcuda.so.1 => not found` on a CPU host) are
    skipped: they are loaded, if ever, from paths the GPU runtime provides."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise RuntimeError("building the sandbox image needs `ldd` (Debian package libc-bin)")
    roots = mounted_roots()
    libs: set[Path] = set()
    for start in range(0, len(elf_files), 200):  # ldd takes many files per call
        batch = [str(p) for p in elf_files[start : start + 200]]
        out = subprocess.run([ldd, *batch], capture_output=True, text=True, check=False).stdout
        for match in _LDD_LINE.finditer(out):
            lib = Path(match.group(1))
            if lib.is_file() and not any(lib.is_relative_to(r) for r in roots):
                libs.add(lib)
    return sorted(libs)


def _etc_files() -> dict[str, str]:
    uid, gid = os.getuid(), os.getgid()
    passwd = ["root:x:0:0:root:/scratch:/bin/sh", "nobody:x:65534:65534:nobody:/nonexistent:/bin/false"]
    group = ["root:x:0:", "nogroup:x:65534:"]
    # The container runs as the host user (so it can read the mounted prefix and write its
    # results); libraries that look the user up (getpass) find it here.
    if uid not in (0, 65534):
        passwd.append(f"recforge:x:{uid}:{gid}:recforge:/scratch:/bin/sh")
    if gid not in (0, 65534):
        group.append(f"recforge:x:{gid}:")
    return {
        "etc/passwd": "\n".join(passwd) + "\n",
        "etc/group": "\n".join(group) + "\n",
        "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }


def _tar_entries(libraries: list[Path]) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    def directory(name: str, mode: int = 0o755) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode = tarfile.DIRTYPE, mode
        return info

    for name in ("bin", "etc", "lib64", "io", "scratch"):
        yield directory(name), None
    yield directory("tmp", 0o1777), None
    # Files are stored dereferenced (the host's /lib64 is a symlink into /usr on merged-usr
    # systems); parent directories are created as needed.
    made = {"bin", "etc", "lib64", "io", "scratch", "tmp"}
    for host_path in sorted({BUSYBOX, LOADER, *libraries}):
        name = str(host_path).lstrip("/")
        parents = Path(name).parents
        for parent in reversed(list(parents)[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                yield directory(str(parent)), None
        data = host_path.read_bytes()
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), host_path.stat().st_mode & 0o755
        yield info, data
    for applet in APPLETS:
        link = tarfile.TarInfo(f"bin/{applet}")
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        yield link, None
    for name, text in _etc_files().items():
        data = text.encode()
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644
        yield info, data


def root_filesystem() -> bytes:
    """The image's root filesystem as a tar archive (tens of MB, held in memory)."""
    for required in (BUSYBOX, LOADER):
        if not required.is_file():
            raise RuntimeError(
                f"building the sandbox image needs {required} (Debian packages busybox-static, libc6)"
            )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in _tar_entries(shared_libraries(_extension_modules())):
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def ensure_image(client: docker.DockerClient) -> str:
    """The sandbox image's tag, built (about 2 s) if the daemon does not hold it yet."""
    import docker

    tag = image_tag()
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    repository, _, version = tag.partition(":")
    client.api.import_image_from_data(
        root_filesystem(),
        repository=repository,
        tag=version,
        changes=["WORKDIR /scratch", "ENV PATH=/bin HOME=/scratch", 'CMD ["/bin/sh"]'],
    )
    client.images.get(tag)  # raises if the import failed
    return tag
