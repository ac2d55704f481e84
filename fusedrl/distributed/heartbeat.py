"""Which ranks died? A heartbeat in the job's TCPStore, read after a collective fails.

A collective that loses a peer fails on the survivors with a transport error that names an address,
not a rank (gloo: "Connection reset by peer [10.0.0.7]:29500"; NCCL: a timeout or remote error). Every
rank stamps a counter in the rendezvous store (torchrun's agent hosts it, so it outlives the workers)
every ``interval_s``; after a failure, :meth:`Heartbeat.peer_report` watches the counters for a few
intervals and names the ranks whose counter stopped (a rank stopping on its own error records it first, so
it is not taken for a dead one). It works across nodes, where torchrun's own failure summary only lists the
local workers.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "fusedrl/heartbeat"
WATCH_INTERVALS = 3.0  # a rank is silent when its counter did not advance over this many intervals


class Heartbeat:
    """This rank's heartbeat thread plus a reader of every rank's counter (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fusedrl-heartbeat", daemon=True)

    @classmethod
    def from_env(cls, interval_s: float = 1.0) -> Heartbeat | None:
        """A started heartbeat on the torchrun store (MASTER_ADDR/PORT, RANK, WORLD_SIZE); None outside torchrun."""
        env = os.environ
        if not all(k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")) or int(env["WORLD_SIZE"]) < 2:
            return None
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30))
        beat = cls(store, int(env["RANK"]), int(env["WORLD_SIZE"]), interval_s)
        beat.start()
        return beat

    def start(self) -> None:
        self.store.set(str(self.rank), "0")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s)

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self.store.set(str(self.rank), str(count))
            except Exception:  # the store is gone (its host died): nothing left to report to
                return

    def report_failure(self, reason: str) -> None:
        """Record that this rank is stopping on its own error, so that peers do not take it for a dead rank."""
        try:
            self.store.set(f"failed/{self.rank}", reason)
        except Exception:
            pass

    def claim(self, name: str) -> bool:
        """True for exactly one rank, the first to claim ``name`` (e.g. the rank that prints an error all ranks hit)."""
        try:
            return self.store.add(f"claim/{name}", 1) == 1
        except Exception:  # the store is gone: printing twice beats printing nothing
            return True

    def _read(self, keys: list[str]) -> dict[str, bytes]:
        present = [k for k in keys if self.store.check([k])]
        return dict(zip(present, self.store.multi_get(present))) if present else {}

    def peer_report(self, watch_intervals: float = WATCH_INTERVALS) -> tuple[list[int], dict[int, str]] | None:
        """(silent ranks, {rank: reason} of ranks that reported their own failure), watched over
        ``watch_intervals`` heartbeat intervals. Silent: another rank whose counter did not advance (or never
        started) and that reported no failure — killed, or hung. None when the store cannot be reached."""
        counters = [str(r) for r in range(self.world_size)]
        try:
            before = self._read(counters)
            time.sleep(watch_intervals * self.interval_s)
            after = self._read(counters)
            failed = {
                int(k.split("/")[1]): v.decode(errors="replace")
                for k, v in self._read([f"failed/{r}" for r in range(self.world_size)]).items()
            }
        except Exception:
            return None
        silent = [
            r
            for r in range(self.world_size)
            if r != self.rank and r not in failed and (str(r) not in after or after[str(r)] == before.get(str(r)))
        ]
        return silent, failed


def describe_failure(exc: BaseException, rank: int, heartbeat: Heartbeat | None) -> str:
    """One line for a rank that is stopping on ``exc``: its error and what the heartbeat says about the peers."""
    first = (str(exc).strip().splitlines() or [""])[0]
    line = f"rank {rank} stopped: {type(exc).__name__}: {first[:300]}"
    if heartbeat is None:
        return line
    heartbeat.report_failure(line)
    report = heartbeat.peer_report()
    if report is None:
        return line + "; the peers cannot be checked (the rendezvous store is gone); see the launcher's summary"
    silent, failed = report
    if silent:
        line += (
            f"; rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering "
            f"(no heartbeat for {WATCH_INTERVALS * heartbeat.interval_s:.3g} s: killed or hung)"
        )
    others = {r: why for r, why in failed.items() if r != rank}
    if others:
        line += "; also " + "; ".join(others.values())
    return line
