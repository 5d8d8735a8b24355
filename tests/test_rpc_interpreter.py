"""The Python process around live Rpcs: fork (children, ``os.fork``) and
subprocesses, interpreter exit with calls in flight or Python code still running
on a core thread, ``sys.exit`` in a function or callback, Ctrl-C during a call,
and the core's threads as the process sees them (their Python thread states when
the pool shrinks, a pool that grows with no descriptor left). Each scenario runs
in a fresh interpreter that must exit on its own, with code 0, before a generous
deadline."""

from __future__ import annotations

import pytest
from helpers.fresh_interpreter import run

pytestmark = pytest.mark.usefixtures("watchdog")

FORK_SCRIPT = """
parent = moolib.Rpc()
parent.set_name("parent")
address = parent.listen("127.0.0.1:0")
parent.define("add", lambda a, b: a + b)
parent.define("tensor", lambda n: torch.arange(n))
user = moolib.Rpc()
user.set_timeout(60)
user.connect(address)
check(user.sync("parent", "add", 1, 1) == 2, "call before fork")

# Calls keep flowing on other threads while the process forks.
stop = threading.Event()
errors = []
def background():
    i = 0
    while not stop.is_set():
        try:
            if user.sync("parent", "add", i, 1) != i + 1:
                errors.append("wrong result")
        except Exception as e:
            errors.append(repr(e))
        i += 1
busy = threading.Thread(target=background)
busy.start()

def child_talks(addr):
    # The inherited Rpcs belong to the parent: using them fails cleanly.
    try:
        user.sync("parent", "add", 1, 2)
        os._exit(3)
    except RuntimeError as e:
        if "fork" not in str(e):
            os._exit(4)
    rpc = moolib.Rpc()
    rpc.set_timeout(60)
    rpc.connect(addr)
    if rpc.sync("parent", "add", 20, 22) != 42:
        os._exit(5)
    if not torch.equal(rpc.sync("parent", "tensor", 100000), torch.arange(100000)):
        os._exit(6)
    mine = moolib.Rpc()
    mine.define("f", lambda: "child")
    if mine.sync(mine.get_name(), "f") != "child":
        os._exit(7)
    rpc.close()

def child_exits():
    pass

def child_collects():
    # Dropping the inherited Rpcs must not touch the parent's threads or loop.
    global parent, user
    del parent, user
    gc.collect()

ctx = mp.get_context("fork")
for target, args in [(child_talks, (address,)), (child_exits, ()), (child_collects, ()),
                     (child_talks, (address,))]:
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(90)
    check(p.exitcode == 0, f"{target.__name__} exit code {p.exitcode}")

# A bare os.fork() whose child exits through os._exit.
pid = os.fork()
if pid == 0:
    os._exit(0)
_, status = os.waitpid(pid, 0)
check(os.waitstatus_to_exitcode(status) == 0, "os.fork child")

check(subprocess.run(["true"], timeout=60).returncode == 0, "subprocess.run(['true'])")
rc = subprocess.run([sys.executable, "-c", "import moolib; moolib.Rpc()"], timeout=90).returncode
check(rc == 0, "python subprocess creating an Rpc")

stop.set()
busy.join(60)
check(not busy.is_alive(), "background caller finished")
check(not errors, f"background calls failed: {errors[:3]}")
check(user.sync("parent", "add", 3, 4) == 7, "call after the forks")
fresh = moolib.Rpc()
fresh.connect(address)
check(fresh.sync("parent", "add", 5, 5) == 10, "new Rpc after the forks")
print("FORK-OK", flush=True)
"""


