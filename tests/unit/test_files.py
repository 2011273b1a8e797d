"""memfit/files.py: a file or folder is the old one or the new one, never half of one, and nothing is left beside it."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from memfit.files import (
    atomic_path,
    commit_folder,
    file_record,
    probe_writable,
    sha256_file,
    temporary_sibling,
    write_json_atomic,
)

pytestmark = pytest.mark.unit


def test_sha256_and_record_match_hashlib_across_chunks(tmp_path):
    data = os.urandom((1 << 20) + 12345)  # more than one read chunk
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert file_record(path) == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_json_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"steps": 1})
    write_json_atomic(path, {"steps": 2, "b": [1]}, indent=2, sort_keys=True)
    assert json.loads(path.read_text()) == {"b": [1], "steps": 2}
    assert path.read_text().startswith('{\n  "b"')  # the json.dumps options reached the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_partial_one(tmp_path):
    path = tmp_path / "cache.safetensors"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk gone"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk gone")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.safetensors"]


def test_temporary_names_are_hidden_siblings_and_unique(tmp_path):
    a, b = temporary_sibling(tmp_path / "hf"), temporary_sibling(tmp_path / "hf")
    assert a.parent == tmp_path and a.name.startswith(".hf.tmp-") and a != b


def test_commit_folder_swaps_in_the_new_folder_and_drops_the_old(tmp_path):
    final = tmp_path / "hf"
    final.mkdir()
    (final / "old.txt").write_text("old")
    staged = temporary_sibling(final)
    staged.mkdir()
    (staged / "model.safetensors").write_text("new")
    commit_folder(staged, final)
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .old-, no .tmp- left


def test_commit_folder_refuses_to_replace_a_file(tmp_path):
    final = tmp_path / "hf"
    final.write_text("a file")
    staged = temporary_sibling(final)
    staged.mkdir()
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        commit_folder(staged, final)
    assert final.read_text() == "a file"


def test_a_link_to_a_folder_is_replaced_but_its_target_is_kept(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    final = tmp_path / "hf"
    final.symlink_to(target)
    staged = temporary_sibling(final)
    staged.mkdir()
    (staged / "new.txt").write_text("new")
    commit_folder(staged, final)
    assert not final.is_symlink() and (final / "new.txt").read_text() == "new"
    assert (target / "keep.txt").read_text() == "keep"


def test_probe_writable_creates_the_folder_and_leaves_nothing(tmp_path):
    folder = tmp_path / "a" / "b"
    probe_writable(folder)
    assert folder.is_dir() and list(folder.iterdir()) == []
    if os.geteuid() != 0:  # root writes anywhere: the refusal shows only for other users
        folder.chmod(0o500)
        with pytest.raises(PermissionError):
            probe_writable(folder)
