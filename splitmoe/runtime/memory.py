"""What a process holds in memory, as the kernel counts it: its own pages (copies: dequantized
tensors, caches, buffers) apart from the pages of the files it maps (the GGUF) that it has touched.

A model is mapped, not copied: its blocks count as file pages, which the page cache shares between
processes mapping the same file and can drop under pressure; only the own pages are what a service
costs beyond the file.
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Resident:
    own_bytes: int          # RssAnon: copies, caches, buffers
    file_bytes: int         # RssFile: pages of mapped files (the model) this process has touched
    shared_bytes: int       # RssShmem: shared-memory regions (the hop's slots)

    def describe(self) -> str:
        return (f"{self.own_bytes / MIB:.0f} MiB own, {self.file_bytes / MIB:.0f} MiB of mapped files, "
                f"{self.shared_bytes / MIB:.0f} MiB shared memory")


def resident(pid: int | str = "self") -> Resident | None:
    """None where /proc does not say (not Linux, or the process is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "RssFile", "RssShmem"):
                    fields[name] = int(value.split()[0]) * 1024  # kB
    except OSError:
        return None
    if len(fields) < 3:
        return None
    return Resident(fields["RssAnon"], fields["RssFile"], fields["RssShmem"])
