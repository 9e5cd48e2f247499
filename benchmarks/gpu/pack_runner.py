"""`pack.py run`: install the wheelhouse with no index, record the machine, run the steps, write the results.

Standard library only: this runs on a bare GPU host before anything is installed. Every command runs in its own
process group under a time limit (SIGTERM, then SIGKILL to the group), with its output echoed and its tail kept.
A step is a function that runs commands through `StepRun.run`; what one returns, or how it fails, is recorded
and the next step starts regardless. The results folder is flat and small (it comes back from a remote machine
as at most 8 files): env.json, one <step>.json per step (written as `running` when it starts, so a killed call
shows), and summary.md, rebuilt after every step from all the step files there, so calls accumulate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOG_TAIL_CHARS = 3000
MIN_COMMAND_S = 5.0     # a command is not started with less time left than this
STOP_GRACE_S = 10.0     # a command past its limit: SIGTERM, then SIGKILL after this (a Command may set more)
MIN_STEP_S = 20.0       # nor a step
STATUSES = ("ok", "failed", "timeout", "skipped", "not run", "running")
# Device memory bandwidth by GPU name (first match), bytes/s, for the TPOT roofline.
BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
             ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12))


def help_formatters() -> tuple:
    """(DefaultsFormatter, RawDescriptionDefaultsFormatter): every option's --help says its default, as infer.py's do
    (benchmarks/results_file.py's, standard library only)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import results_file
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return results_file.DefaultsFormatter, results_file.RawDescriptionDefaultsFormatter


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def bandwidth_of(gpu_name: Optional[str]) -> Optional[float]:
    """Memory bandwidth of a GPU by its name (nvidia-smi's or jax's device_kind), or None if unknown."""
    for key, value in BANDWIDTH:
        if gpu_name and key.lower() in gpu_name.lower():
            return value
    return None


@dataclass(frozen=True)
class Command:
    """One process of a step. `output`: a JSON file it writes, kept as the record's result; `parse`: its output
    text -> result instead. A missing `script` (relative to the repo) skips it as not built yet."""
    label: str
    argv: tuple
    limit_s: float
    output: Optional[Path] = None
    parse: Optional[Callable[[str], object]] = None
    script: Optional[str] = None
    skip: Optional[str] = None
    env: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)   # kept in the record as it is (e.g. a memory estimate)
    stop_grace_s: float = STOP_GRACE_S         # at its limit: SIGTERM, this long to stop, then SIGKILL


@dataclass
class Context:
    """What the steps need to know: the mode, where to work, and what was learnt of the machine."""
    smoke: bool
    python: str
    repo: Path
    tmp: Path = Path(tempfile.gettempdir())
    env: dict = field(default_factory=dict)          # the children's environment
    usable_memory: Optional[int] = None              # bytes a process may take on the device
    memory_bandwidth: Optional[float] = None         # bytes/s
    bench_points: Optional[tuple] = None             # ((prompt_len, batch), ...) to override the step's
    pytest_parts: tuple = ("mosaic", "pallas", "rest")  # the pytest step's commands (pack_steps.PYTEST_PARTS)
    serving_parts: tuple = ("offline",)              # benchmarks/serving.py --part, one command each
    distill_parts: tuple = ("8b", "1b", "dryrun")    # the distill step's commands (pack_steps.DISTILL_PARTS)
    tune_only: Optional[str] = None                  # tune_kernels.py --only (default: every point, in order)
    demo_attention: Optional[str] = None             # demo.py --attention (default: the gpu budget's own)
    kernel_points: dict = field(default_factory=dict)  # kernels.py --decode-points / --prefill-points ("BxS,...")
    kernel_parts: tuple = ("decode", "paged", "prefill")  # the kernels step's commands (pack_steps.KERNEL_PARTS)
    ends_at: Optional[float] = None                  # time.monotonic() by which the running step must end

    def seconds_left(self) -> Optional[float]:
        """What is left of the running step (its limit or the call's deadline, the sooner); None outside a step."""
        return None if self.ends_at is None else self.ends_at - time.monotonic()


@dataclass(frozen=True)
class Step:
    index: int
    name: str
    title: str
    limit_s: float          # on the GPU; smoke steps get their smoke_limit_s
    fn: Callable            # fn(ctx, run): calls run(Command) for each of its commands
    smoke_limit_s: float = 150.0


