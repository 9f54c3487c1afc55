"""The model repository on disk: each model's folder, the versions its policy serves, and a
fingerprint per version. nograd's folders, Triton's (``config.pbtxt``) and TorchServe's archives
sit side by side; each folder is read by the format of ``nograd.formats`` that recognises it.

Control calls and the poller compare fingerprints (file names, sizes and modification times) with
what serves, so an unchanged version is never reloaded and weights are never read to find out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Final

from pydantic import Field, TypeAdapter, ValidationError

from nograd.formats.source import ModelSource as ModelSource
from nograd.formats.source import Override as Override
from nograd.formats.source import VersionSource as VersionSource
from nograd.formats.source import override_text
from nograd.formats.table import FolderFormat, format_of
from nograd.formats.torchserve.reading.archives import (
    ArchiveStore,
    archives,
    declared_bytes,
    origin,
    read_archive,
)
from nograd.schema.config import (
    ConfigError,
    find_config,
    load_config,
    version_order,
)
from nograd.serving.errors import InvalidInput, ModelNotFound

Wanted = Mapping[str, Mapping[str, Override | None]]
"""The versions to serve of some models, by name then version, each with the override it was
loaded with: what every worker of a server serves under explicit model control."""

OVERRIDABLE: Final = ("max_batch_size", "max_queue_delay_ms", "max_queue_size", "max_batch_tokens")
"""The config fields a load call may override: how requests are batched and queued. Every other
field chooses code, files, digests, the device or the model's identity (name, version), which
whoever may call the API must not choose: only the repository's files do."""


OVERRIDE_BOUNDS: Final = {"max_queue_size": 65536, "max_batch_tokens": 1 << 20}
"""The largest value a load call may give the overridable fields that have no bound of their
own in a config: a caller of the API cannot size a model's queue or token batch without limit
(``max_batch_size`` and ``max_queue_delay_ms`` are bounded by the config's own fields)."""


def check_override(override: Override) -> None:
    """Refuse an override that names a field outside ``OVERRIDABLE`` (naming each one) or sets
    a field past its ``OVERRIDE_BOUNDS`` (naming the field and the bound). Checked where an
    override meets a config (``read_model``), so every way in (either front, a sibling worker,
    the state a restarted worker reloads) is held to the same rule."""
    refused = sorted(str(key) for key in override if key not in OVERRIDABLE)
    if refused:
        fields = ", ".join(repr(key) for key in refused)
        raise ConfigError(
            f"config override: field(s) {fields} cannot be overridden by a load call; "
            f"an override may change only {', '.join(OVERRIDABLE)} (the rest is set by the "
            "model's files in the repository)"
        )
    for key, bound in OVERRIDE_BOUNDS.items():
        if key in override and override[key] is not None:
            try:
                TypeAdapter(Annotated[int, Field(ge=1, le=bound)]).validate_python(override[key])
            except ValidationError:
                raise ConfigError(
                    f"config override: field {key!r} must be a whole number from 1 to {bound} "
                    "when a load call sets it"
                ) from None


def read_model(
    model_dir: Path, override: Override | None = None, versions: Collection[str] | None = None
) -> ModelSource | None:
    """The model in ``model_dir`` (None when the folder holds no model): a nograd folder (its
    ``config.toml`` or ``config.yaml``) or one of another format of ``nograd.formats`` (Triton's);
    the versions its policy selects, or those of ``versions`` found among its numbered folders. A
    config that cannot be used, or an override of a field outside ``OVERRIDABLE``, raises
    ``ConfigError`` naming the file (for a config) and the field."""
    if override:
        check_override(override)
    found = format_of(model_dir)
    return found.read(model_dir, override, versions) if isinstance(found, FolderFormat) else None


