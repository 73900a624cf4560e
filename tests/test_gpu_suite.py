"""The GPU suite's smoke mode on CPU (`bench/gpu_suite.sh OUT --quick`): the scripts a GPU run
depends on (checkpoint generator, benchmark, report, suite) cannot rot unseen in CI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_suite_quick_runs_on_cpu(tmp_path):
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "GPU_SUITE_SECONDS": "900"}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(out), "--quick"],
                         capture_output=True, text=True, env=env, timeout=1200)
    log = run.stdout + run.stderr + "".join(p.read_text()[-3000:] for p in out.glob("*.log"))
    assert run.returncode == 0, log
    stages = [row.split("\t") for row in (out / "stages.tsv").read_text().splitlines()]
    assert [(s[0], s[1]) for s in stages] == [("models", "passed"), ("pytest", "passed"), ("bench", "passed")], log

    results = json.loads((out / "gpu.json").read_text())
    assert results["errors"] == {} and results["skipped"] == {}, results["errors"] or results["skipped"]
    for section in ("bandwidth", "steps", "drafts", "accept", "modeled", "near_ties", "e2e", "hf"):
        assert section in results, section
    tiny = results["e2e"]["tiny_draft"]  # tiny (80 mel bins) drafting large-v3 (128) from the audio
    assert tiny.startswith("accepted: ") and "tokens equal: yes" in tiny and "stood aside" not in tiny, tiny
    self_draft = results["e2e"]["systems"]["self-draft k=4"]["1"]
    assert self_draft["acceptance"] == 1.0 and self_draft["same_tokens_as_target_only"]
    assert results["near_ties"]["by_width"]["2"]["positions"] > 0
    assert results["hf"]["eager"]["rows"]["1"]["generated"] == 4  # EOT never wins on these weights
    for name in ("gpu.md", "gpu.png", "summary.md", "junit-cuda.xml"):
        assert (out / name).stat().st_size > 0, name
    summary = (out / "summary.md").read_text()
    assert "## Goals" in summary and "pytest -m cuda:" in summary


def test_gpu_profile_smoke_runs_on_cpu(tmp_path):
    """bench/gpu_profile.py's CPU smoke run (its CUDA-only parts skip): the script a device call
    runs cannot rot unseen either."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--models", str(tmp_path / "models"),
                          "--out", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32", "--quick",
                          "--widths", "1", "2", "--batch", "2", "--no-compile"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    profile = json.loads((tmp_path / "out" / "profile.json").read_text())
    for width in ("1", "2"):
        row = profile["widths"][width]
        assert row["eager_ms"] > 0 and row["graphed_ms"] > 0 and row["profile"]["top"], row
    for b in (1, 2):  # the engine end to end at B = 1 and --batch (torch's ops: the decode ops are CUDA's)
        run = profile["engine"][f"torch ops B={b}"]
        assert run["steps"] > 0 and run["plain_ms_per_step"] > 0 and len(run["tokens"]) == b, run


def test_gpu_suite_selects_every_file_with_cuda_tests():
    """On a GPU the suite runs `pytest -m cuda` over the test files its CUDA_TESTS pattern matches
    (collecting the others would import what a bare GPU image lacks): those files are exactly the
    ones holding tests marked `cuda`, whatever decorator applies the mark."""
    import re

    script = (ROOT / "bench" / "gpu_suite.sh").read_text()
    pattern = re.search(r"^CUDA_TESTS='([^']*)'$", script, re.M).group(1)
    files = sorted((ROOT / "tests").glob("test_*.py"))
    selected = {p.name for p in files if re.search(pattern, p.read_text())}
    # collected: every file that says "cuda" at all (a mark named cuda, or a helper named for it,
    # appears in the file that applies it; conftest.py only skips marked tests), a superset of the
    # selection that spares importing the other 30-odd modules
    candidates = [str(p.relative_to(ROOT)) for p in files if "cuda" in p.read_text()]
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          *candidates], capture_output=True, text=True, cwd=ROOT, timeout=600)
    marked = {line.split("::")[0].split("/")[-1] for line in run.stdout.splitlines() if "::" in line}
    assert marked, run.stdout + run.stderr
    assert selected == marked, (selected, marked)


def test_modeled_and_report_use_the_decode_ops_times_where_timed():
    """bench/gpu.py's modeled speedups and gpu_report's goals take the decode-ops timings a GPU
    run records beside torch's (a results dict as such a run writes it; nothing here runs a GPU)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu
        import gpu_report
    finally:
        sys.path.pop(0)

    widths = {w: dict(eager_ms=20.0, graphed_ms=3.0 + 0.2 * w, decode_ops_graphed_ms=2.4 + 0.05 * w) for w in (1, 2, 3)}
    results = dict(steps=dict(decoder_weight_bytes=1.8e9, cross_kv_bytes_per_row=2.5e8, self_kv_bytes_per_row_read=7e7,
                              rows={1: dict(width=widths, floor=dict(bytes=2e9, ms=0.5))}),
                   drafts=dict(tiny={1: dict(eager_ms=3.0, graphed_ms=0.33, decode_ops_graphed_ms=0.15)}),
                   accept=dict(op="race", rows={1: {k: dict(race_graphed_us=14.0, sample_graphed_us=180.0,
                                                            sample_eager_us=1.0, greedy_eager_us=1.0,
                                                            greedy_graphed_us=1.0) for k in (1, 2)}}),
                   env={}, args=dict(dtype="float16"), errors={}, skipped={})
    bench = types.SimpleNamespace(results=results, args=types.SimpleNamespace(batch=[1]), ks=(1, 2))
    modeled = gpu.Bench.modeled(bench)
    torch_ops, ops = modeled["tiny B=1"], modeled["tiny B=1 decode ops"]
    # the faster target-only step: torch's 3.2 ms there, the decode ops' 2.45 ms here
    step, ops_step = widths[1]["graphed_ms"], widths[1]["decode_ops_graphed_ms"]
    assert torch_ops["t_target_ms"] == step and ops["t_target_ms"] == ops_step
    expected = (1 + 0.8 + 0.8**2) * ops_step / (2 * 0.15 + widths[3]["decode_ops_graphed_ms"] + 0.014)
    assert abs(ops["table"]["0.8:2"]["speedup"] - expected) < 1e-9
    results["modeled"] = modeled
    goals = {row[0].split(" (")[0].split(",")[0]: row[1] for row in gpu_report.goals(results)}
    assert goals["target step B=1"] == gpu_report.fmt(ops_step / 0.5)
    assert goals["tiny draft step B=1"] == gpu_report.fmt(0.15)
    text = gpu_report.markdown(results)
    assert "decode ops graphed" in text and "**tiny B=1 decode ops**" in text
