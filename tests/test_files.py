"""Writing result files safely (issue 27): atomic writes, confined paths, a full disk, the folder lock."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from medflare.console.files import FolderLock, OutputError, atomic_write_bytes, atomic_write_text, confined


def disk_full_below(folder: Path, monkeypatch) -> None:
    """Every ``os.write`` to a file below ``folder`` fails as on a full disk (ENOSPC); other writes go on."""
    real_write = os.write

    def write(fd: int, data) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file a write goes to")
    monkeypatch.setattr(os, "write", write)


def test_a_symlink_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "out.csv.partial").symlink_to(victim)  # the name medflare used to stage under
    atomic_write_text(tmp_path / "out.csv", "a,b\n", replace=False)
    assert (tmp_path / "out.csv").read_text() == "a,b\n" and victim.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "out.csv.partial", "victim.txt"]


@pytest.mark.parametrize("existing", ["file", "dangling symlink"])
def test_without_replace_an_existing_name_is_refused_and_kept(existing: str, tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    if existing == "file":
        path.write_text("mine")
    else:
        path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match="exists; medflare does not replace files"):
        atomic_write_text(path, "new", replace=False)
    assert path.is_symlink() if existing != "file" else path.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_replace_swaps_a_symlink_itself_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "summary.json").symlink_to(victim)
    atomic_write_text(tmp_path / "summary.json", "{}")
    assert victim.read_text() == "mine" and not (tmp_path / "summary.json").is_symlink()


def test_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "summary.json").write_text("earlier")
    disk_full_below(tmp_path, monkeypatch)
    with pytest.raises(OutputError, match="no space left to write .*summary.json") as caught:
        atomic_write_bytes(tmp_path / "summary.json", b"x" * 100_000)
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert (tmp_path / "summary.json").read_text() == "earlier"


def test_a_really_full_disk_leaves_nothing_half_written(tiny_disk: Path) -> None:
    with pytest.raises(OutputError, match="no space left"):
        atomic_write_bytes(tiny_disk / "big.bin", b"x" * 4_000_000)
    assert list(tiny_disk.iterdir()) == []


@pytest.mark.parametrize("relative, reason", [
    ("/home/thesis.tex", "absolute"), ("job/../../thesis.tex", "'..'"), ("..", "'..'"), ("", "empty"),
    ("link/thesis.tex", "symlink"),
])
def test_a_path_leaving_the_folder_is_refused(relative: str, reason: str, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(tmp_path)
    with pytest.raises(OutputError, match=reason):
        confined(tmp_path / "out", relative, "the marker")
    assert confined(tmp_path / "out", "job/summary.json", "x") == (tmp_path / "out" / "job" / "summary.json").resolve()


def test_a_held_lock_names_its_owner_and_a_released_one_leaves_no_file(tmp_path: Path) -> None:
    first, second = FolderLock(tmp_path / "out"), FolderLock(tmp_path / "out")
    first.acquire()
    with pytest.raises(OutputError, match=f"--out .*out is in use by medflare process {os.getpid()} "):
        second.acquire()  # flock: two open files conflict in one process as in two
    first.release()
    assert not (tmp_path / "out.lock").exists()
    second.acquire()
    second.release()


def test_a_dead_processs_lock_does_not_block(tmp_path: Path) -> None:
    (tmp_path / "out.lock").write_text("medflare process 999999999\n")  # left by a killed run: nobody holds it
    lock = FolderLock(tmp_path / "out")
    lock.acquire()
    assert (tmp_path / "out.lock").read_text() == f"medflare process {os.getpid()}\n"
    lock.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "user file"])
def test_a_lock_file_medflare_did_not_make_is_refused_and_kept(planted: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    if planted == "symlink":
        (tmp_path / "out.lock").symlink_to(victim)
    else:
        (tmp_path / "out.lock").write_text("my lock notes")
    with pytest.raises(OutputError, match="not made by medflare"):
        FolderLock(tmp_path / "out").acquire()
    assert victim.read_text() == "mine"
    assert (tmp_path / "out.lock").is_symlink() or (tmp_path / "out.lock").read_text() == "my lock notes"
