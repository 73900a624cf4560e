"""Where a verify pass's extra rows go: the decoder's projections, the cross-attention layers and the
screened head, each over all its layers, 1 row against R rows.

    python bench/verify_parts.py                    # base, 5 rows, 12 rounds, 2 threads
    python bench/verify_parts.py --rows 5 9 --rounds 20

Each part runs as the C++ step runs it (`cpu_ops.linear` over the float16 projections the step
reads, `cpu_ops.attention` over the window's 1500 float32 keys a layer, the screened head's
argmax), after a read of 160 MB that leaves the caches cold, as a step's ≈ 110 MB stream leaves
them for the next; the row counts alternate round by round (the machine's phases hit each alike)
and the table gives medians, with each part's time over its one-row time. Set them against what a
row's arithmetic takes at the multiply-add peaks (bench/cpu.py's "if the extra rows' arithmetic ran
after the stream" row): a part whose extra rows cost more than that runs its arithmetic below the
peak, after the stream rather than under it. Prints the CPU model and flags first.
"""
from __future__ import annotations

import argparse
import statistics
import time

from specwhisper import Engine  # before torch: its huge pages (specwhisper/__init__.py)
import torch  # noqa: E402, I001
from specwhisper.backends import cpu_ops
from specwhisper.model.whisper import DecoderCache


def parts(engine: Engine, max_rows: int) -> dict:
    """{name: run(rows)} for the target's projections, cross attention and head, over inputs of up
    to `max_rows` rows (random activations; a window's cross K/V from random features)."""
    lm = engine.target
    dec, cfg = lm.model.decoder, lm.config
    cache = DecoderCache.allocate(cfg, 1, "cpu", torch.float32, None)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        dec.fill_cross(cache, torch.randn(1, cfg.max_source_positions, cfg.d_model, generator=g))
    weights = [p for p in dec.layer_params() if p.dim() == 2]  # the projections, as the step reads them
    xs = {K: torch.randn(max_rows, K, generator=g) for K in {w.shape[1] for w in weights}}
    heads = dec.layers[0].self_attn.n_heads
    q = torch.randn(1, max_rows, heads, cfg.d_model // heads, generator=g)
    hidden = torch.randn(max_rows, cfg.d_model, generator=g) * 3

    def linears(rows: int):
        for w in weights:
            cpu_ops.linear(xs[w.shape[1]][:rows], w)

    def cross(rows: int):
        keys = torch.full((1, rows), cache.cross_k.shape[3], dtype=torch.long)
        for i in range(len(dec.layers)):
            cpu_ops.attention(q[:, :rows], cache.cross_k[i], cache.cross_v[i], keys, 1.0)

    def head(rows: int):  # the greedy token of each row (the screened head where the target has one)
        lm.greedy(hidden[None, :rows], lm.suppress)

    return {"projections": linears, "cross attention": cross, "head": head}


def measure(engine: Engine, rows: list[int], rounds: int, flush_mb: int = 160) -> dict:
    """{part: {r: median seconds}} for r in [1] + rows, alternated round by round on cold caches."""
    counts = sorted({1, *rows})
    runs = parts(engine, max(counts))
    flush = torch.ones(flush_mb * 1024 * 1024 // 4)
    times = {p: {r: [] for r in counts} for p in runs}
    with torch.inference_mode():
        for run in runs.values():  # warm-up (first-use allocations)
            for r in counts:
                run(r)
        for i in range(rounds):
            for name, run in runs.items():
                for r in (counts if i % 2 == 0 else counts[::-1]):
                    flush.sum()
                    start = time.perf_counter()
                    run(r)
                    times[name][r].append(time.perf_counter() - start)
    return {p: {r: statistics.median(v) for r, v in t.items()} for p, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="base", help="a fetched name or an HF folder (default: base)")
    p.add_argument("--rows", type=int, nargs="+", default=[5], help="verify rows to set against one")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the C++ decode ops are not available here (this measures them)")
    from cpu import cpu_model  # bench/cpu.py: the model name and the vector extensions that matter
    from specwhisper.tools.fetch import NAMES, fetch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; ops at vector level {cpu_ops.current_vector_level()}; "
          f"{args.threads} threads", flush=True)
    engine = Engine(fetch(args.model) if args.model in NAMES else args.model, background=False)
    out = measure(engine, args.rows, args.rounds)
    counts = list(out["projections"])  # 1 and the rows asked for, in order (`measure`'s)
    print("\n| part | " + " | ".join(f"{r} row{'s' * (r > 1)} (ms)" for r in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for name, t in out.items():
        print(f"| {name} | " + " | ".join(f"{1e3 * t[r]:.2f} ({t[r] / t[1]:.2f})" for r in counts) + " |")
    total = {r: sum(t[r] for t in out.values()) for r in counts}
    print("| all three | " + " | ".join(f"{1e3 * total[r]:.2f} ({total[r] / total[1]:.2f})" for r in counts) + " |")


if __name__ == "__main__":
    main()
