"""The child side of :mod:`fusedrl.envs.sandbox`: a script that a bare interpreter (``python -I -S``) runs, never imported.

Stage ``setup`` is the process the parent starts (new session, cwd = the empty work directory, stdout and stderr on
one pipe, a status pipe). With namespaces it forks C and writes C's uid/gid maps once C has unshared the user, mount,
pid, network, IPC and UTS namespaces; C becomes the namespace's root (an unprivileged uid outside), builds a private
root and pivots into it, then forks G, pid 1 of the new pid namespace, which drops every capability and forks R. R
execs a fresh interpreter for stage ``run``, so nothing C loaded (ctypes above all) is left in the memory the program
runs in. Without namespaces this
process forks R, which runs stage ``run`` in-process (ctypes is never imported on that path) as ``nobody`` when the
parent is root. The waiter (G, or this process) writes one line to the status pipe: ``exit N`` or ``signal N``; a
step that fails writes ``setup <why>`` first.

Stage ``run`` sets the resource limits, installs the audit hook and runs the program as ``__main__``.
"""

from __future__ import annotations

import builtins
import io
import json
import linecache
import os
import posix
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

NOBODY = 65534  # the overflow uid and gid: "nobody" on common distributions
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8  # the same bits as os.ST_RDONLY ... os.ST_NOEXEC
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper for pivot_root
# What the private root shows besides the Python installation and the work directory, all read-only. Top-level
# symlinks among them (/lib -> usr/lib on merged-/usr systems) are recreated as symlinks.
SYSTEM_PATHS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

