"""What the rounds of one INT8 build share: the calibration's tensor ranges and the sensitivity ranking, once.

An INT8 build that fails its accuracy gate is rebuilt up to three times with more tensors in float
(engines.build.gating). Every round quantizes the same prepared graph from the same calibration frames, so the
two expensive passes give the same answer every time:

- *calibration*: ONNX Runtime's calibrator runs the graph with every quantized tensor's range exposed over all
  calibration frames (on a GFL head at 608x800, 16 frames: 25-28 s of a 40 s build on this 2-core CPU);
- *ranking*: engines.build.sensitivity measures each tensor's quantization error on the first frames.

Each round is its own build in its own child process, so they are kept on disk, under the engine cache
(`quant-stats/<entry>/`): `ranges.npz` (ONNX Runtime's TensorsData, every array bit for bit) beside `ranges.json`
(what they came from), and `ranking-<tag>.json`. The entry's name hashes everything the ranges depend on: the
prepared graph's bytes, the calibration set's digest, the calibrator (method, op types, options) and the ONNX
Runtime version, so a changed model, frame set or recipe never meets stale ranges. A round then only re-runs
what changes, ONNX Runtime's Q/DQ placement with another `nodes_to_exclude`, fed the stored ranges
(`quantize_static_on`), and its build report says what it reused (`StatsReport`).

Entries are small (two floats a tensor); the newest KEEP_ENTRIES stay. A file that does not read back is moved
aside as `*.corrupt`, logged, and computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import shutil
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from engines.build import sensitivity
from engines.build.sensitivity import Range, TensorError
from kernel.fsutil import atomic_write_bytes
from engines.model.manifest import sha256_file

log = logging.getLogger(__name__)

#: Bump when what an entry holds, or how it is computed, changes.
STATS_FORMAT = 1
#: Entries kept under the store's root (the newest by use); each is a few kB.
KEEP_ENTRIES = 16
#: TensorData's fields across ONNX Runtime 1.17-1.32 (MinMax: lowest/highest; histograms: hist, bins, ...).
_TENSOR_FIELDS = ("lowest", "highest", "avg", "std", "hist", "hist_edges", "bins")
#: quantize_static's extra options that configure its calibrator, and the calibrator's names for them
#: (the same table as onnxruntime/quantization/quantize.py's `calib_extra_options_keys`).
_CALIBRATOR_OPTIONS = (("CalibTensorRangeSymmetric", "symmetric"), ("CalibMovingAverage", "moving_average"),
                       ("CalibMovingAverageConstant", "averaging_constant"),
                       ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"), ("CalibPercentile", "percentile"))

Feeds = Callable[[], Sequence[dict[str, np.ndarray]]]


@dataclass(frozen=True)
class CalibratorSpec:
    """How quantize_static would calibrate: what it passes to ONNX Runtime's `create_calibrator`."""

    op_types: tuple[str, ...]
    method: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, op_types: Sequence[str], method: str, extra_options: Mapping[str, Any]) -> "CalibratorSpec":
        """The calibrator quantize_static builds for these arguments."""
        options = tuple((key, extra_options[name]) for name, key in _CALIBRATOR_OPTIONS if name in extra_options)
        return cls(tuple(sorted(op_types)), method, options)

    def ort_method(self) -> Any:
        """The CalibrationMethod enum member."""
        from onnxruntime.quantization import CalibrationMethod

        methods = {m.name.lower(): m for m in CalibrationMethod}
        try:
            return methods[self.method.lower()]
        except KeyError:
            raise ValueError(f"unsupported calibrate_method {self.method!r}") from None


@dataclass(frozen=True)
class RankingSpec:
    """How the fallback ranks tensors (engines.build.sensitivity.rank_tensors) for one recipe; `tag` names the
    recipe's candidate rule in the stored ranking's file name."""

    symmetric: bool
    quantized: Callable[[onnx.NodeProto | None, list[onnx.NodeProto]], bool]
    tag: str


