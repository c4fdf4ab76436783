"""One process of a multi-process run (kivi_jax.distributed), started twice by
tests/test_distributed.py with 2 host devices each: the same calls in both processes, each
writing the tokens it reads back to OUT/tokens_<process id>.npz; then the engine on the meshes
of ENGINES (names of ENGINE_CASES, comma-separated), process 0 serving REQUESTS (its tokens to
OUT/engine.json) while process 1 follows; then, with --loop, the engine serves until the test
kills a process.

  python tests/distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT SAVED_MODEL ENGINES [--loop]
"""

import json
import sys
import time

import jax.numpy as jnp
import numpy as np
from tiny_model import tiny_params

import kivi_jax
from kivi_jax import distributed
from kivi_jax.generate import TokenStream
from kivi_jax.serving import Engine

# Shared with tests/test_distributed.py, which computes the one-process tokens.
PROMPTS = np.random.default_rng(0).integers(3, 200, size=(4, 40))
LENGTHS = np.array([40, 17, 33, 5])  # ragged: right-padded rows
NEW = 12
CASES = {  # name: (mesh's "model" size, kv, how); one kv, so the processes compile less
    "model4": (4, "kivi2", "generate"),
    "data2_model2": (2, "kivi2", "generate"),
    "data2_model2_stream": (2, "kivi2", "stream"),
    "data2_model2_saved": (2, "kivi2", "saved"),
}
ENGINE_CASES = {"engine_model4": 4, "engine_data2_model2": 2}  # name: the "model" size
# (prompt tokens, max_new_tokens), arriving two at a time, two steps apart; the third is
# prefilled in two chunks, and 6 pages of 32 tokens for 4 slots make the engine preempt
REQUESTS = [(25, 60), (30, 55), (45, 50), (20, 60), (10, 40), (28, 30)]
ENGINE = dict(kv=kivi_jax.KiviConfig(residual_length=32), slots=4, max_len=96, page_size=32,
              prefill_chunk=32, decode_steps=4)  # fmt: skip
PAGES = 6


def request_prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 200, size=n) for n, _ in REQUESTS]


def engine(mesh=None) -> Engine:
    """The engine of the cases: ENGINE with a pool of PAGES pages (on a mesh whose "model"
    axis outnumbers the KV heads, each head's pages are repeated: larger pages)."""
    sized = Engine(tiny_params(), **ENGINE, mesh=mesh).stats()
    page = sized.kv_pool_bytes // sized.pages_total
    return Engine(tiny_params(), **ENGINE, kv_bytes=sized.kv_slot_bytes + PAGES * page, mesh=mesh)


def serve(e: Engine) -> list[list[int]]:
    """REQUESTS through `e`, stepped by hand: each request's tokens."""
    handles = []
    for (_, new), ids in zip(REQUESTS, request_prompts(), strict=True):
        handles.append(e.submit(ids, max_new_tokens=new))
        if len(handles) % 2 == 0:
            e.step()
            e.step()
    while e.step():
        pass
    return [h.result() for h in handles]


def run(model: int, kv: str, how: str, saved: str) -> np.ndarray:
    mesh = distributed.global_mesh(model)
    kw = dict(lengths=LENGTHS, kv=kv, max_new_tokens=NEW, mesh=mesh)
    if how == "stream":
        return np.stack(list(TokenStream(tiny_params(), PROMPTS, **kw)), axis=1)
    if how == "saved":
        params = kivi_jax.load_model(saved, dtype=jnp.float32, mesh=mesh).params
        return np.asarray(kivi_jax.generate(params, PROMPTS, **kw))
    return np.asarray(kivi_jax.generate(tiny_params(), PROMPTS, **kw))


def main(process_id: str, num_processes: str, port: str, out: str, saved: str, engines: str,
         *loop: str):  # fmt: skip
    distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    leader = process_id == "0"
    tokens = {name: run(*case, saved) for name, case in CASES.items()}
    np.savez(f"{out}/tokens_{process_id}.npz", **tokens)
    print("cases done", flush=True)
    served = {}
    for name in engines.split(","):
        t0 = time.perf_counter()
        e = engine(distributed.global_mesh(ENGINE_CASES[name]))
        if leader:
            served[name] = {"tokens": serve(e), "preemptions": e.stats().preemptions}
            e.stop()
        else:
            e.follow()
        print(f"{name} in {time.perf_counter() - t0:.1f} s", flush=True)
    if leader:
        with open(f"{out}/engine.json", "w") as f:
            json.dump(served, f)
    print("engine cases done", flush=True)
    if loop:
        e = engine(distributed.global_mesh())
        if not leader:
            e.follow()
        e.start()
        ids = request_prompts()[0]
        while True:
            e.submit(ids, max_new_tokens=20).result()
            print("served", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
