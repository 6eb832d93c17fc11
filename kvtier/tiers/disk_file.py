"""Claiming a disk tier's rank file: opened only as a file kvtier may have made, locked
against a second process, with the rank files of another world size cleared away.

A rank opens only a regular file of one name: never through a link, never a FIFO or
device, and in a directory other users can write only a sticky one, and only its own
file there (anyone else could swap the name for a link to a file of ours). Each rank
holds its file locked with ``flock``, so a rank file of another world size that can be
locked was left by an earlier run and is deleted; one that is held refuses the
directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
from pathlib import Path

from kvtier.config.sources import file_kind
from kvtier.tiers.base import TierError

logger = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"rank\d+-of(\d+)\.kvtier")
"""Names of rank files; the group is the world size."""


def open_rank_file(file: Path, world_size: int, o_direct: bool) -> int:
    """Open (or create) ``file``, lock it and clear the directory of other world sizes' files.

    Returns:
        The open, locked file descriptor.

    Raises:
        TierError: The directory cannot be created, it or the file is one kvtier may not
            have made, the file (or a rank file of another world size beside it) is held by
            another process, or ``o_direct`` is set and the filesystem refuses it.
    """
    directory = file.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise TierError(
            f"disk tier: cannot create the directory {directory}: {exc.strerror}; point "
            "path at a writable directory on a local disk"
        ) from None
    try:
        shared = _check_directory(directory, os.fstat(dir_fd))
        fd = _open_file(file, dir_fd, shared, o_direct)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = lock_holder(os.fstat(fd))
            os.close(fd)
            raise TierError(
                f"disk tier: {file} is in use by another kvtier process"
                f"{f' ({holder})' if holder else ''}; give each engine its own path, or "
                "stop that process if its engine is gone"
            ) from None
        try:
            _remove_other_world_sizes(directory, dir_fd, shared, world_size)
        except BaseException:
            if os.fstat(fd).st_size == 0:  # made just now: leave no file behind
                os.unlink(file.name, dir_fd=dir_fd)
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return fd


def lock_holder(status: os.stat_result) -> str | None:
    """``pid N, NAME`` of the process holding the file of ``status`` locked with ``flock``,
    from ``/proc/locks``; ``None`` where that cannot be told."""
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        with open("/proc/locks") as locks:
            pids = [
                fields[4]
                for fields in (line.split() for line in locks)
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device
            ]
        if not pids:
            return None
        with open(f"/proc/{pids[0]}/comm") as comm:
            return f"pid {pids[0]}, {comm.read().strip()}"
    except OSError:
        return None


def no_direct_io(file: Path, exc: OSError) -> TierError:
    """The start-up error of a filesystem that refuses ``O_DIRECT``."""
    return TierError(
        f"disk tier: the filesystem of {file.parent} refuses O_DIRECT "
        f"({exc.strerror}); set o_direct: false, or point path at a local filesystem "
        "that supports it (ext4, xfs)"
    )


def _remove_other_world_sizes(directory: Path, dir_fd: int, shared: bool, world_size: int) -> None:
    """Delete the rank files an engine of another world size left in the directory, so
    that it holds no more than ``capacity_bytes``; refuse the directory while such an
    engine still holds one. Only regular files of one name are touched, and in a
    directory other users can write only this user's."""
    for name in sorted(os.listdir(dir_fd)):
        match = _RANK_FILE.fullmatch(name)
        if match is None or int(match[1]) == world_size:
            continue
        try:
            status = os.lstat(name, dir_fd=dir_fd)
            if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
                continue
            if shared and status.st_uid != os.geteuid():
                continue
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (status.st_dev, status.st_ino):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise TierError(
                    f"disk tier: {directory} is in use by an engine of {match[1]} rank(s) "
                    f"({name} is locked), and this one has {world_size}; give each engine "
                    "its own path"
                ) from None
            os.unlink(name, dir_fd=dir_fd)
            logger.info(
                "disk tier: removed %s, left by an engine of %s rank(s) (this one has %d)",
                directory / name,
                match[1],
                world_size,
            )
        finally:
            os.close(fd)


def _check_directory(directory: Path, status: os.stat_result) -> bool:
    """Whether users other than this one can write ``directory``; refuse it unless sticky.

    A directory is shared when its group or others may write it, or when another
    user (not root) owns it; the link ``path`` itself names, when it is one, must
    be this user's or root's too.
    """
    me = os.geteuid()
    link = os.lstat(directory)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise TierError(
            f"disk tier: path {directory} is a symbolic link owned by uid {link.st_uid}, not "
            f"by this user (uid {me}) or root; point path at the directory itself"
        )
    writable_by_others = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not writable_by_others and status.st_uid in (me, 0):
        return False
    if not status.st_mode & stat.S_ISVTX:
        raise TierError(
            f"disk tier: directory {directory} can be written by other users and is not "
            f"sticky (mode {stat.S_IMODE(status.st_mode):o}, owner uid {status.st_uid}); "
            "point path at a directory only this user can write, or chmod 700 it"
        )
    return True


def _open_file(file: Path, dir_fd: int, shared: bool, o_direct: bool) -> int:
    """Open ``file`` in ``dir_fd`` as a regular file kvtier may have made; see the module
    docstring."""
    try:
        before: os.stat_result | None = os.lstat(file.name, dir_fd=dir_fd)
    except FileNotFoundError:
        before = None
    except OSError as exc:
        raise _cannot_open(file, exc) from None
    if before is not None:
        _check_file(file, before, shared)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(file.name, flags | (os.O_DIRECT if o_direct else 0), 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_ours(file, "is a symbolic link") from None
        if o_direct and exc.errno == errno.EINVAL:
            raise no_direct_io(file, exc) from None
        raise _cannot_open(file, exc) from None
    try:
        after = os.fstat(fd)
        if before is not None and (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
            raise _not_ours(file, "was replaced while it was being opened")
        _check_file(file, after, shared)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(file: Path, status: os.stat_result, shared: bool) -> None:
    kind = file_kind(status.st_mode)
    if kind is not None:
        raise _not_ours(file, f"is {kind}, not a regular file")
    if status.st_nlink > 1:
        raise _not_ours(file, f"has {status.st_nlink} names (hard links)")
    if shared and status.st_uid != os.geteuid():
        raise _not_ours(
            file,
            f"is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()}), in a "
            "directory other users can write",
        )


def _not_ours(file: Path, what: str) -> TierError:
    return TierError(
        f"disk tier: {file} {what}; kvtier only opens a file it made: remove it, or "
        "point path at a directory only this user can write"
    )


def _cannot_open(file: Path, exc: OSError) -> TierError:
    return TierError(
        f"disk tier: cannot open {file}: {exc.strerror}; point path at a writable "
        "directory on a local disk"
    )
