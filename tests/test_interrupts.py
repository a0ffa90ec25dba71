"""SIGINT / SIGTERM stop `simtree plan` and `simtree run` with one line each, the exit code
128 + the signal, nothing half-written: a run's staged traces are removed, a plan's folder says
it is partial (PARTIAL.md: which plan folders finished) until a finished plan removes it."""
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from simtree.cli.interrupt import Interrupted, stop_on_signals

PLAN = ["plan", "--batch-sizes", "1,2", "--band-models", "0", "--workload", "gsm8k"]


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "simtree", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _interrupted_line(stderr: str, sig: signal.Signals) -> str:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted ({sig.name}): "), stderr
    return last


def test_plan_stopped_between_deployments_marks_its_folder_partial(tmp_path):
    out = tmp_path / "plan"
    proc = _start(*PLAN, "--out", out)
    lines = []
    for line in proc.stderr:   # piped stderr: progress lines, one as each plan folder starts
        lines.append(line)
        if "(2 of " in line:
            proc.send_signal(signal.SIGTERM)
            break
    else:
        pytest.fail(f"no progress line for the second plan folder: {''.join(lines)}")
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM
    last = _interrupted_line("".join(lines) + rest, signal.SIGTERM)
    count = int(lines[-1].split("(2 of ")[1].split(")")[0])   # the shipped deployments
    assert f"plan stopped with 1 of {count} plan folders finished" in last and "PARTIAL.md" in last, last
    assert lines[0].startswith("plan: planning ") and lines[0].rstrip().endswith("s)") and f"(1 of {count})" in lines[0]
    marker = (out / "PARTIAL.md").read_text()
    assert marker.count(": finished") == 1 and marker.count("not finished") == count - 1, marker
    finished = next(line.split("`")[1] for line in marker.splitlines() if line.endswith(": finished"))
    assert (out / finished / "plan.md").is_file() and (out / finished / "policy.json").is_file()
    assert "partial: interrupted" in (out / "plans.md").read_text()
    assert not list(out.rglob("*.tmp"))


def test_plan_interrupted_in_process_then_finished_clears_the_marker(tmp_path):
    from simtree.cli.plan import plan_and_write
    from simtree.planning.bundles import PARTIAL_MARKER

    def stop_at_second(folder, index, count):
        if index == 1:
            raise KeyboardInterrupt

    kwargs = dict(workload_specs=["gsm8k"], batch_sizes=[1], out_dir=str(tmp_path), band_models=0,
                  model="qwen3.6-27b")   # its two shipped deployments: two plan folders
    with pytest.raises(KeyboardInterrupt):
        plan_and_write(**kwargs, started=stop_at_second)
    marker = (tmp_path / PARTIAL_MARKER).read_text()
    assert "interrupted after 1 of 2 plan folders" in marker and marker.count("not finished") == 1
    outputs = plan_and_write(**kwargs)
    assert len(outputs) == 2 and not (tmp_path / PARTIAL_MARKER).exists()
    assert "partial" not in (tmp_path / "plans.md").read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_stopped_leaves_no_staged_traces(tmp_path, sig):
    out = tmp_path / "run"
    proc = _start("run", "--mode", "linear", "--budget", "3", "--batch-size", "1", "--max-new-tokens", "2000",
                  "--out", out)
    deadline = time.monotonic() + 120
    while not list(out.glob(".traces.jsonl.*.partial")):   # decoding has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    last = _interrupted_line(stderr, sig)
    assert "run stopped after" in last and "of 2000 tokens" in last and "rerun the same command" in last, last
    assert not out.exists(), list(out.iterdir())   # the folder it made, left empty, is gone
    assert stdout == ""


