#!/usr/bin/env python3
"""Device check: does the TensorRT path work on THIS NVIDIA machine (Jetson or discrete GPU)?

Run by scripts/device-check.sh (`make device-check`) with whatever is installed here; installs nothing.
The checks run in the order a first run on a new device fails: what the device check itself needs (the
`device` extra), versions, driver, `engines doctor`,
CUDA memory for real, NVML telemetry, TensorRT import, the backend contract tests, FP16 and INT8 builds
of the demo model compared to ONNX Runtime FP32, CUDA-graph capture, the timing cache written then
reused, and our latency beside `trtexec --loadEngine` on the same plan; then a batch-4 engine run at
batch sizes 1 -> 4 -> 2 -> 1 -> 3 with every row compared to ONNX Runtime (per-size contexts and graphs,
issue 22), its per-frame cost at each size, the FP16/INT8 speed-ups over FP32, and what the result stage's
overlap buys in the agent's worker. Every check lands in one JSON
report, whose path is printed last; a check that cannot run says why (`skipped`); a check that runs a
program keeps the end of its stderr (`stderr_tail`).

Device files are read under `--root` (default /). `--quick`: a smoke run (small demo model, short timing
rounds; timing goals are reported, not judged). A report made where the TensorRT, CUDA or NVML libraries
are stand-ins (tests/simulate, `scripts/device-check.sh --simulate`) says so in `simulated` at its top.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

try:
    import tomllib
except ImportError:  # Python 3.10: tomli is a dependency of the project there
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
TRTEXEC_PATHS = ("/usr/src/tensorrt/bin/trtexec", "/usr/local/tensorrt/bin/trtexec")
MIN_COSINE = {"fp16": 0.999, "int8": 0.98}  # against ONNX Runtime FP32 on held-out frames
BATCH_SEQUENCE = (1, 4, 2, 1, 3)  # grows, shrinks, returns to sizes already captured
INSTALL_HINT = "pip install -e '.[device]' (docs/device-reports/README.md)"
TAIL = 3000  # characters of a program's stdout / stderr kept in the report
# Modules whose stand-ins mark themselves `__simulated__` (tests/simulate/install.py).
SIMULATED_MODULES = ("tensorrt", "cuda", "cuda.bindings.runtime", "cuda.cudart", "pycuda", "pycuda.driver", "pynvml")


@dataclass(frozen=True)
class Limits:
    """How much the checks build and time: FULL for a device report, QUICK for a smoke run (and simulate mode)."""

    demo_size: tuple[int, int] = (320, 256)  # width, height: multiples of 32 (the DB detector's FPN)
    latency_runs: int = 20  # the build's latency gate
    latency: tuple[int, int] = (200, 20)  # our iterations, warm-up (beside trtexec)
    trtexec: tuple[str, ...] = ("--warmUp=500", "--iterations=200", "--duration=0")
    overlap: tuple[int, float] = (5, 3.0)  # rounds, seconds per round and way
    speedup: tuple[int, int] = (5, 20)  # rounds, min_rounds of each timing
    curve: dict[str, Any] = field(default_factory=dict)  # engines.batch_curve.sample_sizes bounds
    shadow: tuple[str, ...] = ("--rounds", "4")
    shadow_timeout_s: float = 1500
    judge_timing: bool = True  # False: a timing goal missed is reported, not failed (too few rounds to judge)


FULL = Limits()
QUICK = Limits(demo_size=(160, 128), latency_runs=3, latency=(20, 3),
               trtexec=("--warmUp=50", "--iterations=20", "--duration=0"), overlap=(1, 0.5), speedup=(1, 3),
               curve={"warmup": 1, "min_rounds": 3, "max_rounds": 5, "max_seconds": 1.0}, shadow=("--quick",),
               shadow_timeout_s=600, judge_timing=False)


class Skip(Exception):
    """A check that cannot run here; the message says why."""


class Failed(Exception):
    """A check that ran and failed; `details` go into the report beside the message."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


