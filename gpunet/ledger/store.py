"""A node's ledger: an append-only, hash-chained SQLite file of complete receipts, one per data dir.

Each entry holds one receipt and the hash of the previous entry; ``entry_hash = sha256(domain | seq | prev_hash |
receipt bytes)``, so changing, removing or reordering any entry breaks every hash after it, and the receipt's own two
signatures catch an attacker who rewrites the chain too. A job is known by its client and its id: a retried job is
stored once, and ids are the client's own namespace (schema 2; in schema 1 a job id was global, so a receipt two
strangers signed under a real job's id turned the real one into a "conflict"). Schema 1 files are migrated when
opened for writing, and read as they are otherwise.

Durability: WAL journal with ``synchronous=NORMAL``. A committed append is in the WAL before ``append`` returns, so it
survives the process being killed at any point (SIGKILL mid-write loses at most the uncommitted entry in flight, and
WAL frames are checksummed, so a torn write is discarded, never half-applied). The WAL is fsynced at checkpoints rather
than at every commit, so an OS crash or power loss can drop the last few appends but cannot corrupt the file or the
chain. That trade is right here because every receipt exists twice — the counterparty holds the same signed receipt
and a ``merge`` restores a lost one — while ``synchronous=FULL`` (an fsync per receipt) would cap appends at the
disk's fsync rate. ``scripts/bench_ledger.py`` measures both.

Besides the chain, three side tables that are not part of it: ``unpaid`` (receipts this node signed as a worker whose
client never countersigned: unpaid work stays visible to the worker), ``conflicts`` (a second, different receipt
for a job id already in the ledger: evidence of fraud, recorded and never chosen over the first) and, since schema 3,
``unbilled`` (work a worker started and was never paid for, with the reason: the client refused the receipt, the job
was cancelled, timed out, was preempted or failed; see ``gpunet earnings``). It keeps the newest
:data:`MAX_UNBILLED` notes. Since schema 4, ``merged`` names the entries that came in by ``merge`` rather than from
this node's own job path, which decides what the node vouches for (gpunet.ledger.vouching); ``provenance`` holds the
first entry whose origin is known (entries filed before a ledger kept it are of unknown origin).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from gpunet.config import resolve_data_dir
from gpunet.errors import InvalidReceipt, LedgerCorrupted, LedgerError, ReceiptConflict
from gpunet.ledger.balances import Balance, BalanceSheet
from gpunet.ledger.entries import Conflict, Entry, LedgerHead, MergeReport, Unbilled
from gpunet.ledger.export import read_json_export
from gpunet.ledger.receipts import MAX_RECEIPT_BYTES, Receipt
from gpunet.ledger.vouching import Origin, vouched

LEDGER_FILENAME = "ledger.sqlite"
SCHEMA_VERSION = 4
#: Notes of unbilled work kept (the oldest go first): a client that cancels in a loop cannot grow the file forever.
MAX_UNBILLED = 100_000
GENESIS_HASH = bytes(32)
_ENTRY_DOMAIN = b"gpunet/ledger-entry/v1\x00"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_VERIFY_BATCH = 2048

_TABLES = """
CREATE TABLE entries (
    seq        INTEGER PRIMARY KEY,
    client_id  TEXT    NOT NULL,
    job_id     TEXT    NOT NULL,
    receipt    BLOB    NOT NULL,
    prev_hash  BLOB    NOT NULL,
    entry_hash BLOB    NOT NULL,
    UNIQUE (client_id, job_id)
);
CREATE TABLE unpaid (
    client_id      TEXT    NOT NULL,
    job_id         TEXT    NOT NULL,
    worker_id      TEXT    NOT NULL,
    receipt        BLOB    NOT NULL,
    recorded_at_us INTEGER NOT NULL,
    PRIMARY KEY (client_id, job_id)
);
CREATE TABLE conflicts (
    id             INTEGER PRIMARY KEY,
    client_id      TEXT    NOT NULL,
    job_id         TEXT    NOT NULL,
    receipt        BLOB    NOT NULL,
    source         TEXT    NOT NULL,
    detected_at_us INTEGER NOT NULL,
    UNIQUE (client_id, job_id, receipt)
);
"""
_UNBILLED = """
CREATE TABLE IF NOT EXISTS unbilled (
    id             INTEGER PRIMARY KEY,
    client_id      TEXT    NOT NULL,
    job_id         TEXT    NOT NULL,
    reason         TEXT    NOT NULL,
    detail         TEXT    NOT NULL,
    flops          INTEGER NOT NULL,
    program_hash   TEXT    NOT NULL,
    lane           TEXT    NOT NULL,
    recorded_at_us INTEGER NOT NULL
);
"""
_PROVENANCE = """
CREATE TABLE IF NOT EXISTS merged (
    seq          INTEGER PRIMARY KEY,
    source       TEXT    NOT NULL,
    merged_at_us INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS provenance (since_seq INTEGER NOT NULL);
INSERT INTO provenance SELECT COALESCE(MAX(seq), 0) + 1 FROM entries WHERE NOT EXISTS (SELECT 1 FROM provenance);
"""
_TRIGGERS = """
CREATE TRIGGER entries_no_update BEFORE UPDATE ON entries
    BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
CREATE TRIGGER entries_no_delete BEFORE DELETE ON entries
    BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
"""
_SCHEMA = _TABLES + _UNBILLED + _PROVENANCE + _TRIGGERS


def entry_hash(seq: int, prev_hash: bytes, receipt_bytes: bytes) -> bytes:
    """The chain link: binds an entry's position, its predecessor and its exact receipt bytes."""
    return hashlib.sha256(_ENTRY_DOMAIN + seq.to_bytes(8, "big") + prev_hash + receipt_bytes).digest()


class _Filed(enum.Enum):
    """What filing one receipt did."""

    ADDED = "added"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


class Ledger:
    """One node's ledger file. Safe to share between processes (SQLite locking); one instance per thread."""

    def __init__(
        self, path: str | os.PathLike, *, create: bool = True, readonly: bool = False, synchronous: str = "NORMAL"
    ):
        """Open (``create``: or make) a ledger file. ``synchronous="FULL"`` fsyncs every append: only for a node that
        cannot count on its counterparties' copies (see the module docstring); it costs an fsync per receipt."""
        if synchronous not in ("NORMAL", "FULL"):
            raise LedgerError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        self.path = Path(path)
        self._sheet, self._sheet_seq, self._sheet_view = BalanceSheet(), 0, (frozenset(), None)
        self._schema = 0  # read from the file by _setup
        self._known_from: int | None = None  # the first entry of known origin; read when first needed (never from a
        # file being merged: nothing but its entries is read from another node's file)
        if not create and not self.path.exists():
            raise LedgerError(f"no ledger at {self.path}")
        try:
            if readonly:
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
            else:
                self._db = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        except sqlite3.Error as e:
            raise LedgerError(f"cannot open ledger {self.path}: {e}") from e
        try:
            self._db.execute("PRAGMA busy_timeout = 30000")
            self._setup(readonly, synchronous)
        except (sqlite3.Error, LedgerError) as e:
            self._db.close()
            if isinstance(e, LedgerError):
                raise
            raise LedgerError(f"{self.path} is not a usable gpunet ledger: {e}") from e

    def _setup(self, readonly: bool, synchronous: str) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables and not readonly:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        elif version not in (1, 2, 3, SCHEMA_VERSION) or "entries" not in tables:
            raise LedgerError(f"{self.path} is not a gpunet ledger of schema version 1 to {SCHEMA_VERSION}")
        elif version < SCHEMA_VERSION and not readonly:
            if version == 1:
                self._migrate_from_1()
            self._db.executescript(f"BEGIN IMMEDIATE; {_UNBILLED} {_PROVENANCE} PRAGMA user_version = {SCHEMA_VERSION}; "
                                   "COMMIT;")
        self._schema = self._db.execute("PRAGMA user_version").fetchone()[0]
        if not readonly:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute(f"PRAGMA synchronous = {synchronous}")

    def _migrate_from_1(self) -> None:
        """Schema 1 -> 2: the same entries (so the same chain and head), keyed by client and job id. One transaction:
        an interrupted migration leaves the schema-1 file as it was."""
        def client_of(data: bytes) -> str:
            try:
                return Receipt.from_bytes(data).client_id
            except InvalidReceipt:
                return ""  # kept as it is: verify names the entry

        db = self._db
        with self._transaction():
            for table in ("entries", "unpaid", "conflicts"):
                db.execute(f"ALTER TABLE {table} RENAME TO old_{table}")
            db.execute("DROP TRIGGER IF EXISTS entries_no_update")
            db.execute("DROP TRIGGER IF EXISTS entries_no_delete")
            for statement in _TABLES.split(";"):
                if statement.strip():
                    db.execute(statement)
            for seq, job_id, data, prev, digest in db.execute(
                    "SELECT seq, job_id, receipt, prev_hash, entry_hash FROM old_entries ORDER BY seq").fetchall():
                db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", (seq, client_of(data), job_id, data, prev,
                                                                             digest))
            for job_id, worker_id, data, at in db.execute(
                    "SELECT job_id, worker_id, receipt, recorded_at_us FROM old_unpaid").fetchall():
                db.execute("INSERT OR IGNORE INTO unpaid VALUES (?, ?, ?, ?, ?)", (client_of(data), job_id, worker_id,
                                                                                   data, at))
            for job_id, data, source, at in db.execute(
                    "SELECT job_id, receipt, source, detected_at_us FROM old_conflicts ORDER BY id").fetchall():
                db.execute("INSERT OR IGNORE INTO conflicts (client_id, job_id, receipt, source, detected_at_us) "
                           "VALUES (?, ?, ?, ?, ?)", (client_of(data), job_id, data, source, at))
            for table in ("entries", "unpaid", "conflicts"):
                db.execute(f"DROP TABLE old_{table}")
            # A "conflict" of schema 1 that was another client's job under the same id is no conflict now: it is a
            # job of its own, appended to the chain (if its receipt is complete and valid).
            orphans = db.execute("SELECT c.id, c.receipt FROM conflicts c WHERE NOT EXISTS (SELECT 1 FROM entries e "
                                 "WHERE e.client_id = c.client_id AND e.job_id = c.job_id) ORDER BY c.id").fetchall()
            for row_id, data in orphans:
                try:
                    receipt = Receipt.from_bytes(data)
                    receipt.verify()
                except InvalidReceipt:
                    continue
                self._insert(receipt, "migration")
                db.execute("DELETE FROM conflicts WHERE id = ?", (row_id,))
            for statement in _TRIGGERS.split("END;"):
                if statement.strip():
                    db.execute(statement + "END;")
            db.execute("PRAGMA user_version = 2")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing -----------------------------------------------------------------------------------------------------

    def append(self, receipt: Receipt) -> Entry:
        """Store a complete receipt (verified here first). Appending the same receipt again returns its entry.

        Raises InvalidReceipt for a receipt without both valid signatures, ReceiptConflict (after recording the
        conflict) when a different receipt for its job id is already stored.
        """
        receipt.verify()
        with self._transaction():
            outcome, seq, _ = self._insert(receipt, "append")
        if outcome is _Filed.CONFLICT:
            raise ReceiptConflict(f"job {receipt.job_id} already has a different receipt (entry {seq}); both kept")
        return self._entry(seq)

    def record_unpaid(self, receipt: Receipt) -> None:
        """Remember a receipt this node signed as worker, until its countersignature arrives (``append`` clears it).

        Call it before sending the receipt to the client: a client that never countersigns stays in ``unpaid()``.
        Only a complete receipt naming this same worker settles it; the job paid to another worker (a client's retry
        elsewhere) leaves this work visible as unpaid.
        """
        receipt.check_terms()
        receipt.verify_worker_signature()
        with self._transaction():
            self._insert_unpaid(receipt)

    def record_unbilled(self, note: Unbilled) -> None:
        """Remember work this node did as a worker and was not paid for, with the reason (``gpunet earnings``)."""
        self.write_batch(unbilled=[note])

    def write_batch(
        self, complete: Sequence[Receipt] = (), unpaid: Sequence[Receipt] = (), unbilled: Sequence[Unbilled] = ()
    ) -> list[tuple[Receipt, LedgerError | InvalidReceipt]]:
        """Group commit: ``append`` every complete receipt and ``record_unpaid`` every unpaid one in ONE transaction.

        Each receipt is checked on its own; the ones refused (invalid, or conflicting with a stored one: the conflict is
        recorded as by ``append``) come back with the reason, the rest are written. Unpaid ones go first, so a
        complete receipt for the same job in the same batch settles them.
        """
        problems: list[tuple[Receipt, LedgerError | InvalidReceipt]] = []
        good_unpaid, good_complete = [], []
        for receipt in unpaid:
            try:
                receipt.check_terms()
                receipt.verify_worker_signature()
                good_unpaid.append(receipt)
            except InvalidReceipt as e:
                problems.append((receipt, e))
        for receipt in complete:
            try:
                receipt.verify()
                good_complete.append(receipt)
            except InvalidReceipt as e:
                problems.append((receipt, e))
        with self._transaction():
            for receipt in good_unpaid:
                self._insert_unpaid(receipt)
            if unbilled:
                self._db.executemany(
                    "INSERT INTO unbilled (client_id, job_id, reason, detail, flops, program_hash, lane, recorded_at_us)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(n.client_id, n.job_id, n.reason, n.detail[:500], n.flops, n.program_hash, n.lane,
                      n.recorded_at_us or _now_us()) for n in unbilled])
                self._db.execute("DELETE FROM unbilled WHERE id <= (SELECT MAX(id) FROM unbilled) - ?", (MAX_UNBILLED,))
            last = None
            for receipt in good_complete:
                outcome, seq, digest = self._insert(receipt, "append", last)
                if outcome is _Filed.ADDED:
                    last = (seq, digest)
                if outcome is _Filed.CONFLICT:
                    problems.append((receipt, ReceiptConflict(
                        f"job {receipt.job_id} already has a different receipt (entry {seq}); both kept")))
        return problems

    def _insert_unpaid(self, receipt: Receipt) -> None:
        paid = self.get(receipt.job_id, receipt.client_id)
        if paid is not None and paid.worker_id == receipt.worker_id:
            return
        self._db.execute(
            "INSERT OR REPLACE INTO unpaid (client_id, job_id, worker_id, receipt, recorded_at_us) VALUES (?, ?, ?, ?, ?)",
            (receipt.client_id, receipt.job_id, receipt.worker_id, receipt.to_bytes(), _now_us()),
        )

    def merge(self, source: str | os.PathLike) -> MergeReport:
        """Import another node's receipts (its ledger file or a JSON export): union by job id.

        Each receipt is checked on its own (the source's chain is not trusted); invalid ones are refused with the
        reason, a different receipt for a job id already held is recorded as a conflict and not chosen. What is added
        is noted as merged: this node vouches for it only through its trust list (gpunet.ledger.vouching), unless it
        settles a result this node delivered as a worker and was still owed for.
        """
        source = Path(source)
        report = MergeReport(source=str(source))
        items = iter(_read_source(source))  # streamed: a ledger file is read a batch at a time
        with ThreadPoolExecutor(_verify_threads()) as pool:
            for start in itertools.count(0, _VERIFY_BATCH):
                batch = list(itertools.islice(items, _VERIFY_BATCH))
                if not batch:
                    break
                decoded: list[tuple[int, Receipt]] = []
                for position, (where, data) in enumerate(batch, start):
                    try:
                        decoded.append((position, Receipt.from_bytes(data)))
                    except InvalidReceipt as e:
                        report.refuse(where, str(e))
                failures = dict(_verify_all(pool, decoded, _verify_threads()))
                with self._transaction():
                    for position, receipt in decoded:
                        if position in failures:
                            report.refuse(f"job {receipt.job_id}", failures[position])
                            continue
                        outcome, _, _ = self._insert(receipt, str(source), merged=True)
                        if outcome is _Filed.ADDED:
                            report.added += 1
                        elif outcome is _Filed.DUPLICATE:
                            report.duplicates += 1
                        else:
                            report.conflict(receipt.job_id)
        return report

    def _insert(
        self, receipt: Receipt, source: str, last: tuple[int, bytes] | None = None, merged: bool = False
    ) -> tuple[_Filed, int, bytes | None]:
        """Inside a write transaction: chain a verified receipt, or say why not. Returns the outcome, the job's entry
        seq and, when added, the new entry's hash.

        ``last``: the head (seq, entry hash) when the caller has just written it in this transaction; read otherwise.
        ``merged``: it came from another node's file (noted, unless it settles this node's own unpaid result).
        """
        row = self._db.execute("SELECT seq, receipt FROM entries WHERE client_id = ? AND job_id = ?",
                               (receipt.client_id, receipt.job_id)).fetchone()
        if row is not None:
            seq, stored = row
            try:
                held = Receipt.from_bytes(stored)
            except InvalidReceipt as e:
                raise LedgerCorrupted(f"entry {seq}: {e}", entry=seq) from None
            if held.body == receipt.body:  # same terms; signatures may differ only if a signer is non-deterministic
                if not merged and self._schema >= 4:  # this node's job path filed it too: it dealt with the job
                    self._db.execute("DELETE FROM merged WHERE seq = ?", (seq,))
                return _Filed.DUPLICATE, seq, None
            self._db.execute(
                "INSERT OR IGNORE INTO conflicts (client_id, job_id, receipt, source, detected_at_us) "
                "VALUES (?, ?, ?, ?, ?)",
                (receipt.client_id, receipt.job_id, receipt.to_bytes(), source, _now_us()),
            )
            return _Filed.CONFLICT, seq, None
        if last is None:
            last = self._db.execute("SELECT seq, entry_hash FROM entries ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev = (last[0] + 1, last[1]) if last else (1, GENESIS_HASH)
        data = receipt.to_bytes()
        digest = entry_hash(seq, prev, data)
        self._db.execute(
            "INSERT INTO entries (seq, client_id, job_id, receipt, prev_hash, entry_hash) VALUES (?, ?, ?, ?, ?, ?)",
            (seq, receipt.client_id, receipt.job_id, data, prev, digest),
        )
        if merged and self._schema >= 4 and not self._settles_unpaid(receipt):
            self._db.execute("INSERT INTO merged (seq, source, merged_at_us) VALUES (?, ?, ?)", (seq, source[:1000],
                                                                                                _now_us()))
        self._db.execute("DELETE FROM unpaid WHERE client_id = ? AND job_id = ? AND worker_id = ?",
                         (receipt.client_id, receipt.job_id, receipt.worker_id))
        return _Filed.ADDED, seq, digest

    def _settles_unpaid(self, receipt: Receipt) -> bool:
        """Whether this node's worker delivered exactly this job and is owed for it: its countersignature came by
        file (a restore after a crash) rather than on the wire."""
        row = self._db.execute("SELECT receipt FROM unpaid WHERE client_id = ? AND job_id = ? AND worker_id = ?",
                               (receipt.client_id, receipt.job_id, receipt.worker_id)).fetchone()
        try:
            return row is not None and Receipt.from_bytes(row[0]).body == receipt.body
        except InvalidReceipt:
            return False

    def _transaction(self) -> "_Transaction":
        return _Transaction(self._db)

    # --- reading -----------------------------------------------------------------------------------------------------

    def head(self) -> LedgerHead:
        row = self._db.execute("SELECT seq, entry_hash FROM entries ORDER BY seq DESC LIMIT 1").fetchone()
        return LedgerHead(row[0], row[1].hex()) if row else LedgerHead(0, GENESIS_HASH.hex())

    def get(self, job_id: str, client_id: str | None = None) -> Receipt | None:
        """The receipt for ``client_id``'s job ``job_id``; without ``client_id``, the first stored under that id
        (ids are each client's own: :meth:`find` lists every client's)."""
        return next(iter(self._lookup("entries", job_id, client_id)), None)

    def find(self, job_id: str) -> list[Receipt]:
        """Every stored receipt with this job id, whatever its client, in ledger order."""
        return self._lookup("entries", job_id, None)

    def get_unpaid(self, job_id: str, client_id: str | None = None) -> Receipt | None:
        return next(iter(self._lookup("unpaid", job_id, client_id)), None)

    def _lookup(self, table: str, job_id: str, client_id: str | None) -> list[Receipt]:
        order = "seq" if table == "entries" else "recorded_at_us"
        if client_id is None or self._schema == 1:  # a schema-1 file read as it is: no client column
            rows = self._db.execute(f"SELECT receipt FROM {table} WHERE job_id = ? ORDER BY {order}", (job_id,))
        else:
            rows = self._db.execute(f"SELECT receipt FROM {table} WHERE client_id = ? AND job_id = ? ORDER BY {order}",
                                    (client_id, job_id))
        found = [Receipt.from_bytes(data) for (data,) in rows]
        return [r for r in found if client_id is None or r.client_id == client_id]

    def entries(self, limit: int | None = None, *, newest_first: bool = False) -> list[Entry]:
        order = "DESC" if newest_first else "ASC"
        rows = self._db.execute(
            f"SELECT seq, receipt, entry_hash FROM entries ORDER BY seq {order} LIMIT ?",
            (-1 if limit is None else limit,),
        )
        return [Entry(seq, Receipt.from_bytes(data), digest) for seq, data, digest in rows]

    def receipts(self) -> Iterator[Receipt]:
        """Every stored receipt in ledger order (decoded, not re-verified: that is ``verify``'s job)."""
        return (receipt for _, receipt in self.receipts_after(0))

    def receipts_after(self, seq: int) -> Iterator[tuple[int, Receipt]]:
        """(entry seq, receipt) of the entries after ``seq``, in order: a reader that keeps a tally reads only what
        was added since its last look (entries are append-only)."""
        # A page at a time, so no statement stays open between the caller's reads (an open one pins an old snapshot).
        page = "SELECT seq, receipt FROM entries WHERE seq > ? ORDER BY seq LIMIT 1000"
        while rows := self._db.execute(page, (seq,)).fetchall():
            seq = rows[-1][0]
            yield from ((n, Receipt.from_bytes(data)) for n, data in rows)

    def filed_after(self, seq: int) -> Iterator[tuple[int, Receipt, Origin]]:
        """(entry seq, receipt, how it came here) of the entries after ``seq``, in order (see :meth:`receipts_after`)."""
        if self._schema < 4:
            for n, receipt in self.receipts_after(seq):
                yield n, receipt, Origin.UNKNOWN
            return
        if self._known_from is None:
            self._known_from = self._db.execute("SELECT MIN(since_seq) FROM provenance").fetchone()[0] or 2**62
        known_from = self._known_from
        page = ("SELECT e.seq, e.receipt, m.seq IS NOT NULL FROM entries e LEFT JOIN merged m ON m.seq = e.seq "
                "WHERE e.seq > ? ORDER BY e.seq LIMIT 1000")
        while rows := self._db.execute(page, (seq,)).fetchall():
            seq = rows[-1][0]
            for n, data, merged in rows:
                origin = Origin.MERGED if merged else Origin.HERE if n >= known_from else Origin.UNKNOWN
                yield n, Receipt.from_bytes(data), origin

    def balances(self, trusted: Iterable[str] = (), me: str | None = None) -> dict[str, Balance]:
        """Per-identity totals as the node ``me`` with the trust list ``trusted`` reads this ledger: what it vouches
        for (filed by its own job path, or with a trusted party; gpunet.ledger.vouching) in earned / spent / net,
        merged receipts it does not vouch for apart. Kept up to date incrementally for the same reader: entries are
        append-only, so only those added since the last call are read (a worker asks on every heartbeat)."""
        view = (frozenset(trusted or ()), me)
        if view != self._sheet_view:
            self._sheet, self._sheet_seq, self._sheet_view = BalanceSheet(), 0, view
        for seq, receipt, origin in self.filed_after(self._sheet_seq):
            self._sheet.add(receipt, vouched(receipt, origin, view[0], me))
            self._sheet_seq = seq
        return self._sheet.snapshot()

    def earned(self, peer_id: str, trusted: Iterable[str] = ()) -> int:
        """Nano-credits ``peer_id`` earned as a worker in this ledger, vouched for as ``peer_id`` reads it (the figure
        a worker announces)."""
        balance = self.balances(trusted, me=peer_id).get(peer_id)
        return balance.earned if balance else 0

    def unpaid(self) -> list[Receipt]:
        """Receipts this node signed as worker that no client has countersigned (yet)."""
        rows = self._db.execute("SELECT receipt FROM unpaid ORDER BY recorded_at_us, job_id")
        return [Receipt.from_bytes(data) for (data,) in rows]

    def unbilled(self, since_us: int = 0, newest: int | None = None) -> list[Unbilled]:
        """Work this node did as a worker and was not paid for, with the reason, oldest first; ``newest``: only that
        many, the latest (a ledger written before schema 3 has none recorded)."""
        if self._schema < 3:
            return []
        query = ("SELECT client_id, job_id, reason, detail, flops, program_hash, lane, recorded_at_us FROM unbilled "
                 "WHERE recorded_at_us >= ? ORDER BY id DESC LIMIT ?")
        rows = self._db.execute(query, (since_us, -1 if newest is None else newest)).fetchall()
        return [Unbilled(*row) for row in reversed(rows)]

    def count_unbilled(self, since_us: int = 0) -> int:
        if self._schema < 3:
            return 0
        return self._db.execute("SELECT COUNT(*) FROM unbilled WHERE recorded_at_us >= ?", (since_us,)).fetchone()[0]

    def conflicts(self) -> list[Conflict]:
        same_job = "e.job_id = c.job_id" + ("" if self._schema == 1 else " AND e.client_id = c.client_id")
        rows = self._db.execute(
            "SELECT c.job_id, e.receipt, c.receipt, c.source, c.detected_at_us FROM conflicts c "
            f"JOIN entries e ON {same_job} ORDER BY c.id"
        )
        return [
            Conflict(job_id, Receipt.from_bytes(existing), Receipt.from_bytes(other), source, at)
            for job_id, existing, other, source, at in rows
        ]

    def _entry(self, seq: int) -> Entry:
        data, digest = self._db.execute("SELECT receipt, entry_hash FROM entries WHERE seq = ?", (seq,)).fetchone()
        return Entry(seq, Receipt.from_bytes(data), digest)

    # --- verification ------------------------------------------------------------------------------------------------

    def verify(self, *, threads: int | None = None) -> LedgerHead:
        """Check the whole chain and both signatures of every receipt; return the head.

        Raises LedgerCorrupted whose ``entry`` is the seq of the first bad entry (and whose message says what is
        wrong with it). Signatures are checked on ``threads`` threads (default: one per core, at most 4):
        ``cryptography`` releases the GIL while verifying.
        """
        threads = threads or _verify_threads()
        expected_seq, prev = 1, GENESIS_HASH
        try:
            client = "''" if self._schema == 1 else "client_id"
            cursor = self._db.execute(f"SELECT seq, {client}, job_id, receipt, prev_hash, entry_hash FROM entries "
                                      "ORDER BY seq")
            with closing(cursor), ThreadPoolExecutor(threads) as pool:
                while rows := cursor.fetchmany(_VERIFY_BATCH):
                    chain_failure: tuple[int, str] | None = None
                    decoded: list[tuple[int, Receipt]] = []
                    for seq, client_id, job_id, data, prev_hash, digest in rows:
                        problem = None
                        if seq != expected_seq:
                            seq, problem = expected_seq, f"missing (the next stored entry is {seq})"
                        elif prev_hash != prev:
                            problem = "does not link to the entry before it (an entry was removed, moved or changed)"
                        elif digest != entry_hash(seq, prev_hash, data):
                            problem = "entry hash does not match its contents (the stored receipt was changed)"
                        if problem is None:
                            try:
                                receipt = Receipt.from_bytes(data)
                            except InvalidReceipt as e:
                                problem = str(e)
                            else:
                                if receipt.job_id != job_id:
                                    problem = f"indexed under job {job_id} but holds a receipt for job {receipt.job_id}"
                                elif self._schema > 1 and receipt.client_id != client_id:
                                    problem = (f"indexed under client {client_id} but holds a receipt of client "
                                               f"{receipt.client_id}")
                                decoded.append((seq, receipt))
                        if problem is not None:
                            chain_failure = (seq, problem)
                            break
                        expected_seq, prev = seq + 1, digest
                    failures = _verify_all(pool, decoded, threads)
                    if chain_failure is not None:
                        failures.append(chain_failure)
                    if failures:
                        seq, problem = min(failures)
                        raise LedgerCorrupted(f"entry {seq}: {problem}", entry=seq)
        except sqlite3.DatabaseError as e:
            raise LedgerCorrupted(f"the ledger file is damaged: {e}", entry=None) from e
        return LedgerHead(expected_seq - 1, prev.hex())


class _Transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (rolled back on error): takes the write lock up front, so no append reads a
    head that another process is about to extend. SQLite failures surface as LedgerError, with nothing written."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise LedgerError(f"cannot write to the ledger: {e}") from e

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error as e:
                exc = e
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise LedgerError(f"ledger write failed, nothing was written: {exc}") from exc


def open_ledger(data_dir: str | os.PathLike | None = None) -> Ledger:
    """The ledger of the node whose data dir is ``data_dir`` (default: ``GPUNET_DATA_DIR`` or ``~/.gpunet``)."""
    return Ledger(resolve_data_dir(data_dir) / LEDGER_FILENAME)


def _verify_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _verify_all(pool: ThreadPoolExecutor, items: list[tuple], threads: int) -> list[tuple]:
    """Verify ``(key, receipt)`` pairs in ``threads`` chunks on the pool; every ``(key, reason)`` that failed."""
    if not items:
        return []
    size = -(-len(items) // threads)
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    return [failure for chunk_failures in pool.map(_verify_chunk, chunks) for failure in chunk_failures]


def _verify_chunk(items: list[tuple]) -> list[tuple]:
    failures = []
    for key, receipt in items:
        try:
            receipt.verify()
        except InvalidReceipt as e:
            failures.append((key, str(e)))
    return failures


def _read_source(path: Path) -> Iterable[tuple[str, bytes]]:
    """``(where, receipt bytes)`` from a ledger file or a JSON export, in the source's order."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    wal_missing = (f"; a running node keeps its newest receipts in {path.name}-wal beside the ledger file: copy both "
                   "files together (or the whole data dir), or run `gpunet ledger export --format json` on that node "
                   "and merge the export")
    has_wal = Path(f"{path}-wal").exists()  # looked at first: opening the file may leave an empty one behind
    if not magic and not has_wal:
        if path.suffix.lower() == ".json":  # an export cut short, not a ledger copied without its -wal
            raise LedgerError(f"{path} is empty: not a `gpunet ledger export --format json` (export it again)")
        raise LedgerError(f"{path} is empty{wal_missing}")
    if magic == _SQLITE_MAGIC:
        try:
            other = Ledger(path, create=False, readonly=True)
        except LedgerError as e:
            if has_wal:
                raise
            raise LedgerError(f"{e}{wal_missing}") from None
        try:
            _check_foreign(other)
        except BaseException:
            other.close()
            raise
        return _foreign_entries(other)
    return read_json_export(path)


def _check_foreign(other: "Ledger") -> None:
    """Another node's ledger file is untrusted input: its ``entries`` must be a plain stored table (a view, a virtual
    table or a generated column could turn a few KiB of file into endless or gigabyte-sized rows), and no value may
    be longer than a receipt can be (SQLite then refuses to build one)."""
    db = other._db
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_RECEIPT_BYTES + 1024)
        kind = db.execute("SELECT type, sql FROM sqlite_master WHERE name = 'entries'").fetchone()
        plain = kind is not None and kind[0] == "table" and str(kind[1]).upper().startswith("CREATE TABLE")
        if not plain or any(column[6] != 0 for column in db.execute("PRAGMA table_xinfo(entries)")):
            raise LedgerError(f"{other.path}: its entries are not a plain table of stored columns (a view, virtual "
                              "table or generated column); this is not a gpunet ledger")
    except sqlite3.Error as e:
        raise LedgerError(f"{other.path} is not a usable gpunet ledger: {e}") from None


def _foreign_entries(other: "Ledger") -> Iterator[tuple[str, bytes]]:
    """The checked file's entries, a batch at a time as they are merged."""
    db = other._db
    try:
        cursor = db.execute("SELECT seq, receipt FROM entries ORDER BY seq")
        while rows := cursor.fetchmany(_VERIFY_BATCH):
            for seq, data in rows:
                # (a hostile file's seq column may hold any text: only a number is repeated in reports)
                yield f"entry {seq if type(seq) is int else '?'}", data if isinstance(data, bytes) else b""
    except sqlite3.DataError as e:
        raise LedgerError(f"{other.path}: a value is larger than any receipt ({e}); this is not a gpunet ledger") \
            from None
    except sqlite3.Error as e:
        raise LedgerError(f"{other.path} is not a usable gpunet ledger: {e}") from None
    finally:
        other.close()


def _now_us() -> int:
    return time.time_ns() // 1000
