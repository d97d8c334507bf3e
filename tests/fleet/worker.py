"""A worker process of the fleet tests: boots the tiny model by declaration and reports what it serves.

``python -m tests.fleet.worker --url U --repo R --family F --cache DIR --stop FILE [--mandatory]
[--events-wait S] [--seed N] [--boot-after FILE2] [--confirm MODE]`` with ``CGSTORE_TOKEN`` in the environment. It boots with
``mint="on_miss"`` (publishing to ``R``; with ``--boot-after``, only once ``FILE2`` exists, torch
imported and its model built before; ``--confirm`` as ``boot``'s, default ``never``: each background
confirmation is an export, a core-second or more per upgrade per worker), then calls the handle every
20 ms until ``FILE`` exists,
printing one JSON line per change of what it serves (``compiled``, ``key``, ``reason``, ``confirmation``), each with
the Unix time it saw it and whether the compiled outputs equal the eager model's; ``raised`` lines
when the handle (mandatory) raises :class:`CompiledRequired`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from cgstore_client import Client, CompiledRequired
from tests.fleet.declaration import ENVELOPE, dynamic_shapes
from tests.support.archives import tiny_inputs, tiny_model


def say(**line) -> None:
    print(json.dumps({"t": time.time(), "pid": os.getpid(), **line}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("--url", "--repo", "--family", "--cache", "--stop"):
        parser.add_argument(name, required=True)
    parser.add_argument("--mandatory", action="store_true")
    parser.add_argument("--events-wait", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--boot-after")
    parser.add_argument("--confirm", default="never", choices=["never", "background", "before"])
    args = parser.parse_args()
    # The client's own account (its upgrades' steps and seconds) goes to stderr: the test keeps it in worker-N.log.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(created).3f %(name)s %(message)s")
    logging.getLogger("cgstore_client").setLevel(logging.INFO)
    model = tiny_model(seed=args.seed).eval()  # its own weights: what is served is bound to them
    inputs = tiny_inputs(2)
    with torch.no_grad():  # computed before boot: the test never calls the model beside the handle's exports
        expected = model(*inputs)
    while args.boot_after and not os.path.exists(args.boot_after):
        if os.path.exists(args.stop):
            return 0
        time.sleep(0.05)
    with Client(args.url, cache_dir=args.cache, events_wait_s=args.events_wait) as client:
        try:
            booted = client.boot(
                args.family,
                model,
                envelope=ENVELOPE,
                example_inputs=tiny_inputs(2),
                dynamic_shapes=dynamic_shapes(),
                mint="on_miss",
                publish_to=args.repo,
                mandatory=args.mandatory,
                confirm=args.confirm,
            )
        except CompiledRequired as err:
            say(event="raised", at="boot", retry_after=err.retry_after, reason=str(err))
            while not os.path.exists(args.stop):
                time.sleep(0.05)
            return 0
        say(event="booted", compiled=booted.compiled, reason=booted.reason)
        last = None
        while not os.path.exists(args.stop):
            key = booted.loaded.key if booted.loaded else None
            state = (booted.compiled, key, booted.reason, booted.confirmation)
            try:
                with torch.no_grad():
                    out = booted(*inputs)
                    equal = bool(torch.allclose(out, expected, rtol=1e-5, atol=1e-6))
            except CompiledRequired as err:
                if last != ("raised", state):
                    say(event="raised", at="call", retry_after=err.retry_after, reason=booted.reason)
                    last = ("raised", state)
                time.sleep(0.02)
                continue
            if state != last:
                say(
                    event="state",
                    compiled=booted.compiled,
                    key=key,
                    reason=booted.reason,
                    confirmation=booted.confirmation,
                    equal=equal,
                )
                last = state
            time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
