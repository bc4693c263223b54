"""The process's one TurboJPEG handle (libjpeg-turbo), shared by the decode stage and the payload codec."""

from __future__ import annotations

_TURBO = None


def turbojpeg_handle():
    """The shared TurboJPEG handle, or None when libturbojpeg is not installed (Pillow then decodes JPEGs)."""
    global _TURBO
    if _TURBO is None:
        try:
            from turbojpeg import TurboJPEG

            _TURBO = TurboJPEG()
        except (ImportError, RuntimeError, OSError):
            _TURBO = False
    return _TURBO or None
