"""Launcher-side machinery of ``hvdliterun`` (private).

- :mod:`hvdlite._launch.monitor`: the launcher <-> rank control channel (heartbeats, exit
  reports, host-loss detection, messages both ways). Standard library only.
- :mod:`hvdlite._launch.hosts`: ``-H`` / hostfile parsing, the ssh check of every host at start
  and the choice of network interface.
- :mod:`hvdlite._launch.watchdog`: the thread inside a rank that ends it, trace written, when
  the launcher says the job is over (even while the rank is blocked inside MPI).
"""
