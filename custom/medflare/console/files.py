"""Writing result files safely: atomic writes (an exclusively created temporary file beside the target, synced,
then renamed: never written through a planted symlink), a full disk as one line, paths confined to the folder
medflare owns (:func:`confined`), and a lock so two commands never write one result folder at once."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from medflare.errors import ConfigError, MedflareError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
LOCK_OWNER = "medflare process"  # the start of every lock file's text


class OutputError(MedflareError, RuntimeError):
    """A result could not be written safely: the disk is full, a path leaves medflare's folder, the folder is in
    use by another run, or a file medflare did not write is in the way."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota) is full, also when ``shutil.copytree`` gathered it."""
    if isinstance(exc, shutil.Error):  # copytree collects (source, destination, reason) and has no errno
        reasons = [str(entry[-1]) for entry in exc.args[0]] if exc.args and isinstance(exc.args[0], list) else []
        return any(os.strerror(code) in reason for reason in reasons for code in DISK_FULL)
    return isinstance(exc, OSError) and exc.errno in DISK_FULL


def disk_full_message(exc: OSError, path: Path | str | None = None) -> str:
    """One line for a full disk (or quota): what could not be written and how to go on."""
    where = path or exc.filename or "a result file"
    return (f"no space left to write {where} ({exc.strerror or os.strerror(errno.ENOSPC)}); nothing half-written "
            "was kept: free some space (df -h shows where) and run the command again")


@contextmanager
def disk_full_is_one_line(path: Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into an :class:`OutputError` with one line."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise OutputError(disk_full_message(exc, path)) from exc
        raise


def atomic_write_bytes(path: Path, data: bytes, *, replace: bool = True) -> Path:
    """Write ``data`` as ``path`` all at once (temporary file beside it, fsync, rename); return ``path``. Without
    ``replace`` an existing ``path`` is refused atomically (the file is linked into place). OutputError when the
    disk is full, or ``path`` exists and ``replace`` is off; ``path`` is left as it was."""
    path = Path(path)
    with disk_full_is_one_line(path):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        temporary = Path(name)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            _move_into_place(temporary, path, replace)
        finally:
            temporary.unlink(missing_ok=True)  # already gone after a rename; a leftover after a failure
        _sync_folder(path.parent)
    return path


def atomic_write_text(path: Path, text: str, *, replace: bool = True) -> Path:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"), replace=replace)


def atomic_write_json(path: Path, content: Any, *, replace: bool = True, indent: int = 1) -> Path:
    """:func:`atomic_write_bytes` of ``content`` as JSON (one trailing newline)."""
    return atomic_write_text(path, json.dumps(content, indent=indent) + "\n", replace=replace)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _move_into_place(temporary: Path, path: Path, replace: bool) -> None:
    if replace:
        os.replace(temporary, path)  # replaces a symlink itself, never what it points at
        return
    try:
        os.link(temporary, path)  # fails if the name exists, even as a dangling symlink
    except FileExistsError:
        raise OutputError(f"{path} exists; medflare does not replace files: choose a new output file") from None
    except OSError as exc:  # a file system without hard links: check, then rename
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise OutputError(f"{path} exists; medflare does not replace files: choose a new output file") from None
        os.replace(temporary, path)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: not every file system can sync a folder)."""
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def confined(root: Path, relative: str, named_by: str) -> Path:
    """``root / relative``, refused (OutputError naming ``named_by``) if it is absolute, has ``..`` or its folders
    are symlinks out of ``root``. The last part is not resolved: a symlink there is the file itself."""
    root = Path(root).resolve()
    parts = Path(relative).parts
    if not relative or Path(relative).is_absolute():
        reason = "an absolute path" if relative else "an empty name"
    elif ".." in parts:
        reason = "it climbs out with '..'"
    elif not (root / relative).parent.resolve().is_relative_to(root):
        reason = f"a folder on the way is a symlink to {(root / relative).parent.resolve()}"
    else:
        return root / relative
    raise OutputError(f"{named_by} names '{relative}', which is outside {root} ({reason}); medflare deletes and "
                      f"writes only inside the folder it owns: remove that entry, or move the folder away")


class FolderLock:
    """An exclusive ``fcntl.flock`` on ``<folder>.lock`` beside the folder (inside would make it non-empty), naming
    the owner's PID. The kernel drops it when the process ends, so a killed run's leftover never blocks."""

    def __init__(self, folder: Path, option: str = "--out") -> None:
        self.folder = Path(folder)
        self.path = self.folder.with_name(self.folder.name + ".lock")
        self.option = option
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; OutputError naming the holder when another process has it or the file is not ours."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_is_one_line(self.path):
            while self._fd is None:
                fd = self._open()
                try:
                    self._fd = self._lock(fd)
                except BaseException:
                    os.close(fd)
                    raise

    def release(self) -> None:
        """Give the lock back and remove its file (nothing happens when it is not held)."""
        if self._fd is None:
            return
        with suppress(OSError):
            self.path.unlink()  # while still held: nobody can take this file between the unlink and the close
        os.close(self._fd)
        self._fd = None

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if is_disk_full(exc):
                raise
            raise OutputError(f"cannot use the lock file {self.path} of {self.option} {self.folder} "
                              f"({exc.strerror}); it was not made by medflare: move it away") from exc

    def _lock(self, fd: int) -> int | None:
        """``fd`` once locked and still the lock file; None when its owner removed it meanwhile (try again)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(fd) or f"{LOCK_OWNER} (starting)"
            raise OutputError(f"{self.option} {self.folder} is in use by {owner} (lock {self.path}); wait for it "
                              f"to finish, or choose another {self.option}") from None
        try:
            still_ours = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            still_ours = False
        if not still_ours:
            os.close(fd)
            return None
        text = _read(fd)
        if text and not text.startswith(LOCK_OWNER):
            raise OutputError(f"{self.path} exists and was not made by medflare; move it away, or choose another "
                              f"{self.option}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{LOCK_OWNER} {os.getpid()}\n".encode(), 0)
        return fd