class Check:
    """Runs the checks in order and collects their results; later checks read earlier state."""

    def __init__(self, work: Path, root: Path = Path("/"), limits: Limits = FULL) -> None:
        self.work, self.root, self.limits = work, root, limits
        self.results: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[["Check"], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        try:
            entry = {"name": name, "ok": True, **fn(self)}
        except Skip as exc:
            entry = {"name": name, "ok": None, "skipped": str(exc)}
        except Failed as exc:
            entry = {"name": name, "ok": False, "error": str(exc), **exc.details}
        except Exception as exc:  # every failure is reported, the next check still runs
            entry = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=6)}
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.results.append(entry)
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[entry["ok"]]
        text = entry.get("error") if entry["ok"] is False else entry.get("summary") or entry.get("skipped")
        print(f"[{mark}] {name}: {text}", flush=True)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a program to its end; Failed (with what it printed) when it outlives `timeout`."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # its output is bytes whatever `text` says
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
        raise Failed(f"{' '.join(cmd[:3])} ... did not finish in {timeout:.0f} s (killed)", stdout_tail=out[-TAIL:],
                     stderr_tail=err[-TAIL:]) from None


def _stderr(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """What every check that runs a program keeps of it: its exit status and the end of its stderr."""
    return {"exit": proc.returncode, "stderr_tail": (proc.stderr or "")[-TAIL:]}


def _last_line(*texts: str) -> str:
    """The last non-empty line of the first text that has one (a program's own last word on why it stopped)."""
    for text in texts:
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        if lines:
            return lines[-1][:300]
    return "no output"


_MODULE_PACKAGES = {"rapidocr_onnxruntime": "rapidocr-onnxruntime", "pytest_timeout": "pytest-timeout"}  # else the same


def missing_module_hint(text: str) -> str | None:
    """"pytest is not installed: pip install ..." for a `No module named 'pytest'` in a program's output."""
    found = re.findall(r"No module named '([\w.]+)'$", text or "", re.MULTILINE)  # not "...; 'x' is not a package"
    if not found:
        return None
    package = _MODULE_PACKAGES.get(found[-1].split(".")[0], found[-1].split(".")[0])
    return f"{package} is not installed in {sys.executable}: {INSTALL_HINT}"


def _missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The packages of `modules` that this interpreter cannot import (what a pytest suite needs)."""
    import importlib.util

    return [_MODULE_PACKAGES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]


def _module_version(name: str) -> str | None:
    try:
        module = __import__(name, fromlist=["_"])
    except Exception as exc:  # report why, not only that it is missing
        return f"not importable ({type(exc).__name__}: {exc})"
    return str(getattr(module, "__version__", "installed"))


# --- 1-4: what is here -------------------------------------------------------------------------


def device_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The `device` extra: what the device check itself needs beside the agent (test runner, demo model)."""
    extras = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    if not extras.get("device"):
        raise Failed(f"{pyproject} has no `device` extra listing what the device check needs")
    return list(extras["device"])


def check_install(c: Check) -> dict[str, Any]:
    """Every requirement of the `device` extra is installed in this interpreter (by distribution name)."""
    from importlib import metadata

    found, missing = {}, []
    for req in device_requirements():
        name = re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0]
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise Failed(f"not installed in {sys.executable}: {', '.join(missing)}; {INSTALL_HINT}", found=found,
                     missing=missing)
    return {"found": found, "summary": f"device extra present: {', '.join(f'{k} {v}' for k, v in found.items())}"}


def check_versions(c: Check) -> dict[str, Any]:
    found = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}
    for module in ("numpy", "onnx", "onnxruntime", "tensorrt", "cuda.bindings", "cuda", "pycuda", "pynvml", "jtop"):
        found[module] = _module_version(module)
    release = c.root / "etc" / "nv_tegra_release"
    if release.is_file():
        found["l4t"] = release.read_text().splitlines()[0].strip()
    smi = shutil.which("nvidia-smi")
    if smi:
        q = _run([smi, "--query-gpu=name,driver_version,compute_cap,memory.total", "--format=csv,noheader"], 60)
        found["nvidia_smi"] = (q.stdout or q.stderr).strip()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc:
        found["nvcc"] = _run([nvcc, "--version"], 60).stdout.strip().splitlines()[-1:]
    return {"found": found, "summary": f"python {found['python']}, tensorrt {found['tensorrt']}"}


def _on_jetson(c: Check) -> bool:
    return (c.root / "etc" / "nv_tegra_release").is_file()


def check_driver(c: Check) -> dict[str, Any]:
    proc_version = c.root / "proc" / "driver" / "nvidia" / "version"
    jetson = _on_jetson(c)
    if proc_version.is_file():
        return {"summary": proc_version.read_text().splitlines()[0].strip(), "jetson": jetson}
    if jetson:
        return {"summary": "Jetson (L4T) driver", "jetson": True}
    raise RuntimeError(f"no NVIDIA driver: {proc_version} is missing and this is not a Jetson")


