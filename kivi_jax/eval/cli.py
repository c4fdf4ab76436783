"""kivi-eval: accuracy studies of the KIVI cache on a real model (docs/accuracy.md).

    kivi-eval ppl|passkey|errors|ablate|mix|lean|all [--out DIR] [--quick] [--text FILE]
              [--check-text FILE ...] [--model PATH] [--weights float|int8|int4|gguf]
              [--lean-rows NAME ...] [--no-format-errors]
    kivi-eval replot --out DIR

Each study writes <study>.json, <study>.md and <study>.png under --out. Progress goes to stderr.
`replot` redraws the plots of DIR from its JSON files (the studies are not re-run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import sys
import time

from kivi_jax.loading import default_group_size
from kivi_jax.weights import add_weights_argument

STUDIES = ("ppl", "passkey", "errors", "ablate", "mix", "lean")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """How much each study runs (full: the published grid; quick: CI-sized)."""

    ppl_tokens: int | None  # None: the whole text
    window: int
    passkey_lengths: tuple[int, ...]
    depths: tuple[float, ...]
    keys_per_cell: int
    error_tokens: int
    error_queries: int
    ablate_tokens: int
    ablate_window: int
    ablate_depths: tuple[float, ...]
    mix_tokens: int
    mix_window: int
    mix_check_tokens: int
    mix_budgets: tuple[int, ...]
    lean_keys_per_cell: int
    ablate_groups: tuple[int, ...] = (16, 32, 64)
    ablate_residuals: tuple[int, ...] = (64, 128, 256)


FULL = Sizes(
    ppl_tokens=None,
    window=2048,
    passkey_lengths=(1024, 2048, 4096),
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    keys_per_cell=4,  # 20 prompts per length
    error_tokens=2048,
    error_queries=64,
    ablate_tokens=1024,  # one window: 10 settings x a 2k window would not fit the hour
    ablate_window=1024,
    ablate_depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    mix_tokens=1024,  # one window: 14 settings x a 2k window would not fit the hour
    mix_window=1024,
    mix_check_tokens=2048,
    mix_budgets=(8, 16, 32, 64),
    lean_keys_per_cell=2,  # 10 prompts per length: 7 settings x 3 lengths within ~30 min
)
QUICK = Sizes(
    ppl_tokens=512,
    window=256,
    passkey_lengths=(1024,),
    depths=(0.2, 0.8),
    keys_per_cell=2,
    error_tokens=320,
    error_queries=32,
    ablate_tokens=512,
    ablate_window=512,
    ablate_depths=(0.5,),
    ablate_groups=(32,),
    ablate_residuals=(64, 128),
    mix_tokens=256,
    mix_window=256,
    mix_check_tokens=256,
    mix_budgets=(8,),
    lean_keys_per_cell=1,
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(prog="kivi-eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "study",
        choices=[*STUDIES, "all", "replot"],
        help="which study to run; replot: redraw the plots of --out from its JSON files",
    )
    p.add_argument("--out", default="eval-results", help="output folder (default: eval-results)")
    p.add_argument("--quick", action="store_true", help="CI-sized runs (minutes, not an hour)")
    p.add_argument(
        "--text", default=None, help="prose file for ppl/errors/ablate/mix (default GPL-3)"
    )
    p.add_argument(
        "--check-text", nargs="+", default=None, metavar="FILE",
        help="mix: prose the settings were not chosen on, where the defaults are checked "
        "(default GFDL-1.3)",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="model file or folder (default SmolLM2-135M)")
    add_weights_argument(p)
    p.add_argument(
        "--passkey-lengths", type=_positive_int, nargs="+", default=None,
        help="passkey prompt lengths in tokens (default 1024 2048 4096; quick: 1024), e.g. 7168",
    )  # fmt: skip
    p.add_argument(
        "--lean-rows", nargs="+", default=None, metavar="NAME",
        help="lean: run only these rows (fp always; default all: studies.lean_candidates)",
    )  # fmt: skip
    p.add_argument(
        "--no-format-errors", action="store_true",
        help="lean: skip the formats' attention-output errors",
    )  # fmt: skip
    return p.parse_args(argv)


def _check_out(out: pathlib.Path) -> None:
    """Raises ValueError unless `out` is a folder, or can be made as one, that we may write."""
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable")


def run(args, log) -> list[pathlib.Path]:
    import jax.numpy as jnp

    import kivi_jax
    from kivi_jax.eval import data, report, studies

    if args.study == "replot":
        written = report.replot(args.out)
        log(f"replot: {', '.join(str(p) for p in written)}")
        return written
    sizes = QUICK if args.quick else FULL
    if args.passkey_lengths:
        sizes = dataclasses.replace(sizes, passkey_lengths=tuple(args.passkey_lengths))
    studies_to_run = STUDIES if args.study == "all" else (args.study,)
    for text in [args.text, *(args.check_text or [])]:
        if text is not None and not pathlib.Path(text).is_file():
            raise FileNotFoundError(f"prose file not found: {text}")
    if args.text is None and set(studies_to_run) - {"passkey"} and not data.DEFAULT_PROSE.is_file():
        raise FileNotFoundError(
            f"the default prose {data.DEFAULT_PROSE} is not here (Debian/Ubuntu's base-files "
            f"ships it): pass --text FILE, any long English text"
        )
    if "mix" in studies_to_run and not args.check_text and not data.HELD_OUT_PROSE.is_file():
        raise FileNotFoundError(
            f"mix's default held-out prose {data.HELD_OUT_PROSE} is not here (Debian/Ubuntu's "
            f"base-files ships it): pass --check-text FILE"
        )
    if args.lean_rows:
        names = list(studies.lean_candidates())
        unknown = sorted(set(args.lean_rows) - set(names))
        if unknown:
            raise ValueError(f"--lean-rows: unknown rows {unknown}; the rows are {names}")
    out = pathlib.Path(args.out)
    _check_out(out)  # before the model loads: an unusable --out fails now, not after an hour
    model = kivi_jax.load_model(
        args.model,
        dtype=jnp.float32,
        weights=args.weights,
        weight_group_size=args.weight_group_size,
    )
    params, tok = model.params, model.tokenizer
    group = args.weight_group_size or default_group_size(model.source)
    if "passkey" in studies_to_run:  # before any study runs
        studies.check_passkey_lengths(
            sizes.passkey_lengths,
            max_context=params.config.max_context,
            new_tokens=studies.PASSKEY_NEW_TOKENS,
        )
    header_base = (
        f"kivi-eval ({'quick' if args.quick else 'full'}), model {model.source}, "
        f"{args.weights} weights"
        f"{f' (groups of {group})' if args.weights == 'int4' else ''}, "
        f"float32 on {platform.machine()} CPU"
    )
    written = []
    for study in studies_to_run:
        t0 = time.perf_counter()
        if study == "ppl":
            ids, src = data.prose_tokens(tok, path=args.text, max_tokens=sizes.ppl_tokens)
            result = studies.ppl_study(params, ids, source=src, window=sizes.window, log=log)
        elif study == "passkey":
            result = studies.passkey_study(
                params,
                tok,
                lengths=sizes.passkey_lengths,
                depths=sizes.depths,
                keys_per_cell=sizes.keys_per_cell,
                log=log,
            )
        elif study == "errors":
            ids, src = data.prose_tokens(tok, path=args.text, max_tokens=sizes.error_tokens)
            result = studies.error_study(params, ids, source=src, num_queries=sizes.error_queries)
        elif study == "lean":
            ids, src = data.prose_tokens(tok, path=args.text, max_tokens=sizes.ppl_tokens)
            error_ids, _ = data.prose_tokens(tok, path=args.text, max_tokens=sizes.error_tokens)
            result = studies.lean_study(
                params,
                tok,
                ids,
                source=src,
                window=sizes.window,
                error_ids=error_ids,
                error_queries=sizes.error_queries,
                passkey_lengths=sizes.passkey_lengths,
                depths=sizes.depths,
                keys_per_cell=sizes.lean_keys_per_cell,
                rows=args.lean_rows,
                format_errors=not args.no_format_errors,
                log=log,
            )
        elif study == "mix":
            ids, src = data.prose_tokens(tok, path=args.text, max_tokens=sizes.mix_tokens)
            check = [
                data.prose_tokens(tok, path=path, max_tokens=sizes.mix_check_tokens)
                for path in (args.check_text or [data.HELD_OUT_PROSE])
            ]
            result = studies.mix_study(
                params,
                ids,
                source=src,
                window=sizes.mix_window,
                check=check,
                check_window=sizes.mix_check_tokens,
                settings=studies.mix_candidates(sizes.mix_budgets),
                log=log,
            )
        else:
            ids, src = data.prose_tokens(tok, path=args.text, max_tokens=sizes.ablate_tokens)
            result = studies.ablation_study(
                params,
                tok,
                ids,
                source=src,
                window=sizes.ablate_window,
                group_sizes=sizes.ablate_groups,
                residuals=sizes.ablate_residuals,
                depths=sizes.ablate_depths,
                log=log,
            )
        seconds = time.perf_counter() - t0
        result["wall_seconds"] = seconds
        header = f"# {study}\n\n{header_base}; this study took {seconds:.0f} s."
        written += report.write(out, study, result, header)
        log(f"{study}: {seconds:.0f} s -> {out}/{study}.{{json,md,png}}")
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        run(args, log)
    except (FileNotFoundError, ValueError) as e:
        print(f"kivi-eval: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a loading error names the file; anything else is a bug: re-raise
        from kivi_jax.loading import ModelLoadError

        if isinstance(e, ModelLoadError):
            print(f"kivi-eval: error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