def _read(fd: int) -> str:
    return os.pread(fd, 200, 0).decode("utf-8", errors="replace").strip()


# ----- what medflare wrote: a marker of files and their content --------------------------------------------------
MARKER = ".medflare-outputs.json"


def files_under(folder: Path) -> list[str]:
    """Every file below ``folder`` (relative, '/'-separated), except the folder's own marker."""
    if not folder.is_dir():
        return []
    files = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(f for f in files if f != MARKER)


def read_record(folder: Path) -> dict[str, str]:
    """relative file -> the SHA-256 medflare recorded for it ("" when the marker recorded none: an older marker,
    which vouches for the name only and so for nothing that may be deleted)."""
    from medflare import readback  # imports numpy: only where a marker is read, never for `medflare methods`

    path = folder / MARKER
    if not path.is_file():
        return {}
    try:
        content = readback.load_json(path)
        files = [str(f) for f in content.get("files", [])]
        digests = content.get("sha256", {})
        digests = {str(k): str(v) for k, v in digests.items()} if isinstance(digests, dict) else {}
    except (MedflareError, AttributeError, TypeError):
        return {}  # an unreadable (or absurdly nested) marker vouches for nothing: nothing is removed
    for relative in files:  # all checked before any is used: a bad entry deletes nothing
        confined(folder, relative, str(path))
    return {relative: digests.get(relative, "") for relative in files}


def read_marker(folder: Path) -> list[str]:
    """The files ``folder``'s marker lists."""
    return list(read_record(folder))


def write_marker(folder: Path, files: list[str], digests: dict[str, str] | None = None) -> None:
    """Write ``folder``'s marker: ``files`` and the SHA-256 of each (relative path -> hex)."""
    content = {"written_by": "medflare", "note": "files medflare wrote here, with the SHA-256 of what it wrote; "
               "--overwrite removes only these, and only while they still hold that content",
               "files": files, "sha256": {f: (digests or {}).get(f, "") for f in files}}
    atomic_write_json(folder / MARKER, content)


def file_digest(path: Path) -> str:
    """SHA-256 of a file's content (hex); "" for anything that is not a regular file (a link is never vouched for)."""
    if path.is_symlink() or not path.is_file():
        return ""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unchanged_files(folder: Path) -> list[str]:
    """The files ``folder``'s marker lists that still hold the content medflare recorded (absent ones too: nothing
    of anyone's lies there)."""
    unchanged = []
    for relative, recorded in read_record(folder).items():
        path = confined(folder, relative, str(folder / MARKER))
        if not (path.exists() or path.is_symlink()) or (recorded and file_digest(path) == recorded):
            unchanged.append(relative)
    return unchanged


