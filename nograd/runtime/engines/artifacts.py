"""Writing engine artifacts (each engine builds its own: ``nograd.runtime.engines.registry``) and
finding them again: checksums and the build cache.

Every writer writes beside its target and renames, so a reader never opens half a file and two
workers building the same artifact at once both leave a whole one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import torch

from nograd.core.engines import engine_row
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.registry import engine
from nograd.runtime.engines.trace import Traced

_CHUNK: Final = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    hash_file(digest, path)
    return digest.hexdigest()


FILE_DIGESTS_KEPT: Final = 4096
"""How many files' SHA-256 ``file_sha256`` keeps (the oldest forgotten first): one per model
file, so a model evicted and loaded again on demand is not read whole just to be recognised."""

_file_digests: dict[str, tuple[tuple[int, ...], bytes]] = {}


def file_sha256(path: Path, cache_dir: Path | None = None) -> bytes:
    """The SHA-256 of the file at ``path``, remembered while the file's identity, size and
    modification and change times stay the same (any write changes the change time): in this
    process, and with ``cache_dir`` in a record there too, so the first load of a model after a
    restart (or in another worker) does not read its weights whole just to recognise them."""
    info = path.stat()
    signature = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    key = str(path)
    known = _file_digests.get(key)
    if known is not None and known[0] == signature:
        return known[1]
    record = None
    if cache_dir is not None:
        record = DigestRecord(cache_dir, path, signature)
    value = None if record is None else record.read()
    if value is None:
        digest = hashlib.sha256()
        hash_file(digest, path)
        value = digest.digest()
        if record is not None:
            record.write(value)
    _file_digests.pop(key, None)
    _file_digests[key] = (signature, value)
    while len(_file_digests) > FILE_DIGESTS_KEPT:
        del _file_digests[next(iter(_file_digests))]
    return value


DIGEST_RECORDS: Final = "file-sha256-*.txt"


class DigestRecord:
    """A file's SHA-256 in the engine cache: one record per file path, naming the file, its
    identity, size and times, and its digest. A changed file's record is written over; those of
    files gone are removed when another is written, so the cache holds one per model file there
    is, at most."""

    def __init__(self, cache_dir: Path, path: Path, signature: tuple[int, ...]) -> None:
        self._cache_dir = cache_dir
        self._path = str(path.resolve())
        self._signature = ",".join(map(str, signature))
        named = hashlib.sha256(self._path.encode()).hexdigest()[:32]
        self.file = cache_file(cache_dir, DIGEST_RECORDS.replace("*", named))

    def read(self) -> bytes | None:
        """The digest recorded for the file as it is now; None when there is none, or the one
        there is for another state of it, or unreadable."""
        try:
            lines = self.file.read_text("utf-8").split("\n")
            if len(lines) != 3 or lines[:2] != [self._path, self._signature]:
                return None
            value = bytes.fromhex(lines[2])
        except (OSError, ValueError):
            return None
        return value if len(value) == hashlib.sha256().digest_size else None

    def write(self, value: bytes) -> None:
        with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
            for other in self._cache_dir.glob(DIGEST_RECORDS):
                named = _first_line(other)
                if other != self.file and named is not None and not Path(named).exists():
                    other.unlink(missing_ok=True)
            write_text_atomically(self.file, f"{self._path}\n{self._signature}\n{value.hex()}")


def _first_line(record: Path) -> str | None:
    """The file a digest record names; None when it cannot be read."""
    try:
        return record.read_text("utf-8").split("\n", 1)[0]
    except OSError:
        return None


def hash_file(digest: hashlib._Hash, path: Path) -> None:
    """Feed the file's bytes to ``digest`` a chunk at a time: an artifact of hundreds of MiB is
    never held whole (a load would count it as its model's memory)."""
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)


def verify_sha256(path: Path, expected: str | None) -> None:
    """Refuse ``path`` unless its SHA-256 is ``expected`` (nothing to check when None)."""
    if expected is None:
        return
    actual = sha256_of(path)
    if actual != expected.lower():
        raise ArtifactError(
            f"{path}: SHA-256 {actual} does not match artifact_sha256 {expected.lower()}"
        )


def replace_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` on a temporary file beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.stem}.", suffix=f".tmp{target.suffix}"
    )
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def write_artifact(name: str, traced: Traced, target: Path) -> Path:
    """Build engine ``name``'s artifact from ``traced`` into ``target``."""
    built = engine(name)
    return replace_atomically(target, lambda path: built.build(traced, path))


def cache_key(name: str, traced: Traced, code: Iterable[Path], device: torch.device) -> str:
    """What the artifact depends on: the engine, the library versions, the device type, the
    model's code files and its weights (hashed by value), and the traced signature."""
    digest = hashlib.sha256()
    for part in (name, torch.__version__, onnxruntime_version(), device.type):
        digest.update(part.encode() + b"\0")
    digest.update(repr((traced.inputs, traced.outputs)).encode())
    for input_name, example in traced.example.items():
        digest.update(repr((input_name, example.dtype, tuple(example.shape[1:]))).encode())
    for path in code:
        digest.update(path.read_bytes() if path.is_file() else b"")
    tensors = {**traced.program.state_dict, **traced.program.constants}
    for tensor_name in sorted(tensors):
        tensor = tensors[tensor_name]
        if isinstance(tensor, torch.Tensor):
            hash_tensor(digest, tensor_name, tensor)
    return digest.hexdigest()[:24]


def hash_tensor(digest: hashlib._Hash, name: str, tensor: torch.Tensor) -> None:
    """Feed ``name`` and the tensor's bytes to ``digest``, read in place: a load hashing its
    weights copies none of a CPU model's (a copy would stay in the heap and count as the model's
    memory); another device's tensor is copied to the host one at a time."""
    digest.update(name.encode())
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)


def cached(cache_dir: Path, label: str, name: str, key: str, build: Callable[[Path], Path]) -> Path:
    """The artifact ``label`` + engine ``name`` + ``key`` in ``cache_dir``, built first if
    missing.

    Builders take a lock file beside it, so workers starting together build it once: the others
    wait, then find it built.
    """
    target = artifact_file(cache_dir, label, name, key)
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        return build(target)


def write_text_atomically(target: Path, text: str) -> None:
    """``text`` into ``target`` through ``replace_atomically``: a reader finds the old file or
    the whole new one, and two processes writing the same record at once each write their own."""

    def write(temporary: Path) -> None:
        temporary.write_text(text, "utf-8")

    replace_atomically(target, write)


def artifact_file(cache_dir: Path, label: str, name: str, key: str) -> Path:
    """Where engine ``name``'s artifact of ``label`` with content ``key`` lies in the cache."""
    return cache_file(cache_dir, f"{label}-{name}-{key}{engine_row(name).suffix}")


def cache_file(cache_dir: Path, file_name: str) -> Path:
    """``file_name`` directly inside ``cache_dir``, resolved, or an ArtifactError. The name is
    built from the model's name and version, which configs validate; this holds even if one slips
    through (a separator, ``..``, a NUL, a planted symlink), so the cache never writes elsewhere."""
    root = cache_dir.resolve()
    target = (root / file_name).resolve() if "\0" not in file_name else None
    if target is None or target.parent != root:
        raise ArtifactError(
            f"engine cache file {file_name!r} would not be inside the cache folder {str(root)!r}"
        )
    return target


def onnxruntime_version() -> str:
    try:
        import onnxruntime
    except ImportError:
        return "none"
    return str(onnxruntime.__version__)