def read_wanted(model_dir: Path, versions: Mapping[str, Override | None]) -> ModelSource | None:
    """The model in ``model_dir`` as ``versions`` names it (version -> override): each version
    read with its own override, whatever the policy selects now; a version no longer on disk
    is left out."""
    by_override: dict[str, tuple[Override | None, list[str]]] = {}
    for version, override in versions.items():
        by_override.setdefault(override_text(override), (override, []))[1].append(version)
    found: dict[str, VersionSource] = {}
    source: ModelSource | None = None
    for override, group in by_override.values():
        source = read_model(model_dir, override, group)
        if source is None:
            return None
        found.update(source.versions)
    if source is None:
        return None
    ordered = dict(sorted(found.items(), key=lambda item: version_order(item[0])))
    return ModelSource(source.name, source.directory, ordered)


def scan(
    root: Path, wanted: Wanted | None = None, store: ArchiveStore | None = None
) -> tuple[dict[str, ModelSource], list[str]]:
    """Every model under ``root`` by name (those of ``wanted`` with the versions and overrides
    it names), and the problems of the folders that could not be read (each message names the
    file and field). With an archive ``store``, TorchServe archives (``.mar``) in ``root`` are
    models too, unpacked there."""
    if not root.is_dir():
        raise ConfigError(f"model repository {str(root)!r} is not a folder")
    wanted = wanted or {}
    found: dict[str, ModelSource] = {}
    problems: list[str] = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            source = read_model(model_dir)
            if source is not None and source.name in wanted:
                source = read_wanted(model_dir, wanted[source.name])
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if source is None:
            continue
        if source.name in found:
            problems.append(f"{model_dir}: field 'name': model {source.name!r} is defined twice")
            continue
        found[source.name] = source
    if store is not None:
        for path in archives(root):
            try:
                source = read_archive_source(path, store)
                if source.name in wanted:
                    source = read_archive_source(path, store, wanted[source.name])
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            if source.name in found:
                problems.append(f"{path}: model {source.name!r} is defined twice")
                continue
            found[source.name] = source
    return found, problems


def read_archive_source(
    path: Path,
    store: ArchiveStore,
    wanted: Mapping[str, Override | None] | None = None,
    override: Override | None = None,
) -> ModelSource:
    """The archive at ``path`` as a model of one version, read with ``override`` (or with the
    override ``wanted`` records for it); ``ConfigError`` names what is wrong."""
    if wanted:
        override = next(iter(wanted.values()))
    if override:
        check_override(override)
    config, folder, fingerprint = read_archive(path, store, override)
    version = VersionSource(config, folder, fingerprint, override)
    return ModelSource(config.name, folder, {config.version: version})


def archive_path(root: Path, name: str, store: ArchiveStore) -> Path | None:
    """The archive in ``root`` whose manifest names model ``name`` (an archive that cannot be
    read names no model); two that name it raise ``ConfigError``, as a scan reports them."""
    found = []
    for path in archives(root):
        try:
            config, _, _ = read_archive(path, store)
        except ConfigError:
            continue
        if config.name == name:
            found.append(path)
    if len(found) > 1:
        files = ", ".join(p.name for p in found)
        raise ConfigError(f"{root}: model {name!r} is defined twice (archives {files})")
    return found[0] if found else None


def holds_model(root: Path, name: str, store: ArchiveStore) -> bool:
    """Whether a folder or an archive of ``root`` holds model ``name`` (one named by two
    archives is held: loading it says why it cannot)."""
    if model_folder(root, name) is not None:
        return True
    try:
        return archive_path(root, name, store) is not None
    except ConfigError:
        return True


def archive_model(
    root: Path,
    name: str,
    store: ArchiveStore,
    override: Override | None = None,
    wanted: Mapping[str, Override | None] | None = None,
) -> ModelSource | None:
    """Model ``name`` as the archive in ``root`` that holds it (None when none does)."""
    path = archive_path(root, name, store)
    return None if path is None else read_archive_source(path, store, wanted, override)


def archive_names(root: Path, store: ArchiveStore) -> list[str]:
    """The names of the models the readable archives in ``root`` hold."""
    names = []
    for path in archives(root):
        try:
            names.append(read_archive(path, store)[0].name)
        except ConfigError:
            continue
    return names


