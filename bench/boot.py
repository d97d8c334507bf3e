"""Time to a first compiled call: compiling locally, loading by exact key, booting by declaration.

    python bench/boot.py                      # the small MLP, GPT-2 and BERT tiny configs (~2 min)
    python bench/boot.py --models mlp --reps 1    # a quick check

Starts its own PostgreSQL database, Ceph's RADOS Gateway (S3) and the store (PostgreSQL + S3)
as a separate process, and stops them afterwards. Per model, each path ends
with the first call's output in hand; (b) and (c) start from an empty cache
(best of ``--reps``), after the model was minted and published once:

- (a) ``compile``: export + AOTI compile (the mint) + load + bind + call: a
  worker without the store.
- (b) ``exact``: export + graph digest + ck1 + ``client.load`` (resolve, record,
  verified downloads) + ``load_compiled`` + call: a worker that derives the key.
- (c) ``discover``: ``client.boot`` with background confirmation (discover,
  verified downloads, bind) + call; the export runs after the first call, in a
  thread, and is not in the figure (its verdict is printed).

Last line: ``{"<model>": {"speedup_exact": a/b, "speedup_discover": a/c, "export_s": …}, …,
"min": {"speedup_exact": …, "speedup_discover": …}}``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from _common import emit_result, log, production_stack

from cgstore_client import Client, Want
from cgstore_client.archive import graph_digest_from_program
from cgstore_client.binding import code_fingerprint
from cgstore_client.environment import environment_sm, environment_toolchain
from cgstore_client.keys import ck1
from cgstore_client.mint import derived_constants_path, package_compiled_graph
from cgstore_client.worker.client import DERIVED_COMPONENT
from cgstore_client.worker.loader import load_compiled
from client import small_model
from tests.support.hf_archives import hf_inputs, tiny_hf_model

OWNER = "bench"
ENVELOPE = {"shapes": [[64, 64]], "text_len": 0}
RELEASE = "bench-release"
CONFIRM_TIMEOUT_S = 600


def mlp() -> tuple[torch.nn.Module, tuple]:
    return small_model(), (torch.randn(4, 64),)


def transformers_model(name: str) -> Callable[[], tuple[torch.nn.Module, tuple]]:
    """GPT-2 (tied LM head) or BERT (non-persistent buffers) in the tests' tiny configs."""
    return lambda: (tiny_hf_model(name), hf_inputs())


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "mlp": mlp,
    "gpt2": transformers_model("gpt2"),
    "bert": transformers_model("bert"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=3, help="cold boots per path and model (default 3)")
    return parser.parse_args()


def timed_export(model, inputs) -> float:
    started = time.perf_counter()
    torch.export.export(model, inputs)
    return time.perf_counter() - started


def exact_boot(url: str, token: str, cache: Path, family: str, model, inputs) -> float:
    started = time.perf_counter()
    program = torch.export.export(model, inputs)
    key = ck1(graph_digest_from_program(program), ENVELOPE, environment_sm(), environment_toolchain())
    with Client(url, token, cache_dir=cache) as client:
        (loaded,) = client.load(family, [Want(key, mandatory=True)])
    load_compiled(loaded, model.state_dict())(*inputs)
    return time.perf_counter() - started


def discovered_boot(url: str, token: str, cache: Path, family: str, model, inputs) -> tuple[float, str]:
    with Client(url, token, cache_dir=cache) as client:
        started = time.perf_counter()
        booted = client.boot(
            family,
            model,
            envelope=ENVELOPE,
            release=RELEASE,
            mandatory=True,
            confirm="background",
            example_inputs=inputs,
        )
        booted(*inputs)
        elapsed = time.perf_counter() - started
        return elapsed, booted.wait_confirmed(CONFIRM_TIMEOUT_S)


def bench_model(name: str, stack, token: str, scratch: Path, reps: int) -> dict[str, float]:
    model, inputs = MODELS[name]()
    export_s = min(timed_export(model, inputs) for _ in range(reps))
    compile_s = compile_locally(model, inputs, scratch / f"{name}.pt2")
    log(f"{name}: export {export_s:.2f}s; compile locally (export + compile + load + bind + call) {compile_s:.1f}s")
    family, repo = f"bench-{name}", f"{OWNER}/{name}"
    with Client(stack.base_url, token, cache_dir=scratch / "mint-cache") as client:
        client.publish(
            repo,
            scratch / f"{name}.pt2",
            family=family,
            envelope=ENVELOPE,
            sm=environment_sm(),
            toolchain=environment_toolchain(),
            release=RELEASE,
            code=code_fingerprint(model),
        )
    exact, discovered, verdicts = [], [], []
    for rep in range(reps):
        exact.append(exact_boot(stack.base_url, token, scratch / f"{name}-exact-{rep}", family, model, inputs))
        seconds, verdict = discovered_boot(
            stack.base_url, token, scratch / f"{name}-discover-{rep}", family, model, inputs
        )
        discovered.append(seconds)
        verdicts.append(verdict)
    log(f"{name}: exact key (export + resolve + download + bind + call) best {min(exact):.2f}s of {exact}")
    log(
        f"{name}: discovery (discover + download + bind + call) best {min(discovered):.2f}s of {discovered};"
        f" background confirmation: {verdicts}"
    )
    return {
        "speedup_exact": round(compile_s / min(exact), 1),
        "speedup_discover": round(compile_s / min(discovered), 1),
        "export_s": round(export_s, 3),
    }


def compile_locally(model, inputs, path: Path) -> float:
    """Export + AOTI compile (the mint) + load + bind (as a worker binds: ``load_compiled``) + first call."""
    started = time.perf_counter()
    package_compiled_graph(torch.export.export(model, inputs), path)
    derived = derived_constants_path(path)
    local = SimpleNamespace(
        artifact_path=path, component_paths={DERIVED_COMPONENT: derived} if os.path.exists(derived) else {}
    )
    load_compiled(local, model.state_dict())(*inputs)
    return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="cgstore-bench-boot-") as scratch_dir, production_stack() as stack:
        token = stack.mint("bench", f"{OWNER}/*:read,write")
        for name in args.models:
            figures[name] = bench_model(name, stack, token, Path(scratch_dir), args.reps)
    figures["min"] = {key: min(f[key] for f in figures.values()) for key in ("speedup_exact", "speedup_discover")}
    log(f"total {time.perf_counter() - started:.0f}s, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    emit_result(figures)


if __name__ == "__main__":
    main()
