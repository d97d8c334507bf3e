"""One worker of ``bench/fleet.py``: boots tiny GPT-2 by declaration with ``mint="on_miss"``, reports what it serves.

``python bench/_fleet_worker.py URL REPO FAMILY CACHE STOP_FILE`` with ``CGSTORE_TOKEN`` set. Prints one
JSON line (with the Unix time) at boot and each time what the handle serves changes (seen before a call),
calling it every 10 ms until ``STOP_FILE`` exists; a ``slow-call`` line for a call that took over a second
(an eager call waiting for an export of the model); a ``log`` line for each of the client's log records (its
upgrades say how long each step took).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.support

import torch  # noqa: E402

from cgstore_client import Client  # noqa: E402
from tests.support.hf_archives import IDS_SHAPE, hf_inputs, tiny_hf_model  # noqa: E402

ENVELOPE = {"shapes": [[1, 1]], "text_len": IDS_SHAPE[1], "batch_sizes": [IDS_SHAPE[0]]}
EVENTS_WAIT_S = 10


_SAYING = threading.Lock()  # the client's threads log too: one whole line at a time


def say(**line) -> None:
    text = json.dumps({"t": time.time(), "pid": os.getpid(), **line}) + "\n"
    with _SAYING:
        sys.stdout.write(text)
        sys.stdout.flush()


class Said(logging.Handler):
    """The client's log records as ``log`` lines, timed like the others."""

    def emit(self, record: logging.LogRecord) -> None:
        say(event="log", message=record.getMessage())


def main() -> int:
    url, repo, family, cache, stop = sys.argv[1:6]
    faulthandler.enable()  # a worker that dies in native code says where, on stderr (``--worker-logs``)
    client_log = logging.getLogger("cgstore_client")
    client_log.setLevel(logging.INFO)
    client_log.addHandler(Said())
    model = tiny_hf_model("gpt2", seed=os.getpid() % 1000)  # random weights of its own: no hub
    inputs = hf_inputs()
    with Client(url, cache_dir=cache, events_wait_s=EVENTS_WAIT_S) as client:
        booted = client.boot(family, model, envelope=ENVELOPE, example_inputs=inputs, mint="on_miss", publish_to=repo)
        say(event="booted", compiled=booted.compiled, reason=booted.reason)
        last = None
        while not os.path.exists(stop):
            serving = booted.state  # one consistent view: target, record, reason, confirmation
            state = (serving.target is not None, serving.loaded.key if serving.loaded else None, serving.reason)
            if state != last:  # said before the call: an eager call may wait on an export holding the model
                say(event="state", compiled=state[0], key=state[1], reason=state[2], confirmation=serving.confirmation)
                last = state
            called = time.time()
            with torch.no_grad():
                booted(*inputs)
            if time.time() - called > 1:
                say(event="slow-call", seconds=round(time.time() - called, 2), confirmation=booted.confirmation)
            time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main())
