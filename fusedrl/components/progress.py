"""Progress of a long phase: a tqdm bar where stderr is a terminal, else a plain line every few seconds."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tqdm.auto import tqdm


class Progress:
    """``done / total`` of one phase with a rate and figures, shown on one process (e.g. rank 0).

    On a terminal a tqdm bar; otherwise (logs, CI, a file) one line every ``interval`` seconds and one at the end
    (``"<desc>: 12/32 req, 3.10 req/s, tok_s 250, 3.9 s"``), none for a phase shorter than ``interval``. ``enabled=False`` shows nothing (other ranks, or
    ``metrics.progress = false``). ``total`` may change while it runs (requests migrated away or in).
    """

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str,
        *,
        enabled: bool = True,
        interval: float = 10.0,
        stream: IO[str] | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.enabled, self.interval = desc, total, unit, enabled, interval
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.figures: dict[str, Any] = {}
        self.start = self.last_line = time.perf_counter()
        terminal = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False) if terminal else None

    def update(self, n: int = 1, **figures: Any) -> None:
        """``n`` more units done; ``figures`` (e.g. ``tok_s=250``) replace the ones shown."""
        if not self.enabled:
            return
        self.done += n
        self.figures.update(figures)
        if self._bar is not None:
            self._bar.update(n)
            if figures:
                self._bar.set_postfix(self.figures, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self._line(now)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        """The final line (plain mode, a phase of ``interval`` or longer) or the bar's removal."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif (now := time.perf_counter()) - self.start >= self.interval:
            self._line(now, final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, now: float, final: bool = False) -> None:
        seconds = max(now - self.start, 1e-9)
        parts = [f"{self.done}/{self.total} {self.unit}", f"{self.done / seconds:.2f} {self.unit}/s"]
        parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.figures.items()]
        parts.append(f"{seconds:.1f} s" + (" (done)" if final else ""))
        print(f"{self.desc}: " + ", ".join(parts), file=self.stream, flush=True)
