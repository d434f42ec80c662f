"""Start the processes of multi-process tests forked from a server that has imported the heavy modules.

A fresh interpreter per rank imports torch, ckpt_integration, Lightning or Megatron-Core again:
3 to 10 s of CPU per process, which was most of the suite's time on 2 cores. multiprocessing's
``forkserver`` imports them once (:data:`PRELOAD`, in a process of its own that never runs a test)
and forks every rank from there, so a rank starts in milliseconds with the same modules, freshly
imported and unused. Each rank is still a real, separate process (own gloo connections, own
session for the kill tests, SIGKILL-able), started with the test process's current environment,
working directory and ``sys.path``.

* :func:`context` is the multiprocessing context ``run_distributed`` starts ranks with.
* :func:`start_script` runs ``python script args...`` that way (``tests.proc_launch.launch``), and
  :func:`run` is ``subprocess.run(capture_output=True, text=True)`` for ``python script | -m module
  | -c code``: the code runs as ``__main__`` with ``sys.argv``, ``sys.path[0]``, the environment, the
  working directory and stdout/stderr as a new interpreter would have them, in a session of its
  own, and ends like one: non-daemon threads are joined, then ``atexit`` handlers run
  (multiprocessing children skip those), and the return code is the exit status (``-9`` when it
  SIGKILLed itself). Where the process itself is under test (resource limits, a closed stdout,
  interpreter start-up), tests keep ``subprocess``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import multiprocessing as mp

# Imported once, by the fork server (tests/rank_preload.py lists them; an import error there only
# means that module is imported by the rank that needs it, as before).
PRELOAD = ["tests.rank_preload"]
_ctx = None


def context():
    """The ``forkserver`` context with :data:`PRELOAD` (the server starts at the first process)."""
    global _ctx
    if _ctx is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ctx = ctx
    return _ctx


def adopt_environment(env: dict) -> None:
    """Make ``os.environ`` exactly ``env`` (the fork server's own environment is the one it started with).

    A module that reads a variable once, at import, would keep the fork server's value: such
    settings are read again here (fsspec's config). ckpt_integration reads its variables when
    they are used, except ``CKPT_READ_ONCE_POPULATE`` (no test sets it).
    """
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)
    # settings a preloaded module read from the environment when it was imported, read again as a
    # fresh import would: fsspec's config (``FSSPEC_S3`` points s3fs at the tests' moto server)
    cfg = sys.modules.get("fsspec.config")
    if cfg is not None:
        cfg.conf.clear()  # the same dict: fsspec's modules hold it
        cfg.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", cfg.default_conf_dir)
        cfg.set_conf_files(cfg.conf_dir, cfg.conf)
        cfg.set_conf_env(cfg.conf)


def adopt_output(parent_pid: int) -> None:
    """Write stdout/stderr where the test process's go now (pytest's capture of the running test),
    as a child started by the test would; the fork server's are those of the test it started in."""
    for fd in (1, 2):
        try:
            f = os.open(f"/proc/{parent_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # not Linux, or gone: keep the fork server's
            continue
        os.dup2(f, fd)
        os.close(f)


class ScriptProcess:
    """A ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``,
    ``terminate``, ``kill``) of a forked script."""

    def __init__(self, proc) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.args = proc.name

    @property
    def returncode(self):
        return self._proc.exitcode

    def poll(self):
        return self._proc.exitcode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, sig) -> None:
        if self._proc.exitcode is None:  # as Popen: no signal to a process already reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_script(script: str, args, env: dict, log: str, cwd: str) -> ScriptProcess:
    """``python script *args`` with ``env``, in ``cwd``, in a session of its own, output to ``log``."""
    script = os.path.abspath(script)
    return _start(("path", script), list(args), env, log, log, cwd,
                  f"{os.path.basename(script)} {' '.join(map(str, args))[:80]}")


def run(argv, env=None, cwd=None, timeout=None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for ``argv`` = ``[sys.executable,
    script | -m module | -c code, *args]``, forked instead of a new interpreter (same return code, output
    and ``subprocess.TimeoutExpired``; the process and what it started are killed at the timeout)."""
    import tempfile

    argv = [str(a) for a in argv]
    if argv[0] != sys.executable:
        raise ValueError(f"not a Python command line: {argv[:3]}")
    rest = [a for a in argv[1:] if a != "-u"]  # output is line-buffered anyway
    if rest[0] == "-m":
        target, args = ("module", rest[1]), rest[2:]
    elif rest[0] == "-c":
        target, args = ("code", rest[1]), rest[2:]
    elif rest[0].startswith("-"):
        raise ValueError(f"interpreter option {rest[0]!r} is not supported")
    else:
        target, args = ("path", os.path.abspath(os.path.join(cwd or os.getcwd(), rest[0]))), rest[1:]
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        p = _start(target, args, dict(os.environ if env is None else env), out, err, cwd or os.getcwd(),
                   " ".join(argv[1:3])[:80])
        try:
            p.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if p.poll() is None:
                kill(p)
                p.wait()

        def read(path):
            with open(path, errors="replace") as f:
                return f.read()

        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, read(out), read(err))
        return subprocess.CompletedProcess(argv, p.returncode, read(out), read(err))


def kill(p) -> None:
    """SIGKILL ``p``'s session (the process and anything it started), or ``p`` itself if it has none yet."""
    import signal

    for f in (os.killpg, os.kill):
        try:
            f(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _start(target, args, env, out, err, cwd, name) -> ScriptProcess:
    for path in {out, err}:
        open(path, "a").close()
    proc = context().Process(target=_main, args=(target, args, dict(env), out, err, cwd), name=name)
    proc.start()
    return ScriptProcess(proc)


def _main(target, args, env, out, err, cwd) -> None:  # in the forked process
    import atexit
    import runpy
    import threading
    import types

    os.setsid()  # its own session: the launcher kills it and whatever it started as one group
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    # line-buffered like PYTHONUNBUFFERED=1 for what matters: a rank that SIGKILLs itself keeps its log
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    adopt_environment(env)
    os.chdir(cwd)
    kind, what = target
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # what ``python`` puts first: the script's folder; the working directory for -m; "" for -c
    first = os.path.dirname(what) if kind == "path" else cwd if kind == "module" else ""
    sys.path[:] = [first, *extra, *[p for p in sys.path if p not in extra and p != first]]
    sys.argv = [what if kind == "path" else "-c" if kind == "code" else what, *map(str, args)]
    code = 0
    try:
        if kind == "path":
            runpy.run_path(what, run_name="__main__")
        elif kind == "module":
            sys.modules.pop(what, None)  # preloaded; ``python -m`` finds the package imported, not the module
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            sys.stderr.write(f"{e.code}\n")
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        # what the interpreter does at its end, which multiprocessing's os._exit would skip
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
