"""Local image files a record names, read only inside the allowed roots: the one check every reader of such a path
goes through (the decode fetcher, `vlmstream view`'s thumbnails), so a path that leads out of the roots (``..``, a
symlink, an encoded slash once decoded) is refused the same way everywhere. The roots are ``decode.allowed_roots``.

The fetch errors live here too, the local ones' home; ``fetch.py`` beside it adds those of URLs.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from vlmstream.images.errors import ImageError


class FetchError(ImageError):
    error_kind = "fetch_error"


class IoError(FetchError):
    """A read failed below us (NFS, a disk): the same file may read fine later."""

    error_kind = "fetch_io_error"
    retriable = True


class NotFound(FetchError):
    error_kind = "fetch_not_found"


class ForbiddenPath(FetchError):
    error_kind = "fetch_forbidden_path"


class TooLarge(FetchError):
    """A file or download over the byte limit; the reason names the setting that raises it."""

    error_kind = "fetch_too_large"

    def __init__(self, what: str, limit: int):
        super().__init__(f"{what}: over decode.max_image_bytes ({limit:,} bytes; "
                         f"VLMSTREAM_DECODE__MAX_IMAGE_BYTES raises it)")


class LocalFiles:
    """Files under ``allowed_roots`` (empty: the current directory), at most ``max_bytes`` each."""

    def __init__(self, allowed_roots: list[str] | tuple[str, ...] = (), max_bytes: int = 64 * 1024 * 1024):
        roots = allowed_roots or [os.getcwd()]
        self.roots = tuple(Path(root).expanduser().resolve() for root in roots)
        self.max_bytes = max_bytes

    def resolve(self, raw_path: str) -> Path:
        """Where the path really leads, or ForbiddenPath when that is outside every root (NotFound when it cannot
        be resolved). A relative path is taken from the first root."""
        if "\x00" in raw_path:
            raise ForbiddenPath("path contains a NUL byte")
        # Resolve symlinks and '..' first: the check must see where the bytes really are.
        try:
            path = Path(raw_path).expanduser()
            if not path.is_absolute():
                path = self.roots[0] / path
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:  # symlink loop, name too long, ~user with no such user
            raise NotFound(f"{raw_path}: cannot resolve: {exc}") from exc
        if not any(resolved.is_relative_to(root) for root in self.roots):
            roots = ", ".join(str(root) for root in self.roots)
            raise ForbiddenPath(
                f"{raw_path} resolves to {resolved}, outside the allowed roots ({roots}); the setting is "
                f"decode.allowed_roots (empty: the current directory), e.g. in the config file "
                f"[decode] allowed_roots = [\"/data/images\"] or the environment "
                f"VLMSTREAM_DECODE__ALLOWED_ROOTS='[\"/data/images\"]', on every machine that reads the images")
        return resolved

    def read(self, raw_path: str) -> bytes:
        resolved = self.resolve(raw_path)
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait forever for a writer. The type is checked on the open
            # handle, not before opening, so the path cannot be swapped for a FIFO or a device in between.
            with open(resolved, "rb", opener=_open_nonblocking) as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):  # a FIFO or device has no end, or blocks on read
                    raise NotFound(f"{raw_path} is not a regular file")
                size = info.st_size
                if size > self.max_bytes:
                    raise TooLarge(f"{raw_path} has {size:,} bytes", self.max_bytes)
                data = handle.read(self.max_bytes + 1)
        except FileNotFoundError as exc:
            raise NotFound(f"{raw_path}: no such file") from exc
        except IsADirectoryError as exc:
            raise NotFound(f"{raw_path} is a directory") from exc
        except PermissionError as exc:
            raise ForbiddenPath(f"{raw_path}: permission denied") from exc
        except OSError as exc:
            if exc.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP, errno.ENXIO):
                raise NotFound(f"{raw_path}: {exc.strerror}") from exc
            raise IoError(f"{raw_path}: {exc}") from exc
        if len(data) > self.max_bytes:  # the file grew while we read it
            raise TooLarge(f"{raw_path} grew while it was read", self.max_bytes)
        return data


def _open_nonblocking(path, flags):
    return os.open(path, flags | os.O_NONBLOCK)
