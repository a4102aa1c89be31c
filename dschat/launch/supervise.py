"""Running one step's processes: the output copied byte for byte to the console and the step's
log, and, when the step fails, which rank failed first."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

# train.py's log of a step that has not begun its outputs yet, beside an earlier run's (training.log ->
# training.attempt.log), and the variable that tells the step where it is
ATTEMPT_SUFFIX = ".attempt.log"
PENDING_LOG_ENV = "DSCHAT_PENDING_LOG"


class RankWatch:
    """Which rank failed first, for the error line of a failed step.

    The DeepSpeed launcher logs ``process PID spawned with command: [... '--local_rank=R' ...]`` per
    rank and stops every rank when one exits non-zero, but does not say which one did: a thread polls
    those processes and remembers the first to end. torchrun's own failure report names the rank
    (``Root Cause ... rank : R``) and is read from the output. ``local=False`` (the DeepSpeed runner on
    other nodes): the spawn lines come back through pdsh with the pids of other machines, which polled
    here would look ended at once and name a rank that never failed, so none is watched (this node's
    own ranks neither: the error line then names no rank).
    """

    SPAWN = re.compile(rb"process (\d+) spawned with command: \[.*?'--local_rank=(\d+)'")
    ROOT_CAUSE = re.compile(
        rb"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S
    )

    def __init__(self, local: bool = True) -> None:
        self.local = local
        self.pids: dict[int, int] = {}  # pid -> local rank
        self.together: list[tuple[int, int]] = []  # every (rank, pid) seen ended in the first such poll
        self.codes: dict[int, int | None] = {}  # pid -> exit code of a rank seen ended (None: not read)
        self.tail = b""
        self._stop = threading.Event()
        self._thread = None
        if local:  # no pids to watch otherwise (see above): no thread
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def feed(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-65536:]
        for m in self.SPAWN.finditer(chunk) if self.local else ():
            self.pids[int(m[1])] = int(m[2])

    @property
    def first(self) -> tuple[int, int] | None:
        """(rank, pid) of the first rank seen ended (the lowest, if several were seen in the same poll)."""
        return self.together[0] if self.together else None

    @property
    def first_exit_code(self) -> int | None:
        """The exit code of the one rank seen ended first (``-N``: killed by signal N), where it was read;
        None where several ended in the same poll or the code was not readable (see ``exit_code``)."""
        if len(self.together) != 1:
            return None
        return self.codes.get(self.together[0][1])

    def _poll(self) -> None:
        import psutil

        while self.first is None and not self._stop.wait(0.02):
            ended = []
            for pid, rank in list(self.pids.items()):
                try:
                    gone = psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                except psutil.NoSuchProcess:
                    gone = True
                if not gone:
                    continue
                code = exit_code(pid)  # before the launcher reaps it: it polls once a second
                if code == 0:  # it finished: the failure, if any, is another rank's
                    del self.pids[pid]
                    continue
                self.codes[pid] = code
                ended.append((rank, pid))
            # Ranks seen ended in the same poll are not ordered (a rank's crash makes its peers' collectives
            # fail within milliseconds): name them all rather than guess, lowest rank first.
            self.together = sorted(ended)

    def _name(self, rank: int, pid: int) -> str:
        """``1 (pid 4242, exit code 13)``, ``1 (pid 4242, killed by SIGKILL)``, or ``1 (pid 4242)``."""
        code = self.codes.get(pid)
        if code is None:
            return f"{rank} (pid {pid})"
        if code >= 0:
            how = f"exit code {code}"
        else:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal has no name
                how = f"killed by signal {-code}"
        return f"{rank} (pid {pid}, {how})"

    def report(self) -> str:
        """The error line's account of the failed rank(s); stops the watch first, so that what it reports
        and :attr:`first_exit_code` describe the same poll."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        m = self.ROOT_CAUSE.search(self.tail)
        if m:
            return f"torchrun on this node reports rank {int(m[1])} failed first (exit code {int(m[2])})"
        if len(self.together) > 1:
            names = ", ".join(self._name(*ended) for ended in self.together)
            return (
                f"ranks {names} ended within 20 ms of each other; the launcher then stopped the other ranks"
            )
        if self.first is not None:
            return f"rank {self._name(*self.first)} ended first; the launcher then stopped the other ranks"
        return ""


