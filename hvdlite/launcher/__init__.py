"""The launcher plane: ``hvdliterun`` and everything that runs outside the ranks' training code.

- :mod:`~hvdlite.launcher.cli`: the command line (flags, Horovod's included) and ``main``.
- :mod:`~hvdlite.launcher.job`: the MPI launcher (which one, its flavour) and its command line.
- :mod:`~hvdlite.launcher.supervise`: one MPI world watched to its end: a rank that failed
  first, a lost host, a signal, the timeout; the message that names what happened.
- :mod:`~hvdlite.launcher.elastic` and :mod:`~hvdlite.launcher.discovery`: the elastic driver
  (a job as a sequence of worlds; host discovery, blacklisting with a cool-down).
- :mod:`~hvdlite.launcher.hosts`: ``-H`` / hostfiles, the ssh check, the network interface,
  the environment every rank gets (``HOROVOD_*`` worker identity included).
- :mod:`~hvdlite.launcher.monitor` and :mod:`~hvdlite.launcher.verdict`: the launcher <-> rank
  control channel and what the launcher concludes from it.
- :mod:`~hvdlite.launcher.rankwrap`: the per-rank wrapper (run by path, standard library only).
- :mod:`~hvdlite.launcher.common`: helpers written once (messages, process groups, reports).
- :mod:`~hvdlite.launcher.doctor` and :mod:`~hvdlite.launcher.links`: ``hvdliterun --check``.

The rank's end of the plane lives in :mod:`hvdlite._rankside` (the runtime imports it, never
this package). Importing this package imports nothing.
"""
