"""The mint child: ``python -m cgstore_client.worker.mint_child JOB.json`` packages, publishes and beats a claim.

A worker granted a declaration's claim exports its live model (the graph it
runs) to a private file and starts this process on the same machine (the same
device), so the compile (AOTInductor: seconds to minutes, gigabytes) never
runs in the serving process while the worker serves eager. The job file
(written by :mod:`cgstore_client.worker.fleet`) names the store, the claim, the
declaration and the files; the token comes in ``CGSTORE_TOKEN`` (never on the
command line, which other users can read).

While it works a thread beats the claim every ``heartbeat_s`` (its worker beats
it too while the child lives, so a slow start never loses it). Outcomes:

- published: the record is released ``published`` (the store also releases a
  claim its holder's publish matches) and ``result.json`` names the key and
  graph digest, exit 0;
- the compile, the packaging or the store refuses: the claim is released
  ``failed`` with the error's first line (the declaration's next grant backs
  off), ``result.json`` says why, exit 3;
- the store unreachable: nothing is released (the claim lapses at its TTL and
  another worker takes over), exit 4;
- killed, or its worker gone (checked every second: a child whose worker died
  has no one to serve its graph and holds the worker's device), nothing is
  released either: the claim lapses.

The log (``mints/<claim>.log`` in the client cache, beside the work directory)
starts with the line ``<unix time> compiling claim … (pid …)``: one per
compile started, which is how a fleet's compiles are counted and timed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cgstore_client.errors import CgstoreError, StoreError, Unavailable
from cgstore_client.worker import claims
from cgstore_client.worker.client import Client

#: Exit statuses the worker reads (anything else, a signal included, is a crash).
PUBLISHED, FAILED, UNREACHABLE = 0, 3, 4
#: How often the child checks that its worker is still there.
PARENT_CHECK_S = 1.0


def _log(message: str) -> None:
    """One line of the log: the Unix time (ms) first, so a fleet's mints can be timed from their logs."""
    print(f"{time.time():.3f} {message}", flush=True)


def _write_result(path: str, document: dict[str, Any]) -> None:
    temporary = f"{path}.part"
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(document, out)
    os.replace(temporary, path)


def _beat(client: Client, job: dict[str, Any], parent: int, done: threading.Event) -> None:
    """Beat the claim every ``heartbeat_s``; leave at once (no release) when the worker is gone."""
    next_beat = time.monotonic()  # at once: the worker's last beat was before this interpreter started
    while True:
        if os.getppid() != parent:
            _log("the worker is gone: stopping without releasing (the claim lapses)")
            os._exit(UNREACHABLE)
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + job["heartbeat_s"]
            try:
                answer = claims.heartbeat(client.writer, job["repo"], job["claim"])
                _log(f"beat: expires {answer.expires_at.isoformat()}")
            except CgstoreError as err:  # retried next time; a lost claim only costs a duplicate mint
                _log(f"heartbeat failed: {err}")
        if done.wait(PARENT_CHECK_S):
            return


def _mint(client: Client, job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from cgstore_client.mint import package_compiled_graph

    for name in job.get("imports") or []:  # the pytree types the program's inputs and outputs need
        try:
            importlib.import_module(name)
        except Exception as err:  # a class defined where the child cannot import it: load says if it mattered
            _log(f"could not import {name}: {err}")
    program = torch.export.load(job["program"])  # written by our own worker, in a directory only we can read
    minted = package_compiled_graph(program, os.path.join(job["work"], "model.pt2"))
    _log(f"compiled: graph {minted.graph_digest}, {minted.size} bytes")
    published = client.publish(
        job["repo"],
        minted.path,
        family=job["family"],
        envelope=job["envelope"],
        toolchain=job["toolchain"],
        sm=job["sm"],
        release=job.get("release"),
        code=job.get("code"),
    )
    _log(f"published {published.key} ({published.status})")
    return {"key": published.key, "graph": minted.graph_digest}


def run(job: dict[str, Any]) -> int:
    parent = int(job.get("parent") or os.getppid())
    _log(f"compiling claim {job['claim']} of {job['family']} in {job['repo']} (pid {os.getpid()})")
    done = threading.Event()
    with Client(job["url"], cache_dir=job["cache_dir"], write_url=job.get("write_url")) as client:
        threading.Thread(target=_beat, args=(client, job, parent, done), name="cgstore-beat", daemon=True).start()
        try:
            result = _mint(client, job)
        except Unavailable as err:
            _log(f"the store is unreachable: {err}; the claim lapses")
            _write_result(job["result"], {"error": claims.first_line(str(err)), "released": False})
            return UNREACHABLE
        except Exception as err:  # a compile error, a refused publish: the declaration failed
            reason = claims.first_line(f"{type(err).__name__}: {err}")
            _log(f"failed: {reason}")
            done.set()
            released = _release(lambda: claims.release_failed(client.writer, job["repo"], job["claim"], reason))
            _write_result(job["result"], {"error": reason, "released": released})
            return FAILED
        done.set()
        _release(lambda: claims.release_published(client.writer, job["repo"], job["claim"], result["key"]))
        _write_result(job["result"], result)
        return PUBLISHED


def _release(call) -> bool:
    try:
        call()
    except StoreError as err:  # already released by the publish, or lapsed: the store knows how it ended
        _log(f"release: {err}")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m cgstore_client.worker.mint_child JOB.json", file=sys.stderr)
        return 2
    return run(json.loads(Path(args[0]).read_text(encoding="utf-8")))


if __name__ == "__main__":
    sys.exit(main())
