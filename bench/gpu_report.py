"""Markdown and PNG for bench/gpu.py's results (a dict as gpu.json holds it; int keys may be
strings after a JSON round trip). `python bench/gpu_report.py OUT_DIR` rewrites them from gpu.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

GOALS = dict(floor_ratio=1.5, draft_ms=0.12, hf_ratio=5.0, speedup=2.5, accept_us=20.0, rtfx=1000.0)


def at(d: dict | None, *keys):
    """d[k1][k2]... with int keys found as ints or strings; None when absent."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k, d.get(str(k)))
    return d


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]


def best(d: dict | None, *keys, larger: bool = False):
    """The least (or largest) of d's values at `keys` that are present; None if none is."""
    values = [v for v in (at(d, k) for k in keys) if v is not None]
    return (max if larger else min)(values) if values else None


def goals(r: dict) -> list[list]:
    steps, drafts, accept, e2e, hf = (r.get(k) for k in ("steps", "drafts", "accept", "e2e", "hf"))
    # graphed steps: the faster of torch's ops and the decode ops (Engine(decode_ops=True)) where timed
    target = best(at(steps, "rows", 1, "width", 1), "graphed_ms", "decode_ops_graphed_ms")
    floor = at(steps, "rows", 1, "floor", "ms")
    draft = best(at(drafts, "tiny", 1), "graphed_ms", "decode_ops_graphed_ms")
    ours = at(e2e, "systems", "target-only", 1, "per_token_ms")
    theirs = at(hf, "eager", "rows", 1, "per_token_ms")
    names = ("tiny B=1", "tiny B=1 decode ops")
    speedup = best({k: at(r.get("modeled"), k, "table", "0.8:5", "speedup") for k in names}, *names, larger=True)
    # the engine's default sampled path (the race kernel over the k + 1 positions) when timed
    acc = at(accept, "rows", 1, 4, "race_graphed_us") or at(accept, "rows", 1, 4, "sample_graphed_us")
    rtfx = max((t["rtfx"] for t in (at(r.get("rtfx"), "systems") or {}).values() if "rtfx" in t), default=None)
    ratio = target / floor if target and floor else None
    hf_ratio = theirs / ours if theirs and ours else None
    check = lambda ok: None if ok is None else ("met" if ok else "missed")  # noqa: E731
    return [
        ["target step B=1 (graphed; best of torch's / decode ops) ÷ floor", fmt(ratio), f"≤ {GOALS['floor_ratio']}",
         check(None if ratio is None else ratio <= GOALS["floor_ratio"])],
        ["tiny draft step B=1, graphed (ms; best of torch's / decode ops)", fmt(draft), f"≤ {GOALS['draft_ms']}",
         check(None if draft is None else draft <= GOALS["draft_ms"])],
        ["transformers eager per token ÷ ours (B=1)", fmt(hf_ratio), f"≥ {GOALS['hf_ratio']}",
         check(None if hf_ratio is None else hf_ratio >= GOALS["hf_ratio"])],
        ["modeled speedup, tiny, α=0.8, k=5, B=1 (best of torch's / decode ops)", fmt(speedup),
         f"≥ {GOALS['speedup']}",
         check(None if speedup is None else speedup >= GOALS["speedup"])],
        ["accept step B=1 k=4 V=51866, graphed (µs; race)", fmt(acc), f"≤ {GOALS['accept_us']}",
         check(None if acc is None else acc <= GOALS["accept_us"])],
        ["concurrent long-form RTFx (best of speculation off / on)", fmt(rtfx), f"≥ {GOALS['rtfx']:g}",
         check(None if rtfx is None else rtfx >= GOALS["rtfx"])],
    ]


