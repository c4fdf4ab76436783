"""kivi-serve's start-up: seconds from launch until /health answers 200, the first start with an
empty compilation cache against the next starts with the same arguments (the programs then
loaded from JAX's persistent cache, kivi_jax.serving.server.compilation_cache_dir).

    python benchmarks/serve_start.py --out benchmarks/results                # the defaults
    python benchmarks/serve_start.py --out DIR -- --kv kivi4 --slots 16       # other arguments

Each start is `kivi-serve --port P ARGS` in a process of its own with XDG_CACHE_HOME set to a
directory of this run (so the first start finds the cache empty and the user's is untouched),
stopped by SIGTERM once healthy. Writes DIR/serve_start.json and DIR/serve_start.md: per start,
the seconds to healthy and the engine's own "compiled and started" time from the log, the
cache's files and bytes after it, and the host (CPU count, platform, jax version).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def one_start(args: list[str], cache_home: str, deadline_s: float) -> dict:
    """Launches kivi-serve, waits for /health 200, stops it; its timings."""
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=cache_home)
    argv = [sys.executable, "-m", "kivi_jax.serving.server", "--port", str(port), *args]
    log = tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while not healthy(f"http://127.0.0.1:{port}"):
            if proc.poll() is not None or time.perf_counter() - t0 > deadline_s:
                log.seek(0)
                raise RuntimeError(f"kivi-serve did not become healthy:\n{log.read()[-3000:]}")
            time.sleep(0.1)
        to_healthy = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    log.seek(0)
    found = re.search(r"engine compiled and started in ([0-9.]+) s", log.read())
    files = [p for p in Path(cache_home).rglob("*") if p.is_file()]
    return {
        "healthy_s": round(to_healthy, 1),
        "warmup_s": float(found.group(1)) if found else None,
        "cache_files": len(files),
        "cache_bytes": sum(p.stat().st_size for p in files),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for serve_start.json and .md")
    p.add_argument("--starts", type=int, default=2, help="starts with the same cache")
    p.add_argument("--deadline", type=float, default=900, help="seconds a start may take")
    p.add_argument("serve_args", nargs="*", help="kivi-serve's arguments (after --)")
    a = p.parse_args()
    import jax

    with tempfile.TemporaryDirectory() as cache_home:
        starts = [one_start(a.serve_args, cache_home, a.deadline) for _ in range(a.starts)]
    result = {
        "serve_args": a.serve_args,
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "backend": jax.default_backend(),
            "jax": jax.__version__,
        },
        "starts": starts,
        "second_over_first": round(starts[1]["healthy_s"] / starts[0]["healthy_s"], 2),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_start.json").write_text(json.dumps(result, indent=2) + "\n")
    h = result["host"]
    lines = [
        "# kivi-serve's start-up: launch to /health 200",
        "",
        f"`kivi-serve {' '.join(a.serve_args) or '(defaults)'}` on {h['backend']} "
        f"({h['cpus']} cores, {h['platform']}), jax {h['jax']}; start 1 with an empty "
        "persistent compilation cache, the next with the cache it wrote.",
        "",
        "| start | to healthy (s) | warmup: compiled and started (s) | cache files | cache MB |",
        "|---|---|---|---|---|",
    ]
    for i, s in enumerate(starts, 1):
        lines.append(f"| {i} | {s['healthy_s']} | {s['warmup_s']} | {s['cache_files']} | "
                     f"{s['cache_bytes'] / 1e6:.1f} |")  # fmt: skip
    lines += ["", f"Second start / first: {result['second_over_first']}."]
    (out / "serve_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
