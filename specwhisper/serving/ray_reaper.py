"""Ray processes never outlive the `specwhisper bulk` driver that started them.

`ray.init()` without an address starts a local cluster (GCS, raylet, dashboard and runtime-env
agents, workers) as the driver's descendants. A driver that exits normally shuts it down; one that
is killed (SIGKILL, OOM killer) cannot, and the agents were seen alive a minute later. So the
driver starts this module as a small watchdog process (`start_reaper`) that holds the read end of
a pipe and, four times a second, notes the driver's descendants that are Ray's (started after the
watchdog, named or run from Ray). When the pipe reaches end of file (the
driver is gone, however it died) the watchdog terminates every process it noted that still runs
(SIGTERM, then SIGKILL after a grace period) and exits. psutil (vendored by Ray) checks each
process's start time, so a reused pid is never signalled.

Run as `python -m specwhisper.serving.ray_reaper DRIVER_PID` with the pipe on stdin.
"""
from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys

GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
POLL_SECONDS = 0.25  # how often the driver's descendants are noted


def start_reaper() -> subprocess.Popen:
    """Start the watchdog for this process; it lives until this process's end (keep the returned
    Popen referenced: its stdin is the pipe whose end of file means this process is gone)."""
    return subprocess.Popen([sys.executable, "-m", "specwhisper.serving.ray_reaper", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _psutil():
    try:
        import psutil
    except ImportError:  # Ray vendors it in ray/thirdparty_files; no need to import Ray itself
        spec = importlib.util.find_spec("ray")
        sys.path.insert(0, os.path.join(os.path.dirname(spec.origin), "thirdparty_files"))
        import psutil
    return psutil


def _is_ray(process, since: float) -> bool:
    """A Ray process started after the watchdog (the driver's other children are left alone)."""
    try:
        if process.create_time() < since - 1.0:
            return False
        return "ray" in process.name().lower() or any("ray" in part for part in process.cmdline()[:3])
    except Exception:  # gone, or not ours to inspect
        return False


def watch(driver_pid: int, pipe_fd: int = 0) -> list[int]:
    """Note `driver_pid`'s descendants until `pipe_fd` reaches end of file, then end them.
    Returns the pids it had to terminate."""
    psutil = _psutil()
    me = psutil.Process()
    noted: dict[int, object] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return []
    while True:
        try:
            for child in driver.children(recursive=True):
                if child.pid != me.pid and child.pid not in noted and _is_ray(child, me.create_time()):
                    noted[child.pid] = child
        except psutil.NoSuchProcess:
            pass  # the driver is gone; the pipe says so next
        readable, _, _ = select.select([pipe_fd], [], [], POLL_SECONDS)
        if readable and not os.read(pipe_fd, 4096):
            break
    for p in list(noted.values()):  # what the noted processes started since the last look
        try:
            if p.is_running():
                for child in p.children(recursive=True):
                    noted.setdefault(child.pid, child)
        except psutil.Error:
            pass
    alive = [p for p in noted.values() if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=GRACE_SECONDS)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in alive]


if __name__ == "__main__":
    watch(int(sys.argv[1]))
