"""The rollout tools (fusedrl/envs): the calculator's values and refusals, and the sandbox's containment: one hostile
program per test, each checked with every layer on and, where a layer can stop it alone, with that layer alone."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from fusedrl.envs.calculator import calculate, extract_call
from fusedrl.envs.sandbox import SandboxLimits, containment, run_python

SMALL = SandboxLimits(timeout_s=5, cpu_s=2, memory_mb=128)
ALL, NAMESPACES, HOOK = "all-layers", "namespaces-only", "audit-hook-only"
LAYERS = {ALL: None, NAMESPACES: ["namespaces"], HOOK: ["audit-hook"]}


def run(code: str, layers: str = ALL, limits: SandboxLimits = SMALL):
    if layers == NAMESPACES and "namespaces" not in containment():
        pytest.skip("unprivileged user namespaces are not available on this machine")
    result = run_python(code, limits, layers=LAYERS[layers])
    os.kill(os.getpid(), 0)  # this process is alive and signalable
    return result


def sandbox_processes() -> list[int]:
    """Processes still running for some sandbox run: each has its work directory's path on its command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"fusedrl-sandbox-" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize(
    "expression,value",
    [
        ("1 + 2", "3"),
        ("7 - 10", "-3"),
        ("6 * 7", "42"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("2 + 3 * 4 ** 2", "50"),
        ("(2 + 3) * 4", "20"),
        ("((1 + 2) * (3 + 4)) % 5", "1"),
        ("3.5 * 2", "7"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        ("-3 + +5", "2"),
        ("-(2 ** 2)", "-4"),
        ("-2 ** 2", "-4"),
        ("10 ** 999 // 10 ** 998", "10"),
    ],
)
def test_calculator_evaluates_each_operator_with_python_precedence(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,kwargs,error",
    [
        ("__import__('os').system('id')", {}, "only numbers and + - * / // % ** ( ) are allowed"),
        ("abs(-1)", {}, "only numbers"),
        ("(1).real", {}, "only numbers"),
        ("x + 1", {}, "only numbers"),
        ("'a' * 3", {}, "only numbers"),
        ("True + 1", {}, "only numbers"),
        ("1j * 1j", {}, "only numbers"),
        ("1 < 2", {}, "only numbers"),
        ("[1][0]", {}, "only numbers"),
        ("9 ** 9 ** 9", {}, "result too large"),
        ("10 ** 1000", {}, "result too large"),
        ("2.0 ** 10000", {}, "result too large"),
        ("1e308 * 10", {}, "result too large"),
        ("(-8) ** (1 / 3)", {}, "not a real number"),
        ("1 / 0", {}, "division by zero"),
        ("1 % 0", {}, "division by zero"),
        ("1 +", {}, "not an arithmetic expression"),
        ("", {}, "empty expression"),
        ("1 + " * 100 + "1", {}, "longer than 200 characters"),
        ("(" * 500 + "1" + ")" * 500, {}, "longer than 200 characters"),
        ("(" * 500 + "1" + ")" * 500, {"max_chars": 2000}, "nested too deeply"),
        ("-" * 150 + "1", {}, "nested too deeply"),
        ("1 + " * 5000 + "1", {"max_chars": 10**5}, "nested too deeply"),
    ],
)
def test_calculator_refuses_with_one_error_line_and_never_raises(expression, kwargs, error):
    result = calculate(expression, **kwargs)
    assert result.startswith("error: ") and error in result and "\n" not in result


def test_calculator_guards_powers_before_computing_them():
    start = time.monotonic()
    assert calculate("9 ** 9 ** 9 ** 9") == "error: result too large"
    assert calculate("2 ** 3000", max_result_digits=2000).isdigit()
    assert time.monotonic() - start < 1


def test_extract_call_returns_the_last_complete_call():
    assert extract_call("Let me see. <calc>1 + 2</calc> so 3; then <calc> 3 * 4 </calc>.") == "3 * 4"
    assert extract_call("<calc>1</calc> then <calc>2") == "1"
    assert extract_call("no call here") is None
    assert extract_call("<calc>unclosed") is None
    assert extract_call("<python>print(1)</python>", tag="python") == "print(1)"


@pytest.mark.parametrize("field", ["timeout_s", "cpu_s", "memory_mb", "output_bytes", "processes", "file_bytes"])
def test_sandbox_limits_refuse_non_positive_values(field):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a positive"):
        SandboxLimits(**{field: 0})


def test_containment_uses_namespaces_where_unprivileged_ones_work():
    layers = containment()
    assert layers[-2:] == ["audit-hook", "limits"]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        assert layers[0] == "namespaces"
    with pytest.raises(ValueError, match="unknown sandbox layer"):
        run_python("pass", layers=["chroot"])


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
def test_a_program_runs_in_an_empty_directory_that_is_deleted_afterwards(layers):
    result = run(
        "import os\nprint(os.listdir('.'))\nopen('a.txt', 'w').write('kept')\nprint(open('a.txt').read(), os.getcwd())", layers
    )
    assert result.status == "ok" and not result.truncated
    first, second = result.observation.splitlines()
    assert first == "[]" and second.startswith("kept ")
    assert not os.path.exists(second.split()[1])


def test_a_syntax_error_and_an_exception_show_the_last_line_of_the_traceback():
    result = run("x = (")
    assert result.status == "error" and result.observation.startswith("error: exit status 1\n")
    assert result.observation.endswith("SyntaxError: '(' was never closed")
    result = run("print('before')\n1 / 0")
    assert result.observation.startswith("error: exit status 1\nbefore\nTraceback")
    assert result.observation.endswith("ZeroDivisionError: division by zero") and "_sandbox_child" not in result.observation


def test_an_infinite_loop_times_out_at_its_limit():
    result = run("while True:\n    pass", limits=SandboxLimits(timeout_s=1, cpu_s=5))
    assert result.status == "timeout" and result.observation == "error: timed out after 1 s"
    assert result.seconds >= 0.9  # never before its limit (how long after it depends on the machine's load)
    assert sandbox_processes() == []


def test_cpu_time_is_limited_apart_from_the_wall_clock():
    result = run("while True:\n    pass", limits=SandboxLimits(timeout_s=5, cpu_s=1))
    assert (result.status, result.observation) == ("killed", "error: killed (CPU time limit)")  # not the wall clock


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
def test_a_fork_bomb_is_contained_and_leaves_no_process(layers):
    result = run("import os\nwhile True:\n    os.fork()", layers)
    assert result.status in ("error", "killed", "timeout", "output_limit")
    if layers == NAMESPACES:  # RLIMIT_NPROC binds: the sandbox's root is an unprivileged uid outside
        assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in result.observation
    else:
        assert "PermissionError: sandbox: starting processes is not allowed" in result.observation
    deadline = time.monotonic() + 2
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_the_process_limit_counts_the_program_and_its_children():
    # In namespaces nothing else refuses a fork: this is RLIMIT_NPROC binding, i.e. the program's uid is not root outside.
    # The children sleep past the wall clock: the program ends normally (no timeout) and none of them outlives it,
    # since they die with the namespace.
    code = "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    result = run(code, NAMESPACES, SandboxLimits(timeout_s=5, processes=4))
    assert (result.status, result.observation) == ("ok", "3 11\n")
    assert sandbox_processes() == []


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**6)"])
def test_a_memory_blowup_hits_the_address_space_limit(code):
    result = run(code)
    assert result.status == "memory"
    assert result.observation.startswith("error: memory limit (128 MB) exceeded") and result.observation.endswith("MemoryError")