def check_doctor(c: Check) -> dict[str, Any]:
    proc = _run([sys.executable, "-m", "agent.cli", "engines", "doctor", "--json", "--root", str(c.root)], 300)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        hint = missing_module_hint(proc.stderr)
        raise Failed(f"exit {proc.returncode}, no JSON: {hint or _last_line(proc.stderr, proc.stdout)}",
                     stdout_tail=proc.stdout[-TAIL:], **_stderr(proc)) from None
    failed = [ch["name"] for ch in report.get("checks", []) if not ch.get("ok")]
    if proc.returncode != 0 or not report.get("usable"):
        raise Failed(f"doctor says not usable (exit {proc.returncode}); failing: {failed}", report=report,
                     **_stderr(proc))
    return {"report": report, **_stderr(proc),
            "summary": f"usable; {len(report.get('checks', []))} checks, failing: {failed}"}


# --- 4-5, 7: the contract suites for real --------------------------------------------------------


def pytest_suite(c: Check, name: str, args: list[str], real: Callable[[str], bool], timeout: float = 1200,
                 needs: tuple[str, ...] = ("pytest",)) -> dict[str, Any]:
    """Run a pytest selection; ok only when it passes AND at least one test of the real thing ran. `needs`: the
    modules the selection imports beyond the agent's own dependencies (named with the install line when missing)."""
    missing = _missing_modules(needs)
    if missing:
        raise Failed(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in {sys.executable}: "
                     f"{INSTALL_HINT}", missing=missing)
    xml = c.work / f"{name}.xml"
    proc = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                timeout)
    cases = [(tc.get("name", ""), tc) for tc in ET.parse(xml).getroot().iter("testcase")] if xml.is_file() else []
    outcome = {n: ("skipped" if tc.find("skipped") is not None else "failed" if tc.find("failure") is not None
                   or tc.find("error") is not None else "passed") for n, tc in cases}
    ran_real = sorted(n for n, o in outcome.items() if real(n) and o == "passed")
    result = {"passed": sum(o == "passed" for o in outcome.values()),
              "failed": sorted(n for n, o in outcome.items() if o == "failed"),
              "skipped": sum(o == "skipped" for o in outcome.values()), "real_passed": ran_real,
              "tail": proc.stdout[-TAIL:], **_stderr(proc)}
    if proc.returncode != 0:
        why = (f"failed: {result['failed']}" if result["failed"] else
               missing_module_hint(proc.stdout + proc.stderr) or f"no test failed: {_last_line(proc.stderr, proc.stdout)}")
        raise Failed(f"pytest exit {proc.returncode}; {why}", **result)
    if not ran_real:
        raise Failed("no test ran against the real implementation (all skipped; reasons in `tail`)", **result)
    return {**result, "summary": f"{len(ran_real)} real tests passed, {result['skipped']} skipped"}


def check_cuda_contract(c: Check) -> dict[str, Any]:
    return pytest_suite(c, "cuda-contract", ["tests/test_cuda_contract.py", "-k", "not fake and not stand"],
                        lambda n: re.search(r"\[(cuda-python|pycuda)(-shape\d+-\w+)?\]$", n) is not None)


JETSON_NVML = "Jetson telemetry uses jtop/sysfs, as `engines doctor` says"


def check_nvml(c: Check) -> dict[str, Any]:
    """Two NVML samples. On a Jetson NVML is optional (`engines doctor` passes it): absent (JetPack 6 has no
    libnvidia-ml, though jetson-stats 7.x installs nvidia-ml-py) or NotSupported on every field (Orin's iGPU) is
    a skip with the reason, not a failure."""
    jetson = _on_jetson(c)
    try:
        from agent.telemetry.nvml_source import NvmlSource
    except ImportError as exc:
        raise Skip(f"nvidia-ml-py is not installed ({exc}); " + (JETSON_NVML if jetson else
                   "for dGPU telemetry: pip install 'jetson-edge-agent[nvml]'")) from None
    source = NvmlSource()
    ok, reason = source.available()
    if not ok:
        if jetson:
            raise Skip(f"NVML is not available on this Jetson: {reason}; {JETSON_NVML}")
        raise RuntimeError(reason)
    try:
        first, second = source.sample(), source.sample()
    finally:
        source.close()
    if not first:
        if jetson:
            raise Skip(f"NVML starts but answers NotSupported for every field on this Jetson's iGPU; {JETSON_NVML}")
        raise RuntimeError("NVML initialised but answered no field")
    return {"sample": first, "second": second, "summary": f"fields {sorted(first)}"}


