"""The rank's end of the launcher plane: what a process started by ``hvdliterun`` needs.

- :mod:`hvdlite._rankside.protocol`: the names, files and exit codes the launcher and the
  ranks agree on (standard library only; the rank wrapper loads it by path).
- :mod:`hvdlite._rankside.ending`: a rank ending without MPI: the reason said once per
  process, the failure report left for the launcher, stdio flushed, ``os._exit``.
- :mod:`hvdlite._rankside.watchdog`: the thread inside a rank that ends it, trace written,
  when the launcher says the job is over, and the rank's side of the control channel
  (``send`` / ``subscribe``).

The runtime imports these and nothing of :mod:`hvdlite.launcher`; the launcher imports
``protocol`` and nothing of the runtime. Nothing here imports anything of hvdlite above this
package (:mod:`hvdlite._exit`, MPI's abort and the exit guard, builds on ``ending``).
"""