def test_huge_output_is_cut_at_the_limit_and_the_program_stopped():
    result = run("while True:\n    print('x' * 10**6)", limits=SandboxLimits(timeout_s=5, output_bytes=1000))
    assert result.status == "output_limit" and result.truncated  # stopped by the output limit, not the wall clock
    text, note = result.observation.rsplit("\n", 1)
    assert text == "x" * 1000 and note.startswith("[output truncated")


WRITE_OUTSIDE = """import os, sys
for path in [{target!r}, sys.base_prefix + '/escape.txt']:
    try:
        with open(path, 'w') as f:
            f.write('escaped')
        print('WROTE', path)
    except OSError as e:
        print('refused:', e)
try:
    os.mkdir({directory!r})
    print('MADE')
except OSError as e:
    print('refused:', e)
"""


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
def test_writes_outside_the_directory_do_not_happen(tmp_path, layers):
    target, directory = tmp_path / "escape.txt", tmp_path / "made"
    result = run(WRITE_OUTSIDE.format(target=str(target), directory=str(directory)), layers)
    assert "WROTE" not in result.observation and "MADE" not in result.observation
    assert not target.exists() and not directory.exists() and not os.path.exists(sys.base_prefix + "/escape.txt")
    refusal = {
        ALL: "sandbox: writing outside the working directory is not allowed",
        HOOK: "sandbox: writing outside the working directory is not allowed",
        NAMESPACES: "Read-only file system",  # the Python installation is in the private root, read-only
    }[layers]
    assert refusal in result.observation
    if layers == NAMESPACES:  # and tmp_path is not in it at all
        assert f"No such file or directory: '{target}'" in result.observation


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
def test_reads_outside_the_directory_do_not_leak(tmp_path, layers):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-token-7f3a")
    code = f"for path in [{str(secret)!r}, '/etc/passwd']:\n    try:\n        print(open(path).read())\n    except OSError as e:\n        print('refused:', e)"
    result = run(code, layers)
    assert "the-secret-token-7f3a" not in result.observation and "root:" not in result.observation
    if layers == NAMESPACES:
        assert result.observation.count("No such file or directory") == 2
    else:  # /etc/passwd is world-readable: only the hook stops the audit-hook-only run
        assert result.observation.count("sandbox: reading outside the working directory") == 2


