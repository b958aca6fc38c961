"""`python -m engines ...`: the engine layer on its own, without the agent (no config, explicit paths).

    python -m engines fingerprint [--json] [--root /]
    python -m engines build MODEL --cache-dir DIR --db FILE [--precision P] [--calibration DIR]
                            [--validation DIR] [--json]
    python -m engines list --cache-dir DIR --db FILE [--json]
    python -m engines gc --cache-dir DIR --db FILE --budget-mb N [--pin KEY_OR_SHA ...]
    python -m engines build-worker JOB.json        (internal: the child process of a build)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """Dispatch; exit codes 0 ok, 1 failed, 2 usage (as `edge-agent`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-worker"]:  # keep the child's start-up lean: no argparse tree, no rich
        from engines.build.worker import main as worker_main

        return worker_main(argv[1:])
    args = _parser().parse_args(argv)
    from kernel.errors import EdgeError

    try:
        return int(args.func(args) or 0)
    except EdgeError as exc:
        print(f"error ({exc.code}): {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engines", description="Build, cache and validate engines.")
    sub = parser.add_subparsers(required=True)
    fp = sub.add_parser("fingerprint", help="what makes an engine non-portable on this device")
    fp.add_argument("--root", type=Path, default=Path("/"))
    fp.add_argument("--json", action="store_true")
    fp.set_defaults(func=_fingerprint)
    build = sub.add_parser("build", help="build (or find cached) the engine for a model")
    build.add_argument("model", type=Path)
    build.add_argument("--precision", choices=("fp32", "fp16", "int8", "auto"))
    build.add_argument("--calibration", type=Path)
    build.add_argument("--validation", type=Path, help="held-out frames the gates judge on (a bare .onnx has none)")
    build.add_argument("--backend", default="auto")
    build.add_argument("--timeout", type=float, default=1800.0)
    build.add_argument("--device", help="TensorRT: gpu | dla | dla:N (default: the manifest's build.device)")
    build.add_argument("--no-validate", action="store_true")
    build.add_argument("--json", action="store_true")
    build.set_defaults(func=_build)
    lst = sub.add_parser("list", help="cached engines")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=_list)
    gc = sub.add_parser("gc", help="evict least recently used engines beyond a size budget")
    gc.add_argument("--budget-mb", type=float, required=True)
    gc.add_argument("--pin", action="append", default=[], help="cache key or model sha256 to keep")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=_gc)
    for p in (build, lst, gc):
        p.add_argument("--cache-dir", type=Path, required=True)
        p.add_argument("--db", type=Path, required=True, help="SQLite file holding the engine index")
    return parser


def _fingerprint(args: argparse.Namespace) -> int:
    from engines.device.fingerprint import read_fingerprint

    fp = read_fingerprint(args.root)
    data = {**fp.to_dict(), "digest": fp.digest()}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            print(f"{key:20} {value if value is not None else '-'}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from engines.build.provisioning import provision
    from engines.model.source import load_model

    def progress(event: dict[str, Any]) -> None:
        if not args.json:
            print(f"[{event.get('elapsed_s', '')}s] {event.get('type')}: {event.get('stage', '')}", file=sys.stderr)

    result = provision(load_model(args.model), backend=args.backend, precision=args.precision,
                       cache_dir=args.cache_dir, db_path=args.db, calibration_dir=args.calibration,
                       validation_dir=args.validation, on_progress=progress, timeout_s=args.timeout,
                       validate=not args.no_validate, device=args.device)
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else
          f"{'hit' if result.hit else 'built'} {result.key[:16]} {result.engine_path} ({result.build_s:.1f} s)")
    return 0


def _list(args: argparse.Namespace) -> int:
    from engines.build.cache_listing import list_cache

    listing = list_cache(args.cache_dir, args.db)  # the index the cache records, else --db (read-only)
    if args.json:
        print(json.dumps([e.to_dict() for e in listing.entries], indent=2))
        return 0
    for e in listing.entries:
        verdict = (e.validation or {}).get("passed")
        users = ", ".join(m["model"] for m in e.models) or e.model
        print(f"{e.key[:16]} {users:24} {e.backend:12} {e.precision:5} {e.size / 2**20:8.1f} MB  "
              f"validation={'-' if verdict is None else ('pass' if verdict else 'FAIL')}")
    for note in listing.notes:
        print(f"note: {note}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from engines.build.cache import EngineCache

    cache = EngineCache(args.cache_dir, args.db)
    try:
        report = cache.gc(int(args.budget_mb * 2**20), set(args.pin))
    finally:
        cache.close()
    print(json.dumps(report.to_dict(), indent=2) if args.json else
          f"removed {len(report.removed)} engine(s), freed {report.freed_bytes / 2**20:.1f} MB, "
          f"{report.kept_bytes / 2**20:.1f} MB kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
