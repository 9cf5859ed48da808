"""Which receipts of a ledger are credit for the node reading it ("vouched"), and that node's trust list.

A receipt proves that two identities signed it, nothing more: identities are free, so two of them can sign each other
receipts for work that never ran, and those merge into anyone's ledger as cleanly as real ones. So a node counts as
earned, spent or spendable only the receipts it can vouch for:

* the ones it filed itself as the job ran (its worker or its client was a party and dealt with the other one), and a
  merged one that settles a result its own worker delivered and was still owed for (``Origin.HERE``);
* the ones with a party in its trust list: peers whose signature it takes as proof of real work (``<data
  dir>/trusted-peers``, one peer id a line; ``gpunet ledger trust add``).

Everything else that came in by ``merge`` -- a receipt bearing this node's own key too: a key can sign anything, the
job path is what dealt with the counterparty -- is "merged, not vouched for": shown apart, never added into earned,
spent, net or earnings. Why not follow chains (a counterparty that dealt with someone this node dealt with): one
honest-looking hop is as free to mint as the receipts themselves, and a rule a user cannot check by eye is no rule.
"""

from __future__ import annotations

import enum
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from gpunet.errors import IdentityError, LedgerError
from gpunet.identity import public_key_from_peer_id
from gpunet.ledger.receipts import Receipt

logger = logging.getLogger(__name__)

#: The trust list's file in a node's data dir.
TRUST_FILENAME = "trusted-peers"
#: Enough for any real list, small enough that a worker reading it on a heartbeat never notices.
MAX_TRUSTED = 10_000


class Origin(enum.Enum):
    """How an entry came into this ledger."""

    HERE = "here"  # filed by this node's own worker or client as the job ran
    MERGED = "merged"  # imported by ``merge`` from another node's file
    UNKNOWN = "unknown"  # filed before ledgers kept the difference (schema < 4)


def vouched(receipt: Receipt, origin: Origin, trusted: frozenset[str], me: str | None = None) -> bool:
    """Whether ``receipt`` is credit for the node ``me`` whose trust list is ``trusted``. An entry from before origins
    were kept counts when ``me`` is one of its parties (the job path files only those), or with no ``me`` given."""
    if receipt.worker_id in trusted or receipt.client_id in trusted:
        return True
    if origin is Origin.UNKNOWN:
        return me is None or me in (receipt.worker_id, receipt.client_id)
    return origin is Origin.HERE


def check_peer_id(text: str) -> str:
    """A peer id as a user typed it, or LedgerError saying what is wrong (an Ed25519 ``12D3KooW…`` id)."""
    peer_id = text.strip()
    try:
        public_key_from_peer_id(peer_id)
    except IdentityError:
        raise LedgerError(f"{peer_id!r} is not a peer id (an Ed25519 id, 12D3KooW…, as `gpunet ledger show` and "
                          "`gpunet status` print them)") from None
    return peer_id


def read_trust_file(path: Path) -> frozenset[str]:
    """Peer ids, one a line (``#`` starts a comment); LedgerError naming the line of anything else."""
    try:
        if path.stat().st_size > MAX_TRUSTED * 200:
            raise LedgerError(f"the trust list {path} is larger than {MAX_TRUSTED} peer ids can be")
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LedgerError(f"cannot read the trust list {path}: {e}") from None
    ids = set()
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            try:
                ids.add(check_peer_id(text))
            except LedgerError as e:
                raise LedgerError(f"{path}, line {number}: {e}") from None
    if len(ids) > MAX_TRUSTED:
        raise LedgerError(f"the trust list {path} holds {len(ids)} peer ids; at most {MAX_TRUSTED}")
    return frozenset(ids)


def trust_path(data_dir: Path) -> Path:
    return Path(data_dir) / TRUST_FILENAME


def load_trusted(data_dir: Path) -> frozenset[str]:
    """The node's configured trust list (empty when it has none)."""
    path = trust_path(data_dir)
    return read_trust_file(path) if path.exists() else frozenset()


def save_trusted(data_dir: Path, add: Iterable[str] = (), remove: Iterable[str] = ()) -> frozenset[str]:
    """Add and remove peer ids (checked) in the node's trust list, keeping its comments; the file is replaced whole,
    so a reader never sees half of it. Returns the new list."""
    add, remove = [check_peer_id(p) for p in add], {p.strip() for p in remove}
    path = trust_path(data_dir)
    lines = path.read_text().splitlines() if path.exists() else [
        "# Peers whose receipts this node counts as credit (gpunet ledger trust; docs/ledger.md): one peer id a line."]
    current = load_trusted(data_dir)
    kept = [line for line in lines if line.split("#", 1)[0].strip() not in remove]
    kept += [peer for peer in dict.fromkeys(add) if peer not in current]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{TRUST_FILENAME}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(kept) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return load_trusted(data_dir)


class TrustWatch:
    """A running node's trust list, read again when the file changes (``gpunet ledger trust add`` while a worker
    runs takes effect at its next heartbeat). A list that cannot be read keeps the last good one, said once."""

    def __init__(self, data_dir: Path):
        self.path = trust_path(data_dir)
        self._seen: tuple | None = None
        self._trusted: frozenset[str] = frozenset()

    def current(self) -> frozenset[str]:
        try:
            stat = self.path.stat()
            seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except FileNotFoundError:
            seen = None
        except OSError:
            return self._trusted
        if seen != self._seen:
            self._seen = seen
            try:
                self._trusted = read_trust_file(self.path) if seen is not None else frozenset()
            except LedgerError as e:
                logger.warning("%s; still counting the peers it listed before", e)
        return self._trusted