NETWORK = "network access is not allowed"
PROCESSES = "starting processes is not allowed"
SIGNALS = "sending signals is not allowed"
NATIVE = "native code (ctypes, extensions) is not allowed"
LINKS = "creating links is not allowed"
INTROSPECTION = "inspecting the garbage collector is not allowed"
CODE = "building or replacing code objects is not allowed"
WRITE = "writing outside the working directory is not allowed"
READ = "reading outside the working directory and the Python standard library is not allowed"
OPEN_DIRECTORY = "opening directories outside the working directory is not allowed"
CHDIR = "leaving the working directory is not allowed"
REFUSED_EVENTS = {
    **dict.fromkeys(("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system"), PROCESSES),
    **dict.fromkeys(("os.startfile", "subprocess.Popen", "pty.spawn"), PROCESSES),
    **dict.fromkeys(("os.kill", "os.killpg", "signal.pthread_kill"), SIGNALS),
    **dict.fromkeys(("os.link", "os.symlink"), LINKS),
    **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents"), INTROSPECTION),
    **dict.fromkeys(("sqlite3.enable_load_extension", "sqlite3.load_extension"), NATIVE),
    "code.__new__": CODE,
    "cpython.PyInterpreterState_New": "creating interpreters is not allowed",
}
REFUSED_PREFIXES = (("socket.", NETWORK), ("ctypes.", NATIVE), ("syslog.", "syslog is not allowed"))
# Modules that reach processes, memory or files below the audit events: _posixsubprocess.fork_exec raises no event
# on 3.11, a subinterpreter has no audit hook, readline and pwd/grp read files in C, _posixshmem writes /dev/shm.
REFUSED_IMPORTS = frozenset(
    ("ctypes", "_ctypes", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_xxsubinterpreters", "readline")
    + ("pwd", "grp", "spwd", "nis", "_curses", "_tkinter")
)
# event -> (argument index, kind) per path argument; kinds: read, list (a directory), write, chdir
PATH_EVENTS = {
    **dict.fromkeys(("os.listdir", "os.scandir"), ((0, "list"),)),
    **dict.fromkeys(("os.getxattr", "os.listxattr"), ((0, "read"),)),
    "os.chdir": ((0, "chdir"),),
    **dict.fromkeys(("os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.chown", "os.utime"), ((0, "write"),)),
    **dict.fromkeys(("os.truncate", "os.setxattr", "os.removexattr", "shutil.rmtree", "shutil.chown"), ((0, "write"),)),
    **dict.fromkeys(("tempfile.mkstemp", "tempfile.mkdtemp"), ((0, "write"),)),
    **dict.fromkeys(("os.rename", "shutil.move"), ((0, "write"), (1, "write"))),
    **dict.fromkeys(("shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree"), ((0, "read"), (1, "write"))),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def main(argv: list[str]) -> int:
    stage, config = argv[1], json.loads(argv[2])
    if stage == "setup":
        return _setup(config)
    fd = int(argv[3])
    with open(fd, "rb") as f:
        code = f.read()
    return _run(config, code, drop_to=None)


def _setup(cfg: dict[str, Any]) -> int:
    """Returns only in the process that ran the program (without namespaces), with its exit status."""
    status = cfg["status_fd"]
    os.set_inheritable(status, False)  # the exec of stage "run" closes it
    try:
        with open(cfg["code_file"], "rb") as f:
            code = f.read()
        if cfg["namespaces"]:
            _contain(cfg, code, status)

        def run_here() -> int:
            os.close(status)
            return _run(cfg, code, drop_to=NOBODY if os.geteuid() == 0 else None)

        return _supervise(status, run_here)
    except Exception as e:  # any process of the chain: report the step that failed, never run the program
        _report(status, f"setup {e}" if isinstance(e, OSError) else f"setup {type(e).__name__}: {e}")
        os._exit(1)


def _report(status: int, line: str) -> None:
    os.write(status, (line.replace("\n", " ") + "\n").encode())


def _supervise(status: int, child: Callable[[], int]) -> int:
    """Forks; the child returns child(), this process reports how the child ended and exits."""
    pid = os.fork()
    if pid == 0:
        return child()
    _, wait_status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wait_status):
        _report(status, f"signal {os.WTERMSIG(wait_status)}")
    else:
        _report(status, f"exit {os.waitstatus_to_exitcode(wait_status)}")
    os._exit(0)


def _contain(cfg: dict[str, Any], code: bytes, status: int) -> NoReturn:
    import ctypes  # here only: no process that runs the program may have it loaded (see the module docstring)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    python = os.path.realpath(sys.executable)
    with open(__file__) as f:
        runner = f.read()  # stage "run" gets this file as `python -c` source: the file is not in the private root
    # Root outside maps the sandbox's root to nobody: a non-root uid outside is what makes RLIMIT_NPROC bind.
    uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid:  # the setup process: only a process outside the new user namespace may map an outer uid other than its own
        os.close(unshared_w)
        os.close(mapped_r)
        if os.read(unshared_r, 1):
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(text)
            os.write(mapped_w, b"1")
        os.close(mapped_w)
        os.waitpid(pid, 0)
        os._exit(0)
    # C
    os.close(unshared_r)
    os.close(mapped_w)
    if os.geteuid() == 0:
        os.setgroups([])  # the outer root's supplementary groups would stay with the program
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    os.write(unshared_w, b"1")
    os.close(unshared_w)
    if os.read(mapped_r, 1) != b"1":
        os._exit(1)  # the setup process failed to map the ids and reported why
    os.close(mapped_r)

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        args = [None if s is None else os.fsencode(s) for s in (source, target, fstype)]
        check(libc.mount(*args, flags, None if data is None else data.encode()), f"mount {target}")

    # A tmpfs root with read-only binds of the Python installation and the system libraries, the work directory
    # read-write; the old root is detached, so nothing else is reachable at any path. The sources are opened while
    # this process still has the caller's uid (nobody may not reach e.g. a Python under /root); the tree is built as
    # the namespace's root (only a uid mapped in the namespace can create files in its tmpfs).
    work, new = cfg["work"], cfg["newroot"]
    sources = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, python)]
    links = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.exists(path):
            sources.append(path)
    read_only, no_exec = MS_RDONLY | MS_NOSUID | MS_NODEV, MS_NOSUID | MS_NODEV | MS_NOEXEC
    binds = [(source, read_only) for source in _outermost(sources)]
    binds += [(device, MS_RDONLY | MS_NOSUID | MS_NOEXEC) for device in DEVICES if os.path.exists(device)]
    binds.append((work, no_exec))
    opened = [(source, os.path.isdir(source), os.open(source, os.O_PATH | os.O_CLOEXEC), flags) for source, flags in binds]
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.umask(0o022)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, target in links:
        os.makedirs(new + os.path.dirname(path), exist_ok=True)
        os.symlink(target, new + path)
    for source, is_dir, fd, flags in opened:
        if is_dir:
            os.makedirs(new + source, exist_ok=True)
        else:
            os.makedirs(new + os.path.dirname(source), exist_ok=True)
            open(new + source, "a").close()
        mount(f"/proc/self/fd/{fd}", new + source, None, MS_BIND | MS_REC)
        # A user namespace may not clear flags the outer mount has, so they are kept; the rest are added.
        kept = os.fstatvfs(fd).f_flag & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount(None, new + source, None, MS_BIND | MS_REMOUNT | flags | kept)
        os.close(fd)
    mount(None, new, None, MS_BIND | MS_REMOUNT | read_only | MS_NOEXEC)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: syscall number unknown on {machine}")
    os.chdir(new)
    check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir(work)

    if os.fork() == 0:  # G: pid 1 of the new pid namespace
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        cap = 0
        while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
            cap += 1
        if cap == 0:
            check(-1, "prctl(PR_CAPBSET_DROP)")
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")  # effective, permitted, inheritable: none
        check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # the program cannot ptrace G
        _supervise(status, lambda: _exec_run(python, runner, cfg, code))
    os.wait()
    os._exit(0)


