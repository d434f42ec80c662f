"""Start the processes of multi-process tests forked from a server that has imported the heavy modules.

A fresh interpreter per rank imports torch, ckpt_integration, Lightning or Megatron-Core again:
3 to 10 s of CPU per process, which was most of the suite's time on 2 cores. multiprocessing's
``forkserver`` imports them once (:data:`PRELOAD`, in a process of its own that never runs a test)
and forks every rank from there, so a rank starts in milliseconds with the same modules, freshly
imported and unused. Each rank is still a real, separate process (own gloo connections, own
session for the kill tests, SIGKILL-able), started with the test process's current environment,
working directory and ``sys.path``.

* :func:`context` is the multiprocessing context ``run_distributed`` starts ranks with.
* :func:`start_script` runs ``python script args...`` that way (``tests.proc_launch.launch``): the
  script runs as ``__main__`` with ``sys.argv``, ``sys.path[0]``, the environment and stdout/stderr
  redirected to a log as a new interpreter would have them, and ends like one: non-daemon
  threads are joined, then ``atexit`` handlers run (multiprocessing children skip those).
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


class ScriptProcess:
    """A ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``returncode``) of a forked script."""

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


def start_script(script: str, args, env: dict, log: str, cwd: str) -> ScriptProcess:
    """``python script *args`` with ``env``, in ``cwd``, in a session of its own, output to ``log``."""
    script = os.path.abspath(script)
    proc = context().Process(target=_run_script, args=(script, list(args), dict(env), log, cwd),
                             name=f"{os.path.basename(script)} {' '.join(map(str, args))[:80]}")
    proc.start()
    return ScriptProcess(proc)


def _run_script(script, args, env, log, cwd) -> None:  # in the forked process
    import atexit
    import runpy
    import threading

    os.setsid()  # its own session: the launcher kills it and whatever it started as one group
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # line-buffered like PYTHONUNBUFFERED=1 for what matters: a rank that SIGKILLs itself keeps its log
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    adopt_environment(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *[p for p in sys.path if p not in extra]]
    sys.argv = [script, *map(str, args)]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
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
