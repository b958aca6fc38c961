"""sqlite_utils, imported without pandas: `from agent.storage.sqlite_lean import sqlite_utils`.

sqlite_utils imports pandas whenever it is installed (sqlite_utils.db, for one entry of its column type table:
`pandas.Timestamp` -> TEXT). The agent never writes a pandas value, yet that import costs ~30 MB of resident memory
and ~0.3 s at every start (benchmarks/footprint.py, per-import RSS; issue 45). pandas is no dependency of the agent:
a test extra (motmetrics) brings it, so a device installed with it would pay for it for nothing.

While sqlite_utils is first imported, pandas is marked absent in `sys.modules`, so its `import pandas` fails the
way it does where pandas is not installed; the mark is taken away at once. A process that has already imported
pandas (a benchmark, a test) imports sqlite_utils as it is: nothing here unloads what someone else loaded.
"""

from __future__ import annotations

import sys


def _import_without_pandas() -> None:
    if "sqlite_utils.db" in sys.modules or "pandas" in sys.modules:
        return
    sys.modules["pandas"] = None  # type: ignore[assignment]  # None in sys.modules: `import pandas` raises ImportError
    try:
        import sqlite_utils  # noqa: F401  (the import this module exists for)
    finally:
        if sys.modules.get("pandas", False) is None:
            del sys.modules["pandas"]


_import_without_pandas()

import sqlite_utils as sqlite_utils  # noqa: E402  (after the import above, which decides how it loads)

__all__ = ["sqlite_utils"]
