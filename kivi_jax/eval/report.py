"""Writes each study's results: <study>.json, <study>.md (tables) and <study>.png (a plot)."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write(out: pathlib.Path, study: str, result: dict, header: str) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{study}.json", out / f"{study}.md", out / f"{study}.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(header + "\n\n" + MARKDOWN[study](result) + "\n")
    PLOTS[study](result, paths[2])
    return paths


def replot(out) -> list[pathlib.Path]:
    """Redraws <study>.png from <study>.json for every study whose JSON is in the folder `out`
    (after a change to a plot: the studies are not re-run). `kivi-eval replot --out DIR`."""
    out = pathlib.Path(out)
    paths = []
    for study, plot in PLOTS.items():
        if (out / f"{study}.json").is_file():
            plot(json.loads((out / f"{study}.json").read_text()), out / f"{study}.png")
            paths.append(out / f"{study}.png")
    if not paths:
        raise FileNotFoundError(f"no study results (<study>.json) in {out}")
    return paths


def _annotate(ax, im, grid: np.ndarray, fmt) -> None:
    """Writes each cell's value on an imshow heatmap, black on light cells and white on dark.
    fmt: a format spec, or a function of the value."""
    label = fmt if callable(fmt) else lambda val: format(val, fmt)
    for (i, j), val in np.ndenumerate(grid):
        r, g, b, _ = im.cmap(im.norm(val))
        light = 0.299 * r + 0.587 * g + 0.114 * b > 0.5  # perceived brightness of the cell
        ax.text(j, i, label(val), ha="center", va="center", fontsize=8,
                color="black" if light else "white")  # fmt: skip


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- ppl


def _ppl_md(r: dict) -> str:
    fp = r["streaming"]["fp"]["ppl"]
    s = (
        f"Text: `{r['source']}`, {r['windows']} window(s) of {r['window']} tokens, "
        f"{r['scored_tokens']} tokens scored; cache dtype {r['cache_dtype']}.\n\n"
    )
    s += "Streaming cache (teacher-forced; decoding through the cache up to float rounding):\n\n"
    s += _table(
        ["KV", "ppl", "vs fp"],
        [[n, f"{x['ppl']:.3f}", f"{x['ppl'] / fp - 1:+.2%}"] for n, x in r["streaming"].items()],
    )
    s += "\n\nFake quantization (paper Table 1: whole sequence, groups of 32, no residual):\n\n"
    s += _table(
        ["config", "ppl", "vs fp"],
        [[n, f"{x['ppl']:.3f}", f"{x['ppl'] / fp - 1:+.2%}"] for n, x in r["fake_quant"].items()],
    )
    return s


def _ppl_plot(r: dict, path) -> None:
    plt = _plt()
    from matplotlib import ticker

    names = list(r["streaming"]) + [f"fq {n}" for n in r["fake_quant"]]
    vals = [x["ppl"] for x in r["streaming"].values()] + [
        x["ppl"] for x in r["fake_quant"].values()
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(
        names[::-1], vals[::-1], color=["C1"] * len(r["fake_quant"]) + ["C0"] * len(r["streaming"])
    )
    for y, val in enumerate(vals[::-1]):
        ax.text(val * 1.02, y, f"{val:.1f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(min(vals) / 1.25, max(vals) * 1.3)
    # Plain numbers at 1, 2 and 5 times the powers of ten; no labels on the minor ticks (they
    # collide on a short log axis).
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.axvline(r["streaming"]["fp"]["ppl"], color="k", lw=0.8, ls="--")
    ax.set_xlabel("perplexity (log scale; dashed: fp)")
    ax.set_title(f"Perplexity, {r['scored_tokens']} tokens of {pathlib.Path(r['source']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- passkey


def _passkey_md(r: dict) -> str:
    s = (
        f"{r['keys_per_cell']} random 5-digit keys per cell, greedy, {r['new_tokens']} new "
        f"tokens, one full-precision prefill shared by every setting.\n\n"
    )
    s += "Keys retrieved per prompt length (all depths):\n\n"
    per_length = r["keys_per_cell"] * len(r["depths"])
    s += _table(
        ["KV", *[f"L={n}" for n in r["lengths"]]],
        [
            [n, *[_of_keys(a, per_length) for a in accs]]
            for n, accs in r["accuracy_by_length"].items()
        ],
    )
    for n, grid in r["accuracy"].items():
        s += f"\n\n{n} ({r['settings'][n]}), keys retrieved per cell, rows L, columns depth:\n\n"
        s += _table(
            ["L", *[str(d) for d in r["depths"]]],
            [
                [length, *[_of_keys(a, r["keys_per_cell"]) for a in row]]
                for length, row in zip(r["lengths"], grid, strict=True)
            ],
        )
    return s


def _of_keys(accuracy: float, keys: int) -> str:
    """A cell's accuracy as keys retrieved of keys asked, e.g. 3/4."""
    return f"{round(accuracy * keys)}/{keys}"


