"""What a registry announcement (or a device's caps, as a client shows them) may hold.

Anyone who can reach an rpyc registry can announce a device, so an announcement is a peer's
word: :func:`check_announcement` keeps only the fields ``tapml devices`` shows, each of the type
it is shown as, bounded in length. Escaping what is printed is the printer's job.
"""

from __future__ import annotations

MAX_TEXT = 200
MAX_FEATURES = 256
TEXT_FIELDS = ("platform", "adapter", "backend")


def check_announcement(info) -> dict | None:
    """The announcement ``info`` (a parsed JSON value) as ``{"platform", "adapter", "backend": str,
    "features": [str]}`` (fields it lacks are left out), or None when it is not an object or a field
    has the wrong type: ``{"features": 5}`` is refused, not shown.

    Example: ``check_announcement({"platform": "wgpu", "features": ["shader-f16"]})`` is that dict;
    ``check_announcement({"features": 5})`` is None.
    """
    if not isinstance(info, dict):
        return None
    out: dict = {}
    for key in TEXT_FIELDS:
        value = info.get(key)
        if value is None:
            continue
        if type(value) is not str or len(value) > MAX_TEXT:
            return None
        out[key] = value
    features = info.get("features")
    if features is not None:
        if type(features) is not list or len(features) > MAX_FEATURES or \
                not all(type(f) is str and len(f) <= MAX_TEXT for f in features):
            return None
        out["features"] = list(features)
    return out


__all__ = ["check_announcement"]
