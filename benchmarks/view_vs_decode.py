"""How close kivi-eval's streaming view comes to decoding through the cache (docs/accuracy.md).

For each KV setting, the perplexity of one window of the GPL-3 two ways on the default model
(float32, CPU): the streaming view (one causal forward pass, kivi_jax.eval.views; what
`kivi-eval ppl` reports) and real teacher-forced decoding from an empty cache, one token per
`llama.decode_step` (append, then the reference attention), scoring the same tokens.

    python benchmarks/view_vs_decode.py --out benchmarks/results

writes view_vs_decode.json and view_vs_decode.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models import llama

import kivi_jax
from kivi_jax.eval import data, studies, views
from kivi_jax.generate import resolve_kv

SETTINGS = ("kivi2", "kivi2-mix")


@functools.partial(jax.jit, static_argnames=("config",))
def decode_nll(params, tokens, *, config):
    """tokens [W] -> summed NLL of tokens 1..W-1, each predicted by a decode step that fed the
    token before it to a cache holding every earlier token (empty at the start)."""
    c = params.config
    w = tokens.shape[0]
    cache = kivi_jax.init_cache(
        config,
        batch=1,
        max_len=w,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=params.dtype,
        num_layers=c.num_layers,
    )

    def step(cache, t):
        logits, cache = llama.decode_step(params, tokens[t][None], t[None], cache)
        logp = jax.nn.log_softmax(logits[0])
        return cache, -logp[tokens[t + 1]]

    _, nll = jax.lax.scan(step, cache, jnp.arange(w - 1))
    return nll.sum()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--window", type=int, default=2048)
    args = p.parse_args()
    model = kivi_jax.load_model(dtype=jnp.float32)
    params = model.params
    ids, source = data.prose_tokens(model.tokenizer, max_tokens=args.window)
    chunk = studies.windows(ids, args.window)
    rows = {}
    for kv in SETTINGS:
        cfg = resolve_kv(kv)
        view = studies.perplexity(params, chunk, views.StreamingAttention(cfg, params.dtype))
        t0 = time.perf_counter()
        nll = float(decode_nll(params, jnp.asarray(chunk[0]), config=cfg)) / (args.window - 1)
        rows[kv] = {
            "view_ppl": view["ppl"],
            "decode_ppl": float(np.exp(nll)),
            "decode_seconds": time.perf_counter() - t0,
        }
        rows[kv]["relative_difference"] = rows[kv]["view_ppl"] / rows[kv]["decode_ppl"] - 1
        print(kv, rows[kv], flush=True)
    result = {"source": source, "window": args.window, "settings": rows}
    out = Path(args.out)
    (out / "view_vs_decode.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# view_vs_decode",
        "",
        f"`python benchmarks/view_vs_decode.py`: perplexity of the first {args.window} tokens of "
        f"`{source}` (SmolLM2-135M-Instruct, float32, CPU) through kivi-eval's streaming view and "
        "by teacher-forced decoding from an empty cache.",
        "",
        "| KV | streaming view | decoding through the cache | view / decode - 1 |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {kv} | {r['view_ppl']:.3f} | {r['decode_ppl']:.3f} | {r['relative_difference']:+.2%} |"
        for kv, r in rows.items()
    ]
    (out / "view_vs_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