def _tail(text: str, n: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= n else "[...]" + text[-n:]


def run_process(argv, limit_s: float, cwd, env, echo: Callable[[str], None] = None,
                stop_grace_s: float = STOP_GRACE_S) -> tuple[str, Optional[int], str]:
    """(status, returncode, output tail): "ok", "failed" or "timeout" (the process group is then sent SIGTERM, and
    SIGKILL if it has not ended stop_grace_s later)."""
    proc = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            text=True, errors="replace", bufsize=1)
    tail = deque(maxlen=400)

    def read():
        for line in proc.stdout:
            tail.append(line)
            if echo:
                echo(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timeout"
        for sig, grace in ((signal.SIGTERM, stop_grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    return status, proc.returncode, _tail("".join(tail))


class StepRun:
    """Runs one step's commands within its time limit and the call's deadline, and keeps their records."""

    def __init__(self, step: Step, ctx: Context, deadline: float, echo=None, on_record=None):
        self.ctx, self.echo, self.on_record = ctx, echo, on_record
        limit = step.smoke_limit_s if ctx.smoke else step.limit_s
        self.end = min(time.monotonic() + limit, deadline)
        self.records: list[dict] = []

    def run(self, cmd: Command) -> dict:
        record = {"label": cmd.label, "argv": [str(a) for a in cmd.argv], **cmd.info}
        left = self.end - time.monotonic()
        if cmd.skip:
            record.update(status="skipped", reason=cmd.skip)
        elif cmd.script and not (self.ctx.repo / cmd.script).exists():
            record.update(status="skipped", reason=f"not built yet ({cmd.script} does not exist)")
        elif left - cmd.stop_grace_s < MIN_COMMAND_S:
            record.update(status="not run", reason="the step's time limit was reached")
        else:
            limit = min(cmd.limit_s, left - cmd.stop_grace_s)  # its stopping, too, ends by the deadline
            if self.echo:
                self.echo(f"--- {cmd.label}: {' '.join(record['argv'])} (limit {limit:.0f} s)\n")
            start = time.monotonic()
            status, rc, log = run_process(cmd.argv, limit, self.ctx.repo, {**self.ctx.env, **cmd.env}, self.echo,
                                          cmd.stop_grace_s)
            record.update(status=status, returncode=rc, seconds=round(time.monotonic() - start, 2),
                          limit_s=round(limit, 1), log_tail=log)
            if status == "timeout":
                record["reason"] = f"killed after {limit:.0f} s"
            try:
                if cmd.output is not None and Path(cmd.output).exists():
                    record["result"] = json.loads(Path(cmd.output).read_text())
                elif cmd.parse is not None:
                    record["result"] = cmd.parse(log)
            except Exception as e:  # noqa: BLE001 - an unreadable result fails a command that succeeded
                why = f"result unreadable: {type(e).__name__}: {e}"[:300]
                if status == "ok":
                    record.update(status="failed", reason=why)
                else:
                    record["result_error"] = why
        self.records.append(record)
        if self.on_record is not None:  # the step's file holds every command as it ends
            self.on_record(self.records)
        return record


def step_status(records: list[dict]) -> tuple[str, Optional[str]]:
    """A step's (status, reason) from its commands': failed > timeout > ok; all skipped is skipped."""
    statuses = [r["status"] for r in records]
    for status in ("failed", "timeout"):
        if status in statuses:
            first = next(r for r in records if r["status"] == status)
            return status, f"{first['label']}: {first.get('reason') or _last_line(first.get('log_tail', ''))}"
    if "not run" in statuses:
        return "timeout", "the step's time limit was reached before all its commands ran"
    if statuses and all(s == "skipped" for s in statuses):
        return "skipped", records[0].get("reason")
    return ("ok", None) if statuses else ("failed", "no command ran")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_step(step: Step, ctx: Context, deadline: float, echo=None, inject_failure: bool = False,
             on_record=None) -> dict:
    """Run one step and return its record (never raises). on_record(records so far) after each command."""
    started, start = now(), time.monotonic()
    runner = StepRun(step, ctx, deadline, echo, on_record)
    error = None
    try:
        step.fn(dataclasses.replace(ctx, ends_at=runner.end), runner.run)
    except Exception:  # noqa: BLE001 - a broken step is recorded; the next one runs
        error = traceback.format_exc()
    if inject_failure:
        runner.run(Command("injected failure", (ctx.python, "-c", "import sys; print('injected failure'); "
                                                                   "sys.exit(3)"), 30))
    status, reason = step_status(runner.records)
    if error:
        status, reason = "failed", f"the step itself raised: {_last_line(error)}"
    record = {"step": step.name, "index": step.index, "title": step.title, "status": status, "reason": reason,
              "smoke": ctx.smoke, "started": started, "seconds": round(time.monotonic() - start, 1),
              "commands": runner.records}
    if error:
        record["error"] = _tail(error)
    return record


# --- the machine ----------------------------------------------------------------------------------------------

def nvidia_smi() -> dict:
    """GPU name, memory, driver and CUDA version from nvidia-smi, or {} without one."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        query = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=60).stdout
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    gpus = []
    for line in query.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "memory_bytes": int(float(memory)) * 2**20, "driver": driver})
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    return {"gpus": gpus, "cuda": cuda[1] if cuda else None}


def commit_info(wheelhouse: Path) -> dict:
    """The commit the tree was taken from: the wheelhouse's commit.json (written by prepare), else git, else
    unknown; with where it was read."""
    stamp = wheelhouse / "commit.json"
    if stamp.is_file():
        try:
            info = json.loads(stamp.read_text())
            return {k: info[k] for k in ("commit", "dirty", "diff", "written") if k in info} | {"source": str(stamp)}
        except (OSError, ValueError):
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "source": "no commit.json in the wheelhouse and no git checkout"}


def install(wheelhouse: Path, site: Path, python: str) -> dict:
    """pip install the wheelhouse into `site`: no index, no dependency resolution, nothing compiled."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        return {"status": "skipped", "reason": f"no wheels in {wheelhouse}"}
    argv = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(site), *wheels]
    start = time.monotonic()
    status, rc, log = run_process(argv, 300, REPO, {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return {"status": status, "returncode": rc, "seconds": round(time.monotonic() - start, 1), "site": str(site),
            "wheels": [w.name for w in wheels], "log_tail": log}


# --- results --------------------------------------------------------------------------------------------------

def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def read_results(folder: Path) -> tuple[Optional[dict], list[dict]]:
    """(env.json or None, the step records there, in step order)."""
    folder = Path(folder)
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").is_file() else None
    steps = []
    for path in sorted(folder.glob("*.json")):
        if path.name == "env.json":
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and "step" in data and "status" in data:
            steps.append(data)
    steps.sort(key=lambda s: (s.get("index", 99), s["step"]))
    return env, steps


def merge(old: Optional[dict], new: dict) -> dict:
    """A step's record after one more call ran it: the new commands replace the old ones of the same label, the
    old call's others stay (bench points that call did not run again), and the status is recomputed."""
    if not old or "running" in (old.get("status"), new.get("status")):
        return new
    fresh = {c["label"]: c for c in new["commands"]}
    commands = [fresh.pop(c["label"], c) for c in old.get("commands", [])] + list(fresh.values())
    if len(commands) == len(new["commands"]):
        return new
    status, reason = step_status(commands)
    if new.get("error"):
        status, reason = new["status"], new["reason"]
    return {**new, "commands": commands, "status": status, "reason": reason, "calls": old.get("calls", 1) + 1,
            "seconds": round(old.get("seconds", 0) + new.get("seconds", 0), 1)}


def _read_step(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def collect(sources, into: Path, summarize: Callable) -> Path:
    """Merge the results folders of several calls into `into` (step records by `merge`, in the order given;
    env.json the newest), then rebuild summary.md."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for source in sources:
        env, steps = read_results(source)
        for record in steps:
            target = into / f"{record['step']}.json"
            old = _read_step(target)
            if record["status"] == "running" and old is not None:
                continue
            write_json(target, merge(old, record))
        if env is not None:
            old = _read_step(into / "env.json") or {}
            if env.get("written", "") >= old.get("written", ""):
                write_json(into / "env.json", env)
    (into / "summary.md").write_text(summarize(into))
    return into


def run(steps: list[Step], ctx: Context, out: Path, wheelhouse: Path, site: Path, deadline_s: float,
        summarize: Callable, install_wheels: bool = True, inject_failure=(), options: Optional[dict] = None,
        echo=None, smi: Optional[dict] = None) -> int:
    """The whole call: install, env.json, then each step in turn; 0 when no step failed or timed out."""
    start = time.monotonic()
    deadline = start + deadline_s
    out.mkdir(parents=True, exist_ok=True)
    say = echo or (lambda s: None)
    env_record = {"written": now(), "smoke": ctx.smoke, "commit": commit_info(wheelhouse),
                  "python": sys.version.split()[0], "executable": ctx.python, "host": os.uname().nodename,
                  "cpu_count": os.cpu_count(), "nvidia_smi": nvidia_smi() if smi is None else smi,
                  "options": options or {}, "steps_requested": [s.name for s in steps]}
    if install_wheels:
        env_record["install"] = install(wheelhouse, site, ctx.python)
        if env_record["install"]["status"] == "ok":
            ctx.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), ctx.env.get("PYTHONPATH")]))
    else:
        env_record["install"] = {"status": "skipped", "reason": "--no-install (this environment is used as it is)"}
    say(f"install: {env_record['install']['status']} {env_record['install'].get('reason', '')}\n")
    probe = subprocess.run([ctx.python, str(HERE / "pack_jax.py"), "probe"], cwd=ctx.repo, env=ctx.env,
                           capture_output=True, text=True, timeout=300)
    try:
        env_record["probe"] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        env_record["probe"] = {"error": _tail(probe.stdout + probe.stderr)}
    gpus = env_record["nvidia_smi"].get("gpus") or []
    env_record["context"] = {"usable_memory": ctx.usable_memory, "memory_bandwidth": ctx.memory_bandwidth,
                             "env": {k: v for k, v in ctx.env.items() if k.startswith(("JAX", "XLA", "HF_"))
                                     or k == "PYTHONPATH"}}
    write_json(out / "env.json", env_record)
    say(f"env: {json.dumps({k: env_record['probe'].get(k) for k in ('jax', 'backend', 'devices', 'unmet')})}\n"
        f"     {json.dumps(env_record['nvidia_smi'])}\n")
    brief = {"commit": env_record["commit"].get("commit"), "device": gpus[0]["name"] if gpus else
             (env_record["probe"].get("devices") or [{}])[0].get("kind"), "jax": env_record["probe"].get("jax")}
    failures = 0
    for step in steps:
        if deadline - time.monotonic() < MIN_STEP_S:
            say(f"=== {step.index}. {step.name}: not run (the call's deadline of {deadline_s:.0f} s is near)\n")
            continue
        say(f"=== {step.index}. {step.name}: {step.title}\n")
        path = out / f"{step.name}.json"
        old = _read_step(path)  # kept until this call's record can be merged into it
        if old is None:
            write_json(path, {"step": step.name, "index": step.index, "title": step.title, "status": "running",
                              "reason": "started but never finished: the call was stopped", "started": now(),
                              "smoke": ctx.smoke, "env": brief, "commands": []})
        step_tmp = Path(tempfile.mkdtemp(prefix=f"gpu-pack-{step.name}-", dir=ctx.tmp))

        def written(records, step=step, path=path, old=old, started=now()):
            """The step's file after each command: its commands so far (merged into an earlier call's), running."""
            status, reason = step_status(records)
            partial = {"step": step.name, "index": step.index, "title": step.title, "status": status,
                       "reason": reason, "smoke": ctx.smoke, "started": started, "env": brief,
                       "commands": list(records)}
            write_json(path, {**merge(old, partial), "status": "running",
                              "reason": f"still running: {len(records)} command(s) recorded "
                                        "(a stopped call ends here)"})

        record = run_step(step, Context(**{**ctx.__dict__, "tmp": step_tmp}), deadline, echo,
                          inject_failure=step.name in inject_failure, on_record=written)
        record["env"] = brief
        write_json(path, merge(old, record))
        (out / "summary.md").write_text(summarize(out))
        shutil.rmtree(step_tmp, ignore_errors=True)
        failures += record["status"] in ("failed", "timeout")
        say(f"=== {step.index}. {step.name}: {record['status']}"
            f"{' - ' + record['reason'] if record.get('reason') else ''} ({record['seconds']:.0f} s)\n")
    (out / "summary.md").write_text(summarize(out))
    return 1 if failures else 0
