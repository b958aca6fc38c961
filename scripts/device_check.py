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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

try:
    import tomllib
except ImportError:  # Python 3.10: tomli is a dependency of the project there
    import tomli as tomllib

# The checks' parts live beside this file (_device_check_*.py); tests load it by its path, without scripts/ on
# sys.path, so the imports below come after the path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _device_check_base import (FULL, INSTALL_HINT, QUICK, REPO, TAIL, Check, Failed, Skip,
                                _last_line, _module_version, _needs_trt, _run, _stderr, missing_module_hint,
                                pytest_suite)
from _device_check_trt import (_demo, build_and_compare, check_batch_sequence, check_cuda_graph,
                               check_result_stage_overlap, check_speedups, check_timing_cache)
# re-exported: tests/test_device_check.py reads them through this module
from _device_check_trt import BATCH_SEQUENCE as BATCH_SEQUENCE, batch_sequence as batch_sequence
from _device_check_trt import compare as compare, worker_fps as worker_fps

TRTEXEC_PATHS = ("/usr/src/tensorrt/bin/trtexec", "/usr/local/tensorrt/bin/trtexec")
# Modules whose stand-ins mark themselves `__simulated__` (tests/simulate/install.py).
SIMULATED_MODULES = ("tensorrt", "cuda", "cuda.bindings.runtime", "cuda.cudart", "pycuda", "pycuda.driver", "pynvml")


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
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError from its libraries or worse: each is the finding
        c.state["no_trt"] = f"tensorrt does not import: {type(exc).__name__}: {exc}"
        raise RuntimeError(c.state["no_trt"]) from None
    where = Path(getattr(trt, "__file__", None) or "?").parent
    return {"version": trt.__version__, "summary": f"TensorRT {trt.__version__} from {where}"}


def check_backend_contract(c: Check) -> dict[str, Any]:
    _needs_trt(c)
    return pytest_suite(c, "backend-contract",
                        ["tests/test_backend_contract.py", "tests/test_trt_build_logic.py", "-k", "tensorrt"],
                        lambda n: n.endswith("[tensorrt]"), needs=("pytest", "hypothesis"))


# --- 11: latency beside trtexec ------------------------------------------------------------------


def find_trtexec() -> str | None:
    return shutil.which("trtexec") or next((p for p in TRTEXEC_PATHS if os.access(p, os.X_OK)), None)


def parse_trtexec(text: str) -> dict[str, float]:
    """Mean/median of trtexec's `GPU Compute Time:` and `Latency:` summary lines (ms)."""
    out = {}
    for label, key in (("GPU Compute Time", "gpu_compute"), ("Latency", "latency")):
        m = re.search(rf"\]\s*{label}: min = [\d.]+ ms, max = [\d.]+ ms, "
                      r"mean = ([\d.]+) ms, median = ([\d.]+) ms", text)
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
    ratio = (round(ours["infer"]["p50"] / theirs["gpu_compute_median_ms"], 2)
             if theirs.get("gpu_compute_median_ms") else None)
    return {"ours_ms": ours, "trtexec_ms": theirs, "infer_p50_over_trtexec_gpu_median": ratio, **ran,
            "summary": f"our infer p50 {ours['infer']['p50']} ms vs trtexec GPU compute median "
                       f"{theirs.get('gpu_compute_median_ms')} ms (x{ratio})"}


def _first_line(text: str) -> str:
    """trtexec's first line names its TensorRT ("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] ...")."""
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")[:300]


def _our_latency(c: Check, result: Any) -> dict[str, Any]:
    from engines.tools.bench import time_runtime
    from engines.evaluation.frames import text_frames
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
