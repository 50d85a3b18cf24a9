"""What `splitmoe up` leaves in its run directory for the commands that act on the running stack
(`splitmoe rebalance`, `splitmoe heatmap`): the cluster secret of the run, readable by the user
only, beside services.json (the supervisor's: which service listens where); and a pointer, in
the cache, to the run started most recently."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from splitmoe.runtime.settings import cache_dir

TOKEN_FILE = "cluster-token"
MANIFEST = "services.json"


def latest_pointer() -> Path:
    return cache_dir() / "runs" / "latest"


def record_run(run_dir: Path, cluster_token: str) -> None:
    """Keep the run's secret in its directory (0600, in a 0700 directory) and point `latest` at it."""
    token_path = run_dir / TOKEN_FILE
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cluster_token + "\n")
    pointer = latest_pointer()
    pointer.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = pointer.with_name(f"latest.{os.getpid()}.tmp")
    tmp.write_text(str(run_dir) + "\n")
    tmp.replace(pointer)


@dataclass(frozen=True, slots=True)
class RunningStack:
    run_dir: Path
    attention_address: str
    token_file: Path


def latest_run() -> RunningStack:
    """The stack `splitmoe up` started most recently, or a ValueError saying why there is none."""
    try:
        run_dir = Path(latest_pointer().read_text().strip())
    except FileNotFoundError:
        raise ValueError("no stack started by `splitmoe up` found: give --attention HOST:PORT") from None
    try:
        manifest = json.loads((run_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        raise ValueError(f"the latest `splitmoe up` run ({run_dir}) has no readable {MANIFEST}: "
                         "is it still starting? Else give --attention HOST:PORT") from None
    if not _alive(manifest.get("supervisor_pid", 0)):
        raise ValueError(f"the latest `splitmoe up` run ({run_dir}) has stopped: give --attention HOST:PORT")
    for service in manifest.get("services", ()):
        if service.get("name") == "attention":
            return RunningStack(run_dir, service["address"], run_dir / TOKEN_FILE)
    raise ValueError(f"the latest `splitmoe up` run ({run_dir}) has no attention service yet")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return pid > 0