def record_files(folder: Path, digests: dict[str, str], dropped: set[str] = frozenset()) -> None:
    """Add files (relative path -> SHA-256 of what medflare wrote) to ``folder``'s marker; ``dropped`` leave it."""
    record = {f: d for f, d in read_record(folder).items() if f not in dropped}
    record.update(digests)
    write_marker(folder, sorted(record), record)


def remove_recorded(folder: Path, unit: str) -> list[str]:
    """Remove ``folder/unit`` when it holds only what medflare recorded writing there, each file still with that
    content; else remove nothing and return what else is there (relative to ``folder``)."""
    prefix = f"{unit}/"
    ours = {f for f in unchanged_files(folder) if f.startswith(prefix)}
    left = [f"{prefix}{f}" for f in files_under(folder / unit) if f"{prefix}{f}" not in ours]
    if left:
        return left
    remove_files(folder, sorted(ours))
    record_files(folder, {}, ours)
    return []


def remove_files(folder: Path, files: list[str]) -> None:
    """Delete the listed files, then folders left empty; all confined first (one outside deletes nothing)."""
    folder = folder.resolve()
    paths = [confined(folder, relative, str(folder / MARKER)) for relative in files]
    parents: set[Path] = set()
    for path in paths:
        if path.is_file() or path.is_symlink():
            path.unlink()
            parents.update(p for p in path.parents if folder in p.parents)
    for directory in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()


def write_recorded(out_dir: Path, name: str, write: Callable[[Path], Any]) -> Path:
    """``out_dir/name`` as ``write`` fills it (in an exclusively made folder beside it, renamed once complete),
    recorded in ``out_dir``'s marker. An existing folder is replaced only when it holds nothing but medflare's
    unchanged files (:func:`remove_recorded`; else OutputError, all kept); a link of that name is replaced itself."""
    target = out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{name}.", suffix=".partial"))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the result from whoever submits or reviews it
    try:
        write(staging)
        if target.is_symlink():
            target.unlink()
        left = remove_recorded(out_dir, name) if target.is_dir() else []
        if left or (target.exists() and not target.is_dir()):
            raise OutputError(f"{target} holds {out_dir / left[0] if left else 'a file of that name'}, which "
                              "medflare did not write (or changed since it did); move it away or write elsewhere")
        if target.is_dir():
            target.rmdir()  # empty: every file in it was medflare's and unchanged
        written = {f"{name}/{p.relative_to(staging).as_posix()}": file_digest(p)
                   for p in sorted(staging.rglob("*")) if p.is_file()}
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record_files(out_dir, written)
    return target


