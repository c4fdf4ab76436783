"""What a shared prefix costs in perplexity (issue 62, item 4).

With `Engine(prefix_sharing=True)` a prompt that starts with another request's sealed pages
prefills only the rest, which then attends to the prefix's quantized keys and values instead of
its full-precision ones. This measures that difference on the `kivi-eval ppl` text (GPL-3,
non-overlapping windows of 2048 tokens, each without context): each window is a prompt split at
a page boundary (`--split`, 1024 by default: 8 pages of 128); the tokens after the split are
scored with the prompt attention of a cold prefill (full precision over the whole window) and
with the prefix shared (`kivi_jax.eval.views.SharedPrefixAttention`).

    python benchmarks/prefix_sharing_ppl.py --out benchmarks/results

writes prefix_sharing_ppl.{json,md}. The default model in float32 (kivi-eval's dtype on a CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from kivi_jax.models import llama

import kivi_jax
from kivi_jax.eval import data, views

SETTINGS = {"kivi2": kivi_jax.KIVI2, "kivi4": kivi_jax.KIVI4}


def suffix_nll(params, window: np.ndarray, split: int, attention) -> tuple[float, int]:
    """Summed NLL of the window's tokens split + 1 .. W - 1 given everything before them."""
    tokens = jnp.asarray(window)[None]
    logits = llama.forward(params, tokens, attention=attention)[0, split:-1]  # [W-1-split, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[0, split + 1 :, None], axis=-1).sum()
    return float(nll), int(logits.shape[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--split", type=int, default=1024)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args()
    model = kivi_jax.load_model(dtype=jnp.float32)
    ids, source = data.prose_tokens(model.tokenizer, max_tokens=args.window * args.windows)
    chunks = np.asarray(ids, np.int32).reshape(args.windows, args.window)
    rows = {}
    settings = {"cold": views.FullAttention()} | {
        name: views.SharedPrefixAttention(cfg, args.split) for name, cfg in SETTINGS.items()
    }
    for name, attention in settings.items():
        t0 = time.perf_counter()
        parts = [suffix_nll(model.params, c, args.split, attention) for c in chunks]
        nll, n = sum(x for x, _ in parts), sum(k for _, k in parts)
        rows[name] = {"ppl": float(np.exp(nll / n)), "tokens": n,
                      "seconds": time.perf_counter() - t0}  # fmt: skip
        print(f"{name}: ppl {rows[name]['ppl']:.4f} ({rows[name]['seconds']:.0f} s)", flush=True)
    model_name = pathlib.Path(model.source).name
    result = {"model": model_name, "text": pathlib.Path(source).name, "window": args.window,
              "split": args.split, "windows": args.windows, "dtype": "float32",
              "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_sharing_ppl.json").write_text(json.dumps(result, indent=2) + "\n")
    cold = rows["cold"]["ppl"]
    lines = [
        f"# Perplexity of a prompt's rest after a shared prefix ({model_name}, float32)",
        "",
        f"{args.windows} windows of {args.window} tokens of {pathlib.Path(source).name}, each a "
        f"prompt split at {args.split}; the {rows['cold']['tokens']} tokens after the split "
        "scored. cold: full-precision prompt attention over the whole window (sharing off); "
        "kivi2 / kivi4: the prefix's keys and values as its sealed pages hold them (sharing on).",
        "",
        "| prefix | ppl | vs cold |",
        "|---|---|---|",
    ]
    for name, row in rows.items():
        vs = "" if name == "cold" else f"{100 * (row['ppl'] / cold - 1):+.2f}%"
        lines.append(f"| {name} | {row['ppl']:.4f} | {vs} |")
    (args.out / "prefix_sharing_ppl.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
