"""Times formulations of the value kernels' split merge alone (GPU trace, random inputs) at the
split counts the kernels use: elementwise over the S slices (the merge before), sums over S
(`gpu._merge_splits` now), elementwise within chunks of 8 or 16 splits then sums, and sums over
a [..., D, S] layout. Writes JSON: per shape [B, H, n_rep, S, D] µs per formulation.

    python benchmarks/merge_splits.py benchmarks/results/merge_splits.json
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import timing
from kivi_jax.pallas_kernels.decode_attention import gpu


def elementwise(m, o, ot, l_sum):
    S = m.shape[-1]
    top = functools.reduce(jnp.maximum, [m[..., s] for s in range(S)])
    w = [jnp.exp2(m[..., s] - top) for s in range(S)]
    num = functools.reduce(
        jnp.add, [w[s][..., None] * (o[..., s, :] + ot[..., s, :]) for s in range(S)]
    )
    den = functools.reduce(jnp.add, [w[s] * l_sum[..., s] for s in range(S)])[..., None]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def chunked(m, o, ot, l_sum, c=8):
    """Elementwise within chunks of c splits, then sums over the chunks."""
    S = m.shape[-1]
    if S <= c:
        return elementwise(m, o, ot, l_sum)
    lead, D = m.shape[:-1], o.shape[-1]
    m2, l2 = m.reshape(*lead, S // c, c), l_sum.reshape(*lead, S // c, c)
    o2, t2 = (x.reshape(*lead, S // c, c, D) for x in (o, ot))
    top = m2.max(-1)
    w = jnp.exp2(m2 - top[..., None])
    num = functools.reduce(
        jnp.add, [w[..., s, None] * (o2[..., s, :] + t2[..., s, :]) for s in range(c)]
    )
    return gpu._merge_splits(top, num, jnp.zeros_like(num), (w * l2).sum(-1))


def transposed(m, o_t, ot_t, l_sum):
    """Sums over S with o as [..., D, S] (a row reduction)."""
    w = jnp.exp2(m - m.max(-1, keepdims=True))
    num = (w[..., None, :] * (o_t + ot_t)).sum(-1)
    den = (w * l_sum).sum(-1)[..., None]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


SHAPES = {  # [B, H, n_rep, S, D] of the value kernels' outputs ("tc": tensor-core GQA)
    "Llama-3-8B 1x32k tc": (1, 8, 4, 128, 128),
    "Llama-3-8B 8x32k tc": (8, 8, 4, 16, 128),
    "Llama-3-8B 16x2176 tc": (16, 8, 4, 8, 128),
    "Llama-3-8B 64x2176 tc": (64, 8, 4, 2, 128),
    "Llama-3-8B 1x32k tc, S 64": (1, 8, 4, 64, 128),
    "Llama-3-8B 1x32k tc, S 32": (1, 8, 4, 32, 128),
    "Llama-2-7B 1x32k": (1, 32, 1, 32, 128),
    "Llama-2-7B 8x32k": (8, 32, 1, 4, 128),
}


def main(path: str) -> None:
    out = []
    for name, (B, H, n, S, D) in SHAPES.items():
        k = jax.random.split(jax.random.key(0), 4)
        m = jax.random.normal(k[0], (B, H, n, S)) * 4
        o, ot = (jax.random.normal(x, (B, H, n, S, D)) for x in k[1:3])
        l_sum = jax.random.uniform(k[3], (B, H, n, S)) + 1
        args = (m, o, ot, l_sum)
        want = jax.jit(elementwise)(*args)
        runs, errors = {}, {}
        formulations = {
            "elementwise": elementwise,
            "reduce": gpu._merge_splits,
            "chunked8": chunked,
            "chunked16": functools.partial(chunked, c=16),
        }
        for fname, f in formulations.items():
            runs[fname] = (jax.jit(f), args)
            errors[fname] = float(jnp.abs(runs[fname][0](*args) - want).max())
        swapped = (m, o.swapaxes(-1, -2), ot.swapaxes(-1, -2), l_sum)
        runs["transposed"] = (jax.jit(transposed), swapped)
        t = timing.device_interleaved(runs, rounds=30)
        rec = {"shape": name, "dims": [B, H, n, S, D], **{f: v * 1e6 for f, v in t.items()}}
        rec["max_abs_error_vs_elementwise"] = errors
        for fname, per_run in timing.traced_by_entry(runs, rounds=3).items():
            rec[fname + "_kernels"] = [e[0] for e in per_run[-1]]
        print(json.dumps(rec), flush=True)
        out.append(rec)
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": out},
              open(path, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