def exit_code(pid: int) -> int | None:
    """The exit code of process ``pid`` that has ended but not yet been reaped (a zombie), as
    ``Popen.returncode`` gives it (``-N``: killed by signal N), read from ``/proc/PID/stat`` (field 52,
    Linux 3.5+). The launcher, not us, is the ranks' parent, so waiting is not possible; None where the
    process is gone (reaped) or the file is not readable (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # from field 3 on: the name in (...) may hold spaces
    try:
        return os.waitstatus_to_exitcode(int(fields[49]))
    except (IndexError, ValueError):  # an older kernel, or a status that is no exit
        return None


def run_step(
    cmd: list[str], log_path: Path, append: bool, env: dict | None = None, remote: bool = False
) -> tuple[int, str]:
    """Run ``cmd``, copying its output byte for byte to the console and ``log_path``; returns the exit
    code and, on failure, which rank failed first (if known). ``remote``: the DeepSpeed runner starts
    ranks on other nodes, which inherit nothing of this environment: the variables a step reads travel
    in a private ``DS_ENV_FILE`` (the user's ``.deepspeed_env`` merged in), removed afterwards."""
    import tempfile

    from dschat.launch.launcher import deepspeed_env_lines

    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DSCHAT_LOG_CAPTURED": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # An earlier run's log is replaced only once the step's outputs begin (its flags and inputs checked,
    # dschat.step_setup.begin_outputs): until then this attempt writes beside it.
    attempt: Path | None = attempt_log(log_path)
    if append or not log_path.exists():  # this run writes log_path itself: an older attempt's file is stale
        attempt.unlink(missing_ok=True)
        attempt = None
    else:
        env[PENDING_LOG_ENV] = str(attempt)
    if not remote:
        return _run(cmd, attempt or log_path, append, env, local=True)
    with tempfile.TemporaryDirectory(prefix="dschat-env-") as private:  # mode 0700: it may hold HF_TOKEN
        env_file = Path(private) / "deepspeed_env"
        env_file.write_text("".join(x + "\n" for x in deepspeed_env_lines(env, Path.home(), Path.cwd())))
        env["DS_ENV_FILE"] = str(env_file)  # absolute: the runner's join with ~ and . keeps it
        return _run(cmd, attempt or log_path, append, env, local=False)


def attempt_log(log_path: Path) -> Path:
    """``training.log`` -> ``training.attempt.log``: where a step writes beside an earlier run's log."""
    return log_path.with_name(log_path.stem + ATTEMPT_SUFFIX)


def step_log(log_path: Path) -> str:
    """Where the step run last wrote its output: ``log_path``, or beside it where the step stopped before
    its outputs began (:func:`run_step` then leaves the earlier run's log as it was)."""
    attempt = attempt_log(log_path)
    if attempt.exists():
        return f"{attempt} ({log_path.name} keeps the earlier run's)"
    return str(log_path)


def adopt_pending_log() -> None:
    """Where train.py writes this step's output beside an earlier run's log (``--overwrite``, a failed
    run's directory), make it the step's training.log: called once the step's outputs begin. The file
    stays open in train.py, which goes on writing to it under its new name."""
    pending = os.environ.get(PENDING_LOG_ENV)
    if pending and pending.endswith(ATTEMPT_SUFFIX):
        # the DeepSpeed runner passes node 0's path to every node: elsewhere it is not there (or, on a shared
        # file system, node 0's local rank 0 may have moved it already)
        with contextlib.suppress(FileNotFoundError):
            os.replace(pending, pending.removesuffix(ATTEMPT_SUFFIX) + ".log")


def _run(cmd: list[str], log_path: Path, append: bool, env: dict, local: bool) -> tuple[int, str]:
    watch = RankWatch(local)
    with open(log_path, "ab" if append else "wb") as log, _terminate_as_interrupt():
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        # The user's working directory: relative --output-dir and data paths mean the same to every step.
        # A session of its own: stopping train.py stops the launcher *and* its ranks (the DeepSpeed
        # runner forwards no signal on one node, and its ranks kept training after train.py had gone).
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,
        )
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                log.write(chunk)
                watch.feed(chunk)
            code = proc.wait()
            if code == 0:
                return 0, ""
            # The DeepSpeed launcher exits with the code of the first failed rank *it* sees, polling once a
            # second in set order: often a peer whose collective failed after the rank that died.
            failed = watch.report()
            return watch.first_exit_code or code, failed
        except KeyboardInterrupt:
            stop_group(proc.pid)
            proc.wait()
            raise


STOP_GRACE_SECONDS = 10.0


def stop_group(pgid: int, grace: float | None = None) -> None:
    """Stop every process of group ``pgid``: SIGINT (a rank's Ctrl-C, so it can clean up), then SIGTERM,
    then SIGKILL, each after ``grace`` seconds (:data:`STOP_GRACE_SECONDS`) in which some process of the
    group is still alive. A second Ctrl-C (or SIGTERM, SIGHUP) meanwhile is ignored: raised in here, it
    ended the escalation before SIGTERM, and a rank blocked in a collective, deaf to SIGINT, trained on."""
    grace = STOP_GRACE_SECONDS if grace is None else grace
    with _signals_ignored():
        _escalate(pgid, grace)


@contextlib.contextmanager
def _signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _escalate(pgid: int, grace: float) -> None:
    import time

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return  # the group is empty
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-pgid, os.WNOHANG)  # reap our own child, or it stays in the group as a zombie
            time.sleep(0.05)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (``kill``, ``timeout``, a scheduler) and SIGHUP stop the step like Ctrl-C does, instead of
    ending train.py at once and leaving the step's processes running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGHUP too: a dropped ssh session hangs up train.py, whose ranks run in a session of their own. A
    # signal already ignored stays ignored (nohup ignores SIGHUP: such a run must outlive the session).
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(s) is not signal.SIG_IGN}  # fmt: skip
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