NETWORK = """import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2)
    print('CONNECTED')
except OSError as e:
    print('refused:', e)
try:
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    s.connect(('127.0.0.1', {port}))
    print('CONNECTED')
except OSError as e:
    print('refused:', e)
"""


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
def test_network_access_is_refused(layers):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        result = run(NETWORK.format(port=listener.getsockname()[1]), layers)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert "CONNECTED" not in result.observation
    if layers == ALL:
        assert result.observation.count("refused: sandbox: network access is not allowed") == 2
    elif layers == NAMESPACES:  # a network namespace whose only device, loopback, is down
        assert result.observation.count("refused: [Errno 101] Network is unreachable") == 2


@pytest.mark.parametrize("layers", [ALL, NAMESPACES, HOOK])
@pytest.mark.parametrize("call", ["os.kill(os.getppid(), 9)", "os.killpg(os.getpgid(os.getppid()), 9)"])
def test_signals_cannot_reach_the_parent(layers, call):
    result = run(f"import os\n{call}\nprint('after the signal')", layers)
    if layers == NAMESPACES:
        # The parent is the pid namespace's init, which ignores signals from inside; its process group as seen from
        # inside is 0, i.e. the program's own group, where outer processes are another uid: only the program dies.
        assert (result.status, result.observation) in [
            ("ok", "after the signal\n"),
            ("killed", "error: killed by signal SIGKILL"),
        ]
    else:
        assert result.status == "error" and result.observation.endswith(
            "PermissionError: sandbox: sending signals is not allowed"
        )


def test_the_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("FUSEDRL_TEST_SECRET", "env-secret-91c2")
    result = run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('FUSEDRL_TEST_SECRET'))")
    assert result.observation == "['HOME', 'LANG', 'PATH', 'TMPDIR']\nNone\n"


def test_without_namespaces_a_root_caller_runs_the_program_as_nobody():
    result = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", HOOK)
    expected = "65534 65534 []" if os.geteuid() == 0 else f"{os.getuid()} {os.getgid()}"
    assert result.status == "ok" and result.observation.startswith(expected)


def test_inside_namespaces_the_program_has_no_capabilities():
    result = run(
        "import os\nprint(os.getuid(), os.getpid())\ntry:\n    os.chroot('.')\nexcept OSError as e:\n    print(e)", NAMESPACES
    )
    assert result.observation == "0 2\n[Errno 1] Operation not permitted: '.'\n"


@pytest.mark.parametrize("layers", [ALL, HOOK])
def test_the_audit_hook_cannot_be_blinded_by_patching(tmp_path, layers):
    target = tmp_path / "escape.txt"
    code = f"""import os, sys
os.getcwd, os.fspath, os.lstat = (lambda *args: '/tmp',) * 3
vars(sys.modules['__main__']).update(WRITE=None, REFUSED_EVENTS={{}}, PATH_EVENTS={{}})
open({str(target)!r}, 'w').write('escaped')
"""
    result = run(code, layers)
    assert result.observation.endswith("PermissionError: sandbox: writing outside the working directory is not allowed")
    assert not target.exists()
    result = run("import gc\nprint(len(gc.get_objects()))", layers)
    assert result.observation.endswith("PermissionError: sandbox: inspecting the garbage collector is not allowed")


def test_the_command_prints_the_observation_and_exits_0():
    command = [sys.executable, "-m", "fusedrl.envs.sandbox", "--timeout-s", "5", "--memory-mb", "128"]
    done = subprocess.run(command, input="print('hello')\nraise SystemExit(3)\n", capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "error: exit status 3\nhello\n")
    done = subprocess.run([*command[:3], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--memory-mb" in done.stdout
