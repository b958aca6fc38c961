"""Model artifacts: signing keys, packaging, device-side trust and verification, downloading.

The device-facing API (docs/deployments.md):

- `ArtifactsConfig` — the `[artifacts]` config section;
- `verify_artifact(dir, config) -> ModelSource` — signature, paths, sizes, hashes, loadable model;
- `fetch_artifact(url, dest_dir, config, on_progress, stop_event) -> Path` and the content-addressed
  `fetch_into(url, store_dir, config, ...)`;
- `ensure_demo_key(state_dir)`, `package_demo(state_dir)` — the locally signed demo artifact.

Submodules are imported lazily by callers; this package imports nothing heavy at import time.
"""

from __future__ import annotations

__all__ = ["ArtifactsConfig", "ensure_demo_key", "fetch_artifact", "fetch_into", "package_demo", "verify_artifact"]


def __getattr__(name: str) -> object:
    """Lazy re-exports, so `import agent.artifacts.config` stays cheap (no onnx, no urllib)."""
    if name == "ArtifactsConfig":
        from agent.artifacts.config import ArtifactsConfig

        return ArtifactsConfig
    if name in ("fetch_artifact", "fetch_into"):
        from agent.artifacts import fetch

        return getattr(fetch, name)
    if name in ("verify_artifact", "ensure_demo_key", "package_demo"):
        from agent.artifacts import trust

        return getattr(trust, name)
    raise AttributeError(f"module 'agent.artifacts' has no attribute {name!r}")
