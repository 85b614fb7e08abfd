"""A benchmark's finished runs, kept on disk as they finish, so that a run of hours resumes where it
stopped, on another machine, from what was committed (a session ends and kills its jobs).

    log = RunLog(path, config)          # config: what must match for the saved runs to count
    if log.has(key): row = log.row(key)
    else: row = ...; log.add(key, row)  # written at once (atomically), with the commit that made it

A log whose config differs from the one given is refused (SystemExit naming the differing keys):
its runs answer another question. `log.values` keeps shared results too (a reference output).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance


class RunLog:
    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path, self.config = path, json.loads(json.dumps(config))  # as it reads back from JSON
        self.runs: dict[str, dict[str, Any]] = {}
        self.values: dict[str, Any] = {}
        if path.exists():
            saved = json.loads(path.read_text())
            if saved["config"] != self.config:
                keys = sorted(k for k in set(saved["config"]) | set(self.config)
                              if saved["config"].get(k) != self.config.get(k))
                raise SystemExit(f"{path} holds runs of another configuration (differs in {keys}): move it away "
                                 "to start afresh")
            self.runs, self.values = saved["runs"], saved.get("values", {})

    def has(self, key: str) -> bool:
        return key in self.runs

    def row(self, key: str) -> dict[str, Any]:
        return self.runs[key]["row"]

    def commits(self) -> list[str]:
        """The commits whose code made the saved runs, in order of first use."""
        return list(dict.fromkeys(run["commit"] for run in self.runs.values()))

    def add(self, key: str, row: dict[str, Any]) -> None:
        origin = provenance()
        self.runs[key] = {"row": row, "commit": origin["commit"], "uncommitted_changes": origin["uncommitted_changes"]}
        self._write()

    def keep(self, name: str, value: Any) -> None:
        self.values[name] = value
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"config": self.config, "values": self.values, "runs": self.runs}) + "\n")
        os.replace(temporary, self.path)
