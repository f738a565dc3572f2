"""Values in the rendezvous store that an outsider cannot forge.

A TCPStore has no authentication (PyTorch's SECURITY.md): anyone who reaches its port can list,
read and overwrite its keys. lockstep never unpickles what it reads from a store, and what its
own keys hold (who joined, the watchdog's positions and verdict) is signed with a per-job secret:
an HMAC-SHA256 over the key and the value. A value whose signature does not check is treated as
absent, so a forged watchdog verdict or position changes nothing.

The secret comes from ``lockstep run`` (a random one per job, handed to the workers in their
environment, which only the job's user and root can read) or from ``--secret-file`` (the same file on
every node of a multi-node job). Without one (plain ``torchrun`` or ``srun``) the values are
checked for form only; the README's "Keeping the store private" section says what that means.

Example::

    signed = SignedStore(store, secret=b"job secret")
    signed.set("verdict", "rank 1 hung")
    signed.get("verdict")          # "rank 1 hung"; None if someone else wrote it
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

    Example::

        SignedStore(store, b"s3cret").get_or_none("0")
    """

    def __init__(self, store: Any, secret: bytes) -> None:
        self.store, self._secret = store, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + _SEP + value, hashlib.sha256).hexdigest().encode()

    def set(self, key: str, value: str) -> None:
        """Write ``value`` under ``key`` with its signature.

        Args:
            key: the store key.
            value: text to store.
        """
        data = value.encode()
        self.store.set(key, self._mac(key, data) + _SEP + data)

    def get(self, key: str) -> str | None:
        """The value under ``key`` (waits for it like ``Store.get``); ``None`` when its signature fails.

        Args:
            key: the store key.
        """
        return self._open(key, self.store.get(key))

    def get_if_set(self, key: str) -> str | None:
        """The value under ``key`` without waiting; ``None`` when absent or not signed by the job.

        Args:
            key: the store key.
        """
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
        """``Store.add`` (a counter cannot be signed; callers treat it as a hint only).

        Args:
            key: the counter's key.
            amount: what to add.
        """
        return int(self.store.add(key, amount))
