"""make_graphed_step's capture rehearsal (``hvdlite/torch/_rehearsal.py``) on the CPU: while it
runs, ``torch.cuda.is_current_stream_capturing()`` answers True on the rehearsing thread only;
it nests, is restored when the last rehearsal ends (also after an error), and a region compiled
during a rehearsal is not compiled again when the same answer comes from a real capture."""

from __future__ import annotations

import threading

import pytest
import torch

from hvdlite.torch._rehearsal import rehearsing


@pytest.fixture(autouse=True)
def not_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's answer on a GPU machine that is not capturing (a CPU-only torch has no answer:
    # its function raises), installed where the rehearsal finds torch's function.
    def torch_answer() -> bool:
        return False

    monkeypatch.setattr(torch.cuda.graphs, "is_current_stream_capturing", torch_answer)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", torch_answer)


def test_true_on_the_rehearsing_thread_only_and_restored() -> None:
    original = torch.cuda.is_current_stream_capturing
    seen: dict[str, bool] = {}
    inside, go = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        seen["other"] = torch.cuda.is_current_stream_capturing()
        go.set()

    t = threading.Thread(target=other)
    t.start()
    with rehearsing():
        seen["me"] = torch.cuda.is_current_stream_capturing()
        seen["graphs"] = torch.cuda.graphs.is_current_stream_capturing()
        with rehearsing():
            seen["nested"] = torch.cuda.is_current_stream_capturing()
        seen["after nested"] = torch.cuda.is_current_stream_capturing()
        inside.set()
        assert go.wait(10)
    t.join(10)
    assert seen == {"me": True, "graphs": True, "nested": True, "after nested": True,
                    "other": False}
    assert torch.cuda.is_current_stream_capturing is original
    assert torch.cuda.graphs.is_current_stream_capturing is original
    assert not torch.cuda.is_current_stream_capturing()


def test_restored_after_an_error() -> None:
    original = torch.cuda.is_current_stream_capturing
    with pytest.raises(RuntimeError, match="boom"), rehearsing():
        raise RuntimeError("boom")
    assert torch.cuda.is_current_stream_capturing is original


def _counting() -> tuple[list[str], object]:
    compiles: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: object) -> object:
        compiles.append("compiled")
        return gm.forward

    return compiles, backend


def test_a_region_compiled_while_rehearsing_serves_the_capture() -> None:
    # make_graphed_step's flow: warm-up steps, the last one rehearsed, then the capture inside
    # the same rehearsal. Eager code picks a region's input by the capture state (a mask, as
    # Hugging Face's causal mask does): the rehearsed step compiles the capture's variant, so
    # the capture (torch's answer True as well) compiles nothing.
    compiles, backend = _counting()
    torch._dynamo.reset()

    def block(h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        h = h + 1
        return h if m is None else h * m

    region = torch.compile(block, backend=backend)

    def step() -> torch.Tensor:
        m = torch.ones(4) if torch.cuda.is_current_stream_capturing() else None
        return region(torch.arange(4.0), m)

    step()
    with rehearsing():
        step()
        assert len(compiles) == 2
        # The capture: on this thread the answer is True (the rehearsal's, and torch's).
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(step(), torch.arange(4.0) + 1)
    assert len(compiles) == 2


def test_a_region_that_asks_itself_is_not_compiled_again_by_the_capture() -> None:
    # A compiled region that calls torch.cuda.is_current_stream_capturing() itself: while
    # dynamo traces, the wrapper answers as torch does (no graph break: one graph per compile),
    # and the rehearsed step and the capture see the same function, so the capture hits.
    compiles, backend = _counting()
    torch._dynamo.reset()

    def block(h: torch.Tensor) -> torch.Tensor:
        h = h * 2
        if torch.cuda.is_current_stream_capturing():
            return h + 1
        return h - 1

    region = torch.compile(block, backend=backend)
    x = torch.arange(4.0)
    assert torch.equal(region(x), x * 2 - 1)
    with rehearsing():
        region(x)
        compiled = len(compiles)
        with torch._dynamo.config.patch(error_on_recompile=True):
            region(x)  # the capture
    assert compiled <= 2 and len(compiles) == compiled, compiles