@dataclass
class StatsReport:
    """What one build computed and what it reused: the build report's `quantization.stats`."""

    #: Calibration inference passes this build ran (0: its ranges were stored by an earlier round).
    calibration_passes: int = 0
    #: Sensitivity rankings this build computed (0: none needed, or an earlier round's reused).
    ranking_passes: int = 0
    #: What came from an earlier build: "ranges", "ranking".
    reused: list[str] = field(default_factory=list)
    calibration_s: float = 0.0
    ranking_s: float = 0.0
    #: Calibration frames the ranges were computed from.
    samples: int = 0
    #: The store entry (None: no store, nothing kept for the next round).
    entry: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the build report."""
        data = asdict(self)
        data["calibration_s"], data["ranking_s"] = round(self.calibration_s, 3), round(self.ranking_s, 3)
        return data


@dataclass(frozen=True)
class Shared:
    """A build's calibration ranges, its ranking (None without a fallback) and how it got them."""

    ranges: Any  # onnxruntime.quantization.calibrate.TensorsData
    ranking: list[TensorError] | None
    report: StatsReport


@dataclass(frozen=True)
class StatsStore:
    """Where INT8 builds keep what their rounds share: `root/<entry>/`, one entry per prepared graph, calibration
    set and calibrator."""

    root: Path
    calibration_digest: str

    def entry(self, prepared: Path, calibrator: CalibratorSpec) -> "StatsEntry":
        """The entry for the prepared graph saved at `prepared`, calibrated as `calibrator` says."""
        import onnxruntime

        key = {"format": STATS_FORMAT, "onnxruntime": onnxruntime.__version__, "prepared": sha256_file(prepared),
               "calibration": self.calibration_digest, "calibrator": _jsonable(asdict(calibrator))}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return StatsEntry(self.root / digest[:32], self.root)