def _outermost(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def _exec_run(python: str, runner: str, cfg: dict[str, Any], code: bytes) -> NoReturn:
    fd = os.memfd_create("main.py")
    view = memoryview(code)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    os.execv(python, [python, "-I", "-S", "-c", runner, "run", json.dumps(cfg), str(fd)])


def _run(cfg: dict[str, Any], code: bytes, drop_to: int | None) -> int:
    """Runs the program as __main__ in this process; returns its exit status."""
    _set_limits(cfg["limits"])
    if drop_to is not None:
        os.setgroups([])
        os.setgid(drop_to)
        os.setuid(drop_to)
    os.chdir(cfg["work"])
    sys.argv = ["main.py"]
    sys.dont_write_bytecode = True
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # stderr shares the pipe: keep prints before the traceback
    text = code.decode("utf-8", "replace")
    linecache.cache["main.py"] = (len(text), None, text.splitlines(True), "main.py")  # tracebacks show the source
    if cfg["audit"]:
        stdlib = tuple(os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix))
        sys.addaudithook(_audit_hook(cfg["work"], stdlib))
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "main.py", "exec", dont_inherit=True), namespace)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        if isinstance(e, MemoryError):
            namespace.clear()  # free what the program held, so that the traceback can be printed
        _print_exception(e)
        return 1
    return 0


def _print_exception(e: BaseException) -> None:
    """Prints the traceback as Python would, without the frames of _run and of the audit hook."""
    own = _run.__code__.co_filename
    report = traceback.TracebackException(type(e), e, e.__traceback__)
    pending, seen = [report], set()
    while pending:  # the exception, its causes and contexts, and an exception group's members
        item = pending.pop()
        if id(item) not in seen:
            seen.add(id(item))
            frames = [f for f in item.stack if not (f.filename == own and f.name in ("_run", "hook"))]
            item.stack = traceback.StackSummary.from_list(frames)
            pending += [x for x in (item.__cause__, item.__context__, *(item.exceptions or ())) if x is not None]
    sys.stderr.write("".join(report.format()))


