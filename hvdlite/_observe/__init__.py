"""Observability: the tracer the engine reports to, the Chrome-trace timeline writer, NVTX
ranges and the statistics behind ``hvdlite.stats()``."""