def _passkey_plot(r: dict, path) -> None:
    plt = _plt()
    names = list(r["accuracy"])
    # One shared y axis, labelled on the first panel only: no tick labels between the panels.
    fig, axes = plt.subplots(
        1, len(names), figsize=(3.2 * len(names) + 1, 2.8), sharey=True, squeeze=False,
        layout="constrained",
    )  # fmt: skip
    for ax, n in zip(axes[0], names, strict=True):
        grid = np.asarray(r["accuracy"][n])
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        _annotate(ax, im, grid, lambda a: _of_keys(a, r["keys_per_cell"]))
        ax.set_xticks(range(len(r["depths"])), [str(d) for d in r["depths"]])
        ax.set_yticks(range(len(r["lengths"])), [str(x) for x in r["lengths"]])
        ax.set_xlabel("depth")
        ax.set_title(n)
    axes[0][0].set_ylabel("prompt length")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- errors


def _errors_md(r: dict) -> str:
    s = (
        f"Text: `{r['source']}`; the last {r['queries']} tokens' queries over the {r['keys']} "
        f"tokens before them; {r['bits']}-bit, groups of {r['group_size']}. Key/value errors "
        f"per KV head, score/output errors per query head, averaged over heads per layer.\n\n"
    )
    s += "Over layers (mean / median of the per-layer values):\n\n"
    rows = []
    for m in ("key", "score", "value", "output"):
        t, c = r["summary"]["per-token"][m], r["summary"]["per-channel"][m]
        rows.append(
            [m, f"{t['mean']:.3g} / {t['median']:.3g}", f"{c['mean']:.3g} / {c['median']:.3g}"]
        )
    s += _table(["measure", "per-token", "per-channel"], rows)
    n = len(r["per_layer"]["per-token"]["key"])
    s += (
        f"\n\nPer-channel keys beat per-token keys in {r['layers_where_per_channel_key_wins']}/{n} "
        f"layers; per-token values beat per-channel values on the attention output in "
        f"{r['layers_where_per_token_value_output_wins']}/{n} layers.\n\n"
    )
    cache_errors = r["cache_output_error"]
    s += (
        "Attention output of the same queries through each streaming cache (G = 32, R = 128, "
        "its window and side storage) against full precision, ||O' - O||_F / ||O||_F per "
        "layer:\n\n"
    )
    s += _table(
        ["KV", "mean", "median", "max"],
        [
            [n, f"{np.mean(e):.4f}", f"{np.median(e):.4f}", f"{np.max(e):.4f}"]
            for n, e in cache_errors.items()
        ],
    )
    s += "\n\nPer layer:\n\n"
    pt, pc = r["per_layer"]["per-token"], r["per_layer"]["per-channel"]
    s += _table(
        [
            "layer",
            "key tok",
            "key ch",
            "score tok",
            "score ch",
            "value tok",
            "value ch",
            "output tok",
            "output ch",
            "key max/median |k|",
        ],
        [
            [
                i,
                *(f"{g[m][i]:.3g}" for m in ("key", "score", "value", "output") for g in (pt, pc)),
                f"{max(r['key_outlier_ratio_max_over_median'][i]):.1f}",
            ]
            for i in range(n)
        ],
    )
    return s


