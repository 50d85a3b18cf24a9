"""`splitmoe cluster-token PATH`: the file holding the cluster secret, made once.

Every service reads it with `--cluster-token-file PATH` (compose.yaml runs this first, into a
volume the services mount read-only). With SPLITMOE_CLUSTER_TOKEN set, that secret is written;
otherwise an existing file is kept, and a missing one gets a fresh random secret. The secret is
never printed.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster-token", help="write the cluster secret file the services read (--cluster-token-file)")
    p.add_argument("path", type=Path, help="the file (mode 0600); kept if it already holds a secret")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from splitmoe.runtime import settings
    from splitmoe.runtime.cluster_auth import ClusterSecurity, read_secret_file

    path: Path = args.path
    given = settings.cluster_token().strip()
    if given:
        ClusterSecurity(token=given)  # what is not a secret fails here, saying why
    elif path.exists():
        ClusterSecurity(token=read_secret_file(path, "cluster-token"))  # so does a damaged file, named
        print(f"{path}: kept the cluster secret it holds")
        return 0
    _write_private(path, given or settings.new_cluster_token())
    print(f"{path}: wrote {'the cluster secret of SPLITMOE_CLUSTER_TOKEN' if given else 'a new random cluster secret'}")
    return 0


def _write_private(path: Path, text: str) -> None:
    """Readable by this user only from the first byte on, and whole or not at all."""
    import os

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    tmp.replace(path)
