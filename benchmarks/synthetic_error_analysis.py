"""Reproduces the KIVI paper's observation (Tables 2 and 3) on synthetic keys and values.

Keys get a few fixed outlier channels (~10x the rest, as the paper observes in real models), values
differ in magnitude from token to token, and queries are aligned with a few tokens so that attention
is sparse. Per-token and per-channel 2-bit
quantization (G = 32) are compared on the key and value reconstruction errors and on what reaches
the attention: the score error and the output error. Prints a table and writes JSON + markdown.

    python benchmarks/synthetic_error_analysis.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax.numpy as jnp
import numpy as np

from kivi_jax import analysis
from kivi_jax.analysis import Grouping


def synthetic_head(seed: int, tokens: int, head_dim: int, outlier_channels: int):
    """q [16, d], k and v [tokens, d] with the structure the paper observes in real models."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(tokens, head_dim))
    outliers = rng.choice(head_dim, outlier_channels, replace=False)
    k[:, outliers] = 10.0 * rng.normal(1.0, 0.3, size=(tokens, outlier_channels))
    # Tokens differ in value magnitude (log-normal, sigma 1); channels do not.
    v = rng.normal(size=(tokens, head_dim)) * np.exp(rng.normal(size=(tokens, 1)))
    # Each query points at one random token: a few tokens take most of the attention weight.
    q = 1.5 * k[rng.choice(tokens, 16)]
    q[:, outliers] = 0.0
    q += 0.1 * rng.normal(size=q.shape)
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def analyse(seeds=range(8), tokens=512, head_dim=128, outlier_channels=4, bits=2, group_size=32):
    rows = {g.value: {"key": [], "score": [], "value": [], "output": []} for g in Grouping}
    sparsity = []
    for seed in seeds:
        q, k, v = synthetic_head(seed, tokens, head_dim, outlier_channels)
        a = analysis.attention_scores(q, k)
        sparsity.append(float(jnp.mean(a < 0.01 / tokens)))
        for g in Grouping:
            k_hat = analysis.quantize_dequantize(k, bits, group_size, g)
            v_hat = analysis.quantize_dequantize(v, bits, group_size, g)
            r = rows[g.value]
            r["key"].append(float(analysis.key_reconstruction_error(k, k_hat)))
            r["score"].append(float(analysis.attention_score_error(q, k, k_hat)))
            r["value"].append(float(analysis.value_reconstruction_error(v, v_hat)))
            r["output"].append(float(analysis.attention_output_error(a, v, v_hat)))
    means = {g: {m: float(np.mean(x)) for m, x in r.items()} for g, r in rows.items()}
    setting = dict(
        seeds=len(seeds),
        tokens=tokens,
        head_dim=head_dim,
        outlier_channels=outlier_channels,
        bits=bits,
        group_size=group_size,
        attention_sparsity=float(np.mean(sparsity)),
    )
    return setting, means


def markdown(setting, means) -> str:
    lines = [
        f"Synthetic head: {setting['tokens']} tokens, d={setting['head_dim']}, "
        f"{setting['outlier_channels']} outlier key channels (10x), "
        f"{setting['bits']}-bit, "
        f"G={setting['group_size']}, mean of {setting['seeds']} seeds; "
        f"{100 * setting['attention_sparsity']:.1f}% of attention weights < 0.01/T.",
        "",
        "| quantization | key error | score error | value error | output error |",
        "|---|---|---|---|---|",
    ]
    for g, m in means.items():
        lines.append(
            f"| {g} | {m['key']:.2f} | {m['score']:.3f} | {m['value']:.2f} | {m['output']:.2f} |"
        )
    lines += [
        "",
        "Paper (Llama-2-13B, Tables 2 and 3): key 13.67 per-token vs 4.55 per-channel; score 47.00",
        "vs 9.60; value 4.57 vs 3.73; attention output 3.55 per-token vs 49.89 per-channel.",
        "",
        "Per-channel keys should cut the key and score errors and per-token values the attention",
        "output error, as in the paper. The value reconstruction error tends to be lower per-token",
        "here (the paper finds the two similar) because the synthetic values vary in magnitude",
        "from token to token, which is what hurts per-channel groups.",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    setting, means = analyse()
    table = markdown(setting, means)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "synthetic_error_analysis.json").write_text(
        json.dumps({"setting": setting, "errors": means}, indent=2) + "\n"
    )
    (args.out / "synthetic_error_analysis.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
