"""Where a stage's ranks find each other: a TCPStore that rank 0 hosts at --tensor-parallel-master
for its whole life. Each peer (rank 1 .. T-1) keeps its advertised worker address there (a
thread sets it every second, so a restarted rank 0's empty store is filled again within a
second), rank 0 reads them to reach its peers' Worker services, and every group formation
(group.py) rendezvouses through it under the session's prefix.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch.distributed as dist

from strata.stage_links import host_of

log = logging.getLogger("strata.worker")

REGISTER_SECONDS = 1.0


def _key(rank: int) -> str:
    return f"strata/tp/peer/{rank}"


def split_address(address: str) -> tuple[str, int]:
    if ":" not in address:
        raise ValueError(f"--tensor-parallel-master {address!r}: expected host:port")
    return host_of(address), int(address.rsplit(":", 1)[1])


class Rendezvous:
    """Rank `rank` of `size`'s end of the stage's store at `master` (host:port)."""

    def __init__(self, rank: int, size: int, master: str, advertise: str, timeout: float):
        self.rank, self.size, self.advertise, self.timeout = rank, size, advertise, timeout
        self.host, self.port = split_address(master)
        self._stop = threading.Event()
        self.store = None
        if rank == 0:
            self.store = dist.TCPStore(
                self.host,
                self.port,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        else:
            threading.Thread(target=self._register, name="tp-register", daemon=True).start()

    def _client(self, timeout: float):
        return dist.TCPStore(
            self.host, self.port, is_master=False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )

    def _register(self) -> None:
        """A peer: its address in rank 0's store, again every second (a store that restarted
        is filled again)."""
        client, said = None, False
        while not self._stop.is_set():
            try:
                if client is None:
                    client = self._client(5.0)
                client.set(_key(self.rank), self.advertise)
                if not said:
                    log.info("tensor parallel: rank %d registered at %s:%d", self.rank, self.host, self.port)
                    said = True
            except Exception as e:  # rank 0 is not up (yet, or any more): try again
                if said:
                    log.warning("tensor parallel: rank 0's store at %s:%d: %s", self.host, self.port, e)
                client, said = None, False
            self._stop.wait(REGISTER_SECONDS)

    def peer_addresses(self) -> list[str | None]:
        """Rank 0: ranks 1 .. T-1's advertised addresses (None where one has not registered)."""
        out = []
        for rank in range(1, self.size):
            key = _key(rank)
            out.append(self.store.get(key).decode() if self.store.check([key]) else None)
        return out

    def group_store(self):
        """The store a group formation rendezvouses through: rank 0's own, or a new connection to
        it (rank 0 may have restarted since the last)."""
        return self.store if self.rank == 0 else self._client(self.timeout)

    def close(self) -> None:
        self._stop.set()
