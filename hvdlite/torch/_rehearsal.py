"""The capture rehearsal: one warm-up step that sees what the capture will see.

Code that runs eagerly around a compiled region may branch on whether the current stream is
capturing a CUDA graph. Hugging Face's models do: ``create_causal_mask`` returns None outside a
capture (SDPA's ``is_causal`` then masks) and an explicit mask tensor inside one. A region
compiled during the warm-up steps guards on ``attention_mask is None``; at the capture that guard
fails, dynamo compiles the region again, and compiling runs CUDA work on the capturing stream,
which invalidates the capture (``operation not permitted when stream is capturing``; GPT-2 by
regions, gpu-validation run 93). ``make_graphed_step`` runs its last warm-up step and the
capture inside :func:`rehearsing`, which makes ``torch.cuda.is_current_stream_capturing()``
answer True on the calling thread, so the region compiles for the capture's inputs during that
warm-up step, and the capture finds its code compiled. The capture runs inside it too, so
compiled code that calls the function itself sees the same function object (dynamo guards on
it) and the same answer in both.

The answer changes on the calling thread only (hvdlite's background thread and any other thread
get the true one) and only while a rehearsal runs: torch's function is wrapped for the time of
the first rehearsal in progress and restored when the last ends. While dynamo traces, the wrapper
answers as torch does, so a compiled region that asks keeps its usual graph (no graph break).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["rehearsing"]

_lock = threading.Lock()
_threads: dict[int, int] = {}  # thread id -> rehearsals it has in progress
# What torch.cuda's and torch.cuda.graphs' attributes were before the first rehearsal.
_original: tuple[Callable[[], bool], Callable[[], bool]] | None = None


def _install() -> None:
    global _original
    original = torch.cuda.graphs.is_current_stream_capturing
    compiling = torch.compiler.is_compiling
    threads = _threads

    def is_current_stream_capturing() -> bool:
        if compiling():
            return original()
        return threading.get_ident() in threads or original()

    is_current_stream_capturing.__doc__ = original.__doc__
    is_current_stream_capturing.__wrapped__ = original  # type: ignore[attr-defined]
    _original = (torch.cuda.is_current_stream_capturing, original)
    torch.cuda.is_current_stream_capturing = is_current_stream_capturing
    torch.cuda.graphs.is_current_stream_capturing = is_current_stream_capturing


def _uninstall() -> None:
    global _original
    if _original is not None:
        torch.cuda.is_current_stream_capturing, torch.cuda.graphs.is_current_stream_capturing \
            = _original
        _original = None


@contextlib.contextmanager
def rehearsing() -> Iterator[None]:
    """Inside: ``torch.cuda.is_current_stream_capturing()`` is True on this thread (see the
    module docstring). Nests; thread-safe; restores torch's function when the last ends."""
    me = threading.get_ident()
    with _lock:
        if not _threads:
            _install()
        _threads[me] = _threads.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            left = _threads[me] - 1
            if left:
                _threads[me] = left
            else:
                del _threads[me]
            if not _threads:
                _uninstall()
