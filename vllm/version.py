__version__ = "0.1.0"


def _prev_minor_version() -> str:
    """The minor release before this one ("0.0" for 0.1.x), as upstream's helper of that name returns it:
    `--show-hidden-metrics-for-version` takes it to show the metrics hidden since then."""
    major, minor = (int(p) for p in __version__.split(".")[:2])
    return f"{major}.{max(minor - 1, 0)}"


def _prev_minor_version_was(version: str) -> bool:
    """Whether `version` ("0.0", or "0.0.x") names the previous minor release."""
    return ".".join(version.split(".")[:2]) == _prev_minor_version()
