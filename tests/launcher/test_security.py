"""``hvdliterun``'s trust boundary (issue 43, docs/security.md): no secret on a command line,
the worker identities at any size, hosts that cannot become options, strict values.

Real jobs under the installed mpiexec, or under a stand-in launcher (a script that runs the
rank wrapper of chosen ranks the way mpiexec would) where the point is what ``hvdliterun``
hands the launcher, not MPI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs_util import REPO, clean_env

from hvdlite.launcher.cli import main
from hvdlite.run import find_mpiexec, mpi_flavor

pytestmark = pytest.mark.timeout(120)


def hvdliterun(*args: str, env: dict[str, str] | None = None,
               timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hvdlite.run", *args],
                          env=clean_env() if env is None else env, cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


# -- finding 2: no secret on a command line ----------------------------------------------------

_SCAN = """\
import os, sys
token = os.environ["HVDLITE_MONITOR_TOKEN"].encode()
seen = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if token in handle.read():
                seen.append(pid)
    except OSError:
        pass
with open(os.path.join(sys.argv[1], "rank-" + os.environ["HOROVOD_RANK"]), "w") as out:
    out.write(f"{token.decode()} {len(seen)}")
"""


@pytest.mark.mpi
def test_the_monitor_token_is_on_no_command_line_and_not_printed(tmp_path: Path) -> None:
    # Hydra got every forwarded variable as -genv NAME VALUE: the token was in ps and in
    # --verbose; with it, a local user could end the job. Names only now, values in the env.
    script = _script(tmp_path, "scan.py", _SCAN)
    result = hvdliterun("-np", "2", "--verbose", "--", sys.executable, script, str(tmp_path))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        token, seen = (tmp_path / f"rank-{rank}").read_text().split()
        assert len(token) == 32
        assert seen == "0", f"rank {rank}: the token is on {seen} processes' command lines"
        assert token not in result.stdout + result.stderr
    command = next(line for line in result.stdout.splitlines()
                   if line.startswith("hvdliterun: command: "))
    if mpi_flavor(find_mpiexec() or "mpiexec") == "hydra":
        assert " -genvlist " in command and "HVDLITE_MONITOR_TOKEN" in command


# -- finding 6: the worker identities at 10,000 ranks --------------------------------------------

_STAND_IN = """\
#!{python}
# A stand-in MPI launcher: says it is Hydra, then runs the rank wrapper of the first and the
# last rank (the command line after the launcher's own arguments) as mpiexec would.
import os, subprocess, sys
if "--version" in sys.argv:
    print("HYDRA build details: stand-in")
    sys.exit(0)
args = sys.argv[1:]
at = next(i for i, a in enumerate(args) if a.endswith("rankwrap.py"))
n = int(args[args.index("-n") + 1])
codes = [subprocess.run(args[at - 2:], env=dict(os.environ, PMI_RANK=str(r), PMI_SIZE=str(n)))
         .returncode for r in (0, n - 1)]
sys.exit(max(codes))
"""

_IDENTITY = """\
import json, os, sys
names = ("HOSTNAME", "RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
with open(os.path.join(sys.argv[1], "id-" + os.environ["HOROVOD_RANK"]), "w") as out:
    json.dump([os.environ["HOROVOD_" + n] for n in names], out)
"""


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_ten_thousand_ranks_start(tmp_path: Path, elastic: bool) -> None:
    # The table of identities went into one variable (about 44 B a rank): past 128 KiB at
    # about 2,900 ranks, and -np 3000 failed with "Argument list too long".
    stand_in = tmp_path / "mpiexec"
    stand_in.write_text(_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    script = _script(tmp_path, "identity.py", _IDENTITY)
    hosts = "localhost:5000,127.0.0.1:5000"
    extra = ["--min-np", "10000"] if elastic else []
    result = hvdliterun("-np", "10000", "-H", hosts, *extra, "--mpiexec", str(stand_in),
                        "--", sys.executable, script, str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "id-0").read_text()) == \
        ["localhost", "0", "10000", "0", "5000", "0", "2"]
    assert json.loads((tmp_path / "id-9999").read_text()) == \
        ["127.0.0.1", "9999", "10000", "4999", "5000", "1", "2"]


# -- findings 7 and 8: bad input is one line naming it, before anything starts ------------------


@pytest.mark.parametrize(("args", "message"), [
    (["-H", "-oProxyCommand=touch {tmp}/ran:1"], "is not a host name or an IP address"),
    (["-H", "localhost:1,a;b:1"], "'a;b' is not a host name"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds (a finite number), got nan"),
    (["--timeout", "inf"], "--timeout must be > 0 seconds (a finite number), got inf"),
    (["--ssh-port", "70000"], "--ssh-port must be between 1 and 65535, got 70000"),
    (["--config-file", "{tmp}/null.yaml"], "params.cycle_time_ms: expected a number, got None"),
    (["--config-file", "{tmp}/list.yaml"], "params.fusion_threshold_mb: expected a number"),
    (["-x", "A-B=1"], "cannot forward the environment variable 'A-B'"),
])
def test_bad_input_is_one_line_and_nothing_starts(tmp_path: Path, args: list[str],
                                                  message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "null.yaml").write_text("params:\n  cycle_time_ms: null\n")
    (tmp_path / "list.yaml").write_text("params:\n  fusion_threshold_mb: [1]\n")
    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as ended:  # argparse's error: usage and one line, exit 2
        main(["-np", "1", *args, "--", sys.executable, "-c",
              f"open({str(tmp_path / 'ran')!r}, 'w')"])
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert message in err.splitlines()[-1], err
    assert not (tmp_path / "ran").exists()