def _errors_plot(r: dict, path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    pt, pc = r["per_layer"]["per-token"], r["per_layer"]["per-channel"]
    for ax, m in zip(axes[0], ("key", "score", "output"), strict=True):
        ax.plot(pt[m], "o-", ms=3, label="per-token")
        ax.plot(pc[m], "s-", ms=3, label="per-channel")
        ax.set_title(
            {
                "key": "key reconstruction ||K-K'||",
                "score": "attention score ||A-A'||",
                "output": "attention output Δ (value quant)",
            }[m]
        )
        ax.set_xlabel("layer")
        ax.legend()
    axes[0][2].set_yscale("log")
    mag = np.asarray(r["key_channel_magnitude"])  # [L, H, D]
    L = mag.shape[0]
    for ax, layer in zip(axes[1], sorted({1, L // 2, L - 1}), strict=False):
        for h in range(mag.shape[1]):
            ax.plot(mag[layer, h], lw=1, label=f"KV head {h}")
        ax.set_title(f"layer {layer}: mean |key| per channel")
        ax.set_xlabel("channel")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- ablation


def _ablate_md(r: dict) -> str:
    fp = r["ppl"]["fp"]["ppl"]
    s = (
        f"KIVI-{r['bits']} over group size G and residual R. Perplexity on `{r['source']}` "
        f"({r['windows']} window(s) of {r['window']} tokens; fp {fp:.3f}); passkey accuracy at "
        f"L={r['passkey_length']} over {len(r['passkey_depths'])} depth(s) x "
        f"{r['passkey_keys_per_cell']} keys (fp {r['passkey']['fp']:.2f}).\n\n"
    )
    rows = []
    for g in r["group_sizes"]:
        cells = []
        for res in r["residuals"]:
            n = f"G{g}_R{res}"
            cells.append(f"{r['ppl'][n]['ppl']:.3f} / {r['passkey'][n]:.1f}")
        rows.append([f"G={g}", *cells])
    s += "ppl / passkey accuracy:\n\n"
    s += _table(["", *[f"R={res}" for res in r["residuals"]]], rows)
    return s


def _ablate_plot(r: dict, path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, what in zip(axes, ("ppl", "passkey"), strict=True):
        grid = np.array(
            [
                [
                    r["ppl"][f"G{g}_R{x}"]["ppl"] if what == "ppl" else r["passkey"][f"G{g}_R{x}"]
                    for x in r["residuals"]
                ]
                for g in r["group_sizes"]
            ]
        )
        if what == "ppl":
            im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
        else:  # accuracy on the full [0, 1] scale, as in passkey.png
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        _annotate(ax, im, grid, ".2f")
        ax.set_xticks(range(len(r["residuals"])), [f"R={x}" for x in r["residuals"]])
        ax.set_yticks(range(len(r["group_sizes"])), [f"G={g}" for g in r["group_sizes"]])
        ax.set_title(
            "perplexity" if what == "ppl" else f"passkey accuracy, L={r['passkey_length']}"
        )
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- mixed precision


def _mix_table(rows: dict, fp: float) -> str:
    return _table(
        ["KV", "ppl", "vs fp", "bytes vs KIVI-2", "config"],
        [
            [n, f"{x['ppl']:.3f}", f"{x['ppl'] / fp - 1:+.2%}", f"{x['bytes_vs_kivi2']:.3f}x",
             x["config"]]
            for n, x in rows.items()
        ],
    )  # fmt: skip


def _mix_md(r: dict) -> str:
    s = (
        f"Mixed-precision KIVI-2: perplexity through the streaming cache on `{r['source']}` "
        f"({r['windows']} window(s) of {r['window']} tokens, {r['scored_tokens']} scored) and "
        f"the bytes each cache allocates for one sequence of {r['bytes_at']} tokens, every "
        f"layer (memory_report, side storage included), against KIVI-2's "
        f"{r['kivi2_bytes']:,} bytes. kivi2-mix defaults: {r['default']}.\n\n"
    )
    s += _mix_table(r["settings"], r["settings"]["fp"]["ppl"])
    for h in r["held_out"]:
        s += (
            f"\n\nHeld out (settings not chosen on it): `{h['source']}`, {h['windows']} "
            f"window(s) of {h['window']} tokens:\n\n"
        )
        s += _mix_table(h["settings"], h["settings"]["fp"]["ppl"])
    return s


def _mix_plot(r: dict, path) -> None:
    plt = _plt()
    rows = r["settings"]
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = {}
    for name, x in rows.items():
        if " N" in name:  # "<selection> N<budget>"
            curves.setdefault(name.split(" N")[0], []).append(x)
    for i, (sel, pts) in enumerate(curves.items()):
        ax.plot([p["bytes_vs_kivi2"] for p in pts], [p["ppl"] for p in pts], "o-",
                color=f"C{i}", label=f"heavy tokens by {sel} (N = 8 ... 64)")  # fmt: skip
    for name, marker in (("kivi2", "s"), ("kivi4", "D"), ("sinks", "^"), ("sinks+sliding", "v"),
                         ("sinks+sliding+F16", "P")):  # fmt: skip
        if name in rows:
            x = rows[name]
            ax.plot(x["bytes_vs_kivi2"], x["ppl"], marker, color="k", label=name)
            ax.annotate(name, (x["bytes_vs_kivi2"], x["ppl"]), textcoords="offset points",
                        xytext=(5, 3), fontsize=7)  # fmt: skip
    ax.axhline(rows["fp"]["ppl"], color="k", lw=0.8, ls="--", label="fp")
    ax.axhline(rows["fp"]["ppl"] * 1.05, color="grey", lw=0.8, ls=":", label="fp + 5%")
    ax.axvline(1.15, color="grey", lw=0.8, ls="-.", label="1.15x KIVI-2's bytes")
    ax.set_xlabel(f"bytes allocated for {r['bytes_at']} tokens / KIVI-2's")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Budget sweep, {r['scored_tokens']} tokens of {pathlib.Path(r['source']).name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- lean


def _lean_md(r: dict) -> str:
    fp = r["ppl"]["fp"]["ppl"]
    lengths = r["passkey_lengths"]
    prompts = len(r["passkey_depths"]) * r["passkey_keys_per_cell"]
    head = ["KV", "bits d64 1k / 4k / 32k", "max 4k..4k+R d64 / d128", "ppl", "vs fp"]
    head += [f"passkey {n}" for n in lengths]
    rows = []
    for name, p in r["ppl"].items():
        p, b = p["ppl"], r["bits"][name]
        row = [
            name,
            " / ".join(f"{b[f'd64_{n}']:.2f}" for n in (1024, 4096, 32768)),
            f"{b['d64_4k_max']:.3f} / {b['d128_4k_max']:.3f}",
            f"{p:.3f}",
            "" if name == "fp" else f"{100 * (p / fp - 1):+.2f}%",
        ]
        row += (
            [_of_keys(a, prompts) for a in r["passkey"][name]]
            if name in r["passkey"]
            else [""] * len(lengths)
        )
        rows.append(row)
    text = (
        f"Perplexity through the streaming view on `{r['source']}` ({r['windows']} window(s) of "
        f"{r['window']} tokens, {r['scored_tokens']} scored; cache dtype {r['cache_dtype']}), "
        f"passkey retrieval ({prompts} prompts per length) and held_bits per value of a "
        "bfloat16 cache (head_dim 64 is the model's).\n\n" + _table(head, rows) + "\n\n"
    )
    text += "".join(f"- {n}: {d}\n" for n, d in r["settings"].items())
    fe = r["format_errors"]
    if not fe:
        return text + "\nThe formats' attention-output errors were not run (--no-format-errors).\n"
    text += (
        f"\nThe formats: attention-output error (relative Frobenius, the last "
        f"{r['format_error_queries']} queries over {r['format_error_keys']} keys, through the "
        "streaming view, against full precision; mean and max over layers) of KIVI-2 with "
        "each 8-bit format:\n\n"
    )
    text += _table(
        ["KV", "error mean", "error max", "bits d64 4k"],
        [
            [n, f"{e['mean']:.4f}", f"{e['max']:.4f}", f"{r['format_bits'][n]['d64_4096']:.3f}"]
            for n, e in fe.items()
        ],
    )
    return text


def _lean_plot(r: dict, path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fp = r["ppl"]["fp"]["ppl"]
    for name, p in r["ppl"].items():
        x, y = r["bits"][name]["d64_4k_max"], 100 * (p["ppl"] / fp - 1)
        ax.scatter([x], [y])
        ax.annotate(name, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax.axvline(3.0, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("held bits per value, max over 4096..4096+R (head_dim 64, bf16)")
    ax.set_ylabel("perplexity vs fp (%)")
    ax.set_yscale("symlog", linthresh=2)
    ax.set_title("Fewer bits per value: each option and kivi2-lean")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MARKDOWN = {
    "ppl": _ppl_md,
    "passkey": _passkey_md,
    "errors": _errors_md,
    "ablate": _ablate_md,
    "lean": _lean_md,
    "mix": _mix_md,
}
PLOTS = {
    "ppl": _ppl_plot,
    "passkey": _passkey_plot,
    "errors": _errors_plot,
    "ablate": _ablate_plot,
    "lean": _lean_plot,
    "mix": _mix_plot,
}
