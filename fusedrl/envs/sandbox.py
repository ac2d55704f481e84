"""Run model-written Python in a separate, contained process and return what the model should see.

``run_python(code, limits)`` never raises for anything the code does: it returns a :class:`SandboxResult` whose
``observation`` is the program's output (stdout and stderr in one stream, cut at ``limits.output_bytes``), or a
one-line ``error: ...`` followed by that output (a traceback ends it). ``python -m fusedrl.envs.sandbox`` does the
same for code read on stdin and exits 0.

Each run gets a fresh, empty temporary directory as its cwd (deleted afterwards), an environment holding only PATH,
LANG, HOME and TMPDIR (the last two point at that directory; nothing of the caller's), stdin from /dev/null, a new
session, and an interpreter in isolated mode (``-I -S``: no PYTHON* variables, no site-packages, no cwd on sys.path).
The containment comes in layers, outermost first; ``containment()`` lists those that work on this machine, and
``run_python(layers=...)`` can leave out the optional ones (the tests use it to check each layer alone):

``namespaces`` (optional; needs unprivileged user namespaces, probed once per process)
    New user, pid, network, mount, IPC and UTS namespaces, made with ``unshare(2)`` through ctypes (Python 3.11 has
    no ``os.unshare``). Network: only a loopback device, down, so every connection fails. Pid: the program's parent is
    the namespace's init, which ignores signals from inside; no process outside is visible, and when that init exits
    the kernel kills everything left inside. Mount: a tmpfs root holding read-only, nosuid binds of the Python
    installation, /usr/lib* (/lib* as symlinks), /etc/ld.so.cache and /dev/{null,zero,random,urandom}, plus the work
    directory read-write and noexec, entered with ``pivot_root`` with the old root detached: nothing else of the
    filesystem exists at any path. User: the sandbox's root is an unprivileged uid outside (nobody when the caller is
    root, else the caller's uid); the program has no capabilities (bounding, permitted and effective sets emptied,
    ``no_new_privs`` set) and runs in a freshly exec'd interpreter, so none of the setup's modules (ctypes above all)
    is loaded in it.
``audit-hook`` (optional)
    A ``sys.addaudithook`` hook, installed before the program runs, refuses with ``PermissionError: sandbox: ...``:
    writes outside the work directory; reads outside it and the standard library (/dev/null and the random devices
    aside); opening directories outside the work directory; paths with ``..``; leaving the work directory; links;
    ``socket.*`` events; starting processes (fork, exec, spawn, system, Popen); sending signals; ``ctypes.*`` events;
    building code objects or replacing a function's code; gc's object lists; and importing the modules that act
    below the audit events (ctypes, _posixsubprocess, _xxsubinterpreters, readline, pwd, ...). It binds what it uses
    when installed, so replacing builtins, os functions or its tables does not blind it.
``limits`` (always)
    In the program's process: RLIMIT_CPU (``cpu_s``; SIGXCPU, then SIGKILL a second later), RLIMIT_AS
    (``memory_mb``), RLIMIT_FSIZE (``file_bytes``), RLIMIT_NOFILE (64), RLIMIT_CORE (0) and RLIMIT_NPROC
    (``processes``). The kernel exempts uid 0 from RLIMIT_NPROC (root bypasses it), so the program never runs as
    root: in namespaces the sandbox's root is an unprivileged uid outside, and without them a root caller's program
    drops to nobody (65534) with ``setuid``. In the parent: the wall-clock ``timeout_s``; output read as it comes,
    the run stopped once it passes ``output_bytes``; SIGKILL to the run's whole process group on timeout, on too
    much output, and after every run.

Checked on this machine (Linux 6.18 in a container, running as root): unprivileged user namespaces work, so all
three layers are on by default; with root mapped to nobody, RLIMIT_NPROC binds (a fork bomb gets EAGAIN), and each
layer stops the hostile programs of tests/test_tools.py on its own.

Not guaranteed:

- Without namespaces, the filesystem is guarded only by the audit hook and file permissions (nobody's, when the
  caller is root), so code that gets past the hook can read world-readable files anywhere; there is no network
  isolation but the hook; and children that call setsid() escape the process-group kill. A root caller whose Python
  installation nobody cannot read (e.g. pyenv under /root, as here) leaves the program only the modules imported
  at start-up (os, sys, builtins, ...).
- The audit hook is not a boundary on its own (CPython says as much): crafted bytecode (``marshal.loads`` stays
  allowed, imports need it), interpreter bugs, or a thread racing a check (an ``os.PathLike`` whose ``__fspath__``
  answers differently each call) can get past it. The namespaces are the boundary.
- Limits count per process (CPU, memory) or per uid (processes), not per run: each of ``processes`` processes may
  use ``memory_mb``. Without namespaces RLIMIT_NPROC counts every process of the uid (nobody's, or a non-root
  caller's), so forks may fail early (the hook refuses them first anyway).
- Submounts under the exposed directories keep their own flags; the program can read all of the Python installation,
  third-party packages installed into it included.
- With a non-root caller the caller's supplementary groups stay with the program (a user namespace may not drop them).
  Only the root-caller paths were exercised here.

Defaults: ``SandboxLimits()`` = 5 s wall clock, 5 s CPU, 256 MB address space, 4096 bytes of output, 8 processes,
1 MiB per written file.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass

NOBODY = 65534  # the overflow uid and gid: "nobody" on common distributions
OPTIONAL_LAYERS = ("namespaces", "audit-hook")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; see the module docstring for how each is enforced."""

    timeout_s: float = 5.0  # wall clock, start-up included
    cpu_s: float = 5.0
    memory_mb: int = 256  # address space of each process
    output_bytes: int = 4096  # stdout and stderr together; the rest is cut with a note
    processes: int = 8  # the program's processes, itself included
    file_bytes: int = 1 << 20  # largest file it may write

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(
                    f"SandboxLimits.{name} must be a positive number of seconds, got {value!r}; pass e.g. {name}=5.0"
                )
        for name in ("memory_mb", "output_bytes", "processes", "file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"SandboxLimits.{name} must be a positive int, got {value!r}; pass e.g. {name}={getattr(SandboxLimits, name)}"
                )


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended."""

    observation: str  # what the model sees
    status: str  # "ok" | "error" | "timeout" | "memory" | "output_limit" | "killed"
    seconds: float
    truncated: bool  # the output passed limits.output_bytes and was cut


def containment() -> list[str]:
    """The containment layers ``run_python`` uses by default on this machine, outermost first."""
    return [*(["namespaces"] if _namespace_problem() is None else []), "audit-hook", "limits"]


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, layers: Collection[str] | None = None) -> SandboxResult:  # noqa: B008 (frozen)
    """Runs ``code`` as ``__main__`` in the sandbox; ``layers``: the optional layers to use (default: every one that
    works here), a subset of ``OPTIONAL_LAYERS``."""
    if layers is None:
        layers = [layer for layer in containment() if layer in OPTIONAL_LAYERS]
    for layer in layers:
        if layer not in OPTIONAL_LAYERS:
            raise ValueError(f"unknown sandbox layer {layer!r}; choose from {', '.join(OPTIONAL_LAYERS)}")
    if "namespaces" in layers and (problem := _namespace_problem()) is not None:
        raise ValueError(f"the namespaces layer does not work here ({problem}); leave layers=None to use what works")
    return _execute(code, limits, namespaces="namespaces" in layers, audit="audit-hook" in layers)


@functools.cache
def _namespace_problem() -> str | None:
    """None when the namespaces layer works on this machine, else what went wrong when trying it."""
    result = _execute("print('ok')", SandboxLimits(timeout_s=30), namespaces=True, audit=False)
    return None if (result.status, result.observation) == ("ok", "ok\n") else result.observation


def _execute(code: str, limits: SandboxLimits, *, namespaces: bool, audit: bool) -> SandboxResult:
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="fusedrl-sandbox-")
    try:
        os.chmod(root, 0o711)  # nobody must reach work/ when the caller is root and namespaces are off
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        if os.geteuid() == 0:
            os.chown(work, NOBODY, NOBODY)  # the program's uid, in or out of a user namespace
        os.mkdir(os.path.join(root, "newroot"), 0o700)
        code_file = os.path.join(root, "main.py")
        with open(os.open(code_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(code.encode("utf-8", "replace"))
        status_r, status_w = os.pipe()
        config = {
            "work": work,
            "newroot": os.path.join(root, "newroot"),
            "code_file": code_file,
            "status_fd": status_w,
            "namespaces": namespaces,
            "audit": audit,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_mb": limits.memory_mb,
                "file_bytes": limits.file_bytes,
                # RLIMIT_NPROC counts the uid's processes: in namespaces, the two helpers above the program's too
                "processes": limits.processes + (2 if namespaces else 0),
            },
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        with os.fdopen(status_r, "rb") as status:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", _CHILD, "setup", json.dumps(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                    env=env,
                    start_new_session=True,
                    pass_fds=(status_w,),
                )
            finally:
                os.close(status_w)
            assert proc.stdout is not None
            with proc.stdout:
                ended = False  # on its own, rather than stopped by the deadline, the output limit or an exception here
                try:
                    output, stopped = _collect(proc.stdout.fileno(), start + limits.timeout_s, limits.output_bytes)
                    ended = stopped is None
                finally:
                    _end(proc, kill=not ended)
            report = status.read().decode("utf-8", "replace").partition("\n")[0]
        return _result(output, stopped, report, proc.returncode, limits, time.monotonic() - start)
    finally:
        _remove_tree(root)


def _collect(fd: int, deadline: float, limit: int) -> tuple[bytes, str | None]:
    """Reads the program's output until every process holding the pipe is gone, the deadline passes ("timeout") or
    more than ``limit`` bytes came ("output_limit"); never holds more than ``limit`` + 64 KiB."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "timeout"
        if not poller.poll(math.ceil(left * 1000)):
            continue
        data = os.read(fd, 65536)
        if not data:
            return b"".join(chunks), None
        chunks.append(data)
        size += len(data)
        if size > limit:
            return b"".join(chunks), "output_limit"


