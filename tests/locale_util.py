"""A test helper: run a block under an ASCII locale (for checks that text files are read and written as UTF-8)."""

from __future__ import annotations

import contextlib
import locale
import sys

import pytest


@contextlib.contextmanager
def ascii_locale():
    """Run the body with LC_CTYPE = "C", where text files opened without an encoding read and write ASCII.

    Skips the test where that cannot happen: Python's UTF-8 mode, or a platform whose C locale is UTF-8.
    """
    if sys.flags.utf8_mode:
        pytest.skip("Python UTF-8 mode: the locale encoding is always UTF-8")
    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            pytest.skip("the C locale of this platform is UTF-8")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