def markdown(r: dict) -> str:
    env = r.get("env", {})
    lines = [f"# GPU benchmark — {env.get('gpu') or env.get('device')}", "",
             "Random weights at the real shapes (bench/gpu_models.py); "
             f"dtype {at(r, 'args', 'dtype')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}, CUDA {env.get('cuda')}.", ""]
    if at(r, "args", "quick"):
        lines += ["**Smoke run (--quick): toy sizes, numbers mean nothing.**", ""]
    lines += ["## Goals", ""] + table(["measure", "value", "goal", ""], goals(r)) + [""]
    bw = r.get("bandwidth")
    if bw:
        lines += [f"Copy bandwidth: **{bw['gb_per_s']:.0f} GB/s** (read + write of {bw['bytes'] / 2**20:.0f} MiB).", ""]
    steps = r.get("steps")
    if steps:
        lines += ["## Target (large-v3) step and verify pass (ms)", "",
                  f"Decoder weights {steps['decoder_weight_bytes'] / 1e9:.2f} GB, cross K/V "
                  f"{steps['cross_kv_bytes_per_row'] / 1e9:.3f} GB per row (self K/V read over all 449 slots: "
                  f"{steps['self_kv_bytes_per_row_read'] / 1e9:.3f} GB per row, not in the floor).", ""]
        rows = []
        for batch, row in steps["rows"].items():
            floor = row["floor"]["ms"]
            for w, t in row["width"].items():
                ops = t.get("decode_ops_graphed_ms")
                rows.append([batch, w, t["eager_ms"], t["graphed_ms"], ops, floor,
                             t["graphed_ms"] / floor if floor else None, ops / floor if ops and floor else None])
        lines += ["*decode ops*: the same step graphed on the Triton decode ops (`Engine(decode_ops=True)`: each "
                  "row's and token's bits independent of the others).", ""]
        lines += table(["B", "tokens (k+1)", "eager", "graphed", "decode ops graphed", "floor", "graphed ÷ floor",
                        "decode ops ÷ floor"], rows) + [""]
    drafts = r.get("drafts")
    if drafts:
        rows = [[name, b, t["eager_ms"], t["graphed_ms"], t["eager_ms"] / t["graphed_ms"],
                 t.get("decode_ops_graphed_ms")] for name, per in drafts.items() for b, t in per.items()]
        lines += ["## Draft step, chained (ms)", ""] + table(["draft", "B", "eager", "graphed", "gain",
                                                               "decode ops graphed"], rows) + [""]
    acc = r.get("accept")
    if acc:
        rows = [[b, k, t["sample_eager_us"], t["sample_graphed_us"], t["greedy_eager_us"], t["greedy_graphed_us"],
                 t.get("race_graphed_us"), t.get("race_row_graphed_us")]
                for b, per in acc["rows"].items() for k, t in per.items()]
        lines += [f"## Accept step (µs), V = 51866, {acc['op']}; race: the engine's default sampled path, "
                  "B × (k+1) rows raced (chunked kernel / one program per row)", ""] + table(
            ["B", "k", "sample eager", "sample graphed", "greedy eager", "greedy graphed", "race graphed",
             "race per-row graphed"], rows) + [""]
    ties = r.get("near_ties")
    if ties:
        rows = [[w, t["positions"], t["flips"], t["flip_rate"], t["last_position_flips"], t["max_abs_logit_diff"],
                 t["median_top2_gap"], t["gap_within_2x_diff"], t["padded_flips"], t["padded_max_abs_logit_diff"]]
                for w, t in ties["by_width"].items()]
        lines += ["## Near ties: verify pass vs single-token steps", "",
                  f"B = {ties['batch']}, {ties['trials']} random prefixes per width, {ties['dtype']}. A flip is a "
                  "position whose argmax differs between one (k+1)-token verify pass and k+1 single-token steps "
                  "from the same cache: speculative greedy output would differ from target-only greedy there. "
                  "*Padded*: each single token run instead as a (k+1)-wide pass whose other rows are padding "
                  "(scratch slot), i.e. target-only decoding on the verify pass's kernel shapes; it costs "
                  "t_verify(k+1) ÷ t_step per token (see the step table).", ""]
        lines += table(["k+1", "positions", "flips", "rate", "last-position flips", "max |Δlogit|",
                        "median top-2 gap", "gap ≤ 2·Δ", "padded flips", "padded max |Δlogit|"], rows) + [""]
    hf = r.get("hf")
    if hf:
        rows = []
        for mode, res in hf.items():
            if "error" in res:
                rows.append([mode, "—", res["error"][:200], "", ""])
            else:
                rows += [[res["mode"], b, t["per_token_ms"], t["seconds"], t["warmup_seconds"]]
                         for b, t in res["rows"].items()]
        lines += ["## transformers generate", ""] + table(
            ["mode", "B", "per token ms", "call s", "warm-up s"], rows) + [""]
    e2e = r.get("e2e")
    if e2e:
        ok = {name: per for name, per in e2e["systems"].items() if "error" not in per}
        rows = [[name, b, t["tokens_per_s"], t["per_token_ms"], t["acceptance"], t["tokens_per_pass"],
                 t["same_tokens_as_target_only"]] for name, per in ok.items() for b, t in per.items()]
        lines += [f"## End to end: Engine.transcribe, {e2e['max_new_tokens']} new tokens per row", "",
                  f"tiny as a draft for large-v3: {e2e.get('tiny_draft')}", ""]
        lines += table(["system", "B", "tokens/s", "per token ms", "acceptance", "tokens/pass",
                        "= target-only"], rows) + [""]
        lines += [f"- {name}: {per['error']}" for name, per in e2e["systems"].items() if "error" in per]
        lines += [""] if len(ok) < len(e2e["systems"]) else []
    rtfx = r.get("rtfx")
    if rtfx:
        rows = [[name, t["rtfx"], t["wall_s"], t["tokens"], t["tokens_per_s"], t.get("iterations"),
                 t.get("ms_per_iteration"), t.get("decode_ops"), t.get("same_tokens_as_target_only")]
                for name, t in rtfx["systems"].items() if "rtfx" in t]
        lines += [f"## Concurrent long-form: {rtfx['requests']} requests of {rtfx['seconds_each']} s in one engine "
                  "(random mels, greedy, no previous text)", ""]
        lines += table(["system", "RTFx (audio s per wall s)", "wall s", "tokens", "tokens/s", "iterations",
                        "ms / iteration", "decode ops", "= target-only"], rows) + [""]
        lines += [f"- {name}: {t['skipped']}" for name, t in rtfx["systems"].items() if "skipped" in t]
        if rtfx.get("host_profile"):
            lines += ["Host time of one target-only call (cProfile, by own time):", ""]
            lines += table(["function", "calls", "own s", "cumulative s"],
                           [[p["function"], p["calls"], p["own_s"], p["cumulative_s"]]
                            for p in rtfx["host_profile"][:15]])
            lines += [""]
    modeled = r.get("modeled")
    if modeled:
        lines += ["## Modeled speculative speedup over graphed target-only", "",
                  "E[tokens/pass] × t_target ÷ (k·t_draft + t_verify(k+1) + t_accept), graphed times, "
                  "t_accept = the race kernel over the k + 1 positions (the engine's default) where timed, else the "
                  "fused accept kernel. *decode ops*: draft and verify on the decode ops, t_target the faster of "
                  "the two target-only steps.", ""]
        for name, m in modeled.items():
            alphas = sorted({v["alpha"] for v in m["table"].values()})
            ks = sorted({v["k"] for v in m["table"].values()})
            rows = [[a] + [m["table"][f"{a}:{k}"]["speedup"] for k in ks] for a in alphas]
            lines += [f"**{name}** (t_target {m['t_target_ms']:.3g} ms, t_draft {m['t_draft_ms']:.3g} ms)", ""]
            lines += table(["α \\ k"] + [str(k) for k in ks], rows) + [""]
    if r.get("decode_ops_errors"):
        lines += ["## Decode ops errors", ""] + [f"- {e}" for e in r["decode_ops_errors"]] + [""]
    if r.get("errors") or r.get("skipped"):
        lines += ["## Errors and skipped sections", ""]
        lines += [f"- {name}: {msg}" for name, msg in {**r.get("errors", {}), **r.get("skipped", {})}.items()] + [""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> str | None:
    """gpu.png: modeled speedup vs k (tiny, B=1) and verify-pass time vs width; None if no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    modeled = at(r, "modeled", "tiny B=1")
    if modeled:
        for alpha in sorted({v["alpha"] for v in modeled["table"].values()}):
            pts = sorted((v["k"], v["speedup"]) for v in modeled["table"].values() if v["alpha"] == alpha)
            left.plot(*zip(*pts), marker="o", label=f"α = {alpha}")
        left.axhline(1.0, color="gray", lw=0.8)
        left.set(xlabel="k (draft tokens)", ylabel="modeled speedup", title="tiny draft, B = 1")
        left.legend()
    steps = r.get("steps")
    if steps:
        for batch, row in steps["rows"].items():
            widths = sorted(int(w) for w in row["width"])
            for kind, style in (("eager_ms", "--"), ("graphed_ms", "-")):
                right.plot(widths, [at(row, "width", w, kind) for w in widths], style, marker=".",
                           label=f"B={batch} {kind[:-3]}")
            if row["floor"]["ms"]:
                right.axhline(row["floor"]["ms"], color="gray", lw=0.8, ls=":")
        right.set(xlabel="tokens per pass (k + 1)", ylabel="ms", title="large-v3 verify pass (floor dotted)")
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(results: dict, out: Path) -> None:
    out = Path(out)
    (out / "gpu.md").write_text(markdown(results))
    why = plot(results, out / "gpu.png")
    if why:
        results.setdefault("skipped", {})["png"] = why


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    write(json.loads((folder / "gpu.json").read_text()), folder)
