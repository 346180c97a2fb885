"""Run Horovod's own elastic integration job, unchanged, through ``hvdliterun``: every
scenario of ``tests/elastic_scenarios.py`` (Horovod's ``elastic_common.py``), checked with
Horovod's expectations. Record the outcome in docs/horovod.md.

    python scripts/horovod_elastic_scenarios.py --job /path/to/elastic_torch_main.py \\
        --shim /tmp/hvdshim [--only NAME ...]

``--job``: ``test/integration/data/elastic_torch_main.py`` from Horovod's repository.
``--shim``: a folder with ``horovod/__init__.py`` (empty) and ``horovod/torch/__init__.py``
holding the one line ``from hvdlite.torch import *`` (and ``psutil``, which the job imports,
if it is not installed). Nothing of Horovod's is part of this repository.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import elastic_scenarios as es  # noqa: E402


def main() -> int:
    """Run the scenarios; print one line each and the count; exit 1 if any failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="Horovod's elastic_torch_main.py")
    ap.add_argument("--shim", required=True, help="folder with the horovod.torch shim")
    ap.add_argument("--only", nargs="*", help="scenario names (default: Horovod's nine)")
    ap.add_argument("--extra", action="store_true", help="also the scenarios beyond the nine")
    args = ap.parse_args()
    chosen = es.SCENARIOS + (es.EXTRA if args.extra else [])
    if args.only:
        chosen = [s for s in es.SCENARIOS + es.EXTRA if s.name in args.only]
    passed = 0
    for s in chosen:
        with tempfile.TemporaryDirectory() as work:
            result = es.run(s, Path(work), [sys.executable, args.job], es.env_for(args.shim))
        try:
            assert s.check is not None
            s.check(result)
            passed += 1
            print(f"PASS {s.name} ({result.took_s:.1f} s, exit {result.code})", flush=True)
        except AssertionError as exc:
            print(f"FAIL {s.name} ({result.took_s:.1f} s, exit {result.code}): {exc}",
                  flush=True)
    print(f"{passed} of {len(chosen)} scenarios passed")
    return 0 if passed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
