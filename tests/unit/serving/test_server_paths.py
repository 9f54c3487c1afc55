"""Error texts as a client reads them: the server's folders, other absolute paths and traceback
frames are left out; what the client sent or named stays."""

from __future__ import annotations

from pathlib import Path

from nograd.serving.calls.server_paths import without_server_paths


def test_a_path_under_a_server_folder_is_written_from_it(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    repository.mkdir()
    text = f"{repository}/m/config.pbtxt: field 'max_batch_size': must be >= 0"
    assert without_server_paths(text, [repository]) == (
        "m/config.pbtxt: field 'max_batch_size': must be >= 0"
    )
    assert without_server_paths(f"not in the repository '{repository}'", [repository]) == (
        "not in the repository '.'"
    )


def test_a_symbolic_link_to_a_server_folder_is_left_out_too(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert without_server_paths(f"{real}/m/1/model.py: bad", [tmp_path / "link"]) == (
        "m/1/model.py: bad"
    )


def test_other_absolute_paths_and_traceback_frames_keep_their_last_name() -> None:
    text = (
        'Traceback: File "/usr/lib/python3.11/importlib/__init__.py", line 126, in import_module'
        " ; cannot open /srv/secret/weights.pt (see /opt/nograd/serving/control/loading.py)"
    )
    shown = without_server_paths(text, [])
    assert "/usr" not in shown and "/srv" not in shown and "/opt" not in shown
    assert "line 126" not in shown
    assert "weights.pt" in shown and "in __init__.py" in shown


def test_a_text_without_server_paths_is_unchanged() -> None:
    text = "parameter 'config' is not JSON: Expecting value: line 1 column 1 (char 0)"
    assert without_server_paths(text, [Path("/srv/models")]) == text
    assert without_server_paths("ratio 1/2 of a/b", []) == "ratio 1/2 of a/b"