class StatsEntry:
    """One entry's files: the ranges and the rankings computed from them."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root

    def load_ranges(self) -> tuple[Any, int] | None:
        """The stored TensorsData and how many frames it came from; None when absent or unreadable."""
        npz, meta = self.path / "ranges.npz", self.path / "ranges.json"
        if not npz.is_file() or not meta.is_file():
            return None
        try:
            info = json.loads(meta.read_text())
            raw = npz.read_bytes()
            if hashlib.sha256(raw).hexdigest() != info.get("npz_sha256"):
                raise ValueError("ranges.npz is not the file ranges.json describes")
            with np.load(io.BytesIO(raw), allow_pickle=False) as arrays:
                ranges = _tensors_data(info, arrays)
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            self._set_aside(npz, meta, reason=exc)
            return None
        self._touch()
        return ranges, int(info.get("samples", 0))

    def save_ranges(self, ranges: Any, samples: int) -> None:
        """Store `ranges` (TensorsData) atomically: the arrays first, then the description that makes them valid."""
        self.path.mkdir(parents=True, exist_ok=True)
        arrays, fields_of = _arrays(ranges)
        buffer = _npz_bytes(arrays)
        atomic_write_bytes(self.path / "ranges.npz", buffer)
        info = {"format": STATS_FORMAT, "method": ranges.calibration_method.name, "samples": samples,
                "tensors": list(fields_of), "fields": fields_of, "npz_sha256": hashlib.sha256(buffer).hexdigest()}
        atomic_write_bytes(self.path / "ranges.json", json.dumps(info).encode())
        self._prune()

    def load_ranking(self, tag: str) -> list[TensorError] | None:
        """The stored ranking for the recipe `tag`; None when absent or unreadable."""
        path = self._ranking_path(tag)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            ranking = [TensorError.from_dict(item) for item in data["ranking"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._set_aside(path, reason=exc)
            return None
        return ranking

    def save_ranking(self, tag: str, ranking: list[TensorError]) -> None:
        """Store the ranking for the recipe `tag` (beside the ranges it was measured with)."""
        self.path.mkdir(parents=True, exist_ok=True)
        data = {"format": STATS_FORMAT, "tag": tag, "frames": sensitivity.MAX_FRAMES,
                "ranking": [t.to_dict() | {"error": t.error} for t in ranking]}
        atomic_write_bytes(self._ranking_path(tag), json.dumps(data).encode())

    @property
    def name(self) -> str:
        """The entry's directory name (its key)."""
        return self.path.name

    def _ranking_path(self, tag: str) -> Path:
        return self.path / f"ranking-{hashlib.sha256(tag.encode()).hexdigest()[:16]}.json"

    def _touch(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def _set_aside(self, *paths: Path, reason: BaseException) -> None:
        log.warning("calibration stats %s do not read back (%s: %s): set aside as *.corrupt, computing them again",
                    self.path, type(reason).__name__, reason)
        for path in paths:
            with contextlib.suppress(OSError):
                os.replace(path, path.with_name(path.name + ".corrupt"))

    def _prune(self) -> None:
        """Keep the newest KEEP_ENTRIES entries (by last use)."""
        try:
            entries = sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for old in entries[:-KEEP_ENTRIES]:
            if old != self.path:
                log.info("calibration stats: dropping the least recently used entry %s", old.name)
                shutil.rmtree(old, ignore_errors=True)


def shared(prepared: Path, feeds: Feeds, calibrator: CalibratorSpec, *, store: StatsStore | None,
           ranking: RankingSpec | None, work: Path) -> Shared:
    """The ranges (and, with `ranking`, the sensitivity ranking) of the prepared graph saved at `prepared` (node
    names unique, shapes inferred): from the store's entry when an earlier round left them there, else computed,
    and stored. `feeds()` gives the calibration feeds; it is called only when something must be computed."""
    entry = store.entry(prepared, calibrator) if store is not None else None
    report = StatsReport(entry=entry.name if entry else None)
    items = _Once(feeds)
    stored = entry.load_ranges() if entry else None
    if stored is not None:
        ranges, report.samples = stored
        report.reused.append("ranges")
    else:
        t0 = time.perf_counter()
        ranges = calibrate(prepared, items(), calibrator, work)
        report.calibration_passes, report.calibration_s, report.samples = 1, time.perf_counter() - t0, len(items())
        if entry:
            entry.save_ranges(ranges, report.samples)
    ranked = _ranking(prepared, items, ranges, ranking, entry, report) if ranking else None
    log.info("INT8 calibration: ranges %s%s", "reused" if "ranges" in report.reused else
             f"computed on {report.samples} frames in {report.calibration_s:.1f} s",
             "" if ranking is None else ", ranking " + ("reused" if "ranking" in report.reused else
                                                        f"computed in {report.ranking_s:.1f} s"))
    return Shared(ranges, ranked, report)


def _ranking(prepared: Path, items: "_Once", ranges: Any, spec: RankingSpec, entry: StatsEntry | None,
             report: StatsReport) -> list[TensorError]:
    """The stored ranking, or one measured with the calibration's own ranges (and stored)."""
    stored = entry.load_ranking(spec.tag) if entry else None
    if stored is not None:
        report.reused.append("ranking")
        return stored
    t0 = time.perf_counter()
    ranked = sensitivity.rank_tensors(
        onnx.load(str(prepared)),
        items()[: sensitivity.MAX_FRAMES],
        symmetric=spec.symmetric,
        quantized=spec.quantized,
        ranges=value_ranges(ranges),
    )
    report.ranking_passes, report.ranking_s = 1, time.perf_counter() - t0
    if entry:
        entry.save_ranking(spec.tag, ranked)
    return ranked


def calibrate(prepared: Path, feeds: Sequence[dict[str, np.ndarray]], calibrator: CalibratorSpec, work: Path) -> Any:
    """ONNX Runtime's calibration of the graph saved at `prepared` over `feeds`: the TensorsData quantize_static
    would compute itself (same `create_calibrator` arguments)."""
    from onnxruntime.quantization.calibrate import create_calibrator

    work.mkdir(parents=True, exist_ok=True)
    ort_calibrator = create_calibrator(Path(prepared), list(calibrator.op_types),
                                       augmented_model_path=str(work / "augmented.onnx"),
                                       calibrate_method=calibrator.ort_method(), extra_options=dict(calibrator.options))
    try:
        ort_calibrator.collect_data(_Reader(feeds))
        return ort_calibrator.compute_data()
    finally:
        del ort_calibrator
        (work / "augmented.onnx").unlink(missing_ok=True)


def value_ranges(ranges: Any) -> dict[str, Range]:
    """Each tensor's (lowest, highest) from a TensorsData (per-channel ranges: their extremes)."""
    out: dict[str, Range] = {}
    for name, data in ranges.items():
        lowest, highest = getattr(data, "lowest", None), getattr(data, "highest", None)
        if lowest is not None and highest is not None:
            out[name] = (float(np.min(lowest)), float(np.max(highest)))
    return out


def quantize_static_on(prepared: Path, out: Path, ranges: Any, **options: Any) -> None:
    """onnxruntime.quantization.quantize_static with `ranges` as its calibration: no calibration inference.

    Where quantize_static takes a `calibration_cache_path` (ONNX Runtime 1.26+), the ranges go through ORT's own
    cache file. Older releases (1.17 to 1.25, JetPack 6 ships 1.23) always calibrate, through the
    `create_calibrator` their quantize module imported; for the call, that name returns a calibrator that
    already holds the ranges. The build runs in its own single-threaded child process, so the swap is seen by
    this call only, and it is checked: a release that calibrates some other way fails on the empty reader
    instead of quantizing with ranges of its own."""
    # the module, not the package's `quantize` function of the same name
    ort_quantize = importlib.import_module("onnxruntime.quantization.quantize")
    if takes_cache_path(ort_quantize.quantize_static):
        from onnxruntime.quantization.calibrate import save_tensors_data

        cache = out.with_name(out.name + ".ranges.json")
        save_tensors_data(ranges, cache)
        try:
            ort_quantize.quantize_static(str(prepared), str(out), None, calibration_cache_path=str(cache), **options)
        finally:
            cache.unlink(missing_ok=True)
        return
    with _served(ort_quantize, ranges) as calls:
        ort_quantize.quantize_static(str(prepared), str(out), _Reader([]), **options)
    if calls != [1]:
        raise RuntimeError(f"quantize_static built {len(calls)} calibrators, expected 1: this onnxruntime "
                           "calibrates differently; engines.build.calibration_stats needs updating")


def takes_cache_path(quantize_static: Callable[..., Any]) -> bool:
    """Whether this onnxruntime's quantize_static reads its calibration from a `calibration_cache_path`."""
    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


@contextlib.contextmanager
def _served(module: Any, ranges: Any) -> Iterator[list[int]]:
    original = module.create_calibrator
    calls: list[int] = []

    def serve(*_args: Any, **_kwargs: Any) -> _Served:
        calls.append(1)
        return _Served(ranges)

    module.create_calibrator = serve
    try:
        yield calls
    finally:
        module.create_calibrator = original


class _Served:
    """A calibrator whose ranges are already known (quantize_static calls collect_data, then compute_data)."""

    def __init__(self, ranges: Any) -> None:
        self.ranges = ranges

    def collect_data(self, _reader: Any) -> None:
        """Nothing to run: the ranges are known."""

    def compute_data(self) -> Any:
        """The known ranges."""
        return self.ranges


class _Reader:
    """ONNX Runtime's CalibrationDataReader over ready feeds."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]) -> None:
        self._it = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next feed, None at the end."""
        return next(self._it, None)


class _Once:
    """`feeds()` called at most once, on first use."""

    def __init__(self, feeds: Feeds) -> None:
        self._feeds = feeds
        self._items: Sequence[dict[str, np.ndarray]] | None = None

    def __call__(self) -> Sequence[dict[str, np.ndarray]]:
        if self._items is None:
            self._items = list(self._feeds())
        return self._items


# -------------------------------------------------------------------------------- TensorsData on disk


def _arrays(ranges: Any) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Every array of a TensorsData as npz members `<index>.<field>`, and each tensor's fields (in order)."""
    arrays: dict[str, np.ndarray] = {}
    fields_of: dict[str, list[str]] = {}
    for i, (name, data) in enumerate(ranges.items()):
        present = [f for f in _TENSOR_FIELDS if hasattr(data, f)]
        for f in present:
            arrays[f"{i}.{f}"] = np.asarray(getattr(data, f))
        fields_of[name] = present
    return arrays, fields_of


def _tensors_data(info: Mapping[str, Any], arrays: Any) -> Any:
    """Inverse of `_arrays`: a 0-d array comes back as the numpy scalar the calibrator gave."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    if info.get("format") != STATS_FORMAT:
        raise ValueError(f"format {info.get('format')!r}, expected {STATS_FORMAT}")
    data = {}
    for i, name in enumerate(info["tensors"]):
        values = {}
        for f in info["fields"][name]:
            array = arrays[f"{i}.{f}"]
            values[f] = array[()] if array.ndim == 0 else array
        data[name] = TensorData(**values)
    return TensorsData(CalibrationMethod[info["method"]], data)


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # mypy: a key could be savez's allow_pickle; these are tensor names
    return buffer.getvalue()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
