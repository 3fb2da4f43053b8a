"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
