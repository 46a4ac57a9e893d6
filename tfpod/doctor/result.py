"""A check's result: one line of the doctor's output (no TensorFlow here: main.py imports the
doctor before TensorFlow loads)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Result:
    """One check's line: `status check: found[; fix]`.

    Attributes:
      status: "ok", "warn", "FAIL" or "skip" (the check could not run: an earlier one failed).
      check: the check's name, e.g. "devices".
      found: what was found (or what is wrong).
      fix: how to fix it (FAIL and warn).
    """

    status: str
    check: str
    found: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def message(self) -> str:
        return f"{self.found}; {self.fix}" if self.fix else self.found

    def line(self) -> str:
        return f"{self.status:<4} {self.check}: {self.message()}"