def _configs(root: Path) -> Iterator[tuple[Path, str | None]]:
    """Each model folder under ``root`` with the name its config gives (None when the config
    cannot be read); folders without a config are not models."""
    if not root.is_dir():
        return
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        path = find_config(model_dir)
        if path is None and format_of(model_dir) is None:
            continue
        try:
            # Another format's model is named by its folder (a config naming another is refused).
            yield model_dir, load_config(path).name if path is not None else model_dir.name
        except ConfigError:
            yield model_dir, None


def model_folder(root: Path, name: str) -> Path | None:
    """The folder of model ``name``: the one whose config names it, or a folder of that name
    whose config cannot be read (reading it then says why). The folder named ``name`` is read
    first: a repository of many models (or of large configs) is not parsed whole to find one."""
    own = root / name
    plain = name and "/" not in name and "\\" not in name and not name.startswith(".")
    if plain and own.is_dir() and format_of(own) is not None:
        try:
            path = find_config(own)
            if (load_config(path).name if path is not None else name) == name:
                return own
        except ConfigError:
            pass  # an unreadable config: the other folders may name the model
    for model_dir, found in _configs(root):
        if found == name or (found is None and model_dir.name == name):
            return model_dir
    return None


def model_names(root: Path) -> list[str]:
    """The names of the models under ``root`` whose configs can be read, without reading or
    fingerprinting anything else."""
    return [name for _, name in _configs(root) if name is not None]


def repository_names(root: Path, store: ArchiveStore) -> list[str]:
    """Every model the repository holds, in folders and in archives."""
    return model_names(root) + archive_names(root, store)


def find_source(
    root: Path,
    store: ArchiveStore,
    name: str,
    override: Override | None = None,
    wanted: Mapping[str, Override | None] | None = None,
) -> ModelSource:
    """The repository folder (or archive) of model ``name``, read with ``override`` (the
    versions its policy selects), or as ``wanted`` names its versions and their overrides."""
    folder = model_folder(root, name)
    try:
        if folder is None:
            source = archive_model(root, name, store, override, wanted)
            if source is None:
                raise ModelNotFound(f"model {name!r} is not in the repository {str(root)!r}")
            return source
        source = read_model(folder, override) if wanted is None else read_wanted(folder, wanted)
    except ConfigError as exc:
        raise InvalidInput(str(exc)) from exc
    if source is None or not source.versions:
        if wanted is not None:
            listed = ", ".join(sorted(wanted))
            raise InvalidInput(f"{folder}: none of version(s) {listed} is in the repository")
        raise InvalidInput(f"{folder}: its version policy selects no version")
    return source


def files_bytes(source: ModelSource) -> int:
    """The size of a model's files on disk: what its first load is expected to hold (an
    archive's, unpacked or not yet, as its members declare)."""
    total = 0
    for version in source.versions.values():
        declared = declared_bytes(version.directory)
        if declared is not None:
            total += declared
            continue
        for path in version.directory.rglob("*"):
            if path.is_file():
                total += path.stat().st_size
    return total


def folder_gone(root: Path, directory: Path) -> bool:
    """Whether the folder (or archive) a version was loaded from has left the repository; an
    unreadable config does not count as gone (a half-copied folder must not unload a model)."""
    archive = origin(directory)
    if archive is not None:  # an archive: its file, not its unpacked folder
        return not (root / archive).is_file()
    folder = directory.parent if directory.name.isdigit() else directory
    return format_of(folder) is None


def always_resident(sources: Mapping[str, ModelSource], names: Collection[str] | None) -> set[str]:
    """The models on-demand control keeps resident: those ``names`` lists (every one when None,
    ``load_models = "*"``) and those whose config says ``resident = "always"``."""
    return {
        name
        for name, source in sources.items()
        if names is None
        or name in names
        or any(v.config.resident == "always" for v in source.versions.values())
    }
