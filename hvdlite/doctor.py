"""``python -m hvdlite.doctor``: the doctor's public path; it lives in
:mod:`hvdlite.launcher.doctor` (this module re-exports it)."""

from __future__ import annotations

import sys

from hvdlite.launcher.doctor import Report, main, self_test

__all__ = ["Report", "main", "self_test"]

if __name__ == "__main__":
    sys.exit(main())
