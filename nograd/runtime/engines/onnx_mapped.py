"""An ONNX file's weights moved beside it, so ONNX Runtime memory-maps them instead of copying.

ONNX Runtime reads a model whose weights are embedded in its file into a protobuf, then copies
each initializer out of it: a load rises to twice the weights and holds one copy. Given the
same graph with its large initializers as external data, it maps the weights file and uses the
mapped pages as the initializers (with prepacking off, which would copy them again), so a load
rises by the weights once and what the model holds is the file's pages, shared by every session
of it. The mapped form is written once per file, without reading its weights into memory (the
protobuf is walked field by field and the weights copied file to file), into the engine cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Final

from nograd.runtime.engines.artifacts import cache_file, replace_atomically, write_text_atomically
from nograd.runtime.engines.errors import ArtifactError

logger = logging.getLogger(__name__)

MAPPED_TENSOR_BYTES: Final = 64 << 10
"""Initializers at least this large move to the weights file; smaller ones stay in the graph
(a page of their own each would cost more than they hold)."""
WEIGHTS_ALIGNMENT: Final = 64 << 10
"""Each weight starts at a multiple of this in the weights file: a page boundary on every
system ONNX Runtime maps files on (Windows' allocation granularity the largest)."""
WEIGHTS_SUFFIX: Final = ".weights"
SOURCE_SUFFIX: Final = ".source"
"""Beside each mapped form, the path of the file it was written for: a form whose file is gone
or changed is removed when the next one is written."""

# Field numbers of onnx.proto (ModelProto.graph, GraphProto.initializer, TensorProto's own).
_MODEL_GRAPH: Final = 7
_GRAPH_INITIALIZER: Final = 5
_TENSOR_RAW_DATA: Final = 9
_TENSOR_EXTERNAL_DATA: Final = 13
_TENSOR_DATA_LOCATION: Final = 14
_EXTERNAL: Final = 1
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class NotWalkable(ValueError):
    """The file is not a protobuf this walk reads (groups, a truncated field)."""


def mapped_form(path: Path, cache_dir: Path) -> Path | None:
    """The graph of the ONNX file ``path`` with its large weights in a file beside it, in
    ``cache_dir`` (written on first use; keyed by the file's identity, size and times, so an
    edited file gets a new one, and the forms of files gone or changed go); None when no
    initializer is large enough to move or the file is not one this walk reads (then the file
    itself is opened)."""
    where, target = _form_of(path, cache_dir)
    plain = target.with_suffix(".plain")
    if target.is_file():
        return target
    if plain.is_file():
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Workers loading the same model together write it once: the others wait, then find it.
    with cache_file(cache_dir, f".{where}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        if plain.is_file():
            return None
        _remove_stale(cache_dir)
        try:
            moved = _write_mapped(path, target)
        except NotWalkable:
            moved = False
        if not moved:
            plain.touch()
        write_text_atomically(target.with_suffix(SOURCE_SUFFIX), str(path.resolve()))
    return target if moved else None


def existing_form(path: Path, cache_dir: Path) -> list[Path]:
    """The files of the mapped form of ``path`` in ``cache_dir`` (graph and weights), if it
    was written for the file as it is now; none else."""
    _, target = _form_of(path, cache_dir)
    weights = target.with_name(target.name + WEIGHTS_SUFFIX)
    return [target, weights] if target.is_file() and weights.is_file() else []


def _form_of(path: Path, cache_dir: Path) -> tuple[str, Path]:
    """The key of ``path``'s place (its resolved path, hashed) and where its mapped form lies,
    named by the file's identity, size and modification time."""
    info = path.stat()
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    key = f"{info.st_dev:x}-{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}"
    return where, cache_file(cache_dir, f"{where}-mapped-{key}.onnx")


def _remove_stale(cache_dir: Path) -> None:
    """Remove every mapped form whose file is gone or changed since (each form names its file
    in a record beside it): the cache holds one form per model file there is, at most (a
    session that mapped a removed one keeps its pages until it closes)."""
    for record in cache_dir.glob(f"*-mapped-*{SOURCE_SUFFIX}"):
        form = record.name.removesuffix(SOURCE_SUFFIX)
        try:
            source = Path(record.read_text("utf-8"))
            current = _form_of(source, cache_dir)[1].stem if source.is_file() else None
        except OSError:
            current = None
        if current == form:
            continue
        for stale in cache_dir.glob(f"{form}.*"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


def _write_mapped(path: Path, target: Path) -> bool:
    """Write the mapped form of ``path`` at ``target`` (graph) and beside it (weights); False
    when no initializer was large enough to move (nothing written)."""
    weights = target.with_name(target.name + WEIGHTS_SUFFIX)
    with path.open("rb") as source:
        size = os.fstat(source.fileno()).st_size
        # Per moved weight: its offset in the source, its length, its offset in the weights.
        moves: list[tuple[int, int, int]] = []
        graph = _rewrite_model(source, size, weights.name, moves)
        if not moves:
            return False

        def write_weights(temporary: Path) -> None:
            with temporary.open("wb") as sink:
                for start, length, at in moves:
                    _copy_range(source, sink, start, length, at)

        replace_atomically(weights, write_weights)

    def write_graph(temporary: Path) -> None:
        temporary.write_bytes(graph)

    replace_atomically(target, write_graph)
    return True


def _rewrite_model(
    source: BinaryIO, size: int, weights_name: str, moves: list[tuple[int, int, int]]
) -> bytes:
    """The ModelProto with its graph's large initializers pointing at ``weights_name``."""
    out = bytearray()
    for number, kind, start, end in _fields(source, 0, size):
        if number == _MODEL_GRAPH and kind == _LENGTH:
            graph = bytearray()
            for g_number, g_kind, g_start, g_end in _fields(source, start, end):
                if g_number == _GRAPH_INITIALIZER and g_kind == _LENGTH:
                    tensor = _rewrite_tensor(source, g_start, g_end, weights_name, moves)
                    graph += _length_field(g_number, tensor)
                else:
                    graph += _raw_field(source, g_number, g_kind, g_start, g_end)
            out += _length_field(number, bytes(graph))
        else:
            out += _raw_field(source, number, kind, start, end)
    return bytes(out)


def _rewrite_tensor(
    source: BinaryIO, start: int, end: int, weights_name: str, moves: list[tuple[int, int, int]]
) -> bytes:
    """A TensorProto, its ``raw_data`` moved to the weights file when large enough."""
    fields = list(_fields(source, start, end))
    raw = [f for f in fields if f[0] == _TENSOR_RAW_DATA and f[1] == _LENGTH]
    if any(f[0] in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION) for f in fields):
        # Its weights already lie in files beside it, where ONNX Runtime maps them: a graph
        # moved into the cache would no longer find them.
        raise NotWalkable("the model keeps weights in external data already")
    if len(raw) != 1 or raw[0][3] - raw[0][2] < MAPPED_TENSOR_BYTES:
        source.seek(start)
        return source.read(end - start)
    out = bytearray()
    for number, kind, f_start, f_end in fields:
        if number != _TENSOR_RAW_DATA:
            out += _raw_field(source, number, kind, f_start, f_end)
    _, _, data_start, data_end = raw[0]
    length = data_end - data_start
    at = 0
    if moves:
        last_at, last_length = moves[-1][2], moves[-1][1]
        at = -(-(last_at + last_length) // WEIGHTS_ALIGNMENT) * WEIGHTS_ALIGNMENT
    moves.append((data_start, length, at))
    for key, value in (("location", weights_name), ("offset", str(at)), ("length", str(length))):
        entry = _length_field(1, key.encode()) + _length_field(2, value.encode())
        out += _length_field(_TENSOR_EXTERNAL_DATA, entry)
    out += _varint((_TENSOR_DATA_LOCATION << 3) | _VARINT) + _varint(_EXTERNAL)
    return bytes(out)


def _fields(source: BinaryIO, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Each field of the message between ``start`` and ``end``: its number, its wire type and
    where its payload begins and ends (a varint's or a fixed value's bytes, a length-delimited
    field's contents)."""
    position = start
    while position < end:
        source.seek(position)
        key, position = _read_varint(source, position)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            _, after = _read_varint(source, position)
            payload = (position, after)
        elif kind == _FIXED64:
            payload = (position, position + 8)
        elif kind == _FIXED32:
            payload = (position, position + 4)
        elif kind == _LENGTH:
            length, begins = _read_varint(source, position)
            payload = (begins, begins + length)
        else:
            raise NotWalkable(f"wire type {kind} at byte {position}")
        if payload[1] > end:
            raise NotWalkable(f"field {number} runs past its message at byte {position}")
        yield number, kind, payload[0], payload[1]
        position = payload[1]


def _read_varint(source: BinaryIO, position: int) -> tuple[int, int]:
    """The varint at ``position`` (the source is there) and the position after it."""
    value = shift = 0
    while True:
        byte = source.read(1)
        if not byte:
            raise NotWalkable(f"file ends inside a varint at byte {position}")
        position += 1
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise NotWalkable(f"varint too long at byte {position}")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _length_field(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | _LENGTH) + _varint(len(payload)) + payload


def _raw_field(source: BinaryIO, number: int, kind: int, start: int, end: int) -> bytes:
    """A field copied as it is (its key and, for a length-delimited one, its length again)."""
    source.seek(start)
    payload = source.read(end - start)
    if kind == _LENGTH:
        return _length_field(number, payload)
    return _varint((number << 3) | kind) + payload


def _copy_range(source: BinaryIO, sink: BinaryIO, start: int, length: int, at: int) -> None:
    """``length`` bytes of ``source`` from ``start`` into ``sink`` at ``at``, file to file in
    the kernel where it can (no copy of the weights in this process's memory)."""
    sink.flush()
    copied = 0
    while copied < length:
        try:
            done = os.copy_file_range(
                source.fileno(), sink.fileno(), length - copied, start + copied, at + copied
            )
        except OSError:
            done = 0
        if done <= 0:
            source.seek(start + copied)
            sink.seek(at + copied)
            chunk = source.read(min(length - copied, 1 << 20))
            sink.write(chunk)
            sink.flush()
            done = len(chunk)
            if done == 0:
                raise NotWalkable(f"file ends inside a weight at byte {start + copied}")
        copied += done


_mapped_weights_dir: Path | None = None
"""Where the mapped forms of ONNX files are kept (``map_weights``); None: files open as they are."""


def map_weights(cache_dir: Path | None) -> None:
    """From now on, CPU sessions of ONNX files with large embedded weights open from a mapped
    form kept in ``cache_dir`` (``mapped_form``), without prepacking:
    what a model costs is its weights once, at its load and after it. Prepacked weights make
    batches of several rows faster and cost a copy of the weights; a server that keeps models
    resident by their bytes (on-demand control) takes the bytes. None: as ONNX Runtime does."""
    global _mapped_weights_dir
    _mapped_weights_dir = cache_dir


def mapped_files(path: Path) -> list[Path]:
    """The files of the mapped form of the ONNX file ``path`` that a load now reads instead of
    it (none when weights are not mapped here or it has none yet): what keeps an evicted
    model's next load from reading the disk."""
    if _mapped_weights_dir is None:
        return []
    return existing_form(path, _mapped_weights_dir)


def with_mapped_forms(files: list[tuple[Path, int]]) -> list[tuple[Path, int]]:
    """``files`` (path, size) and the files of the mapped forms their ONNX files load from."""
    forms = [m for path, _ in files if path.suffix == ".onnx" for m in mapped_files(path)]
    for form in forms:
        with contextlib.suppress(OSError):  # a form replaced meanwhile: the next one counts
            files.append((form, form.stat().st_size))
    return files


def mapped_session(path: Path, device_type: str, options: Any, providers: list[Any]) -> Any:
    """A session on the mapped form of ``path`` (``map_weights``), or None: weights not mapped
    here, nothing to map, or a mapped form ONNX Runtime refused (then the file opens itself)."""
    if _mapped_weights_dir is None or device_type != "cpu":
        return None
    import onnxruntime

    try:
        mapped = mapped_form(path, _mapped_weights_dir)
    except (OSError, ArtifactError):
        logger.warning("%s: no mapped form of its weights; opened as it is", path, exc_info=True)
        return None
    if mapped is None:
        return None
    # Prepacking copies each matrix multiply's weights into a layout of its own: the mapped
    # pages would then be read once and a copy of them held.
    options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        return onnxruntime.InferenceSession(str(mapped), options, providers=providers)
    except Exception:
        logger.warning("%s: its mapped form did not open; opened as it is", path, exc_info=True)
        options.add_session_config_entry("session.disable_prepacking", "0")
        return None