def assert_exited_cleanly(proc):
    """The script reached its end and the interpreter exited with code 0."""
    assert "EXITING" in proc.stdout
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_fork_children_and_subprocess(tmp_path):
    proc = run(tmp_path, FORK_SCRIPT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "FORK-OK" in proc.stdout


def test_interpreter_exit_with_calls_in_flight(tmp_path):
    proc = run(
        tmp_path,
        """
        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")
        release = threading.Event()
        kept = []
        server.define("block", lambda: release.wait(600))
        server.define_deferred("never", lambda cb: kept.append(cb))
        queue = server.define_queue("queued")
        server.define("big", lambda n: torch.ones(n))
        clients = []
        futures = []
        for transports in (None, ["shm"], ["tcp"]):
            c = moolib.Rpc()
            if transports:
                c.set_transports(transports)
            c.set_timeout(600)
            c.connect(address)
            check(c.sync("server", "big", 10).sum().item() == 10, "warm-up call")
            clients.append(c)
        # Blocked functions hold pool threads, so the warm-up calls come first.
        for c in clients:
            futures += [c.async_("server", "block") for _ in range(3)]
            futures += [c.async_("server", "never") for _ in range(3)]
            futures += [c.async_("server", "queued", i) for i in range(3)]
            futures += [c.async_("server", "big", 1 << 20) for _ in range(3)]
            c.async_callback("server", "block", lambda r, e: None)
        # A Python thread blocked in sync() at exit, too.
        threading.Thread(target=lambda: clients[0].sync("server", "block"), daemon=True).start()
        time.sleep(1.0)
        check(not futures[0].done(), "blocking call still in flight")
        print("EXITING", flush=True)
        """,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "EXITING" in proc.stdout


def test_interpreter_exit_with_calls_to_another_process(tmp_path, spawn_peer):
    peer = spawn_peer("exit-target")
    proc = run(
        tmp_path,
        f"""
        rpc = moolib.Rpc()
        rpc.set_timeout(600)
        rpc.connect({peer.address!r})
        check(rpc.sync("exit-target", "add", 1, 2) == 3, "warm-up call")
        futures = [rpc.async_("exit-target", "sleep", 300) for _ in range(4)]
        futures += [rpc.async_("exit-target", "echo", torch.ones(1 << 22)) for _ in range(4)]
        time.sleep(0.5)
        print("EXITING", flush=True)
        """,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "EXITING" in proc.stdout
    assert peer.alive()  # the peer survives its caller leaving


def test_sys_exit_from_a_callback_thread(tmp_path):
    # SystemExit inside a function is reported to the caller; the process goes
    # on and later exits normally with code 0.
    proc = run(
        tmp_path,
        """
        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")
        server.define("leave", lambda: sys.exit(5))
        client = moolib.Rpc()
        client.set_timeout(60)
        client.connect(address)
        got = []
        done = threading.Event()
        def callback(result, error):
            got.append(error)
            done.set()
            sys.exit(6)  # raised on a core thread: must not kill the process
        client.async_callback("server", "leave", callback)
        check(done.wait(60), "callback ran")
        check(got[0] is not None and "SystemExit" in str(got[0]), f"error reported: {got}")
        server.define("ok", lambda: "ok")
        check(client.sync("server", "ok") == "ok", "still working")
        print("EXIT-OK", flush=True)
        """,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "EXIT-OK" in proc.stdout


def test_exit_while_a_function_runs_python_code(tmp_path):
    """Regression: exit aborted (SIGABRT/SIGSEGV, 'Fatal Python error: PyEval_SaveThread')
    when Python ended a core thread still running Python code with a forced unwind."""
    proc = run(
        tmp_path,
        """
        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")

        def naps():  # Python code that keeps dropping and retaking the GIL
            for _ in range(2000):
                time.sleep(0.01)
            return "rested"

        def spin():  # pure Python computation
            end = time.monotonic() + 20
            n = 0
            while time.monotonic() < end:
                n += 1
            return n

        server.define("naps", naps)
        server.define("spin", spin)
        client = moolib.Rpc()
        client.set_timeout(600)
        client.connect(address)
        futures = [client.async_("server", "naps"), client.async_("server", "spin")]
        time.sleep(0.5)
        check(not any(f.done() for f in futures), "functions still running")
        print("EXITING", flush=True)
        """,
    )
    assert_exited_cleanly(proc)


def test_exit_while_a_callback_runs_python_code(tmp_path):
    """Regression: as above, for an async_callback callback still running at exit."""
    proc = run(
        tmp_path,
        """
        rpc = moolib.Rpc()
        rpc.set_name("me")
        rpc.define("one", lambda: 1)
        started = threading.Event()

        def callback(result, error):
            started.set()
            for _ in range(2000):
                time.sleep(0.01)

        rpc.async_callback("me", "one", callback)
        check(started.wait(60), "callback started")
        print("EXITING", flush=True)
        """,
    )
    assert_exited_cleanly(proc)


def test_ctrl_c_interrupts_a_waiting_call(tmp_path):
    """Regression: SIGINT was only honoured once the call had timed out."""
    proc = run(
        tmp_path,
        """
        import signal
        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")
        release = threading.Event()
        server.define("block", lambda: release.wait(60))
        client = moolib.Rpc()
        client.set_timeout(5)
        client.connect(address)
        server.define("ping", lambda: "pong")
        check(client.sync("server", "ping") == "pong", "warm-up call")
        threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        outcome = None
        try:
            try:
                client.sync("server", "block")
                outcome = "returned"
            except RuntimeError:
                outcome = "timed-out"
                time.sleep(0.5)  # a signal held back until now lands here
        except KeyboardInterrupt:
            outcome = outcome or "interrupted"
        print(f"OUTCOME {outcome} {time.monotonic() - start:.1f}", flush=True)
        release.set()
        """,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    # KeyboardInterrupt while waiting: a signal held back until the 5 s call
    # timeout would land in the sleep after it and leave "timed-out".
    outcome = proc.stdout.split("OUTCOME ")[1].split()[0]
    assert outcome == "interrupted", proc.stdout


def test_threads_a_smaller_pool_ends_free_their_python_thread_states(tmp_path):
    """Regression: core threads ended by set_max_threads kept their Python
    thread state forever (one leaked per thread)."""
    proc = run(
        tmp_path,
        """
        import ctypes
        api = ctypes.pythonapi  # called with the GIL held
        api.PyInterpreterState_Main.restype = ctypes.c_void_p
        api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
        api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
        api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
        api.PyThreadState_Next.restype = ctypes.c_void_p

        def thread_states():
            n, t = 0, api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Main())
            while t:
                n, t = n + 1, api.PyThreadState_Next(t)
            return n

        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")
        server.define("nap", lambda: time.sleep(0.05) or threading.get_ident())
        client = moolib.Rpc()
        client.set_timeout(60)
        client.connect(address)
        # Calls that overlap run Python on many of the pool's threads.
        idents = set()
        for _ in range(10):
            idents |= {f.result() for f in [client.async_("server", "nap") for _ in range(32)]}
        before = thread_states()
        print("python threads", len(idents), "thread states", before, flush=True)
        check(len(idents) >= 4, f"only {len(idents)} core threads ran Python")
        moolib.set_max_threads(1)
        deadline = time.monotonic() + 60
        # Ended threads go once they wake up: calls wake them.
        while thread_states() > before - (len(idents) - 2) and time.monotonic() < deadline:
            [f.result() for f in [client.async_("server", "nap") for _ in range(8)]]
        after = thread_states()
        print("after the pool shrank: thread states", after, flush=True)
        check(after <= before - (len(idents) - 2), f"{before} thread states, then {after}")
        check(client.sync("server", "nap"), "calls still work")
        """,
        env={"MOOLIB_MAX_THREADS": "8"},  # from the start: a pool shrunk later still serves
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_pool_grows_while_no_descriptor_is_left(tmp_path):
    """Regression: a core thread that could not open its eventfd (descriptors
    exhausted, e.g. by a flood of connections) threw out of the thread and
    ended the process. It now waits for a descriptor; the pool serves meanwhile."""
    proc = run(
        tmp_path,
        """
        import resource
        moolib.set_log_level("info")
        server = moolib.Rpc()
        server.set_name("server")
        address = server.listen("127.0.0.1:0")
        server.define("ident", threading.get_ident)
        client = moolib.Rpc()
        client.set_timeout(60)
        client.connect(address)
        check(client.sync("server", "ident"), "a call before")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        spare = []
        try:  # use up every descriptor
            while True:
                spare.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        moolib.set_max_threads(6)  # four workers cannot open their eventfd
        print("set_max_threads returned", flush=True)
        for fd in spare:
            os.close(fd)
        idents = set()
        deadline = time.monotonic() + 60
        while len(idents) < 3 and time.monotonic() < deadline:
            futures = [client.async_("server", "ident") for _ in range(16)]
            idents |= {f.result() for f in futures}
        print("threads that served", len(idents), flush=True)
        check(len(idents) >= 3, f"only {len(idents)} threads served calls")
        """,
        env={"MOOLIB_MAX_THREADS": "2"},  # the pool starts small, before the Rpcs
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "it starts once a descriptor is free" in proc.stdout
    assert "got its descriptor and starts" in proc.stdout