# ----- a result folder medflare may create, fill and replace ----------------------------------------------------
@dataclass
class OutputTarget:
    """A result folder (``unit`` inside ``root``, whose marker records every file medflare wrote; "" = ``root``)
    that medflare may create, fill and replace. ``overwrite`` replaces medflare's earlier files (never anyone
    else's); ``merge`` keeps them beside the results, replacing only same-named ones (``report`` into a
    downloaded job). ``option`` names the folder's flag in messages."""

    root: Path
    unit: str = ""
    overwrite: bool = False
    merge: bool = False
    option: str = "--out"

    def __post_init__(self) -> None:
        if self.unit and (Path(self.unit).name != self.unit or self.unit in (".", "..")):
            raise ConfigError(f"'{self.unit}' must be one folder name inside {self.option} (no '/', '.' or '..')")
        self.root = Path(self.root).resolve()
        if not self.root.name:
            raise ConfigError(f"{self.option} {self.root} is the top of the file system; medflare stages results "
                              f"beside the folder it writes, so choose a named folder (e.g. {self.option} results)")
        self._keep_staging = False  # set when publishing refused: the finished results must not be lost
        self._lock = FolderLock(self.root, self.option)  # the root: units share its marker

    @property
    def target(self) -> Path:
        return self.root / self.unit if self.unit else self.root

    @property
    def staging(self) -> Path:
        return self.target.with_name(self.target.name + ".partial")

    @property
    def failed_log(self) -> Path:
        return self.target.with_name(self.target.name + ".failed.log")

    def check(self) -> None:
        """Refuse, before anything starts, a target that is a file or already holds something (without
        ``--overwrite``), and a staging folder medflare did not make. Writes nothing."""
        for folder in (self.root, self.target):
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"{self.option} {folder} is a file, not a folder; choose a folder path")
        blocker = next((p for p in self.root.parents if p.exists() or p.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise ConfigError(f"{self.option} {self.root} lies below {blocker}, which is a file, not a folder; "
                              f"choose a folder path")
        if self.target.is_dir() and any(self.target.iterdir()) and not (self.overwrite or self.merge):
            what = "already exists" if self.unit else "is not empty"
            raise ConfigError(f"{self.option} {self.target} {what}; choose a new folder, or add --overwrite to "
                              f"replace medflare's earlier results there (files medflare did not write are kept)")
        if self.staging.is_symlink() or (self.staging.exists() and not (self.staging / MARKER).is_file()):
            raise ConfigError(f"{self.staging} exists and was not made by medflare; move it away or choose "
                              f"another {self.option}")
        read_record(self.root)  # a marker naming a path outside the folder is refused before anything runs

    def begin(self) -> Path:
        """Lock the folder (until :meth:`publish` or :meth:`abandon`; OutputError when another command holds it),
        then make a fresh staging folder marked as medflare's."""
        self.check()  # a refusal creates nothing, not even the lock's folder
        self._lock.acquire()
        try:
            self.check()  # again, now that no other medflare command can change the folder
            shutil.rmtree(self.staging, ignore_errors=True)  # check() proved it is medflare's, and no one uses it
            self.staging.mkdir(parents=True)
            write_marker(self.staging, [])
        except BaseException:
            self._lock.release()
            raise
        return self.staging

    def publish(self, source: Path | None = None) -> Path:
        """Move the staged results (``source``, default the staging folder) into the target and record them in
        the root's marker. OutputError, results kept staged, when one would replace a file medflare did not write."""
        source = source or self.staging
        new_files = files_under(source)
        if not self.target.exists():
            if self.unit:
                (self.staging / MARKER).unlink(missing_ok=True)  # the root's marker records a unit's files
            else:
                write_marker(source, new_files, {f: file_digest(source / f) for f in new_files})
            source.rename(self.target)
            shutil.rmtree(self.staging, ignore_errors=True)
            if self.unit:
                self._record(new_files)
            self._lock.release()
            return self.target
        prefix = f"{self.unit}/" if self.unit else ""
        ours = {f[len(prefix):] for f in unchanged_files(self.root) if f.startswith(prefix)}
        clashes = sorted(set(new_files) & (set(files_under(self.target)) - ours))
        if clashes:
            self._keep_staging = True
            raise OutputError(
                f"{self.target / clashes[0]} was not written by medflare (or changed since it was) and would be "
                f"replaced; the results are kept in {self.staging}. Move that file away, or choose another "
                f"{self.option}")
        replaced = ours & set(new_files) if self.merge else ours
        destinations = [confined(self.target, relative, f"the result {relative}") for relative in new_files]
        # first: a result moved in below is medflare's even if the move stops half-way
        self._record(new_files, digests={f: file_digest(source / f) for f in new_files})
        remove_files(self.target, sorted(replaced))
        for relative, destination in zip(new_files, destinations):
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source / relative, destination)
        shutil.rmtree(self.staging)
        self._record(new_files, replaced={prefix + f for f in replaced})
        self._lock.release()
        return self.target

    def abandon(self, log: str | None = None) -> Path | None:
        """Remove the staging folder (medflare's); keep ``log`` as ``<target>.failed.log`` and return its path
        (None when even the log cannot be written: the error that ended the run is the one to report)."""
        try:
            if (self.staging / MARKER).is_file() and not self._keep_staging:
                shutil.rmtree(self.staging, ignore_errors=True)  # first: on a full disk it frees room for the log
            if log:
                self.failed_log.parent.mkdir(parents=True, exist_ok=True)
                return atomic_write_text(self.failed_log, log)
        except (OSError, OutputError):
            pass
        finally:
            self._lock.release()
        return None

    def _record(self, new_files: list[str], replaced: set[str] | None = None,
                digests: dict[str, str] | None = None) -> None:
        """Add ``new_files`` (relative to the unit) to the root's marker, with ``digests`` (default: read from
        where they now lie); ``replaced`` leaves the marker."""
        prefix = f"{self.unit}/" if self.unit else ""
        digests = digests if digests is not None else {f: file_digest(self.target / f) for f in new_files}
        record_files(self.root, {prefix + f: digest for f, digest in digests.items()}, replaced or set())

