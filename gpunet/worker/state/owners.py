"""Private programs (``Submit.private``): which clients sent a program's bytes. Only they may run it from this
worker's memory; it is never advertised nor written to disk, and anyone else must send the bytes (the bytes are the
capability). Pure: whether an executor still holds a program is asked through ``held``."""

from __future__ import annotations

from typing import Callable

from gpunet.errors import JobRejected

MAX_PRIVATE_PROGRAMS = 4096  # private programs whose owners are tracked


class Owners:
    def __init__(self, held: Callable[[str], bool], max_programs: int | None = None):
        """``held(hash)``: whether an executor may still hold that program."""
        self._held, self.max_programs = held, max_programs or MAX_PRIVATE_PROGRAMS
        self._owners: dict[str, set[str]] = {}  # bounded by add (never evicts a program still held)

    def __contains__(self, program_hash: str) -> bool:
        return program_hash in self._owners

    def owns(self, program_hash: str, client_id: str) -> bool | None:
        """Whether ``client_id`` sent that private program's bytes (None: the program is not private here)."""
        owners = self._owners.get(program_hash)
        return None if owners is None else client_id in owners

    def add(self, program_hash: str, client_id: str) -> None:
        """Record that ``client_id`` holds a private program's bytes. Entries are never evicted while an executor
        may still hold the program (an evicted one would make it public); when the table is full, entries of
        programs no longer held are dropped, and if none is, the job is refused."""
        owners = self._owners.get(program_hash)
        if owners is None:
            if len(self._owners) >= self.max_programs:
                for gone in [h for h in self._owners if not self._held(h)]:
                    del self._owners[gone]
            if len(self._owners) >= self.max_programs:
                raise JobRejected("this worker holds as many private programs as it keeps track of; try another")
            owners = self._owners[program_hash] = set()
        owners.add(client_id)