def check_tensorrt(c: Check) -> dict[str, Any]:
    try:
        import tensorrt as trt
    except Exception as exc:
        c.state["no_trt"] = f"tensorrt does not import: {type(exc).__name__}: {exc}"
        raise RuntimeError(c.state["no_trt"]) from None
    where = Path(getattr(trt, "__file__", None) or "?").parent
    return {"version": trt.__version__, "summary": f"TensorRT {trt.__version__} from {where}"}


def _needs_trt(c: Check) -> None:
    if "no_trt" in c.state:
        raise Skip(c.state["no_trt"])


def check_backend_contract(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    return pytest_suite(c, "backend-contract", ["tests/test_backend_contract.py", "-k", "tensorrt"],
                        lambda n: n.endswith("[tensorrt]"), needs=("pytest", "hypothesis"))


# --- 8-10: the demo model through TensorRT --------------------------------------------------------


def _demo(c: Check) -> Any:
    if "demo" not in c.state:
        from agent.artifacts.demo_model import prepare_demo_model_dir
        from engines.model import load_model

        c.state["demo"] = load_model(prepare_demo_model_dir(c.work / "models", *c.limits.demo_size))
    return c.state["demo"]


def _held_out_inputs(source: Any, count: int = 4) -> list[Any]:
    from engines.frames import text_frames
    from engines.preprocess import Preprocessor

    pre, out = Preprocessor(source.manifest.preprocess), []
    for frame in text_frames(source.manifest.preprocess.width, source.manifest.preprocess.height, count, seed=4242):
        pre(frame)
        out.append(pre.tensor.copy())
    return out


def compare(got: list[Any], want: list[Any]) -> dict[str, float]:
    """Relative L2 error, cosine similarity and max |difference| of two lists of output arrays."""
    import numpy as np

    g = np.concatenate([np.asarray(a, np.float64).ravel() for a in got])
    w = np.concatenate([np.asarray(a, np.float64).ravel() for a in want])
    norm = float(np.linalg.norm(w)) or 1.0
    return {"rel_l2": round(float(np.linalg.norm(g - w)) / norm, 6),
            "cosine": round(float(g @ w / ((np.linalg.norm(g) * np.linalg.norm(w)) or 1.0)), 6),
            "max_abs": round(float(np.max(np.abs(g - w))), 6)}


def build_and_compare(c: Check, precision: str) -> dict[str, Any]:
    _needs_trt(c)
    import onnxruntime as ort

    from engines.build.provisioning import load_provisioned, provision

    source = _demo(c)
    cache = c.work / "cache"
    result = provision(source, backend="tensorrt", precision=precision, cache_dir=cache, db_path=c.work / "state.db",
                       validation_samples=4, latency_runs=c.limits.latency_runs, fingerprint_root=c.root)
    c.state[f"built_{precision}"] = result
    runtime = load_provisioned(result, source)
    try:
        engine = runtime.engine
        name = engine.inputs[0].name
        inputs = _held_out_inputs(source)
        got = [engine.infer({name: x})[0] for x in inputs]
        c.state[f"describe_{precision}"] = engine.describe()
    finally:
        runtime.close()
    session = ort.InferenceSession(str(source.onnx_path), providers=["CPUExecutionProvider"])
    want = [session.run(None, {name: x})[0] for x in inputs]
    numbers = compare(got, want)
    entry = {"engine": str(result.engine_path), "precision": result.precision, "build_s": round(result.build_s, 1),
             "report": result.report, "validation": result.validation.to_dict() if result.validation else None,
             "vs_onnxruntime_fp32": numbers, "summary": f"{precision} vs ORT fp32: {numbers}"}
    if numbers["cosine"] < MIN_COSINE[precision]:
        raise Failed(f"{precision} outputs disagree with ONNX Runtime FP32: {numbers} (min cosine "
                     f"{MIN_COSINE[precision]})", **{k: v for k, v in entry.items() if k != "summary"})
    return entry


def batch_sequence(engine: Any, name: str, reference: Callable[[Any], Any], frames: list[Any],
                   sizes: tuple[int, ...] = BATCH_SEQUENCE) -> list[dict[str, Any]]:
    """Batches of `sizes` distinct frames (1xCxHxW each) through `engine`; every output row compared with
    `reference(frame)` (one frame at a time). What a context replaying a graph captured at another shape
    gets wrong: each step's worst row is reported."""
    import numpy as np

    steps, start = [], 0
    for n in sizes:
        rows = [frames[(start + i) % len(frames)] for i in range(n)]
        start += n
        out = engine.infer({name: np.concatenate(rows)})[0]
        numbers = [compare([out[i:i + 1]], [reference(row)]) for i, row in enumerate(rows)]
        steps.append({"batch": n, "worst_cosine": min(x["cosine"] for x in numbers),
                      "max_abs": max(x["max_abs"] for x in numbers)})
    return steps


def per_frame_ms(engine: Any, name: str, frame: Any, sizes: tuple[int, ...], **limits: Any) -> dict[int, dict[str, float]]:
    """Engine-only ms per frame at each batch size, timed as the build times them (engines.batch_curve: warm,
    interleaved rounds until each median is known; `limits` bound it): median and spread (p25, p75) per size."""
    import numpy as np

    from engines.batch_curve import sample_sizes, size_cost

    batches = {n: np.concatenate([frame] * n) for n in sizes}
    samples = sample_sizes(lambda n: engine.infer({name: batches[n]}), sizes, **limits)
    costs = {n: size_cost(values) for n, values in samples.items()}
    return {n: {"median": round(c.median, 4), "spread": [round(c.low, 4), round(c.high, 4)], "rounds": c.rounds}
            for n, c in costs.items()}


def _inside(build: dict[str, Any], size: int, spread: list[float]) -> bool | None:
    """Whether the build's median for `size` lies within the spread timed here (None: not in the build)."""
    median = (build.get("curve") or {}).get(str(size))
    return None if median is None else spread[0] <= float(median) <= spread[1]


def check_batch_sequence(c: Check) -> dict[str, Any]:
    """A batch-4 FP16 engine at sizes 1, 4, 2, 1, 3: every row against ONNX Runtime FP32; then its cost curve."""
    _needs_trt(c)
    import onnxruntime as ort

    from engines.backends.base import EngineOptions
    from engines.batching import choose_batch_size
    from engines.build.provisioning import load_provisioned, provision

    source = _demo(c)
    result = provision(source, backend="tensorrt", precision="fp16", cache_dir=c.work / "cache",
                       db_path=c.work / "state.db", validation_samples=4, latency_runs=c.limits.latency_runs,
                       max_batch=4, fingerprint_root=c.root)
    runtime = load_provisioned(result, source, EngineOptions(max_batch=4))
    session = ort.InferenceSession(str(source.onnx_path), providers=["CPUExecutionProvider"])
    try:
        engine = runtime.engine
        name = engine.inputs[0].name
        frames = _held_out_inputs(source, 6)
        steps = batch_sequence(engine, name, lambda x: session.run(None, {name: x})[0], frames)
        timed = per_frame_ms(engine, name, frames[0], tuple(range(1, engine.describe().get("max_batch", 1) + 1)),
                             **c.limits.curve)
        info = engine.describe()
    finally:
        runtime.close()
    curve = {n: t["median"] for n, t in timed.items()}
    build = (result.report.get("batch") or {})
    pick = choose_batch_size(curve, None, max(curve), spread={n: t["spread"] for n, t in timed.items()})
    best = min(curve, key=curve.get)
    entry = {"steps": steps, "contexts": info.get("contexts"), "cuda_graphs": info.get("cuda_graphs"),
             "per_frame_ms": timed, "build_curve_ms": build.get("curve"), "build_spread_ms": build.get("spread"),
             "ceiling": round(curve[1] / curve[best], 3), "best_batch": best, "auto_pick": pick.size,
             "auto_reason": pick.reason,
             "build_inside_spread": {str(n): _inside(build, n, t["spread"]) for n, t in timed.items()},
             "summary": f"worst cosine {min(s['worst_cosine'] for s in steps)} over {list(BATCH_SEQUENCE)}; "
                        f"per frame {curve} ms, auto picks {pick.size}"}
    bad = [s for s in steps if s["worst_cosine"] < MIN_COSINE["fp16"]]
    if bad:
        raise Failed(f"batch sizes {[s['batch'] for s in bad]} disagree with ONNX Runtime FP32 (a graph replayed at "
                     f"another shape?): {bad}", **{k: v for k, v in entry.items() if k != "summary"})
    return entry


def check_speedups(c: Check) -> dict[str, Any]:
    """FP16 and INT8 engine-only latency against an FP32 TensorRT build of the same model, interleaved."""
    _needs_trt(c)
    import statistics

    from engines.build.provisioning import load_provisioned, provision

    built = {p: c.state.get(f"built_{p}") for p in ("fp16", "int8")}
    if any(v is None for v in built.values()):
        raise Skip("needs the FP16 and the INT8 build")
    source = _demo(c)
    built["fp32"] = provision(source, backend="tensorrt", precision="fp32", cache_dir=c.work / "cache",
                              db_path=c.work / "state.db", validation_samples=4, latency_runs=c.limits.latency_runs,
                              fingerprint_root=c.root)
    runtimes = {p: load_provisioned(r, source) for p, r in built.items()}
    try:
        frame = _held_out_inputs(source, 1)[0]
        name = runtimes["fp32"].engine.inputs[0].name
        times: dict[str, list[float]] = {p: [] for p in runtimes}
        rounds, min_rounds = c.limits.speedup
        for _ in range(rounds):  # each precision timed in turn
            for p, rt in runtimes.items():
                times[p].append(per_frame_ms(rt.engine, name, frame, (1,), **{**c.limits.curve,
                                                                              "min_rounds": min_rounds})[1]["median"])
    finally:
        for rt in runtimes.values():
            rt.close()
    ms = {p: statistics.median(v) for p, v in times.items()}
    speedups = {p: round(ms["fp32"] / ms[p], 3) for p in ("fp16", "int8")}
    return {"ms": {p: round(v, 3) for p, v in ms.items()}, "rounds_ms": times, "speedup_vs_fp32": speedups,
            "summary": f"fp16 {speedups['fp16']}x, int8 {speedups['int8']}x over fp32"}


def worker_fps(runtime: Any, frames: list[Any], seconds: float, overlap: bool) -> float:
    """Frames per second of the agent's InferenceWorker fed ready frames, with postprocessing on the result
    stage's thread (`overlap`) or inline between engine calls: benchmarks/pipeline.py's worker loop."""
    benchmarks = str(REPO / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from pipeline import worker_loop  # benchmarks/pipeline.py

    return worker_loop(runtime, frames, seconds, overlap)[0] / seconds


def check_result_stage_overlap(c: Check) -> dict[str, Any]:
    """What the result stage buys where the engine runs on the GPU: the FP16 demo engine in the agent's worker,
    postprocessing overlapped vs inline, interleaved rounds (5 of 3 s; --quick: 1 of 0.5 s)."""
    _needs_trt(c)
    import statistics

    from engines.frames import text_frames
    from engines.build.provisioning import load_provisioned

    built = c.state.get("built_fp16")
    if built is None:
        raise Skip("needs the FP16 build")
    source = _demo(c)
    spec = source.manifest.preprocess
    frames = text_frames(spec.width, spec.height, 4)
    runtime = load_provisioned(built, source)
    try:
        count, seconds = c.limits.overlap
        rounds = [(worker_fps(runtime, frames, seconds, True), worker_fps(runtime, frames, seconds, False))
                  for _ in range(count)]
    finally:
        runtime.close()
    ratios = [round(a / b, 3) for a, b in rounds]
    return {"fps_overlap": [round(a, 1) for a, _ in rounds], "fps_inline": [round(b, 1) for _, b in rounds],
            "overlap_vs_inline_rounds": ratios, "overlap_vs_inline": statistics.median(ratios),
            "summary": f"overlap vs inline {statistics.median(ratios)}x (rounds {ratios})"}


def check_cuda_graph(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    info = c.state.get("describe_fp16") or c.state.get("describe_int8")
    if info is None:
        raise Skip("no TensorRT engine was loaded (see the build checks)")
    if not info.get("cuda_graph"):
        raise RuntimeError(f"CUDA graph not in use: {info.get('cuda_graph_status')} (cuda memory: {info.get('cuda_memory')})")
    return {"status": info.get("cuda_graph_status"), "cuda_memory": info.get("cuda_memory"),
            "summary": f"captured with {info.get('cuda_memory')}"}


def check_timing_cache(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    first, second = c.state.get("built_fp16"), c.state.get("built_int8")
    if first is None or second is None:
        raise Skip("needs both the FP16 and the INT8 build")
    files = sorted((c.work / "cache" / "timing").glob("*.cache"))
    if not files or files[0].stat().st_size == 0:
        raise RuntimeError(f"no timing cache written under {c.work / 'cache' / 'timing'}")
    notes = (second.report or {}).get("notes", [])
    if not any(str(n).startswith("reused timing cache") for n in notes):
        raise RuntimeError(f"the second build did not reuse the timing cache; its notes: {notes}")
    return {"file": str(files[0]), "bytes": files[0].stat().st_size, "notes": notes,
            "summary": f"{files[0].stat().st_size} bytes written, reused by the INT8 build"}


# --- 11: latency beside trtexec ------------------------------------------------------------------


def find_trtexec() -> str | None:
    return shutil.which("trtexec") or next((p for p in TRTEXEC_PATHS if os.access(p, os.X_OK)), None)


def parse_trtexec(text: str) -> dict[str, float]:
    """Mean/median of trtexec's `GPU Compute Time:` and `Latency:` summary lines (ms)."""
    out = {}
    for label, key in (("GPU Compute Time", "gpu_compute"), ("Latency", "latency")):
        m = re.search(rf"\]\s*{label}: min = [\d.]+ ms, max = [\d.]+ ms, mean = ([\d.]+) ms, median = ([\d.]+) ms", text)
        if m:
            out[f"{key}_mean_ms"], out[f"{key}_median_ms"] = float(m.group(1)), float(m.group(2))
    return out


def check_trtexec(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    result = c.state.get("built_fp16")
    if result is None:
        raise Skip("no FP16 plan was built")
    trtexec = find_trtexec()
    if trtexec is None:
        raise Skip(f"trtexec not found on PATH or in {TRTEXEC_PATHS}")
    ours = _our_latency(c, result)
    info = c.state["describe_fp16"]["inputs"][0]
    shape = "x".join(str(d) for d in info["shape"])
    proc = _run([trtexec, f"--loadEngine={result.engine_path}", f"--shapes={info['name']}:{shape}",
                 *c.limits.trtexec, "--useCudaGraph"], 600)
    theirs = parse_trtexec(proc.stdout + proc.stderr)
    ran = {"trtexec": trtexec, "banner": _first_line(proc.stdout), **_stderr(proc)}
    if proc.returncode != 0 or not theirs:
        raise Failed(f"trtexec exit {proc.returncode}: {_last_line(proc.stdout, proc.stderr)}",
                     stdout_tail=proc.stdout[-TAIL:], **ran)
    ratio = round(ours["infer"]["p50"] / theirs["gpu_compute_median_ms"], 2) if theirs.get("gpu_compute_median_ms") else None
    return {"ours_ms": ours, "trtexec_ms": theirs, "infer_p50_over_trtexec_gpu_median": ratio, **ran,
            "summary": f"our infer p50 {ours['infer']['p50']} ms vs trtexec GPU compute median "
                       f"{theirs.get('gpu_compute_median_ms')} ms (x{ratio})"}


def _first_line(text: str) -> str:
    """trtexec's first line names its TensorRT ("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] ...")."""
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")[:300]


def _our_latency(c: Check, result: Any) -> dict[str, Any]:
    from engines.bench import time_runtime
    from engines.frames import text_frames
    from engines.build.provisioning import load_provisioned

    source = _demo(c)
    runtime = load_provisioned(result, source)
    try:
        spec = source.manifest.preprocess
        iterations, warmup = c.limits.latency
        return time_runtime(runtime, text_frames(spec.width, spec.height), iterations=iterations,
                            warmup=warmup)["stages_ms"]
    finally:
        runtime.close()


SHADOW_GOALS = {"fps_ratio": 0.9, "p99_ratio": 1.10}  # benchmarks/shadow.py's, for the default (its own process)


def shadow_cost(data: dict[str, Any], judge: bool = True) -> dict[str, Any]:
    """The serving model's fps and p99 with a shadow beside it, from benchmarks/shadow.py's JSON; Failed where a goal
    is missed (the numbers go into the report either way). `judge` False (a --quick run: one short round): a missed
    goal is listed in `goals_missed`, not failed."""
    cost = data["cost"]
    numbers = {"fps_ratio": cost["fps_ratio"], "p99_ratio": cost["p99_ratio"], "p50_ratio": cost.get("p50_ratio"),
               "thread_p99_ratio": (cost.get("thread") or {}).get("p99_ratio"),
               "equal_cost_p99_ratio": (cost.get("equal_cost") or {}).get("p99_ratio"),
               "agreement_live": data.get("agreement_live"), "agreement_offline": data.get("agreement_offline"),
               "blind_candidate_s": (data.get("blind_candidate") or {}).get("seconds_from_shadow_start")}
    missed = [f"{k} {numbers[k]} (goal {'>=' if k == 'fps_ratio' else '<='} {goal})" for k, goal in SHADOW_GOALS.items()
              if numbers[k] is None or (numbers[k] < goal if k == "fps_ratio" else numbers[k] > goal)]
    if missed and judge:
        raise Failed("shadow at share 0.1: " + "; ".join(missed), **numbers)
    if not judge:
        numbers["goals_missed"] = missed
        numbers["goals_judged"] = "no: a --quick run (one short round) cannot judge timing goals"
    return {**numbers, "summary": f"fps x{numbers['fps_ratio']}, p99 x{numbers['p99_ratio']} (thread "
                                  f"x{numbers['thread_p99_ratio']}), agreement live {numbers['agreement_live']}"}


def check_shadow_cost(c: Check) -> dict[str, Any]:
    """benchmarks/shadow.py where the engines are TensorRT's: the candidate's kernels share the GPU with the
    serving model's, which no CPU measurement can show."""
    _needs_trt(c)
    out = c.work / "shadow.json"
    proc = _run([sys.executable, str(REPO / "benchmarks" / "shadow.py"), *c.limits.shadow, "--out", str(out)],
                c.limits.shadow_timeout_s)
    if not out.is_file():
        why = missing_module_hint(proc.stderr) or _last_line(proc.stderr, proc.stdout)
        raise Failed(f"exit {proc.returncode}, no JSON: {why}", stdout_tail=proc.stdout[-TAIL:], **_stderr(proc))
    try:
        return {**shadow_cost(json.loads(out.read_text()), judge=c.limits.judge_timing), **_stderr(proc)}
    except Failed as exc:
        exc.details.update(_stderr(proc))
        raise


CHECKS: tuple[tuple[str, Callable[[Check], dict[str, Any]]], ...] = (
    ("install", check_install), ("versions", check_versions), ("nvidia-driver", check_driver),
    ("engines-doctor", check_doctor),
    ("cuda-memory-contract", check_cuda_contract), ("nvml-telemetry", check_nvml), ("tensorrt-import", check_tensorrt),
    ("backend-contract", check_backend_contract), ("build-fp16", lambda c: build_and_compare(c, "fp16")),
    ("build-int8", lambda c: build_and_compare(c, "int8")), ("cuda-graph", check_cuda_graph),
    ("timing-cache", check_timing_cache), ("trtexec-latency", check_trtexec),
    ("batch-sequence", check_batch_sequence), ("precision-speedups", check_speedups),
    ("result-stage-overlap", check_result_stage_overlap), ("shadow-cost", check_shadow_cost),
)


def simulated() -> dict[str, Any] | None:
    """What in this interpreter is a stand-in (tests/simulate marks each `__simulated__`), or None: a report made
    with stand-ins must say so at its top, so it is never taken for evidence about hardware."""
    marks = {name: str(mark) for name in SIMULATED_MODULES
             if (mark := getattr(sys.modules.get(name), "__simulated__", None))}
    spec = os.environ.get("DEVICE_CHECK_SIMULATE")
    if not marks and not spec:
        return None
    return {"spec": spec, "stand_ins": marks, "trtexec": find_trtexec(),
            "meaning": "a run against stand-ins (tests/simulate): it tests the device check, not a device"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "device-check", help="report directory")
    parser.add_argument("--only", action="append", help="run only these checks (repeatable; default: all)")
    parser.add_argument("--root", type=Path, default=Path("/"), help="read device files under this root (default /)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small demo model, short timing rounds, timing goals reported not judged")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    sim = simulated()
    check = Check(work, args.root.resolve(), QUICK if args.quick else FULL)
    for name, fn in CHECKS:
        if not args.only or name in args.only:
            check.run(name, fn)
    report = {**({"simulated": sim} if sim else {}), "host": socket.gethostname(), "started_utc": stamp,
              "repo": str(REPO), "work_dir": str(work), "root": str(check.root), "quick": args.quick,
              "ok": all(r["ok"] is not False for r in check.results),
              "first_failure": next((r["name"] for r in check.results if r["ok"] is False), None),
              "checks": check.results}
    path = args.out / f"{'simulated-' if sim else ''}{socket.gethostname()}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(path)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
