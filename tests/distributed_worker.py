"""One process of a multi-process run (kivi_jax.distributed), started twice by
tests/test_distributed.py with 2 host devices each: the same calls in both processes, each
writing the tokens it reads back to OUT/tokens_<process id>.npz; then, with --loop, generate
until the test kills a process.

  python tests/distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT SAVED_MODEL [--loop]
"""

import sys

import jax.numpy as jnp
import numpy as np
from tiny_model import tiny_params

import kivi_jax
from kivi_jax import distributed
from kivi_jax.generate import TokenStream

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


def run(model: int, kv: str, how: str, saved: str) -> np.ndarray:
    mesh = distributed.global_mesh(model)
    kw = dict(lengths=LENGTHS, kv=kv, max_new_tokens=NEW, mesh=mesh)
    if how == "stream":
        return np.stack(list(TokenStream(tiny_params(), PROMPTS, **kw)), axis=1)
    if how == "saved":
        params = kivi_jax.load_model(saved, dtype=jnp.float32, mesh=mesh).params
        return np.asarray(kivi_jax.generate(params, PROMPTS, **kw))
    return np.asarray(kivi_jax.generate(tiny_params(), PROMPTS, **kw))


def main(process_id: str, num_processes: str, port: str, out: str, saved: str, *loop: str):
    distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    tokens = {name: run(*case, saved) for name, case in CASES.items()}
    np.savez(f"{out}/tokens_{process_id}.npz", **tokens)
    print("cases done", flush=True)
    if loop:
        mesh = distributed.global_mesh()
        params = kivi_jax.sharding.shard_params(tiny_params(), mesh)
        while True:
            kivi_jax.generate(params, PROMPTS, lengths=LENGTHS, kv="kivi2", max_new_tokens=NEW)
            print("generated", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
