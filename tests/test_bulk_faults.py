"""`specwhisper bulk` under faults (issue #28): errors the user can act on are one line with an
exit code that says what happened (no traceback, no Ray started); the local cluster listens on
loopback only; a driver killed with SIGKILL leaves none of its Ray processes behind, after which
a rerun resumes the job."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")  # also puts Ray's vendored psutil on sys.path
import psutil  # noqa: E402

from specwhisper.samples import sample_paths  # noqa: E402
from specwhisper.serving.distributed import EXIT_BAD_INPUT, EXIT_MODEL, EXIT_OUTPUT, read_results  # noqa: E402
from specwhisper.tools.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def audio_folder(tmp_path):
    folder = tmp_path / "audio"
    folder.mkdir()
    for path in sample_paths()[:4]:
        shutil.copy(path, folder / path.name)
    return folder


def unwritable(tmp_path) -> Path:
    """A results folder that cannot be written: read-only, or (as root, who may write anyway)
    beneath a regular file."""
    if os.geteuid() == 0:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        return blocker / "results"
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def one_line_error(capsys, rc: int, expected_rc: int, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == expected_rc, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("specwhisper bulk: error:"), err
    assert all(w in err for w in words), err
    return err


def test_errors_are_one_line_with_their_exit_code(tmp_path, audio_folder, multilingual, capsys):
    assert not ray.is_initialized()
    missing = tmp_path / "no-such-folder"
    rc = main(["bulk", str(missing), "--out", str(tmp_path / "out"), "--target", str(multilingual)])
    one_line_error(capsys, rc, EXIT_BAD_INPUT, str(missing))

    out = unwritable(tmp_path)
    rc = main(["bulk", str(audio_folder), "--out", str(out), "--target", str(multilingual)])
    one_line_error(capsys, rc, EXIT_OUTPUT, "cannot write results", str(out))

    broken = tmp_path / "broken-model"
    shutil.copytree(multilingual, broken)
    (broken / "tokenizer.json").unlink()
    rc = main(["bulk", str(audio_folder), "--out", str(tmp_path / "out"), "--target", str(broken)])
    one_line_error(capsys, rc, EXIT_MODEL, "target model folder", "tokenizer.json")
    assert not ray.is_initialized()  # every check ran before Ray


def ray_descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        children = process.children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for p in children:
        try:
            if "ray" in p.name().lower() or any("ray" in part for part in p.cmdline()[:3]):
                found.append(p)
        except psutil.Error:  # ended meanwhile
            pass
    return found


@pytest.mark.slow  # two Ray start-ups (~20 s each on 2 cores) and one small job
def test_killed_driver_leaves_no_ray_processes_and_the_job_resumes(tmp_path, audio_folder, multilingual):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "specwhisper.tools.cli", "bulk", str(audio_folder), "--out", str(out),
               "--target", str(multilingual), "--language", "en", "--actors", "1", "--cpus-per-actor", "0.5",
               "--max-new-tokens", "4"]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process, deadline = psutil.Process(driver.pid), time.monotonic() + 180
        while True:  # the local cluster is up and has started a worker
            assert driver.poll() is None and time.monotonic() < deadline, "the driver ended before Ray started"
            seen = ray_descendants(process)
            names = [p.name() for p in seen]
            if "raylet" in names and "gcs_server" in names and any(n.startswith("ray::") for n in names):
                break
            time.sleep(0.5)
        time.sleep(2.0)  # let the watchdog note them (it looks four times a second)
        seen = ray_descendants(process)
        listening = []
        for p in [process, *seen]:
            try:
                listening += [(p.name(), c.laddr.ip) for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
            except psutil.Error:
                pass
        assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in listening), listening
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        _, alive = psutil.wait_procs(seen, timeout=30)
        assert not alive, [f"{p.pid} {p.name()}" for p in alive]
    finally:
        if driver.poll() is None:
            driver.kill()

    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    records = read_results(str(out))
    assert sorted(r["path"] for r in records) == sorted(str(p.resolve()) for p in audio_folder.iterdir())
    assert all(r["error"] is None for r in records)
