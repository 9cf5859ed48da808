"""Who may run a program this worker holds without sending its bytes.

Program hashes are published (worker records list what they cache), so a hash is no capability: a stranger who named
one ran another client's model on the cached weights, and recovered a private layer's weights exactly. Here:

* a client that sent the program's bytes to this worker (checked against its hash), or proved that it holds them
  (:mod:`gpunet.protocol.holding`), is one of its **holders** here: its jobs run on the copy held here;
* a program a holder published as **shared** (``Submit.shared``: public checkpoints) runs for anyone who names its
  hash, and its pieces are served to any peer. Only a holder can share it (whoever holds the bytes could publish them
  anyway), and a shared program stays shared;
* a **private** program (``Submit.private``) is never written to disk, served or advertised; only clients that sent
  its bytes run it (the worker keeps no copy outside its executors to check a proof against).

Forgetting fails closed: a program or holder dropped from the bounded table must send its bytes or prove again (a
client sends its proof with every job, so that costs it nothing); it never makes a program runnable by anyone else.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PROGRAMS = 4096  # programs whose holders are tracked (least recently used forgotten first)
MAX_HOLDERS = 256  # holders tracked per program (least recently seen forgotten first)


@dataclass
class _Program:
    holders: dict[str, None] = field(default_factory=dict)  # insertion-ordered: the least recently seen first
    private: bool = False
    shared: bool = False


class Owners:
    def __init__(self, max_programs: int | None = None, max_holders: int | None = None):
        self.max_programs, self.max_holders = max_programs or MAX_PROGRAMS, max_holders or MAX_HOLDERS
        self._programs: dict[str, _Program] = {}  # insertion-ordered: the least recently used first

    def __len__(self) -> int:
        return len(self._programs)

    def may_run(self, program_hash: str, client_id: str) -> bool:
        """Whether ``client_id``'s job may run on the copy held here without sending the bytes or a proof."""
        program = self._programs.get(program_hash)
        return program is not None and (program.shared or client_id in program.holders)

    def is_private(self, program_hash: str) -> bool:
        program = self._programs.get(program_hash)
        return program is not None and program.private

    def is_shared(self, program_hash: str) -> bool:
        program = self._programs.get(program_hash)
        return program is not None and program.shared

    def add(self, program_hash: str, client_id: str, private: bool = False, shared: bool = False) -> None:
        """``client_id`` holds the program's bytes (it sent them, checked, or proved it). ``private``: its copy here
        is private (nobody else's job runs on it); ``shared``: it publishes the program for anyone. A shared program
        is never made private, and a private one never shared."""
        program = self._programs.pop(program_hash, None)
        if program is None:
            program = _Program(private=private)
            while len(self._programs) >= self.max_programs:
                del self._programs[next(iter(self._programs))]
        self._programs[program_hash] = program
        program.holders.pop(client_id, None)
        program.holders[client_id] = None
        while len(program.holders) > self.max_holders:
            del program.holders[next(iter(program.holders))]
        if shared and not program.private:
            program.shared = True
