"""A handle's switch is one step: no reader sees a new target beside an old confirmation or reason.

Each test watches every attribute assignment a switch makes on a :class:`Booted` and records what a
reader on another thread could see right after it (target, confirmation, reason, record): every
view must be the state before or the state after, never a mix. No threads or timing: a switch done
as several assignments fails here whatever the machine's speed.
"""

from __future__ import annotations

import threading
from pathlib import Path

from cgstore_client import Booted, Loaded


class Watched(Booted):
    """A handle recording the view a concurrent reader would have after each assignment to it."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if "views" in self.__dict__:
            self.views.append(self.view())

    def view(self):
        return (self.compiled, self.confirmation, self.reason, self.loaded)


def compiled_one(*args):
    return "compiled"


def eager(*args):
    return "eager"


def loaded(key: str) -> Loaded:
    return Loaded(key=key, artifact_path=Path("/nonexistent"), repo="acme/r")


def watched(**state) -> Watched:
    handle = Watched(eager, **state)
    handle.views = []
    return handle


def only_before_or_after(handle: Watched, before: tuple) -> None:
    after = handle.view()
    assert after != before
    assert all(view in (before, after) for view in handle.views), handle.views


def test_an_upgrade_switches_target_record_confirmation_and_reason_together():
    handle = watched(reason="waiting for a mint")
    before = handle.view()
    handle.adopt(Booted(eager, compiled=compiled_one, loaded=loaded("ck1-a"), confirmation="confirmed"))
    only_before_or_after(handle, before)
    assert handle.view() == (True, "confirmed", None, loaded("ck1-a")) and handle() == "compiled"


def test_a_drift_switches_target_confirmation_and_reason_together():
    handle = watched(compiled=compiled_one, loaded=loaded("ck1-a"), confirmation="pending")
    before = handle.view()
    handle.switch_to_eager("drift: the live model's graph is g2, the record's g1", confirmation="drift")
    only_before_or_after(handle, before)
    assert handle.view()[:2] == (False, "drift") and handle() == "eager"


def test_a_yank_switches_target_and_reason_together_and_keeps_the_record_named():
    handle = watched(compiled=compiled_one, loaded=loaded("ck1-a"), confirmation="confirmed")
    before = handle.view()
    handle.switch_to_eager("yanked: bad numerics")
    only_before_or_after(handle, before)
    assert handle.view() == (False, "confirmed", "yanked: bad numerics", loaded("ck1-a"))


def test_a_state_read_once_is_unchanged_by_a_later_switch():
    handle = Booted(eager, compiled=compiled_one, loaded=loaded("ck1-a"), confirmation="confirmed")
    seen = handle.state
    handle.switch_to_eager("yanked: bad numerics")
    assert seen.target is compiled_one and seen.reason is None  # a call that read it finishes on it
    assert handle.state.target is None and handle() == "eager"


def test_an_eager_call_waiting_for_an_export_goes_compiled_when_the_handle_does():
    """A background confirmation's export holds the model (eager calls wait for it); a switch to compiled
    meanwhile serves the waiting call compiled, before the export is done."""
    from cgstore_client.worker.discovery import model_lock

    handle = Booted(eager, reason="waiting for a mint")
    results: list[str] = []
    exporting = model_lock(eager)
    exporting.acquire()  # the export, on another thread in real life: held throughout this test
    try:
        call = threading.Thread(target=lambda: results.append(handle()), daemon=True)
        call.start()
        call.join(0.2)
        assert results == []  # waiting for the export: eager cannot run
        handle.adopt(Booted(eager, compiled=compiled_one, loaded=loaded("ck1-a"), confirmation="pending"))
        call.join(30)
        assert results == ["compiled"]
    finally:
        exporting.release()