def _set_limits(limits: dict[str, Any]) -> None:
    cpu = int(-(-limits["cpu_s"] // 1))
    memory = limits["memory_mb"] << 20
    for kind, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU first, SIGKILL a second later if the program ignores it
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
    ):
        current = resource.getrlimit(kind)[1]
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(kind, (soft, hard))


def _audit_hook(work: str, stdlib: tuple[str, ...]) -> Callable[[str, tuple[Any, ...]], None]:
    """The hook that refuses what REFUSED_EVENTS, REFUSED_PREFIXES, REFUSED_IMPORTS and PATH_EVENTS name.

    Everything it uses is bound here, not looked up when it runs, so that a program that replaces builtins, os
    functions or this module's tables cannot blind it; CPython runs hooks with tracing off, and the program cannot
    reach the hook object (gc's object lists are refused), so it cannot replace its code or closure either.
    """
    refused_events, path_events = dict(REFUSED_EVENTS), dict(PATH_EVENTS)  # copies the program cannot reach
    refused_prefixes, refused_imports, write_flags = REFUSED_PREFIXES, REFUSED_IMPORTS, WRITE_FLAGS
    lstat, stat, readlink, getcwd, fspath = posix.lstat, posix.stat, posix.readlink, posix.getcwd, posix.fspath
    str_, bytes_, int_, type_, refusal, failures = str, bytes, int, type, PermissionError, (OSError, ValueError)
    work_prefix, stdlib_prefixes, devices = work + "/", tuple(p + "/" for p in stdlib), DEVICES
    write, read, open_directory, chdir, code = WRITE, READ, OPEN_DIRECTORY, CHDIR, CODE

    def resolve(path: str) -> str:
        """The absolute path with every symlink resolved, as the kernel would walk it."""
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        pending = [name for name in path.split("/") if name not in ("", ".")]
        pending.reverse()
        parts: list[str] = []
        hops = 0
        while pending:
            name = pending.pop()
            if name == "..":
                if parts:
                    parts.pop()
                continue
            current = "/" + "/".join([*parts, name])
            try:
                is_link = lstat(current)[0] & 0o170000 == 0o120000
            except failures:
                is_link = False
            if not is_link or hops > 40:  # past 40 links the kernel fails the path with ELOOP anyway
                parts.append(name)
                continue
            hops += 1
            target = readlink(current)
            if target.startswith("/"):
                parts = []
            names = [n for n in target.split("/") if n not in ("", ".")]
            names.reverse()
            pending.extend(names)
        return "/" + "/".join(parts)

    def check(kind: str, arg: Any) -> str | None:
        if type_(arg) is int_:  # a descriptor: reading through one is fine; changing its file is refused
            return None if kind in ("read", "list") else write if kind == "write" else chdir
        path: Any = "." if arg is None else arg if type_(arg) is str_ else fspath(arg)
        if type_(path) is bytes_:
            path = path.decode("utf-8", "surrogateescape")
        if type_(path) is not str_:  # a str subclass could override the methods used below
            return "paths must be plain str or bytes (or os.PathLike objects that give one)"
        if ".." in path.split("/"):
            return "paths with '..' are not allowed"
        real = resolve(path)
        if (real + "/").startswith(work_prefix):
            return None
        if kind == "write":
            return None if real == "/dev/null" else write
        if kind == "chdir":
            return chdir
        if real in devices:
            return None
        if not (real + "/").startswith(stdlib_prefixes):
            return read
        try:
            is_dir = stat(real)[0] & 0o170000 == 0o040000
        except failures:
            is_dir = False
        return open_directory if kind == "open" and is_dir else None

    def decide(event: str, args: tuple[Any, ...]) -> str | None:
        if event == "open":  # (path or descriptor, mode, os-level flags)
            path, flags = args[0], args[2]
            if type_(path) is int_:  # wrapping a descriptor (os.fdopen, tempfile): it came from an allowed open
                return None
            return check("write" if type_(flags) is not int_ or flags & write_flags else "open", path)
        kinds = path_events.get(event)
        if kinds is not None:
            for index, kind in kinds:
                reason = check(kind, args[index])
                if reason is not None:
                    return reason
            return None
        reason = refused_events.get(event)
        if reason is not None:
            return reason
        for prefix, reason in refused_prefixes:
            if event.startswith(prefix):
                return reason
        if event == "import" and (args[0] in refused_imports or args[0].startswith(("_test", "_xx"))):
            return f"importing {args[0]} is not allowed"
        if event in ("object.__setattr__", "object.__delattr__") and args[1] == "__code__":
            return code
        if event == "sqlite3.connect":  # SQLite opens its files in C, without an "open" event
            database = args[0]
            if database in (":memory:", "", b":memory:", b""):
                return None
            if (database.decode("utf-8", "replace") if type_(database) is bytes_ else str_(database)).startswith("file:"):
                return "SQLite URIs are not allowed"
            return check("write", database)
        return None

    def hook(event: str, args: tuple[Any, ...]) -> None:
        reason = decide(event, args)
        if reason is not None:
            raise refusal("sandbox: " + reason)

    return hook


if __name__ == "__main__":
    sys.exit(main(sys.argv))