def _end(proc: subprocess.Popen[bytes], *, kill: bool) -> None:
    """Kills what is left of the run's process group and reaps the setup process."""
    if kill:
        _kill_group(proc.pid)
    # Wait for the exit without reaping: until reaped, the setup process's pid cannot name another process group.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_tree(path: str) -> None:
    # The program may have made its directories unreadable: make them ours again (never through a symlink).
    for parent, dirs, _ in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _result(
    output: bytes, stopped: str | None, report: str, returncode: int, limits: SandboxLimits, seconds: float
) -> SandboxResult:
    truncated = len(output) > limits.output_bytes
    text = output[: limits.output_bytes].decode("utf-8", "replace")

    def error(status: str, line: str) -> SandboxResult:
        body = text.rstrip("\n")
        return SandboxResult(f"{line}\n{body}" if body.strip() else line, status, seconds, truncated)

    if stopped == "output_limit":
        note = f"[output truncated: the program wrote more than {limits.output_bytes} bytes and was stopped]"
        return SandboxResult(f"{text}\n{note}", "output_limit", seconds, truncated)
    if stopped == "timeout":
        return error("timeout", f"error: timed out after {limits.timeout_s:g} s")
    kind, _, value = report.partition(" ")
    if kind == "setup":
        return error("error", f"error: sandbox setup failed: {value}")
    if kind == "exit" and value == "0":
        return SandboxResult(text, "ok", seconds, truncated)
    if kind == "exit":
        if text.rstrip().rpartition("\n")[2].startswith("MemoryError"):
            return error("memory", f"error: memory limit ({limits.memory_mb} MB) exceeded")
        return error("error", f"error: exit status {value}")
    if kind == "signal":
        number = int(value)
        if number == signal.SIGXCPU:
            return error("killed", "error: killed (CPU time limit)")
        if number == signal.SIGXFSZ:
            return error("killed", "error: killed (file size limit)")
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        return error("killed", f"error: killed by signal {name}")
    return error("error", f"error: the sandbox stopped without a report (exit status {returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusedrl.envs.sandbox",
        description="Run the Python code read on stdin in the sandbox and print the observation a model would see. "
        "Exits 0 whatever the code did.",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=SandboxLimits.timeout_s, help="wall-clock limit (default: %(default)s)"
    )
    parser.add_argument(
        "--memory-mb", type=int, default=SandboxLimits.memory_mb, help="address-space limit (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        limits = SandboxLimits(timeout_s=args.timeout_s, memory_mb=args.memory_mb)
    except ValueError as e:
        parser.error(str(e))
    print(run_python(sys.stdin.read(), limits).observation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
