"""The error every engine raises for an artifact it cannot build, open or run."""

from __future__ import annotations


class ArtifactError(Exception):
    """An artifact that cannot be built or used; the message names the file."""
