"""Values in the rendezvous store that an outsider cannot forge: HMAC-SHA256 over key and value.

A TCPStore has no authentication; a value whose signature does not check with the job's secret
is treated as absent. Without a secret the values are checked for form only (see "Keeping the
store private" in docs/clusters.md).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

__all__ = ["SignedStore"]

_SEP = b"|"


class SignedStore:
    """Sign what is written and check what is read, on top of a ``torch.distributed`` store.

    Args:
        store: the store (usually a ``PrefixStore``).
        secret: the job's secret; ``b""`` signs with an empty key (form only, no authentication).
    """

    def __init__(self, store: Any, secret: bytes) -> None:
        self.store, self._secret = store, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + _SEP + value, hashlib.sha256).hexdigest().encode()

    def set(self, key: str, value: str) -> None:
        """Write ``value`` under ``key`` with its signature."""
        data = value.encode()
        self.store.set(key, self._mac(key, data) + _SEP + data)

    def get(self, key: str) -> str | None:
        """The value under ``key`` (waits for it like ``Store.get``); ``None`` when its signature fails."""
        return self._open(key, self.store.get(key))

    def get_if_set(self, key: str) -> str | None:
        """The value under ``key`` without waiting; ``None`` when absent or not signed by the job."""
        if not self.store.check([key]):
            return None
        return self.get(key)

    def _open(self, key: str, raw: bytes) -> str | None:
        mac, sep, data = bytes(raw).partition(_SEP)
        if not sep or not hmac.compare_digest(mac, self._mac(key, data)):
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None

    def add(self, key: str, amount: int) -> int:
        """``Store.add`` (a counter cannot be signed; callers treat it as a hint only)."""
        return int(self.store.add(key, amount))
