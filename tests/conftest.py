"""Root test configuration.

``tests/mpi/`` and ``tests/torch/`` hold multi-rank tests. They only make sense under an MPI
launcher, so a plain ``python -m pytest`` does not collect them; ``tests/test_mpi_jobs.py``
runs ``tests/mpi`` instead, as real ``mpiexec`` jobs at 1, 2 and 4 ranks, and
``tests/test_torch_jobs.py`` runs ``tests/torch`` at 2. Under a launcher the roles flip:
everything that starts jobs of its own (the suite runners, the example and benchmark jobs, the
launcher tests) is ignored, so an ``mpiexec ... pytest`` never spawns nested jobs.
"""

from __future__ import annotations

from jobs_util import under_mpi_launcher

collect_ignore = (["test_mpi_jobs.py", "test_torch_jobs.py", "test_example_and_bench.py",
                   "test_memory_job.py", "launcher", "multihost"]
                  if under_mpi_launcher() else ["mpi", "torch"])