def test_a_signal_whose_exception_python_drops_is_raised_at_the_next_check(monkeypatch):
    """A signal that arrives while a weakref callback runs (as in garbage collection or a lazy
    import's caches) raises there, and Python drops that exception; the block goes on, and
    ``check`` (a command's progress callback) raises it.  The dropped Interrupted is not
    reported ("Exception ignored" and a traceback); any other dropped exception still is."""
    class Node:
        pass

    def interrupt(ref):
        os.kill(os.getpid(), signal.SIGINT)    # the handler runs in this frame
        sum(range(100))

    def fail(ref):
        raise ValueError("another")

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    handler, reached = signal.getsignal(signal.SIGINT), False
    with pytest.raises(Interrupted) as exc:
        with stop_on_signals() as stop:
            nodes = [Node(), Node()]
            refs = [weakref.ref(nodes[0], interrupt), weakref.ref(nodes[1], fail)]
            del nodes                          # the callbacks run here; what they raise is dropped
            reached = True
            stop.check()
    assert reached and refs[0]() is None and exc.value.exit_code == 128 + signal.SIGINT
    assert [type(r.exc_value) for r in reported] == [ValueError]
    assert sys.unraisablehook == reported.append and signal.getsignal(signal.SIGINT) == handler


def test_a_full_scale_run_checks_for_a_dropped_signal_at_each_progress_line(monkeypatch):
    """``simtree run --model``: a signal whose exception Python dropped stops the runs at the next
    progress line (the block's check is the progress callback's first step)."""
    from simtree.cli import run as run_cli
    from simtree.runtime.full import measure
    lines = []
    monkeypatch.setattr(run_cli, "_rank_model", lambda *a: "model")
    monkeypatch.setattr(measure, "full_run", lambda *a, progress, **k: [progress(f"run {i}") or lines.append(i)
                                                                        for i in range(3)])
    with stop_on_signals() as stop:
        stop.signum = signal.SIGINT                       # as the handler records it when its raise is dropped
        with pytest.raises(Interrupted) as exc:
            run_cli._full_scale("m", "cpu", None, None, "1", None, None, None, None, None, None, True,
                                check=stop.check)
    assert exc.value.signal_name == "SIGINT" and exc.value.exit_code == 130 and lines == []


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (Linux /proc; Python sets none by itself)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's handlers from /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_command_without_its_own_handling_says_it_was_interrupted(sig):
    """simulate (and bench-serve, fit, ...) stopped by a signal: typer turned Ctrl-C into exit 130
    without a word, and SIGTERM ended Python at once, also without one."""
    proc = _start("simulate", "--model", "qwen3.6-27b", "--monte-carlo", "2000000")
    try:
        deadline = time.monotonic() + 120
        while not _catches_sigterm(proc.pid) and time.monotonic() < deadline:   # the CLI's handlers are set
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig
    assert _interrupted_line(stderr, sig) == f"interrupted ({sig.name}): simtree simulate stopped before it finished"


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's children from /proc")
@pytest.mark.parametrize("whom", ["parent", "group"])
def test_bench_serve_stopped_while_its_seeds_run_says_one_line_and_does_not_wait(tmp_path, whom):
    """bench-serve with out-of-sample seeds serves them in worker processes: a SIGTERM to the
    parent alone used to wait for every seed to finish (minutes) before exiting, and one to the
    whole process group printed a traceback from each worker beside the one line."""
    pytest.importorskip("sglang")      # bench-serve refuses before any worker without SGLang's policies
    proc = subprocess.Popen([sys.executable, "-m", "simtree", "bench-serve", "--requests", "300",
                             "--out-of-sample", "1", "--out", str(tmp_path / "b")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:   # the seeds' workers run
            time.sleep(0.1)
        assert len(_children(proc.pid)) >= 2, "bench-serve started no worker processes"
        time.sleep(1.0)
        t0 = time.monotonic()
        if whom == "parent":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    assert proc.returncode == 128 + signal.SIGTERM
    assert _interrupted_line(stderr, signal.SIGTERM) == \
        "interrupted (SIGTERM): simtree bench-serve stopped before it finished"
    assert not (tmp_path / "b" / "bench.csv").exists()
