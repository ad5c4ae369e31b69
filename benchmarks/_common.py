"""What the benchmarks share: the repository on sys.path (so that `import qlora_fsdp` works
after importing this), a timer, and a launcher for sub-runs that hands back a run's JSON summary
or, when the run failed, the lines of its stderr that say why."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
TRAINER = str(REPO / "qlora_fsdp.py")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nproc():
    """Ranks for a distributed benchmark: 2 on a CPU-only host (gloo), else min(2, GPUs)."""
    return min(2, gpus()) or 2


def median_ms(fn, n=10, warmup=2):
    """Median wall time of fn() in ms; on a GPU each call is timed to the end of its kernels."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):  # compilation, first-touch allocation
        fn()
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1000


class Run:
    """One finished sub-process: its JSON summary (the last stdout line that is one), or why not."""

    def __init__(self, cmd, rc, stdout, stderr, seconds, timed_out=False):
        self.cmd, self.rc, self.stdout, self.stderr, self.seconds = cmd, rc, stdout, stderr, seconds
        self.timed_out = timed_out
        self.json = None
        for line in reversed(stdout.splitlines()):
            if line.startswith("{"):
                try:
                    self.json = json.loads(line)
                except json.JSONDecodeError:
                    continue
                break
        self.ok = rc == 0 and self.json is not None

    def error(self, lines=12):
        """Why it failed, in a few lines: the workers' own traceback rather than torchrun's."""
        if self.ok:
            return ""
        if self.timed_out:  # no traceback to show: how far it got, from both streams' last lines
            tail = [line for line in self.stdout.splitlines() if line.strip()][-lines // 2:]
            err = re.split(r".*Received \S+ death signal.*", self.stderr)[0]  # not the kill
            tail += [line for line in err.splitlines() if line.strip() and not _banner(line)][-lines // 2:]
            return f"timed out after {self.seconds:.0f} s:\n" + "\n".join("    " + line for line in tail)
        head = f"exit code {self.rc}" + ("" if self.rc else ", no JSON summary on stdout")
        return head + ":\n" + "\n".join("    " + line for line in error_lines(self.stderr or self.stdout, lines))


def _banner(line):  # torchrun's note that it set OMP_NUM_THREADS, in a box of asterisks
    return line.startswith("*****") or line.startswith("Setting OMP_NUM_THREADS")


def error_lines(text, n=12):
    """The lines of a failed run's stderr that say why. torchrun ends it with its own report and
    traceback (ChildFailedError), after the worker's: show the last traceback that is not
    torchrun's, and any 'error:' line (qlora_fsdp's and argparse's one-line refusals)."""
    lines = [re.sub(r"^\[rank\d+\]: ?", "", line.rstrip()) for line in text.splitlines()
             if line.strip() and not _banner(line)]
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            j = i + 1
            while j < len(lines) and lines[j].startswith(" "):  # frames, then the exception line
                j += 1
            blocks.append(lines[i:j + 1])
            i = j + 1
        else:
            i += 1
    worker = [b for b in blocks if "ChildFailedError" not in b[-1]]
    errors = list(dict.fromkeys(line for line in lines  # once, not once per rank
                                if line.startswith("error:") or re.match(r"^\S+: error: ", line)))  # argparse's
    if worker:
        block = worker[-1]
        return (block[:1] + ["    ..."] if len(block) > n else []) + block[-(n - 1):] + errors[-2:]
    return errors[-n:] or lines[-n:]


def _stat(pid):
    """(parent pid, start time) of a live process, from /proc (Linux); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid):
    """{pid: start time} of every process below pid: torchrun starts its workers in sessions of
    their own, so they are not in its process group."""
    children = {}
    for entry in os.listdir("/proc"):
        st = _stat(entry) if entry.isdigit() else None
        if st:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    found, todo = {}, [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            found[child] = start
            todo.append(child)
    return found


def _kill(started):
    """SIGKILL each of {pid: start time} that is still the same process (not a reused id)."""
    for pid, start in started.items():
        st = _stat(pid)
        if st and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def launch(cmd, env=None, timeout=None, grace=30):
    """Run cmd (a list) to the end, or to `timeout` s, then end it and everything it started:
    SIGTERM, and `grace` s later SIGKILL, so that it is over by timeout + grace."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        started = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to its workers and waits for them
        try:
            out, err = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            # The workers first: they hold the pipes open, and reading them to the end would wait.
            _kill(started)
            proc.kill()
            out, err = proc.communicate()
        _kill(started)  # a worker left behind
    return Run(cmd, proc.returncode, out, err, time.perf_counter() - t0, timed_out)


def torchrun(script, args, nproc, env=None, timeout=None, grace=30):
    """script (a path) under torchrun with nproc local ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    return launch(cmd, env, timeout, grace)
